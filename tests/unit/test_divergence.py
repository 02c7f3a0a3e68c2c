"""SFT's and RM's steps on a NaN/inf loss: skipped (the weights untouched), counted, stopped after max_bad_steps in a
row with one line; a model with NaN/inf weights is never saved; progress shows nothing before a figure exists."""

import math
from types import SimpleNamespace

import pytest
import torch

from rlfuse.errors import UserError
from rlfuse.learn.optim import build_optimizer
from rlfuse.learn.update import BadSteps, require_finite_weights, stage_step
from rlfuse.metrics.progress import Progress


def _step(model, opt, sched, section, bad, scale: float) -> float:
    loss = model(torch.ones(2, 3)).sum() * scale
    loss.backward()
    return stage_step(model, opt, sched, section, "sft", float(loss.detach()), bad)


def test_a_nan_step_is_skipped_counted_and_stops_the_stage_after_max_bad_steps():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt, sched = build_optimizer(model, 1e-2, 0.0, 0, 10)
    section, bad = SimpleNamespace(grad_clip=1.0, max_bad_steps=2), BadSteps()
    assert math.isfinite(_step(model, opt, sched, section, bad, 1.0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert math.isnan(_step(model, opt, sched, section, bad, float("nan")))
    assert (bad.skipped, bad.consecutive, bad.why) == (1, 1, "a NaN/inf loss")
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), f"{n} changed on a skipped step"
    _step(model, opt, sched, section, bad, 1.0)  # a good step ends the run of bad ones
    assert (bad.skipped, bad.consecutive) == (1, 0)
    _step(model, opt, sched, section, bad, float("inf"))
    with pytest.raises(UserError, match=r"2 consecutive updates skipped.*lower sft.lr or raise sft.warmup_steps; no "
                                        r"model saved"):
        _step(model, opt, sched, section, bad, float("nan"))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_model_with_nan_weights_is_refused_before_saving():
    model = torch.nn.Linear(3, 2)
    require_finite_weights(model, "rm")
    with torch.no_grad():
        model.bias[1] = float("nan")
    with pytest.raises(UserError, match=r"1 trained weight tensors hold NaN/inf \(first bias\); no model saved; "
                                        r"lower rm.lr"):
        require_finite_weights(model, "rm")


def test_progress_lines_show_no_figure_before_it_exists(capsys):
    with Progress(2, "sft") as bar:  # stderr is not a terminal here: lines
        bar.update(loss=1.5, val=None)
        bar.update(loss=1.25, val=2.0)
    lines = capsys.readouterr().err.splitlines()
    assert "val" not in lines[0] and "nan" not in lines[0] and "loss=1.5" in lines[0]
    assert lines[1].endswith("loss=1.25 val=2")
