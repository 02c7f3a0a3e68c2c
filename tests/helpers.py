"""Tiny local models the tests build themselves (no hub): a byte-level BPE tokenizer and a 2-layer, 64-dim GPT-2 or
Llama."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from rlfuse.models.build import enable_gradient_checkpointing
from rlfuse.models.heads import ValueModel
from rlfuse.models.tiny import make_tiny_llama, make_tiny_model  # noqa: F401  (the tests' tiny models)
from rlfuse.models.tiny import tiny_tokenizer as _tiny_tokenizer  # noqa: F401

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
IMDB_CSV = SHARED_DATA / "imdb_reviews_2000.csv"
HH_JSONL = SHARED_DATA / "hh_rlhf_harmless_1800.jsonl.gz"


def _probe_batch(vocab_size: int, pad_id: int):
    """Two right-padded rows (lengths 7 and 4) of fixed ids, so padding and the reward model's last-token read are
    exercised."""
    import torch

    ids = (torch.arange(14).view(2, 7) * 37 + 5) % vocab_size
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    ids[1, 4:] = pad_id
    return ids, mask


def _outputs(model, ids, mask):
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask).logits.float()
    finally:
        model.train(was_training)
    return out[mask.bool()] if out.dim() == 3 else out  # LM: logits of real tokens only


def assert_reloads(model, folder, kind: str) -> None:
    """A stage folder saved by save_trained_model reloads as `model` (the in-memory model at the end of training):
    logits (kind="causal") or scores (kind="reward") of a fixed padded batch equal, at assert_close's fp32 defaults,
    for folder/model in plain transformers, folder/adapter (if any) on its base in peft, and both folders through
    rlfuse's loaders. The adapter's base must be a folder that exists."""
    import json

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlfuse.models.load import load_causal_lm, load_reward_model

    folder = Path(folder)
    assert kind in ("causal", "reward"), kind
    model = model.to("cpu")
    config = json.loads((folder / "model" / "config.json").read_text())
    pad_id = config.get("pad_token_id")
    assert pad_id is not None, "pad_token_id missing from the saved config"
    ids, mask = _probe_batch(config["vocab_size"], pad_id)
    want = _outputs(model, ids, mask)
    if kind == "causal":
        auto, rlfuse_load = AutoModelForCausalLM, load_causal_lm
        plain = AutoModelForCausalLM.from_pretrained(folder / "model", dtype=torch.float32)
    else:
        auto, rlfuse_load = AutoModelForSequenceClassification, load_reward_model
        plain = AutoModelForSequenceClassification.from_pretrained(folder / "model", num_labels=1, dtype=torch.float32)
    reloaded = {"plain transformers": plain, "rlfuse model/": rlfuse_load(str(folder / "model"))}
    adapter = folder / "adapter"
    if adapter.exists():
        base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert Path(base).is_dir(), f"adapter base {base} does not exist"
        kwargs = {"num_labels": 1, "pad_token_id": pad_id} if kind == "reward" else {}
        reloaded["peft base + adapter/"] = PeftModel.from_pretrained(auto.from_pretrained(base, dtype=torch.float32,
                                                                                           **kwargs), adapter)
        reloaded["rlfuse adapter/"] = rlfuse_load(str(adapter))
    for how, m in reloaded.items():
        if kind == "reward":
            m.config.pad_token_id = pad_id
        got = _outputs(m, ids, mask)
        torch.testing.assert_close(got, want, msg=lambda msg, how=how: f"{folder} reloaded as {how}: {msg}")


def adapter_bases(run_dir) -> dict[str, str]:
    """adapter_config.json under run_dir -> its base_model_name_or_path."""
    import json

    return {str(p.parent): json.loads(p.read_text())["base_model_name_or_path"]
            for p in Path(run_dir).rglob("adapter_config.json")}


def llama_sft_and_rm(root: Path, texts: list[str], stage_overrides: list[str]) -> tuple[Path, Path]:
    """A tiny Llama (make_tiny_llama) and the SFT then reward-model stages on it through the CLI; (model folder, run
    folder)."""
    from rlfuse.cli import main

    model = make_tiny_llama(root / "tiny-llama", texts)
    run_dir = root / "run"
    for stage in ("sft", "rm"):
        assert main([stage, f"model.name={model}", f"run.dir={run_dir}", *stage_overrides]) == 0
    return model, run_dir


def hand_experience(actor, n: int, k: int, seed: int = 1, longest: int = 6, long_prompts: int = 0):
    """An Experience of n samples, n/k prompts of 2..5 tokens, responses of 1..`longest` tokens (unequal lengths);
    old log-probs near the actor's own so some ratios clip; random values and scores. long_prompts: that many more
    tokens in every other prompt (their samples' forwards then pay to share the prompt), and the other prompts'
    responses all `longest` tokens (packing their continuations would save nothing: sharing such a short prompt
    pays for 5 tokens and not for 3)."""
    import torch

    from rlfuse.rollout.fusion import Experience
    from rlfuse.models.forward import collate, response_logprobs

    g = torch.Generator().manual_seed(seed)
    vocab = actor.config.vocab_size
    prompts = [torch.randint(1, vocab, (2 + i % 4 + (long_prompts if i % 2 == 0 else 0),), generator=g).tolist()
               for i in range(n // k)]
    prompt_ids = [prompts[i // k] for i in range(n)]
    step = 3 if longest == 6 else 5  # 3 keeps the lengths the data-parallel tests were written with
    length = lambda i: longest if long_prompts and (i // k) % 2 else 1 + (step * i) % longest
    response_ids = [torch.randint(1, vocab, (length(i),), generator=g).tolist() for i in range(n)]
    mb = collate(prompt_ids, response_ids, 0, "cpu")
    with torch.no_grad():
        lp = response_logprobs(actor, mb)
    noise = lambda s: s * torch.randn(*mb.mask.shape, generator=g) * mb.mask
    return Experience(prompt_ids, response_ids, torch.arange(n) // k, torch.randn(n, generator=g), lp + noise(0.2),
                      lp + noise(0.3), noise(1.0), mb.mask, ["eos"] * n)


def lora_on(model, arch: str, targets: list[str] | None = None):
    """A peft LoRA (rank 4) on a tiny GPT-2 or Llama, its B matrices drawn away from zero so that the adapters change
    the forward (equivalence tests compare paths through them)."""
    targets = targets or (["c_attn", "c_proj", "c_fc"] if arch == "gpt2" else
                          ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"])
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                                             fan_in_fan_out=arch == "gpt2"))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.3)
    return model


def actor_and_critic(build, arch: str, lora: bool, checkpointing: bool):
    """A tiny actor build(arch, 0) (with lora_on where asked) and a critic on build(arch, 1)'s body with a random head,
    both with gradient checkpointing where asked."""
    actor = lora_on(build(arch, 0), arch) if lora else build(arch, 0)
    critic = ValueModel.from_causal_lm(build(arch, 1)).train()
    torch.nn.init.normal_(critic.head.weight, std=0.5)
    if checkpointing:
        enable_gradient_checkpointing(actor)
        enable_gradient_checkpointing(critic.backbone)
    return actor, critic


@contextlib.contextmanager
def saved_bytes(model):
    """Counts the bytes autograd keeps for the backward of what runs inside, besides `model`'s parameters: yields a
    list whose one element is the running total."""
    params, kept, total = {p.data_ptr() for p in model.parameters()}, {}, [0]

    def pack(t):
        if t.data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            total[0] = sum(kept.values())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


def seeded_rm_folders(base: str, root: Path) -> list[str]:
    """RL overrides whose SFT model is `base` and whose reward model is `base` with a seeded scalar head saved in
    root/rm (the reward, and the critic's start), for the placement tests that compare layouts on the same models."""
    from rlfuse.models.load import load_reward_model, load_tokenizer

    torch.manual_seed(0)
    tok = load_tokenizer(base)
    rm = load_reward_model(base, pad_token_id=tok.pad_token_id)
    rm.save_pretrained(root / "rm")
    tok.save_pretrained(root / "rm")
    return [f"rl.sft_path={base}", f"rl.rm_path={root / 'rm'}", "rl.reward=rm"]
