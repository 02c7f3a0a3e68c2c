"""Pure schedule model: simulator against hand-computed 1F1B numbers, the RLHFuse reference rows (serial exact,
lower bound exact, fused target reached), the checker's rejections, and determinism."""

import pytest

import math

from rlfuse.schedule.build import fused, one_f_one_b, serial
from rlfuse.schedule.model import (Problem, Schedule, ScheduleError, Task, check, compiled, lower_bound,
                                   preemptive_one_device_bound, simulate)

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
    """The 8-stage RLHFuse rows: the K = 2 rows and the M = 8 and 32 rows of K = 1 reach the bound in seconds; the
    K = 1, M = 16 row (5:2) is the hardest of them: its phases follow the clock, and suite runs on an idle machine
    ended 20 s at 1.9% and 60 s at 1.09%, so here it is held to 2% in 60 s and stops as soon as it is there; the 1%
    is bench/schedule_reference.py's to show (docs/benchmarks/schedule_reference.md, 120 s per row)."""
    pp, pps, m, ms, f, fs, ser, target = row
    prob = Problem.fused(pp, pps, m, ms, f, fs)
    hardest = row == REFERENCE[4]
    # makespan only (the memory pass is tested on its own); rows stop as soon as they reach the bound
    res = fused(prob, seed=0, time_limit=60, memory_pass=False, tolerance=0.02 if hardest else 0.0)
    check(prob, res.schedule)
    assert res.result.makespan >= target  # never below the lower bound
    if hardest:
        assert res.result.makespan <= target * 1.02
    else:
        assert res.result.makespan == target
        assert res.seconds < 10


@pytest.mark.parametrize("shape", [(16, 8, 16, 8, 3, 2), (4, 2, 8, 4, 3, 2), (6, 3, 12, 6, 5, 3), (16, 16, 8, 8, 5, 2)])
def test_other_shapes_against_the_lower_bound(shape):
    prob = Problem.fused(*shape)
    res = fused(prob, seed=1, time_limit=10)
    check(prob, res.schedule)
    lb = lower_bound(prob)
    assert lb <= res.result.makespan <= 1.03 * lb
    assert res.result.makespan < simulate(prob, serial(prob)).makespan


def brute_force_optimum(prob: Problem) -> float:
    """Exact optimum by enumerating every active schedule (Giffler-Thompson branching, which contains an optimal
    schedule), pruned only by the makespan of the best complete one: independent of lower_bound's heads and tails."""
    c = compiled(prob)
    pos = [[0] * len(q) for q in c.queues]
    free, end, best = [0.0] * prob.devices, [-1.0] * len(c.tasks), [math.inf]

    def branch(placed, span):
        if span >= best[0]:
            return
        if placed == len(c.tasks):
            best[0] = span
            return
        cand = [(r, d, qi, q[pos[d][qi]]) for d in range(prob.devices) for qi, q in enumerate(c.queues[d])
                if pos[d][qi] < len(q) for r in [c.ready_time(q[pos[d][qi]], free[d], end)] if r is not None]
        first_end, d = min((r + c.duration[i], d) for r, d, _, i in cand)
        for r, dd, qi, i in cand:
            if dd == d and r < first_end:
                was = free[d]
                end[i] = free[d] = r + c.duration[i]
                pos[d][qi] += 1
                branch(placed + 1, max(span, end[i]))
                pos[d][qi] -= 1
                free[d], end[i] = was, -1.0

    branch(0, 0.0)
    return best[0]


def test_preemptive_one_device_bound_by_hand():
    # (head, duration, tail): A runs 0-1, B (released at 1, longer tail) preempts and ends at 2 -> 2 + 5 = 7;
    # A finishes 2-4 -> 4 + 0. The bound is 7 = B alone (1 + 1 + 5).
    assert preemptive_one_device_bound([(0, 3, 0), (1, 1, 5)]) == 7
    # without preemption the best order is also 7 here; with equal tails it is plain work after the first head
    assert preemptive_one_device_bound([(2, 3, 1), (0, 1, 1), (0, 2, 1)]) == 7  # 0-1, 1-3, 3-6 then +1


@pytest.mark.parametrize("shape", [(2, 2, 2, 2, 1, 1), (2, 1, 2, 1, 2, 1), (2, 2, 2, 2, 5, 2), (4, 4, 2, 2, 1, 1),
                                   (4, 2, 2, 1, 1, 1), (3, 3, 2, 2, 2, 1), (4, 4, 1, 1, 5, 4)])
def test_lower_bound_never_above_the_exhaustive_optimum(shape):
    prob = Problem.fused(*shape)
    optimum = brute_force_optimum(prob)
    assert lower_bound(prob) <= optimum
    found = fused(prob, time_limit=5, memory_pass=False)
    check(prob, found.schedule)
    assert found.result.makespan == optimum == lower_bound(prob)  # tight on these, and the search reaches it


def test_lower_bound_with_comm_never_above_the_optimum():
    prob = Problem.fused(2, 2, 2, 2, 2, 1, comm=1.0)
    assert lower_bound(prob) <= brute_force_optimum(prob)


def test_one_device_bound_is_tighter_where_micro_batches_are_few():
    # 4 stages, 2 micro-batches, f = 1 for both: the per-device bound (own work + least head + least tail) gives 15,
    # which no schedule reaches; the preemptive one-device bound with per-task heads and tails gives the optimum 16
    prob = Problem.fused(4, 4, 2, 2, 1, 1)
    own, head, tail = 12, 1, 2  # device 1: 2 x 2 x (1 + 2) of work; big stage 1 starts after 1, ends 2 before the end
    assert own + head + tail == 15 < lower_bound(prob) == 16 == brute_force_optimum(prob)


@pytest.mark.parametrize("shape", [(4, 4, 8, 8, 5, 2), (4, 2, 8, 4, 5, 4), (8, 4, 8, 4, 2, 1), (8, 8, 8, 8, 1, 1),
                                   (16, 8, 4, 2, 5, 4), (16, 16, 4, 4, 2, 1)])
def test_search_reaches_the_bound_on_small_grids(shape):
    prob = Problem.fused(*shape)
    res = fused(prob, seed=0, time_limit=20)
    check(prob, res.schedule)
    assert res.result.makespan == lower_bound(prob)
    assert res.seconds < 10  # stops at the bound (plus the memory pass: 15% of the limit)


def test_search_is_deterministic_for_a_seed():
    prob = Problem.fused(8, 8, 16, 16, 5, 2)
    a = fused(prob, seed=3, time_limit=1e9, max_evals=60)
    b = fused(prob, seed=3, time_limit=1e9, max_evals=60)
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
