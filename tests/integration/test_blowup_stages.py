"""A stage whose loss blows up without a NaN, run as a user runs it (the issue: SFT at a learning rate under the cap,
clipping off, ran its loss from 7 to 54 and saved that model with exit 0): one line, exit 2, no model saved, and the
newest checkpoint from before the blow-up kept (none where there was none). The series these runs make are in
tests/unit/test_blowup.py."""

import re

import torch

from conftest import TINY
from test_run_folders import one_line_error, rlfuse_here

BLOWS_UP = ["sft.lr=0.9", "sft.grad_clip=0", "sft.steps=20", "sft.eval_every=20", "sft.ckpt_every=2"]


def test_sft_whose_loss_blows_up_stops_and_keeps_the_last_checkpoint_before_it(tmp_path):
    run = rlfuse_here("sft", *TINY, *BLOWS_UP, "sft.warmup_steps=8", f"run.dir={tmp_path}")
    line = one_line_error(run, 2, "rlfuse sft: sft diverged at step ")
    m = re.search(r"at step (\d+): loss ([\d.]+) \(the median of its last 5 steps\) against ([\d.]+)(?: at its best "
                  r"\(step \d+\)|, a uniform guess over its 1024-token vocabulary); the model of step (\d+) \(the last "
                  r"checkpoint before it\) is kept in (\S+); lower sft.lr or set sft.grad_clip", line)
    assert m, line
    step, loss, best, kept = int(m[1]), float(m[2]), float(m[3]), int(m[4])
    assert step < 20 and loss > 2 * best and kept < step
    sft = tmp_path / "sft"
    assert m[5] == str(sft / "checkpoint.pt")
    assert torch.load(sft / "checkpoint.pt", weights_only=False)["step"] == kept
    assert not (sft / "checkpoint.pt.prev").exists()
    assert not (sft / "model").exists() and not (sft / "summary.json").exists()  # before: saved, exit 0


def test_sft_blowing_up_at_its_second_step_saves_nothing(tmp_path):
    run = rlfuse_here("sft", *TINY, *BLOWS_UP, "sft.warmup_steps=0", f"run.dir={tmp_path}")
    line = one_line_error(run, 2, "rlfuse sft: sft diverged at step ")
    assert "against 6.93, a uniform guess over its 1024-token vocabulary; no model saved and no checkpoint from " \
           "before it (one comes every sft.ckpt_every=2 steps)" in line
    left = {p.name for p in (tmp_path / "sft").iterdir()} if (tmp_path / "sft").exists() else set()
    assert not left & {"model", "adapter", "summary.json", "checkpoint.pt", "checkpoint.pt.prev"}, left


def test_rl_whose_update_blows_the_policy_apart_stops_at_that_iteration(tiny_task, tmp_path):
    # before: 25 iterations of "the boy finds car car car ...", KL 143, exit 0 and a saved policy
    run = rlfuse_here("rl", f"run.dir={tmp_path}", f"rl.sft_path={tiny_task.model_dir}", "data.num_reviews=400",
                      "model.n_layer=2", "model.n_embd=64", "model.n_head=2", "data.max_length=96", "rl.algo=ppo",
                      "rl.critic_init=actor", "rl.k=4", "rl.reward=rlfuse.data.gold:gold_reward", "rl.iterations=6",
                      "rl.prompts_per_iter=4", "rl.mini_batch_size=16", "rl.micro_batch_size=16", "rl.eval_prompts=4",
                      "rl.lr=0.2", "rl.grad_clip=0", "rl.max_new_tokens=24", "run.precision=fp32", "run.quiet=true")
    line = one_line_error(run, 2, "rlfuse rl: rl diverged at iteration ")
    assert "nats per token on its own samples (train/approx_kl" in line and "lower rl.lr or set rl.grad_clip" in line
    assert not (tmp_path / "rl" / "model").exists()
