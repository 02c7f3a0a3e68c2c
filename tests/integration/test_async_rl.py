"""Asynchronous RL (rl.max_staleness=1) with partial rollouts on 2 Ray workers, separated (rank 0 trains and scores,
rank 1 generates and takes the reference's log-probs of what it decoded): iteration i trains the batch the weights of update max(0, i - 1) started and those of update i
finished; the decoupled objective's importance weights are logged; a batch is trained whole (no length bias); and a
second run, its driver killed with SIGKILL after a checkpoint and resumed, ends with the first run's bits (the
schedule is counts, not timing; the batch generated ahead, parked half-way, is saved beside the checkpoint)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, TINY
from rlfuse.cli import main

ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'ray==2.60.*' for the placement tests")

ITERATIONS = 4
RL = ["rl.algo=grpo", "rl.k=2", "rl.reward=rlfuse.data.gold:gold_reward", f"rl.iterations={ITERATIONS}",
      "rl.prompts_per_iter=4", "rl.mini_batch_size=4", "rl.micro_batch_size=2", "rl.max_new_tokens=24", "rl.epochs=1",
      "rl.eval_prompts=4", "rl.lr=1e-3", "rl.ckpt_every=2", "run.threads=1", "placement.strategy=separated",
      "placement.workers=2", "rl.max_staleness=1", "rl.partial_rollout_after=2", "rollout.max_rows=4",
      # fp32 whatever the CPU: a fresh batch is on-policy here, which a bf16 sampler's is not (its correction:
      # tests/integration/test_placement_precision.py)
      "run.precision=fp32", "rollout.generator_dtype=fp32"]
ENV = os.environ | {"CI": "true"}


def rl_cmd(tiny_task, run_dir, *extra):
    return [sys.executable, "-m", "rlfuse", "rl", f"rl.sft_path={tiny_task.model_dir}", f"run.dir={run_dir}", *TINY,
            *RL, *extra]


def rows_of(run_dir):
    return [json.loads(l) for l in (run_dir / "rl" / "metrics.jsonl").read_text().splitlines()]


def weights_of(run_dir):
    return load_file(str(run_dir / "rl" / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def async_run(tiny_task, tmp_path_factory, ray_session):
    """The uninterrupted run, in this process on the module's Ray (no Ray start of its own)."""
    run_dir = tmp_path_factory.mktemp("async")
    assert main(rl_cmd(tiny_task, run_dir)[3:]) == 0
    return run_dir


def test_async_run_trains_partial_rollouts_whole_with_importance_weights(async_run):
    run_dir = async_run
    rows = rows_of(run_dir)
    assert [r["step"] for r in rows] == list(range(1, ITERATIONS + 1))
    # partial rollouts: a stale batch's first 2 samples finish under the old weights; with 4 rows the tiny model's
    # samples (most run to the length limit) finish about 4 together, and the other 2 prompts start under the new
    # weights: about half the samples and tokens are the trained policy's own (the first batch is not stale: whole)
    assert rows[0]["async/staleness_mean"] == 0.0 and rows[0]["async/tokens_next_version"] == 0.0
    for r in rows[1:]:
        assert 0.0 < r["async/staleness_mean"] < 1.0 and 0.25 < r["async/tokens_next_version"] < 0.75
        assert r["async/staleness_0"] + r["async/staleness_1"] == pytest.approx(1.0)
    assert "train/behaviour_weight_mean" not in rows[0]  # the first batch is on-policy: PPO's own objective
    for r in rows[1:]:
        # a one-update-old sampler: the weights differ from 1, and stay near it at this learning rate
        assert 0.5 < r["train/behaviour_weight_mean"] < 2.0 and r["train/behaviour_weight_mean"] != 1.0
        assert 0.0 <= r["train/behaviour_beyond_cap"] <= 1.0
        assert r["time/proximal_logprobs"] > 0
    for r in rows:  # every generated sample is trained: the two lengths agree
        assert r["rollout/mean_length_trained"] == pytest.approx(r["rollout/mean_length_generated"])
        assert r["worker/1/rss_mb"] > 0 and r["time/decode"] > 0 and r["rollout/prefill_tokens"] > 0
        # the generation worker took the reference's log-probs of what it decoded (inside its decoding time)
        assert 0 < r["time/reference_on_decoders"] < r["time/decode"]
    assert (run_dir / "rl" / "checkpoint.pt.inflight").exists()


