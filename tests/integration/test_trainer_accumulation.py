"""The SFT and reward-model trainers accumulate micro-batches into the optimiser batch's own step: train_sft and
train_rm (the functions `rlfuse sft` and `rlfuse rm` call) at micro-batch 1, 2 and 8 on batches of 8 log the same loss
and gradient norm at every step and end on the same weights (TRL's invariant, PDB=1xGAS=8 equals PDB=8xGAS=1).
tests/equivalence/test_accumulation.py checks the losses' arithmetic in a loop of its own; this runs the trainers'
loops.

The gradient norm (logged before clipping) is what sees a weighting dropped when the micro-batches are of one size:
AdamW's step is blind to a gradient scaled by a constant, and clipping to rm.grad_clip rescales it anyway, so the
weights alone could agree."""

import json

import pytest
import torch

from conftest import TINY
from rlfuse.config import load_config
from rlfuse.trainers.rm import train_rm
from rlfuse.trainers.sft import train_sft

STEPS = 3
BATCH = 8
# reviews of different lengths in every batch (the default task's long tail): micro-batches of one sample hold
# different token counts, so SFT's per-token weighting matters
STAGE = [*TINY, f"sft.steps={STEPS}", f"sft.batch_size={BATCH}", "sft.eval_every=100", "sft.eval_samples=0",
         "sft.ckpt_every=100", "sft.warmup_steps=1", f"rm.steps={STEPS}", f"rm.batch_size={BATCH}",
         "rm.eval_every=100", "rm.ckpt_every=100", "rm.warmup_steps=1", "rm.init=base", "run.precision=fp32"]


def train(stage, micro, tmp_path):
    """(metric rows, trained weights) of one stage at micro-batch `micro`."""
    cfg = load_config(None, [*STAGE, f"{stage}.micro_batch_size={micro}"])
    run_dir = tmp_path / f"{stage}-{micro}"
    kept = {}
    trainer = train_sft if stage == "sft" else train_rm
    trainer(cfg, run_dir, log=lambda *_: None,
            on_trained=lambda m: kept.update({n: p.detach().clone() for n, p in m.named_parameters()}))
    rows = [json.loads(line) for line in (run_dir / stage / "metrics.jsonl").read_text().splitlines()]
    return rows, kept


@pytest.fixture(scope="module")
def whole_batch(tmp_path_factory):
    """Each stage at micro-batch 8 (one micro-batch per step), trained once for the module."""
    root = tmp_path_factory.mktemp("whole")
    return {stage: train(stage, BATCH, root) for stage in ("sft", "rm")}


@pytest.mark.parametrize("stage", ["sft", "rm"])
@pytest.mark.parametrize("micro", [1, 2])
def test_micro_batches_train_as_the_whole_batch(stage, micro, whole_batch, tiny_task, tmp_path):
    """train_<stage> at micro-batch 1 (8 backwards a step) and 2 logs every step's loss and gradient norm as at
    micro-batch 8 and ends on the same weights (to 1e-4, 5x what the summation order alone gave: AdamW divides by the
    root of a second moment, which magnifies the rounding of a near-zero gradient; a weighting dropped moves most
    weights by about a step, 2e-3). Dropping the weighting of the micro-batches' losses (SFT: by the batch's labelled
    tokens; RM: by the micro-batch's share of the pairs), or zeroing the gradient between micro-batches, fails."""
    want_rows, want = whole_batch[stage]
    rows, got = train(stage, micro, tmp_path)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row, want_row in zip(rows, want_rows):
        for key in ("train/loss", "train/grad_norm"):
            assert row[key] == pytest.approx(want_row[key], rel=1e-4), (row["step"], key)
    assert got.keys() == want.keys()
    for n in want:
        if stage == "rm" and n == "transformer.ln_f.bias":
            # it shifts a pair's two rewards alike, so the pairwise loss gives it an exact zero gradient; AdamW turns
            # the rounding of that zero (1e-9, summed in another order) into steps of 1e-4
            continue
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-4, msg=lambda m, n=n: f"{stage} {n}: {m}")


def test_the_whole_batch_trains(whole_batch):
    """The comparison above compares steps that happened: every step of each stage logged a finite loss and a
    non-zero gradient, and the SFT loss fell over the 3 steps."""
    for stage, (rows, weights) in whole_batch.items():
        assert len(rows) == STEPS and weights
        assert all(r["train/grad_norm"] > 0 and r["train/skipped_steps"] == 0 for r in rows), stage
    sft = [r["train/loss"] for r in whole_batch["sft"][0]]
    assert sft[-1] < sft[0]
