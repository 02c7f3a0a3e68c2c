"""configs/qlora_1gpu.yaml end to end (SFT -> reward model -> PPO -> report) on a tiny Llama-style model the test
builds and the shared hh-rlhf file, on CPU: a 4-bit base shared by every role, 8-bit AdamW, checkpointing; the run
records the memory table per component and the report shows it."""

import gzip
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import HH_JSONL, make_tiny_llama
from rlfuse.cli import main
from test_real_pipelines import FEW, assert_pipeline_ran

pytest.importorskip("bitsandbytes", reason="bitsandbytes is a test dependency (pip install -e .[test])")


def test_qlora_config_runs_end_to_end_on_a_tiny_llama(tmp_path):
    if not HH_JSONL.exists():
        pytest.skip(f"shared data file {HH_JSONL} not present")
    rows = [json.loads(line) for line in gzip.open(HH_JSONL, "rt", encoding="utf-8")][:200]
    model = make_tiny_llama(tmp_path / "tiny-llama", [r["chosen"] for r in rows], n_positions=128)
    run_dir = tmp_path / "run"
    assert main(["run", "configs/qlora_1gpu.yaml", f"model.name={model}", f"data.path={HH_JSONL}", f"run.dir={run_dir}",
                 "data.max_length=96", "rl.max_new_tokens=8", *FEW]) == 0
    assert_pipeline_ran(run_dir)  # every stage's model/ is a plain full-precision folder that reloads
    for stage in ("sft", "rm", "rl"):
        assert "quantization_config" not in json.loads((run_dir / stage / "model" / "config.json").read_text())
    table = json.loads((run_dir / "rl" / "memory.json").read_text())
    b = table["bytes"]
    assert table["quantization"] == "4bit" and set(b) == {"base", "adapters", "gradients", "optimizer", "activations",
                                                          "kv_cache", "slack", "total"}
    assert b["adapters"] > 0 and b["gradients"] > 0 and b["optimizer"] > 0
    # one 4-bit base and no full-precision generator copy beside it: under the model's fp32 size
    n_params = sum(t.numel() for t in AutoModelForCausalLM.from_pretrained(model).parameters())
    assert 0 < b["base"] < 4 * n_params
    assert b["total"] >= b["base"] + b["adapters"]
    rows = [json.loads(line) for line in (run_dir / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(r["sync/bytes"] == 0 for r in rows)  # the engine decodes the shared base: nothing to sync
    predicted = json.loads((run_dir / "rl" / "memory_predicted.json").read_text())["bytes"]
    assert set(predicted) == set(b) and predicted["base"] > 0 and predicted["optimizer"] > 0
    report = (run_dir / "report.html").read_text()
    assert "Memory per component (RL)" in report and "kv_cache" in report and "predicted" in report
    # the RL adapter alone was saved (not the critic's or the reward model's beside it), on the SFT model
    adapter = run_dir / "rl" / "adapter"
    assert not (adapter / "critic").exists() and not (adapter / "reward").exists()
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str((run_dir / "sft" / "model").resolve())
    assert_rl_model_is_the_trained_actor(run_dir)


def assert_rl_model_is_the_trained_actor(run_dir):
    """The trained actor, rebuilt as RL holds it (the 4-bit shared base, the actor's adapter from the last
    checkpoint), gives the logits of the saved plain rl/model; and training moved it away from the SFT model."""
    from transformers import AutoModelForCausalLM

    from rlfuse.config import load_config
    from rlfuse.models.build import build_models

    # the 4-bit layers computing in fp32 whatever the hardware (run.precision auto is bf16 where native): the same
    # arithmetic as the plain fp32 folder, so the two agree to fp32 rounding
    cfg = load_config(str(run_dir / "config.yaml"), ["run.precision=fp32"])
    models = build_models(cfg, run_dir, torch.device("cpu"))
    state = torch.load(run_dir / "rl" / "checkpoint.pt", weights_only=False, map_location="cpu")
    assert not models.actor.load_state_dict(state["actor"], strict=False).unexpected_keys
    ids = torch.tensor([[1, 5, 9, 11, 40, 7, 30]])
    saved = AutoModelForCausalLM.from_pretrained(run_dir / "rl" / "model", dtype=torch.float32).eval()
    sft = AutoModelForCausalLM.from_pretrained(run_dir / "sft" / "model", dtype=torch.float32).eval()
    with torch.no_grad():
        trained, reloaded = models.actor.eval()(input_ids=ids).logits, saved(input_ids=ids).logits
        torch.testing.assert_close(reloaded, trained)
        assert (reloaded - sft(input_ids=ids).logits).abs().max() > 1e-3


def test_quantised_sft_trains_only_full_precision_adapters(tmp_path):
    import bitsandbytes as bnb

    from rlfuse.config import load_config
    from rlfuse.models.load import load_causal_lm

    model = make_tiny_llama(tmp_path / "tiny-llama", ["a small corpus of words"] * 20)
    cfg = load_config(None, ["model.lora=true", "model.quantization=4bit"])
    lm = load_causal_lm(str(model), cfg.model, precision="fp32", device="cpu")
    layers = [m for m in lm.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 2 * 7  # q k v o gate up down in each of 2 layers
    assert layers[0].weight.quant_state.quant_type == "nf4"
    trainable = [p for p in lm.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    assert not any(isinstance(p, bnb.nn.Params4bit) and p.requires_grad for p in lm.parameters())
