"""Pure schedule model: simulator against hand-computed 1F1B numbers, the RLHFuse reference rows (serial exact,
lower bound exact, fused target reached), the checker's rejections, and determinism."""

import pytest

from rlfuse.schedule.build import fused, one_f_one_b, serial
from rlfuse.schedule.model import Problem, Schedule, ScheduleError, Task, check, lower_bound, simulate

REFERENCE = [  # pp, pp_small, m, m_small, f, f_small, serial, target
    (8, 4, 32, 16, 5, 4, 813, 708), (8, 4, 16, 8, 5, 4, 477, 372), (8, 4, 8, 4, 5, 4, 309, 225),
    (8, 8, 32, 32, 5, 2, 819, 702), (8, 8, 16, 16, 5, 2, 483, 366), (8, 8, 8, 8, 5, 2, 315, 225),
]
ids = [f"{r[0]}/{r[1]}-M{r[2]}/{r[3]}" for r in REFERENCE]


def test_1f1b_hand_computed():
    # one model, 2 stages, 2 micro-batches, f=1, b=2: makespan (M+N-1)(f+b) = 9
    # device 0: F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9]; device 1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]
    prob = Problem(2, (Problem.fused(2, 2, 2, 1, 1, 1).models[0],))
    r = simulate(prob, one_f_one_b(prob, 0))
    assert r.makespan == 9
    assert r.busy == [6, 6]
    assert r.bubble_ratio == pytest.approx(1 - 12 / 18)
    assert r.peak_memory == [2, 1]  # stage 0 holds two micro-batches' activations, the last stage one
    assert r.start[Task(0, 0, 0, "B", 0)] == 4 and r.end[Task(0, 0, 0, "B", 1)] == 9


def test_layout_small_model_runs_the_other_way():
    prob = Problem.fused(8, 4, 4, 4, 1, 1)
    assert [prob.device_of(1, 0, s) for s in range(4)] == [3, 2, 1, 0]
    assert [prob.device_of(1, 1, s) for s in range(4)] == [7, 6, 5, 4]
    assert prob.stage_on(1, 4) == (1, 3) and prob.stage_on(0, 4) == (0, 4)


@pytest.mark.parametrize("row", REFERENCE, ids=ids)
def test_reference_serial_and_lower_bound_exact(row):
    pp, pps, m, ms, f, fs, ser, target = row
    prob = Problem.fused(pp, pps, m, ms, f, fs)
    sched = serial(prob)
    check(prob, sched)
    assert simulate(prob, sched).makespan == ser
    assert lower_bound(prob) == target


@pytest.mark.parametrize("row", REFERENCE, ids=ids)
def test_reference_fused_search(row):
    """The issue asks for the target in at least 5 of 6 rows and within 2% in the other; row 4 is the one we
    reach within 1% rather than exactly, so it is held to 2%."""
    pp, pps, m, ms, f, fs, ser, target = row
    prob = Problem.fused(pp, pps, m, ms, f, fs)
    # makespan only (the memory pass is tested on its own); exact rows stop as soon as they reach the bound
    res = fused(prob, seed=0, time_limit=60 if row == REFERENCE[3] else 120, memory_pass=False)
    check(prob, res.schedule)
    assert res.result.makespan >= target  # never below the lower bound
    if row == REFERENCE[3]:
        assert res.result.makespan <= target * 1.02
    else:
        assert res.result.makespan == target
    assert res.seconds < 125


@pytest.mark.parametrize("shape", [(16, 8, 16, 8, 3, 2), (4, 2, 8, 4, 3, 2), (6, 3, 12, 6, 5, 3), (16, 16, 8, 8, 5, 2)])
def test_other_shapes_against_the_lower_bound(shape):
    prob = Problem.fused(*shape)
    res = fused(prob, seed=1, time_limit=10)
    check(prob, res.schedule)
    lb = lower_bound(prob)
    assert lb <= res.result.makespan <= 1.03 * lb
    assert res.result.makespan < simulate(prob, serial(prob)).makespan


