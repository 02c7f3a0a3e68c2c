"""The policy's weights as a plain transformers state dict: what the trainer hands the generator each iteration
(`DecodeEngine.load_weights`), and later what moves between workers in buckets."""

from __future__ import annotations

import torch
from torch import Tensor


def _plain_name(peft_name: str) -> str | None:
    """A peft base-model state-dict name -> the plain model's name; None for adapter tensors (lora_A/B, the
    untouched original of a modules_to_save copy)."""
    if ".lora_" in peft_name or ".original_module." in peft_name:
        return None
    name = peft_name.replace(".base_layer.", ".")
    if ".modules_to_save." in name:  # the trained copy: drop the wrapper and adapter name
        head, _, tail = name.partition(".modules_to_save.")
        name = f"{head}.{tail.partition('.')[2]}"
    return name


@torch.no_grad()
def policy_weights(actor: torch.nn.Module) -> dict[str, Tensor]:
    """The actor's current weights under plain transformers names (what `model.state_dict()` of the merged model
    would hold). A plain model's tensors are returned as they are (no copy: the caller copies them into its own).

    For a peft actor each LoRA layer gives base weight + get_delta_weight(adapter) for its active adapters, computed
    out of place: merging and unmerging in place would round the frozen base a little every iteration, and a
    resumed run (which reloads the unrounded base) would drift from an uninterrupted one.
    """
    if not hasattr(actor, "get_base_model"):
        return dict(actor.state_dict())
    from peft.tuners.lora import LoraLayer

    base = actor.get_base_model()
    out = {}
    for name, t in base.state_dict().items():
        plain = _plain_name(name)
        if plain is not None:
            out[plain] = t
    for prefix, module in base.named_modules():
        if isinstance(module, LoraLayer) and not module.disable_adapters:
            weight = module.get_base_layer().weight
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A)
            out[f"{prefix}.weight"] = weight + delta if torch.is_tensor(delta) else weight
    return out