def test_a_one_step_stale_batch_with_a_kl_penalty_is_scored_with_the_proximal_log_probs(tiny_task, ray_session,
                                                                                         tmp_path):
    # RLOO puts the KL into the sequence reward before the update: a stale batch trained in one optimiser step (8
    # samples, mini-batch 8) still gets the trained policy's log-probs from the scoring pass, as a multi-step one and
    # the synchronous loop's bf16 batches do (rollout/fusion.py scores_proximal), not the sampler's
    run_dir = tmp_path / "one-step"
    assert main(rl_cmd(tiny_task, run_dir, "rl.algo=rloo", "rl.kl_coef=0.05", "rl.mini_batch_size=8",
                       "rl.iterations=2")[3:]) == 0
    rows = rows_of(run_dir)
    assert "time/proximal_logprobs" not in rows[0]  # the first batch is on-policy
    assert rows[1]["async/staleness_mean"] > 0 and rows[1]["time/proximal_logprobs"] > 0


def test_the_first_async_iteration_is_the_synchronous_single_processs(tiny_task, async_run, tmp_path):
    # the first batch is drawn by the initial weights and trained by them (not stale, decoded whole): the same
    # samples, rewards and on-policy update as one process running the synchronous loop
    single = [a for a in rl_cmd(tiny_task, tmp_path / "single")[3:]
              if not a.startswith(("placement.", "rl.max_staleness", "rl.partial_rollout_after", "rl.iterations"))]
    assert main([*single, "rl.iterations=1"]) == 0
    want, got = rows_of(tmp_path / "single")[0], rows_of(async_run)[0]
    for key in ("reward/mean", "rollout/length_mean", "reward/kl_k1"):
        assert got[key] == pytest.approx(want[key], abs=1e-6), key
    # the generation worker prefilled each prompt once, its samples sharing it, as the single process did
    assert got["rollout/prefill_tokens"] == want["rollout/prefill_tokens"] > 0
    assert got["train/policy_loss"] == pytest.approx(want["train/policy_loss"], abs=1e-5)


def test_a_second_run_killed_and_resumed_ends_with_the_first_runs_bits(tiny_task, async_run, tmp_path, capfd):
    """Two runs with the same seed and placement, one of them killed after its first checkpoint and resumed: the
    same weights and rewards, bit for bit. Both the schedule (counts, not timing) and the resume (the batch generated
    ahead read back, not decoded again by newer weights) must hold for this."""
    killed = tmp_path / "killed"
    proc = subprocess.Popen(rl_cmd(tiny_task, killed), env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    ckpt = killed / "rl" / "checkpoint.pt"
    deadline = time.time() + 180  # kill once the first checkpoint (iteration 2, with batch 3 in flight) is written
    while time.time() < deadline and not ckpt.exists():
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and its Ray workers, as a lost machine would
    proc.wait(timeout=60)
    saved = torch.load(ckpt, weights_only=False)["iteration"]
    assert saved == 2 and not (killed / "rl" / "model").exists()
    assert main(["rl", "--resume", str(killed)]) == 0  # in this process, on the module's Ray
    assert "no batches in flight saved" not in capfd.readouterr().err
    assert [r["step"] for r in rows_of(killed)] == list(range(1, ITERATIONS + 1))
    assert [r["reward/mean"] for r in rows_of(killed)] == [r["reward/mean"] for r in rows_of(async_run)]
    a, b = weights_of(async_run), weights_of(killed)
    assert all(torch.equal(a[n], b[n]) for n in a)


TIES = '''
def has_the(completions, **columns):
    return [float(" the " in f" {c} ") for c in completions]
'''


def test_dynamic_sampling_refills_asynchronously_with_the_weights_being_trained(tiny_task, ray_session, tmp_path):
    """rl.recipe=dapo with rl.max_staleness=1: the further draws are decoded when the trainer asks, by the weights
    being trained (a count decides their weights, as for every batch: the same in every run, which the kill and
    resume test above checks for the schedule), and the batch keeps rl.prompts_per_iter groups."""
    (tmp_path / "ties.py").write_text(TIES)
    assert main(rl_cmd(tiny_task, tmp_path / "a", f"rl.reward={tmp_path / 'ties.py'}:has_the", "rl.recipe=dapo",
                       "rl.max_refills=3", "rl.max_new_tokens=8")[3:]) == 0
    rows = rows_of(tmp_path / "a")
    assert any(r["rollout/refills"] > 0 for r in rows), [r["rollout/refills"] for r in rows]
    assert all(r["rollout/samples"] == 8 for r in rows)  # 4 groups of 2, whatever was drawn
    assert all(r["async/staleness_max"] <= 1 for r in rows)
