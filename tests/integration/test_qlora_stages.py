"""The QLoRA stages on a tiny Llama-style model (4-bit base, LoRA, one shared base in RL, 8-bit AdamW): every saved
model reloads as what was trained (SFT's and the reward model's plain folders compute what the 4-bit model with its
adapter computed), and an RL run resumed from its checkpoint ends where an uninterrupted run ends."""

import json

import pytest
import torch

from conftest import TINY
from helpers import llama_sft_and_rm
from rlfuse.config import load_config

pytest.importorskip("bitsandbytes", reason="bitsandbytes is a test dependency (pip install -e .[test])")

QLORA = ["model.lora=true", "model.quantization=4bit", "run.precision=fp32"]
STAGES = [o for o in TINY if not o.startswith(("model.n_", "sft.eval_samples"))] + ["sft.eval_samples=0", *QLORA]
RL = ["rl.algo=ppo", "rl.reward=rm", "rl.critic_init=rm", "rl.optimizer=adamw_8bit", "rl.prompts_per_iter=4", "rl.k=1",
      "rl.mini_batch_size=4", "rl.micro_batch_size=2", "rl.max_new_tokens=6", "rl.epochs=1", "rl.eval_prompts=2",
      "rl.lr=1e-3", "rl.critic_lr=1e-3", "rollout.score_every=2",
      "model.lora_r=64"]  # the actor's LoRA tensors reach bitsandbytes' 4096-element minimum for 8-bit states


@pytest.fixture(scope="module")
def stages(tiny_task, tmp_path_factory):
    """SFT then the reward model, both on a 4-bit base with LoRA; (base model folder, run folder)."""
    return llama_sft_and_rm(tmp_path_factory.mktemp("qlora"), tiny_task.reviews()[:300], STAGES)


def _probe(tok):
    ids = [tok.bos_token_id] + tok("the acting was truly great , a film")["input_ids"]
    return torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)


def _trained_sft(model, run_dir):
    """The SFT stage's model as it trained: the 4-bit base (loaded as load_causal_lm does) with the saved adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlfuse.models.load import fuse_activations
    from rlfuse.models.quantize import keep_one_cpu_layout, quantized_load_kwargs

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, **quantized_load_kwargs("4bit", "fp32"))
    return PeftModel.from_pretrained(fuse_activations(keep_one_cpu_layout(base)), str(run_dir / "sft" / "adapter")).eval()


def test_sft_saved_from_a_4bit_base_reloads_as_trained(stages):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, run_dir = stages
    folder = run_dir / "sft" / "model"
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    ids, _ = _probe(AutoTokenizer.from_pretrained(folder))
    with torch.no_grad():
        trained = _trained_sft(model, run_dir)(input_ids=ids).logits
        reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(input_ids=ids).logits
        original = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()(input_ids=ids).logits
    torch.testing.assert_close(reloaded, trained)
    assert (reloaded - original).abs().max() > 1e-3  # trained, and 4-bit: not the original model


def test_reward_model_saved_from_a_4bit_base_reloads_as_rl_scores_it(stages):
    """rm/model (plain, sequence classification) gives the reward RL computes on its shared 4-bit base from the rm
    stage's adapter and score head."""
    from transformers import AutoModelForSequenceClassification

    from rlfuse.models.build import build_models
    from rlfuse.rollout.engine import Sample

    _, run_dir = stages
    cfg = load_config(None, [f"run.dir={run_dir}", *STAGES, *RL])
    models = build_models(cfg, run_dir, torch.device("cpu"))
    tok = models.tokenizer
    ids, mask = _probe(tok)
    prompt, response = ids[0, :4].tolist(), ids[0, 4:].tolist() + [tok.eos_token_id]
    with torch.no_grad():
        in_rl = models.reward_fn([Sample(0, 0, prompt, response, torch.zeros(len(response)), "eos")])
        rm = AutoModelForSequenceClassification.from_pretrained(run_dir / "rm" / "model", dtype=torch.float32).eval()
        reloaded = rm(input_ids=torch.tensor([prompt + response])).logits.squeeze(-1)
    torch.testing.assert_close(reloaded, in_rl)


