"""One loader for hub names and local folders: causal LMs and reward models through the Auto classes, LoRA
through peft. Folders saved by rlfuse (full weights or a peft adapter) load the same way."""

from __future__ import annotations

from pathlib import Path

import torch

from rlfuse.config import ModelConfig
from rlfuse.errors import UserError

# LoRA targets by architecture; anything else gets peft's "all-linear".
LORA_TARGETS = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def _is_adapter(name: str) -> bool:
    return (Path(name) / "adapter_config.json").is_file()


def _load_error(name: str, e: Exception) -> UserError:
    return UserError(f"model error: could not load {name!r} ({type(e).__name__}); "
                     "set model.name to a local model folder (with config.json) or a reachable hub name")


def load_tokenizer(name: str):
    """Right-padded tokenizer with a pad token (GPT-2's hub tokenizer has none: its EOS is used)."""
    from transformers import AutoTokenizer

    if _is_adapter(name) and not (Path(name) / "tokenizer_config.json").exists():
        name = _adapter_base(name)
    try:
        tok = AutoTokenizer.from_pretrained(name)
    except Exception as e:
        raise _load_error(name, e) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return tok


def _adapter_base(name: str) -> str:
    import json

    return json.loads((Path(name) / "adapter_config.json").read_text())["base_model_name_or_path"]


def lora_targets(model, cfg: ModelConfig):
    if cfg.lora_targets:
        return list(cfg.lora_targets)
    return LORA_TARGETS.get(getattr(model.config, "model_type", ""), "all-linear")


def apply_lora(model, cfg: ModelConfig, task_type: str = "CAUSAL_LM", extra_trainable: list[str] | None = None):
    from peft import LoraConfig, get_peft_model

    lcfg = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules=lora_targets(model, cfg),
                      task_type=task_type, modules_to_save=extra_trainable,
                      fan_in_fan_out=getattr(model.config, "model_type", "") == "gpt2")
    return get_peft_model(model, lcfg)


def fuse_activations(model):
    """Swap transformers' `gelu_new` (tanh-GELU written as five tensor ops, each saving its input for backward) for
    torch's fused tanh-GELU: the same function (to 3e-7), one kernel forward and backward, and one saved tensor
    instead of five per MLP. Only modules change; the saved config and weights do not. Returns the model."""
    from transformers.activations import GELUTanh, NewGELUActivation

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, NewGELUActivation):
                setattr(module, name, GELUTanh())
    return model


def load_causal_lm(name: str, cfg: ModelConfig | None = None, trainable_lora: bool | None = None):
    """AutoModelForCausalLM from a hub name or folder; a saved peft adapter loads onto its base.
    With cfg.lora (and a plain model) fresh adapters are added."""
    from transformers import AutoModelForCausalLM

    try:
        if _is_adapter(name):
            from peft import AutoPeftModelForCausalLM

            model = AutoPeftModelForCausalLM.from_pretrained(name, is_trainable=bool(trainable_lora))
        else:
            model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
    except Exception as e:
        raise _load_error(name, e) from None
    fuse_activations(model)
    if cfg is not None and cfg.lora and not _is_adapter(name):
        model = apply_lora(model, cfg)
    return model


def load_reward_model(name: str, cfg: ModelConfig | None = None, pad_token_id: int | None = None):
    """Scalar-head model (AutoModelForSequenceClassification, one label) on a causal LM backbone. The score is
    read at the last non-pad token, so the pad id must be set in its config."""
    from transformers import AutoModelForSequenceClassification

    import json
    import tempfile

    adapter_task = json.loads((Path(name) / "adapter_config.json").read_text()).get("task_type") if _is_adapter(name) else None
    try:
        if adapter_task == "SEQ_CLS":  # a saved reward model with LoRA
            from peft import AutoPeftModelForSequenceClassification

            model = AutoPeftModelForSequenceClassification.from_pretrained(name, num_labels=1)
        elif adapter_task is not None:  # an SFT adapter as backbone: merge it into its base, then add the head
            with tempfile.TemporaryDirectory() as tmp:
                load_causal_lm(name).merge_and_unload().save_pretrained(tmp)
                model = AutoModelForSequenceClassification.from_pretrained(tmp, num_labels=1, dtype=torch.float32)
        else:
            model = AutoModelForSequenceClassification.from_pretrained(name, num_labels=1, dtype=torch.float32)
    except Exception as e:
        raise _load_error(name, e) from None
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    fuse_activations(model)
    if cfg is not None and cfg.lora and adapter_task != "SEQ_CLS":
        model = apply_lora(model, cfg, task_type="SEQ_CLS", extra_trainable=["score"])
    return model


def save_model(model, tokenizer, out_dir: str | Path) -> Path:
    """save_pretrained of weights (or adapter) and tokenizer into one folder, written then renamed."""
    import os
    import shutil

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out