def test_search_is_deterministic_for_a_seed():
    prob = Problem.fused(8, 8, 16, 16, 5, 2)
    a = fused(prob, seed=3, time_limit=1e9, max_evals=300)
    b = fused(prob, seed=3, time_limit=1e9, max_evals=300)
    assert a.schedule.orders == b.schedule.orders


def test_memory_pass_never_raises_the_makespan():
    prob = Problem.fused(8, 4, 16, 8, 5, 4)
    plain = fused(prob, seed=0, time_limit=1e9, max_evals=400, memory_pass=False)
    lean = fused(prob, seed=0, time_limit=1e9, max_evals=400, memory_pass=True)
    assert lean.result.makespan <= plain.result.makespan
    assert max(lean.result.peak_memory) <= max(plain.result.peak_memory)


def swap(order, a, b):
    i, j = order.index(a), order.index(b)
    order[i], order[j] = order[j], order[i]


def small_problem():
    return Problem.fused(2, 2, 2, 1, 1, 1)


def valid(prob):
    return serial(prob)


def test_checker_accepts_serial_and_fused():
    prob = small_problem()
    check(prob, valid(prob))
    check(prob, fused(prob, time_limit=1).schedule)


def test_checker_rejects_backward_before_forward():
    prob = small_problem()
    s = valid(prob)
    swap(s.orders[1], Task(0, 0, 1, "F", 0), Task(0, 0, 1, "B", 0))
    with pytest.raises(ScheduleError, match="before its forward"):
        check(prob, s)


def test_checker_rejects_fifo_violation_wrong_device_and_missing():
    prob = small_problem()
    s = valid(prob)
    swap(s.orders[0], Task(0, 0, 0, "F", 0), Task(0, 0, 0, "F", 1))
    with pytest.raises(ScheduleError, match="FIFO"):
        check(prob, s)
    s = valid(prob)
    s.orders[1].append(s.orders[0].pop())
    with pytest.raises(ScheduleError, match="placed on device"):
        check(prob, s)
    s = valid(prob)
    s.orders[1].pop()
    with pytest.raises(ScheduleError, match="missing"):
        check(prob, s)


def test_checker_rejects_deadlock():
    # device 0 waits for B(stage 1, mb 0) before sending F(mb 1); device 1 waits for F(mb 1) before B(mb 0)
    prob = Problem(2, (Problem.fused(2, 2, 2, 1, 1, 1).models[0],))
    F = lambda s, m: Task(0, 0, s, "F", m)
    B = lambda s, m: Task(0, 0, s, "B", m)
    s = Schedule([[F(0, 0), B(0, 0), F(0, 1), B(0, 1)], [F(1, 0), F(1, 1), B(1, 0), B(1, 1)]])
    with pytest.raises(ScheduleError, match="deadlock"):
        check(prob, s)


def test_schedule_command_json(capsys, tmp_path):
    import json

    from rlfuse.cli import main

    chart = tmp_path / "chart.png"
    assert main(["schedule", "--pp", "4", "--pp-small", "2", "--micro-batches", "4", "--micro-batches-small", "2",
                 "--fwd", "2", "--fwd-small", "1", "--time-limit", "2", "--json", "--out", str(chart)]) == 0
    out = json.loads(capsys.readouterr().out)
    prob = Problem.fused(4, 2, 4, 2, 2, 1)
    assert out["serial"]["makespan"] == simulate(prob, serial(prob)).makespan
    assert out["lower_bound"]["makespan"] == lower_bound(prob)
    assert out["lower_bound"]["makespan"] <= out["fused"]["makespan"] <= out["serial"]["makespan"]
    assert {"makespan", "bubble_ratio", "peak_memory"} <= set(out["fused"])
    assert chart.stat().st_size > 0
    assert main(["schedule", "--pp", "4", "--pp-small", "3"]) == 2
