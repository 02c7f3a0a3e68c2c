"""A loss that blows up without a NaN (rlfuse/learn/divergence.py): found on hand-made and measured series, never on
healthy noisy ones; a checkpoint due while the loss rises is not written, and after a blow-up the newest checkpoint
from before it is the one kept; an RL update that moves the policy by tens of nats per token ends the run."""

import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlfuse.errors import UserError
from rlfuse.learn.checkpoint import StageCheckpoint, checkpoint_step
from rlfuse.learn.divergence import RATIO, RISE, SETTLE, STEP_KL, WINDOW, LossWatch, blown_at, rl_blowup
from rlfuse.learn.optim import build_optimizer
from rlfuse.learn.update import BadSteps, stop_if_blown

# measured (tiny SFT / RM / RL on the embedded task, 2 layers x 64, batch 8; see divergence.py's constants)
SFT_LR_09_NO_CLIP = [6.94, 58.93, 41.01, 80.4, 61.57, 75.92, 88.15, 79.86, 71.47, 115.6]  # the issue's kind: exit 0
SFT_LR_09_WARMUP_8 = [6.94, 6.56, 9.77, 12.73, 27.18, 19.32, 15.81, 26.38, 24.29, 30.0]
SFT_LR_03_SPIKE = [6.94, 6.13, 8.87, 8.06, 7.96, 8.12, 7.75, 7.65, 8.1, 7.45, 5.77, 5.92, 5.77, 5.34, 5.6, 5.34, 5.38,
                   5.68, 6.14, 6.07, 5.53, 5.65, 5.16, 5.25, 4.81, 5.3, 5.45, 5.29, 4.95, 4.93]  # rough, recovers
RM_LR_03_NO_CLIP = [0.72, 0.69, 0.71, 0.7, 0.69, 1.19, 0.65, 0.59, 0.98, 1.11, 0.53, 0.74, 0.79, 0.72, 0.67, 0.72,
                    0.57, 0.54, 0.65, 1.97, 0.74, 0.68, 0.68, 0.69, 0.94, 0.74, 0.68, 0.7, 0.69, 0.69]
PPO_LR_02_APPROX_KL = [50.1, 537.6, 0.0]  # collapsed onto one repeated word at the first update
GRPO_LR_005_APPROX_KL = [0.958, 4.104, 1.515, 0.892, 1.861, 1.103, 0.347, 0.128]  # rough, but reward and gold rose


def _healthy(start: float, end: float, n: int, noise: float, seed: int) -> list[float]:
    """A falling loss with multiplicative batch noise."""
    rng = random.Random(seed)
    return [(start + (end - start) * (1 - math.exp(-4 * i / n))) * (1 + rng.uniform(-noise, noise)) for i in range(n)]


def test_the_issues_example_7_to_54_is_found_within_a_few_steps_and_names_its_best():
    losses = [7.0, 6.2, 5.1, 4.0, 3.2, 2.6, 2.3, 2.35, 2.31, 2.4, 9.0, 25.0, 54.0, 54.1, 53.0, 55.0]
    found = blown_at(losses)
    # step 11 is the first blown one; the median of five crosses at 13 (9.0 > 2 x 2.35), and stays over for 3 steps
    assert found is not None and found.step == 15
    assert found.best_step == 9 and found.reference == pytest.approx(2.35)
    assert found.loss == pytest.approx(53.0) and found.window == 5


UNIFORM = math.log(1024)  # the tiny model's vocabulary: 6.93, what its untrained loss (6.94) is


def test_measured_blowups_are_found():
    found = blown_at(SFT_LR_09_NO_CLIP, chance=UNIFORM, chance_name="a uniform guess")
    # at step 2, before any median of SETTLE losses: measured against the uniform guess's loss
    assert (found.step, found.best_step, found.window) == (4, 0, 4)
    assert found.against() == "6.93, a uniform guess"
    assert blown_at(SFT_LR_09_NO_CLIP) is None  # without it nothing came before the blow-up to measure it against
    found = blown_at(SFT_LR_09_WARMUP_8, chance=UNIFORM, chance_name="a uniform guess")
    assert (found.step, found.against()) == (9, "6.93, a uniform guess")  # its best, 6.94 at step 3, is no lower
    found = blown_at([2.0, 1.9, 1.8, 1.7, 1.8, 30.0, 30.0, 30.0, 30.0, 30.0], chance=UNIFORM)
    assert (found.step, found.against()) == (10, "1.8 at its best (step 5)")  # the median of steps 1-5


def test_an_odd_first_batch_is_never_the_reference():
    # hh-rlhf completion-only, tiny batches: a batch with no answer token (loss 0), then healthy losses near 6
    assert blown_at([0.0, 6.1, 5.9, 6.0, 5.8, 6.2, 5.9, 5.7], chance=math.log(49152)) is None
    assert blown_at([0.3, 1.4, 1.5, 1.3, 1.4, 1.6, 1.4, 1.3, 1.5]) is None  # one lucky batch of a pretrained model


