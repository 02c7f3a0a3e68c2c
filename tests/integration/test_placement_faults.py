"""A Ray worker killed with SIGKILL mid-iteration (a generation worker; a worker that also trains, its peer rank
then blocked in a collective): the run stops with one line naming the worker, and
`--resume` continues from the last checkpoint to the end, nothing logged twice, ending where a run without the kill
ends (the single-process run from the same folders, to test_placement_run.py's tolerance)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, TINY

pytest.importorskip("ray", reason="ray is not installed: pip install 'ray==2.60.*' for the placement tests")

RL = ["rl.algo=grpo", "rl.k=2", "rl.reward=rlfuse.data.gold:gold_reward", "rl.iterations=4", "rl.prompts_per_iter=4",
      "rl.mini_batch_size=4", "rl.micro_batch_size=2", "rl.max_new_tokens=24", "rl.epochs=1", "rl.eval_prompts=4",
      "rl.lr=1e-3", "rl.ckpt_every=1", "rollout.score_every=2", "run.threads=1"]


def rl_cmd(tiny_task, run_dir, *extra):
    return [sys.executable, "-m", "rlfuse", "rl", f"rl.sft_path={tiny_task.model_dir}", f"run.dir={run_dir}", *TINY,
            *RL, *extra]


@pytest.fixture(scope="module")
def full_run(tiny_task, tmp_path_factory):
    """The uninterrupted single-process run every killed one must end equal to."""
    full = tmp_path_factory.mktemp("full")
    subprocess.run(rl_cmd(tiny_task, full), check=True, env=os.environ | {"CI": "true"}, capture_output=True, cwd=ROOT)
    return full


# separated on 2 workers: rank 0 is "train" (trains, scores), rank 1 is "generate" (decodes). flattened: both ranks
# decode, score and train (data-parallel): killing one leaves the other blocked in a collective or a rollout call.
# each on a test worker of its own (tests/conftest.py), each building full_run: 20 s against a minute and more apiece
@pytest.mark.parametrize("strategy,group", [
    pytest.param("separated", "generate", marks=pytest.mark.split_group("separated")),
    pytest.param("flattened", "all", marks=pytest.mark.split_group("flattened"))])
def test_killed_worker_stops_the_run_and_resume_finishes_it(tiny_task, tmp_path, full_run, strategy, group):
    env, full, killed = os.environ | {"CI": "true"}, full_run, tmp_path / "killed"
    err = open(tmp_path / "stderr.txt", "w")
    proc = subprocess.Popen(rl_cmd(tiny_task, killed, f"placement.strategy={strategy}", "placement.workers=2"),
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    metrics, ckpt = killed / "rl" / "metrics.jsonl", killed / "rl" / "checkpoint.pt"
    deadline = time.time() + 120  # the kill lands once an iteration is logged and checkpointed (the row goes first)
    while time.time() < deadline and (not metrics.exists() or not metrics.read_text().strip() or not ckpt.exists()):
        time.sleep(0.05)
    pids = dict(re.findall(r"(\d+):(\d+)", re.search(r"pids ([\d:, ]+)\)", (tmp_path / "stderr.txt").read_text())[1]))
    if len(os.sched_getaffinity(0)) >= 2:  # a run that starts its own Ray keeps each worker on a core of its own
        first, second = sorted(os.sched_getaffinity(0))[:2]
        assert f"on cores 0:{first}, 1:{second};" in (tmp_path / "stderr.txt").read_text()
    os.kill(int(pids["1"]), signal.SIGKILL)
    assert proc.wait(timeout=120) == 2
    message = (tmp_path / "stderr.txt").read_text().strip().splitlines()[-1]
    assert f"worker 1 (group {group}) died" in message and "--resume" in message
    assert not (killed / "rl" / "model").exists()
    done = len(metrics.read_text().splitlines())
    # the row of the iteration the kill cut short may be logged before its checkpoint: resume drops and repeats it
    saved = torch.load(ckpt, weights_only=False)["iteration"]
    assert 1 <= saved <= done < 4 and done - saved <= 1
    resumed = subprocess.run([sys.executable, "-m", "rlfuse", "rl", "--resume", str(killed)], env=env, cwd=ROOT,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = [json.loads(l) for l in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 5))  # nothing lost, nothing logged twice
    # the reward function ran on the scoring workers: its mean is every iteration's reward (GRPO: no KL in it)
    for row, want in zip(rows, (json.loads(l) for l in (full / "rl" / "metrics.jsonl").read_text().splitlines())):
        assert row["reward/fn/gold_reward"] == pytest.approx(want["reward/fn/gold_reward"], abs=1e-6)
    a, b = load_file(str(full / "rl" / "model" / "model.safetensors")), load_file(str(killed / "rl" / "model" /
                                                                                     "model.safetensors"))
    for n in a:  # tolerance: see test_placement_run.py (lr / 10; Adam and rounding-level gradient differences)
        torch.testing.assert_close(b[n], a[n], atol=1e-4, rtol=1.3e-6, msg=lambda m: f"{n}: {m}")
