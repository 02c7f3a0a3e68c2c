"""The shipped real-data configs run end to end (SFT -> reward model -> RL -> report) through `rlfuse run`, each
on a tiny GPT-2 the test builds and the shared data file, and every stage's model/ folder reloads in plain
transformers. hh-rlhf runs on a 128-position model, so its long conversations must be cut to the prompt budget."""

import csv
import gzip
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from helpers import HH_JSONL, IMDB_CSV, adapter_bases, make_tiny_model
from rlfuse.cli import main

FEW = ["sft.steps=2", "sft.batch_size=4", "sft.micro_batch_size=2", "sft.eval_every=2", "sft.eval_samples=0",
       "rm.steps=2", "rm.batch_size=4", "rm.micro_batch_size=2", "rm.eval_every=2", "rm.num_pairs=16",
       "rl.iterations=2", "rl.prompts_per_iter=4", "rl.k=1", "rl.mini_batch_size=4", "rl.micro_batch_size=2",
       "rl.epochs=1", "rl.eval_prompts=4", "rl.ckpt_every=2", "rollout.micro_batch_size=4", "rollout.score_every=2",
       "data.max_examples=120", "run.quiet=true"]


def _needs(path):
    if not path.exists():
        pytest.skip(f"shared data file {path} not present")


def assert_pipeline_ran(run_dir):
    for stage in ("sft", "rm"):
        assert (run_dir / stage / "summary.json").exists(), f"{stage} did not finish"
    assert set(json.loads((run_dir / "eval.json").read_text())) >= {"before", "after"}
    assert (run_dir / "rl" / "metrics.jsonl").read_text().count("\n") == 2  # both RL iterations logged
    assert (run_dir / "report.html").exists()
    ids = torch.tensor([[0, 7, 11, 13]])
    for stage, auto in (("sft", AutoModelForCausalLM), ("rm", AutoModelForSequenceClassification),
                        ("rl", AutoModelForCausalLM)):
        folder = run_dir / stage / "model"
        assert not (folder / "adapter_config.json").exists(), f"{folder} is an adapter, not a plain model"
        out = auto.from_pretrained(folder).eval()(input_ids=ids).logits
        assert torch.isfinite(out).all()


def test_imdb_distilgpt2_config_runs_end_to_end_with_lora(tmp_path):
    _needs(IMDB_CSV)
    texts = [r["review"] for r in csv.DictReader(IMDB_CSV.open(encoding="utf-8"))][:200]
    model = make_tiny_model(tmp_path / "tiny-gpt2", texts)
    run_dir = tmp_path / "run"
    assert main(["run", "configs/imdb_distilgpt2.yaml", f"model.name={model}", f"data.path={IMDB_CSV}",
                 f"run.dir={run_dir}", "data.max_length=64", "rl.max_new_tokens=8", *FEW]) == 0
    assert_pipeline_ran(run_dir)
    bases = adapter_bases(run_dir)  # LoRA, as shipped: each stage's adapter beside its merged model, on a real base
    assert set(bases) == {str(run_dir / stage / "adapter") for stage in ("sft", "rm", "rl")}
    assert all(Path(b).is_dir() for b in bases.values())


def test_hh_rlhf_config_runs_end_to_end_and_cuts_long_prompts(tmp_path):
    _needs(HH_JSONL)
    rows = [json.loads(line) for line in gzip.open(HH_JSONL, "rt", encoding="utf-8")][:200]
    model = make_tiny_model(tmp_path / "tiny-gpt2", [r["chosen"] for r in rows], n_positions=128)
    run_dir = tmp_path / "run"
    assert main(["run", "configs/hh_rlhf.yaml", f"model.name={model}", f"data.path={HH_JSONL}", f"run.dir={run_dir}",
                 "model.lora=false", "data.max_length=96", "rl.max_new_tokens=16", *FEW]) == 0
    assert_pipeline_ran(run_dir)
    summary = json.loads((run_dir / "rl" / "summary.json").read_text())
    assert summary["prompt_budget"] == 128 - 16  # the model's context minus rl.max_new_tokens
    assert 0 < summary["prompts_truncated"] <= summary["prompts"]  # real conversations are longer than that