@pytest.mark.parametrize("losses", [
    SFT_LR_03_SPIKE, RM_LR_03_NO_CLIP,
    _healthy(6.9, 2.3, 600, 0.15, 0),  # SFT from scratch
    _healthy(1.8, 1.2, 300, 0.25, 1),  # SFT of a pretrained model
    _healthy(0.69, 0.05, 500, 0.9, 2),  # a reward model's pairwise loss, near zero at the end
    [2.0 if i % 10 else 50.0 for i in range(100)],  # a lone huge batch now and then
    [2.0 if i % 5 > 1 else 9.0 for i in range(100)],  # two bad batches in every five
    [0.05, 0.04, 0.12, 0.11, 0.13, 0.12, 0.12, 0.1],  # near zero, doubling is noise
    [3.0, float("nan"), float("inf"), 2.9, 2.8],  # NaN/inf are BadSteps', not a blow-up
], ids=["sft-lr0.3-spike", "rm-lr0.3", "sft-scratch", "sft-pretrained", "rm-noisy", "lone-spikes", "two-in-five",
        "near-zero", "nan"])
def test_healthy_and_rough_but_recovering_series_are_not_blowups(losses):
    assert blown_at(losses) is None


def test_the_limit_is_twice_the_best_and_one_nat_above_it():
    assert (RATIO, RISE, WINDOW, SETTLE) == (2.0, 1.0, 5, 3)
    watch = LossWatch()
    watch.add(1, 6.0)
    watch.add(2, 6.0)
    assert watch.limit() == math.inf  # no median of SETTLE losses yet
    watch.add(3, 6.0)
    assert watch.limit() == 12.0
    watch.add(4, 0.4)
    watch.add(5, 0.4)
    watch.add(6, 0.4)  # median of 6, 6, 0.4, 0.4, 0.4
    assert watch.limit() == pytest.approx(1.4)
    assert LossWatch(chance=0.693).limit() == pytest.approx(1.693)  # the know-nothing loss, from the first step
    assert blown_at([6.0, 6.0, 6.0, 11.9, 11.9, 11.9, 11.9, 11.9, 11.9]) is None  # just under
    assert blown_at([6.0, 6.0, 6.0, 12.1, 12.1, 12.1, 12.1, 12.1, 12.1]) is not None  # just over


def test_a_short_rise_at_the_end_is_rising_and_checkpoints_wait_for_calm():
    watch = LossWatch()
    for step, loss in enumerate([3.0, 2.9, 2.8, 2.7], 1):
        watch.add(step, loss)
    assert watch.calm() and not watch.rising()
    watch.add(5, 30.0)  # one blown step: the median is still fine, but no checkpoint now
    assert not watch.calm() and not watch.rising()
    watch.add(6, 31.0)
    assert watch.add(7, 32.0) is None and watch.rising()  # two steps of a streak: not yet PATIENCE
    assert not watch.before_blowup(4) and watch.before_blowup(3)  # step 4's weights gave step 5's 30


def _stage(tmp_path: Path, every: int = 2, steps: int = 20):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt, sched = build_optimizer(model, 1e-2, 0.0, 0, steps)
    return model, StageCheckpoint(tmp_path, every, steps, model, opt, sched)


def test_after_a_blowup_the_newest_checkpoint_from_before_it_is_kept(tmp_path):
    model, ckpt = _stage(tmp_path)
    watch, bad = LossWatch(chance=UNIFORM, chance_name="a uniform guess"), BadSteps()
    for step, loss in enumerate(SFT_LR_09_WARMUP_8, 1):
        found = watch.add(step, loss)
        if found:
            break
        ckpt.save_if_due(step, bad, calm=watch.calm())
    # written at 2 and 4 (calm); skipped at 6 and 8 (step 5's 27.2 is over the limit 13.5)
    assert (checkpoint_step(ckpt.path), checkpoint_step(tmp_path / "checkpoint.pt.prev")) == (4, 2)
    with pytest.raises(UserError) as e:
        raise ckpt.blown("sft", found, watch, SimpleNamespace(grad_clip=0.0))
    assert str(e.value) == (
        f"sft diverged at step 9: loss 24.3 (the median of its last 5 steps) against 6.93, a uniform guess; the "
        f"model of step 2 (the last checkpoint before it) is kept in {ckpt.path}; lower sft.lr or set sft.grad_clip "
        f"(1.0 is the default), then `rlfuse sft --resume RUN_DIR sft.lr=...`")
    # step 4's weights gave step 5's 27.2: gone, step 2's moved back in its place
    assert checkpoint_step(ckpt.path) == 2 and not (tmp_path / "checkpoint.pt.prev").exists()