@pytest.mark.slow
def test_shared_4bit_base_with_8bit_adamw_resumes_as_uninterrupted(stages, tmp_path):
    """2 iterations with a checkpoint each, resumed to 3, equal 3 uninterrupted iterations with the same seed: the
    actor's and critic's adapters, the critic's head, the 8-bit optimiser states and the logged metrics."""
    from rlfuse.trainers.rl import train_rl

    _, run_dir = stages
    stage_paths = [f"rl.sft_path={run_dir / 'sft' / 'model'}", f"rl.rm_path={run_dir / 'rm' / 'model'}"]
    cfg = lambda out, n: load_config(None, [f"run.dir={out}", *STAGES, *RL, *stage_paths, f"rl.iterations={n}",
                                            "rl.ckpt_every=1"])
    quiet = lambda *_: None
    train_rl(cfg(tmp_path / "full", 3), tmp_path / "full", log=quiet)
    train_rl(cfg(tmp_path / "part", 2), tmp_path / "part", log=quiet)
    train_rl(cfg(tmp_path / "part", 3), tmp_path / "part", log=quiet, resume=True)
    rows = {d: [json.loads(l) for l in (tmp_path / d / "rl" / "metrics.jsonl").read_text().splitlines()]
            for d in ("full", "part")}
    assert [r["step"] for r in rows["part"]] == [1, 2, 3]
    for key in ("reward/mean", "reward/kl", "train/policy_loss", "train/value_loss"):
        assert [r[key] for r in rows["part"]] == [r[key] for r in rows["full"]], key
    full, part = (torch.load(tmp_path / d / "rl" / "checkpoint.pt", weights_only=False) for d in ("full", "part"))
    assert full["iteration"] == part["iteration"] == 3
    for name in ("actor", "critic"):
        assert full[name].keys() == part[name].keys()
        for n in full[name]:
            torch.testing.assert_close(part[name][n], full[name][n], rtol=0, atol=0, msg=n)
    def states(ckpt):  # bitsandbytes nests its 8-bit states (uint8 + absmax + qmap) in a dict of their own
        flat = lambda d: [t for v in d.values() for t in (flat(v) if isinstance(v, dict) else [v]) if torch.is_tensor(t)]
        return flat(ckpt["opt_actor"]["state"])

    assert any(v.dtype == torch.uint8 for v in states(full))  # 8-bit AdamW states were saved and restored
    assert len(states(part)) == len(states(full))
    for a, b in zip(states(part), states(full)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_shared_4bit_base_on_two_flattened_ray_workers_trains_as_one_process(stages, tmp_path):
    """model.shared_base on Ray (placement.strategy=flattened): each worker holds the 4-bit base with every role's
    adapter, decodes it with no weight sync, and DDP reduces each role's adapter alone (the actor's backward never
    reaches the critic's adapter on the same base). After 2 PPO iterations the actor's and critic's adapters and the
    critic's head equal the single process's (plain AdamW: 8-bit states would round the workers' rounding-level
    differences into whole quantisation steps)."""
    ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'ray==2.60.*' for the placement tests")
    from rlfuse.cli import main

    _, run_dir = stages
    args = [*STAGES, *RL, f"rl.sft_path={run_dir / 'sft' / 'model'}", f"rl.rm_path={run_dir / 'rm' / 'model'}",
            "rl.iterations=2", "rl.optimizer=adamw", "run.threads=1"]
    assert main(["rl", f"run.dir={tmp_path / 'single'}", *args]) == 0
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert main(["rl", f"run.dir={tmp_path / 'ray'}", *args, "placement.strategy=flattened",
                     "placement.workers=2"]) == 0
    finally:
        ray.shutdown()
    rows = [json.loads(l) for l in (tmp_path / "ray" / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train/data_parallel_ranks"] == 2 and r["sync/bytes"] == 0 for r in rows)
    single, placed = (torch.load(tmp_path / d / "rl" / "checkpoint.pt", weights_only=False) for d in ("single", "ray"))
    start = dict(build_start_adapters(run_dir))
    for role in ("actor", "critic"):
        assert placed[role].keys() == single[role].keys()
        for n in single[role]:  # rounding only: the workers score other micro-batches (test_placement_run.py)
            torch.testing.assert_close(placed[role][n], single[role][n], atol=1e-4, rtol=1.3e-6, msg=n)
    moved = {n: float((t - start[n]).abs().max()) for n, t in single["actor"].items() if n in start}
    assert any(".default." in n for n in moved) and any(".critic." in n for n in moved)
    assert max(v for n, v in moved.items() if ".default." in n) > 1e-3  # both adapters trained, far past atol
    assert max(v for n, v in moved.items() if ".critic." in n) > 1e-3


def build_start_adapters(run_dir):
    """The adapters' tensors as RL starts them (the critic's copied from the reward adapter; the actor's LoRA B zero)."""
    from rlfuse.models.build import build_models

    cfg = load_config(None, [f"run.dir={run_dir}", *STAGES, *RL])
    models = build_models(cfg, run_dir, torch.device("cpu"))
    return {n: p.detach().clone() for n, p in models.actor.named_parameters() if p.requires_grad}.items()
