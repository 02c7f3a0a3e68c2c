"""User reward functions written wrong (tests/fixtures/bad_rewards.py), run as a user runs them: `rlfuse rl
configs/verifiable.yaml rl.reward=module:function`. Each mistake ends in one line naming the function, where it was
called and what was wrong (in one process and on Ray workers), never a traceback; a reward far out of scale is
reported and the run and its report still finish; a function that abstains on everything stops the run."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from test_run_folders import one_line_error, rlfuse_here

FIXTURES = ROOT / "tests" / "fixtures"
SMALL = ["data.max_examples=300", "rl.iterations=3", "rl.prompts_per_iter=4", "rl.k=4", "rl.mini_batch_size=16",
         "rl.micro_batch_size=8", "rl.eval_prompts=4", "run.quiet=true"]


def rl_with(tiny_task, run_dir, function: str, *extra) -> subprocess.CompletedProcess:
    env = os.environ | {"CI": "true", "PYTHONPATH": f"{FIXTURES}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "rlfuse", "rl", "configs/verifiable.yaml", f"run.dir={run_dir}",
                           f"rl.sft_path={tiny_task.model_dir}", f"rl.reward=bad_rewards:{function}", *SMALL, *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture
def rl_here(tiny_task, monkeypatch):
    """rl_with in this process (test_run_folders.rlfuse_here), the fixtures' folder on sys.path as PYTHONPATH puts it
    there: the same command, exit code and lines without a new interpreter's start-up."""
    monkeypatch.syspath_prepend(str(FIXTURES))
    return lambda run_dir, function, *extra: rlfuse_here(
        "rl", "configs/verifiable.yaml", f"run.dir={run_dir}", f"rl.sft_path={tiny_task.model_dir}",
        f"rl.reward=bad_rewards:{function}", *SMALL, *extra)


WRONG = [
    ("raises", "raised ZeroDivisionError: division by zero"),
    ("returns_strings", "returned str 'good' for completion 0; return floats"),
    ("returns_nothing", "returned NoneType None, not a list"),
    ("returns_too_few", "returned 3 values for 4 completions"),
]


@pytest.mark.parametrize("function,what", WRONG, ids=[w[0] for w in WRONG])
def test_a_wrong_reward_function_is_one_line_naming_it_and_the_call(tiny_task, rl_here, tmp_path, function, what):
    # one in its own process, the CLI as a user runs it; the others in this one
    run = rl_with(tiny_task, tmp_path / "run", function) if function == "raises" else rl_here(tmp_path / "run", function)
    line = one_line_error(run, 2, "rlfuse rl: the held-out evaluation before RL: reward error: rl.reward:")
    assert f"rl.reward: {function}, called on 4 completions, {what}" in line


def test_a_name_that_is_not_a_function_is_a_config_error(rl_here, tmp_path):
    line = one_line_error(rl_here(tmp_path / "run", "not_a_function"), 2, "rlfuse rl: config error: "
                          "rl.reward:")
    assert "bad_rewards:not_a_function is a int, not a function" in line


def test_a_failure_on_a_ray_scoring_worker_is_the_same_line_with_its_iteration(tiny_task, tmp_path):
    proc = rl_with(tiny_task, tmp_path / "run", "raises", "rl.eval_prompts=0", "placement.strategy=flattened",
                   "placement.workers=2")
    line = one_line_error(proc, 2, "rlfuse rl: iteration 1: reward error: rl.reward: raises, called on")
    assert "raised ZeroDivisionError: division by zero" in line and "RayTaskError" not in proc.stderr


def test_rewards_far_out_of_scale_are_reported_and_the_run_finishes(tiny_task, tmp_path):
    # its own process: the warnings go to stderr as a user sees them (pytest would collect them here)
    proc = rl_with(tiny_task, tmp_path / "run", "returns_huge")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "returns_huge returned" in proc.stderr and "beyond +-10000" in proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["reward/beyond_bound"] > 0 for r in rows)
    assert (tmp_path / "run" / "report.html").is_file()
    assert "e+29" in proc.stdout  # the before/after table keeps its columns


def test_non_finite_rewards_are_named_skip_their_updates_and_the_report_still_draws(tiny_task, tmp_path):
    # (max_bad_steps in a row stop the run: tests/integration/test_rl.py); its own process: the warnings as above
    proc = rl_with(tiny_task, tmp_path / "run", "returns_nan", "rl.iterations=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rl.reward: returns_nan returned nan for 4 of 4 completions" in proc.stderr
    rows = [json.loads(row) for row in (tmp_path / "run" / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [("train/policy_loss" in r) for r in rows] == [False, False]  # both updates skipped
    assert (tmp_path / "run" / "report.html").is_file()


def test_a_function_abstaining_on_everything_warns_then_stops(rl_here, tmp_path):
    line = one_line_error(rl_here(tmp_path / "run", "abstains"), 2, "rlfuse rl: reward error:")
    assert "every function abstained (returned None) on every sample for 3 iterations in a row" in line
    logged = (tmp_path / "run" / "rl" / "metrics.jsonl").read_text().splitlines()
    assert len(logged) == 3  # every iteration up to the stop is logged