def test_a_blowup_before_the_first_checkpoint_keeps_none(tmp_path):
    model, ckpt = _stage(tmp_path)
    watch, bad = LossWatch(chance=UNIFORM, chance_name="a uniform guess"), BadSteps()
    for step, loss in enumerate(SFT_LR_09_NO_CLIP, 1):
        if found := watch.add(step, loss):
            break
        ckpt.save_if_due(step, bad, calm=watch.calm())
    assert not ckpt.path.exists()  # step 2 was due, but its loss was already blown
    ckpt.save_if_due(2, bad)  # one written anyway (an older rlfuse): from inside the blow-up, so it goes
    line = str(ckpt.blown("rm", found, watch, SimpleNamespace(grad_clip=1.0)))
    assert line == ("rm diverged at step 4: loss 50 (the median of its last 4 steps) against 6.93, a uniform guess; "
                    "no model saved and no checkpoint from before it (one comes every rm.ckpt_every=2 steps); lower "
                    "rm.lr")
    assert not ckpt.path.exists()


def test_a_resume_at_a_lower_learning_rate_takes_it_at_the_schedules_point(tmp_path):
    model, ckpt = _stage(tmp_path, every=3, steps=10)
    for step in range(1, 4):
        model(torch.ones(1, 3)).sum().backward()
        ckpt.opt.step()
        ckpt.sched.step()
        ckpt.save_if_due(step, BadSteps())
    at_3 = ckpt.sched.get_last_lr()[0]
    for lr, want in ((1e-2, at_3), (1e-3, at_3 / 10)):
        model2 = torch.nn.Linear(3, 2)
        opt, sched = build_optimizer(model2, lr, 0.0, 0, 10)
        step, _ = StageCheckpoint(tmp_path, 3, 10, model2, opt, sched).restore("sft", lambda _: None)
        assert step == 3 and sched.get_last_lr()[0] == pytest.approx(want, rel=1e-12)
        assert opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12)
        sched.step()  # and the schedule goes on from there at the new rate
        assert opt.param_groups[0]["lr"] == pytest.approx(lr * sched.lr_lambdas[0](4), rel=1e-12)


def test_an_rl_update_that_moves_the_policy_tens_of_nats_per_token_is_a_blowup():
    assert STEP_KL == 10.0
    assert rl_blowup(PPO_LR_02_APPROX_KL[0]) and rl_blowup(PPO_LR_02_APPROX_KL[1])
    assert not any(rl_blowup(kl) for kl in GRPO_LR_005_APPROX_KL)
    assert not rl_blowup(None) and not rl_blowup(float("nan")) and not rl_blowup(0.02)


def test_rl_stops_before_the_checkpoint_of_the_blown_iteration_and_names_the_one_kept():
    rl = SimpleNamespace(ckpt_every=5, grad_clip=0.0)
    stop_if_blown({"train/approx_kl": 0.05}, 7, rl, Path("r/rl/checkpoint.pt"), 0)  # healthy: nothing
    stop_if_blown({}, 7, rl, Path("r/rl/checkpoint.pt"), 0)  # a skipped update
    with pytest.raises(UserError, match=r"^rl diverged at iteration 7: its update moved the policy by 50.1 nats per "
                                        r"token .*; the policy of iteration 5 \(the last checkpoint before it\) is "
                                        r"kept in r/rl/checkpoint.pt, for --resume; lower rl.lr or set rl.grad_clip"):
        stop_if_blown({"train/approx_kl": 50.1}, 7, rl, Path("r/rl/checkpoint.pt"), 0)
    with pytest.raises(UserError, match=r"iteration 6: .*the policy of iteration 5 "):
        stop_if_blown({"train/approx_kl": 50.1}, 6, rl, Path("c.pt"), 0)
    with pytest.raises(UserError, match=r"iteration 5: .*no policy saved"):  # its own checkpoint is not written yet
        stop_if_blown({"train/approx_kl": 50.1}, 5, rl, Path("c.pt"), 0)
    with pytest.raises(UserError, match=r"the policy of iteration 3 .*; lower rl.lr$"):  # resumed at 3
        stop_if_blown({"train/approx_kl": 50.1}, 4, SimpleNamespace(ckpt_every=5, grad_clip=1.0), Path("c.pt"), 3)
    with pytest.raises(UserError, match=r"no policy saved and no checkpoint from before it \(one comes every "
                                        r"rl.ckpt_every=5 iterations\)"):
        stop_if_blown({"train/approx_kl": 537.6}, 1, rl, Path("c.pt"), 0)


def test_a_collapsed_sample_without_a_sentence_is_not_grammatical():
    """A policy blown into 'car car car ...' to the length limit has no complete sentence: the grammar accepts
    none of it (it reported a grammatical rate of 1.000)."""
    from rlfuse.data.gold import gold_summary

    summary = gold_summary(["the boy finds car car car car car car", "i loved this film."], [False, True])
    assert summary["grammatical_rate"] == 0.5
