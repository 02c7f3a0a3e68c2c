"""Executed fused schedules on P gloo processes give the gradients of training each model alone, unpipelined."""

import pytest
import torch

from rlfuse.schedule.build import fused
from rlfuse.schedule.chart import gantt
from rlfuse.schedule.execute import ExecSpec, execute, measured_bubble_ratio, reference_grads
from rlfuse.schedule.model import Problem, ScheduleError, Task


@pytest.fixture(scope="module")
def four_layer_model():
    from rlfuse.data.task import build_default_task

    return build_default_task(400, 0, 4, 64, 2, log=lambda *_: None).model_dir


@pytest.mark.parametrize("P,pp_small,m,m_small", [(2, 2, 4, 4), (2, 1, 3, 2), (4, 2, 4, 2), (4, 4, 3, 3)],
                         ids=["P2-K1", "P2-K2", "P4-K2", "P4-K1"])
def test_fused_schedule_gradients_equal_unpipelined(four_layer_model, tmp_path, P, pp_small, m, m_small):
    prob = Problem.fused(P, pp_small, m, m_small, 2, 1)
    sched = fused(prob, seed=0, time_limit=2).schedule
    spec = ExecSpec(str(four_layer_model))
    grads, spans = execute(prob, sched, spec)
    ref = reference_grads(prob, spec)
    assert grads.keys() == ref.keys() and len(ref) > 50  # every parameter of both models got a gradient
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], msg=name)
    assert len(spans) == sum(len(o) for o in sched.orders)
    makespan, bubble = measured_bubble_ratio(spans, P)
    assert makespan > 0 and 0 <= bubble < 1
    assert gantt([("executed", spans)], tmp_path / "executed.png").stat().st_size > 0


def test_a_rejected_schedule_is_never_run(four_layer_model, monkeypatch):
    import rlfuse.schedule.execute as ex

    prob = Problem.fused(2, 2, 2, 2, 2, 1)
    sched = fused(prob, time_limit=1).schedule
    o = sched.orders[1]
    i, j = o.index(Task(0, 0, 1, "F", 0)), o.index(Task(0, 0, 1, "B", 0))
    o[i], o[j] = o[j], o[i]  # backward before its forward
    monkeypatch.setattr(ex.mp, "spawn", lambda *a, **k: pytest.fail("a rejected schedule was launched"))
    with pytest.raises(ScheduleError):
        execute(prob, sched, ExecSpec(str(four_layer_model)))
