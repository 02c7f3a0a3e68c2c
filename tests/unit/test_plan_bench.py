"""bench/plan.py --repredict: stored measurements predicted again from a profile, without running anything."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.plan import drop_weights, plans_for, predicted_seconds, report, repredict, run_dir  # noqa: E402
from rlfuse.plan.profiles import BUILTIN_CPU  # noqa: E402

INPUTS = {"lengths": [11.5, 33], "prompt_tokens": 4.1, "prompt_lengths": 3.8}


@pytest.fixture
def stored(tmp_path):
    """A results.json of two measured plans (as bench/plan.py writes it), its profile beside it, empty model folders
    (the config only checks that they exist)."""
    for role in ("sft", "rm"):
        (tmp_path / "models" / role / "model").mkdir(parents=True)
    BUILTIN_CPU.save(tmp_path / "machine_profile.json")
    plans = plans_for("default", tmp_path / "models", tmp_path / "machine_profile.json", INPUTS)
    measured = {"rollout": 0.3, "train": 1.0, "sync": 0.01, "iteration": 1.3, "rss_mb": {"0": 600.0, "1": 600.0},
                "spread": 0.05, "iterations": [1.28, 1.32]}
    results = [{"task": "default", "label": pl.label(), "rank": 0, "predicted": {"iteration": 99.0}, "mem_pred": {},
                "inputs": INPUTS, "measured": measured, "runs": [], "models": str(tmp_path / "models")}
               for pl in (plans[0], plans[-1])]
    (tmp_path / "results.json").write_text(json.dumps(results))
    return tmp_path, plans


def test_repredict_replaces_the_predictions_and_keeps_the_measurements(stored):
    work, plans = stored
    out = repredict(work / "results.json", None, work / "machine_profile.json")
    assert [r["label"] for r in out] == [plans[0].label(), plans[-1].label()]
    assert out[0]["predicted"] == plans[0].seconds and out[1]["predicted"] == plans[-1].seconds
    assert out[0]["rank"] == 1 and out[1]["rank"] == len(plans)
    assert out[0]["measured"]["iteration"] == 1.3 and set(out[0]["mem_pred"]) == {"0", "1"}
    assert "mean relative error" in report(out, "test", "header")


def test_repredict_follows_the_profile_it_is_given(stored):
    work, plans = stored
    slow = replace(BUILTIN_CPU, pair_train_slowdown=2.0).save(work / "slow.json")
    base = repredict(work / "results.json", None, work / "machine_profile.json")
    again = repredict(work / "results.json", None, slow)
    assert again[0]["predicted"]["train"] > base[0]["predicted"]["train"]  # flattened trains on both at once


def test_each_iteration_is_predicted_from_its_own_prompts(stored):
    """Two iterations whose prompts were recorded at 4 and 40 tokens: the prediction is the median of each one's, so
    it lies above the one priced from the 4-token mean; the same recorded at the mean gives the mean's prediction."""
    work, plans = stored
    per = dict(INPUTS, iteration_lengths=[[11.5, 33], [11.5, 33]])
    label, profile = plans[0].label(), work / "machine_profile.json"
    at_mean = predicted_seconds("default", work / "models", profile, per)[label]
    longer = predicted_seconds("default", work / "models", profile,
                               dict(per, iteration_prompts=[[4.1, 3.8], [40.0, 3.8]]))[label]
    same = predicted_seconds("default", work / "models", profile,
                             dict(per, iteration_prompts=[[4.1, 3.8], [4.1, 3.8]]))[label]
    assert longer["train"] > at_mean["train"] and longer["score"] > at_mean["score"]
    assert same == at_mean


def test_repredict_says_what_is_missing(stored):
    work, _ = stored
    results = json.loads((work / "results.json").read_text())
    (work / "old.json").write_text(json.dumps([{k: v for k, v in r.items() if k != "models"} for r in results]))
    with pytest.raises(SystemExit, match="give --models"):
        repredict(work / "old.json", None, work / "machine_profile.json")
    (work / "gone.json").write_text(json.dumps([results[0] | {"label": "flattened 9, micro 3"}]))
    with pytest.raises(SystemExit, match="no longer among the candidates"):
        repredict(work / "gone.json", None, work / "machine_profile.json")


def test_a_measured_runs_weights_go_and_what_the_bench_reads_stays(tmp_path):
    rl = tmp_path / "rl"
    for folder in ("model", "adapter", "checkpoint.pt.shards-3"):
        (rl / folder).mkdir(parents=True)
        (rl / folder / "weights.safetensors").write_bytes(b"0" * 64)
    for name in ("checkpoint.pt", "checkpoint.pt.prev", "metrics.jsonl", "summary.json"):
        (rl / name).write_text("{}")
    drop_weights(tmp_path)
    assert sorted(p.name for p in rl.iterdir()) == ["metrics.jsonl", "summary.json"]


def test_an_fsdp_plan_never_reuses_the_same_layouts_ddp_run(stored):
    # the bench reuses a finished run from its folder: an FSDP plan in a DDP run's folder took its measurements
    tmp_path, plans = stored
    ddp = next(p for p in plans if p.strategy == "flattened" and p.train_parallel != "fsdp")
    fsdp = replace(ddp, train_parallel="fsdp")
    assert run_dir("default", fsdp, tmp_path, 0) != run_dir("default", ddp, tmp_path, 0)
    assert run_dir("default", replace(ddp, train_parallel="data"), tmp_path, 0) == run_dir("default", ddp, tmp_path, 0)
