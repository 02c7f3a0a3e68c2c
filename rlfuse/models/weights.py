"""The policy's weights as a plain transformers state dict: what the trainer hands the generator each iteration
(`DecodeEngine.load_weights`), what each stage saves as its merged model, and later what moves between workers in
buckets."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlfuse.models.quantize import conv1d_layout, dequantized_weight, quantized_layer

# bitsandbytes' quantisation state beside a quantised weight in a state dict (4-bit: weight.absmax, weight.quant_map,
# ...; 8-bit: SCB, weight_format): not weights of the plain model.
QUANT_STATE_KEYS = ("weight.", "SCB", "weight_format")


def peft_layer_types() -> tuple[tuple, tuple]:
    """(peft's LoRA layer classes, its modules_to_save wrapper classes), or empty where peft was never imported:
    no module of this process can be one of them then, and peft stays out of processes that never use it (see
    models/load.py apply_lora)."""
    if "peft" not in sys.modules:
        return (), ()
    from peft.tuners.lora import LoraLayer  # deferred: already imported by whoever built a LoRA model
    from peft.utils import ModulesToSaveWrapper  # (the same)

    return (LoraLayer,), (ModulesToSaveWrapper,)


@dataclass(frozen=True)
class DeferredTensor:
    """A merged LoRA weight that merged_weights(deferred=True) computes only when the receiver copies it (rollout/
    weights.py copy_weights): its shape is known before, so names and shapes are checked first, and one merged
    weight is alive at a time instead of a full-precision copy of every adapted matrix at once (SmolLM2 LoRA on q/k/v/
    o/gate/up/down: about 0.5 GB during each weight sync)."""
    shape: torch.Size
    make: Callable[[], torch.Tensor]


@torch.no_grad()
def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """merged_weights with every tensor computed: what each stage saves."""
    return merged_weights(model)


@torch.no_grad()
def merged_weights(model, deferred: bool = False) -> dict[str, torch.Tensor | DeferredTensor]:
    """The state dict of `model` with its active LoRA adapters folded in, under the plain model's key names, without
    touching `model`: each LoRA layer's weight is base weight + peft's get_delta_weight (a new tensor), a
    modules_to_save copy (the reward model's trained `score` head) replaces its original, and adapter tensors are
    dropped. Other tensors are the model's own (no copy). A model without peft returns its state dict. Tied
    weights (one tensor under two names) are listed once, under the first name; loading ties them again.

    What the trainer hands the generator each iteration (DecodeEngine.load_weights) and what each stage saves. Merging
    and unmerging in place instead would round the frozen base a little every iteration, and a resumed run (which
    reloads the unrounded base) would drift from an uninterrupted one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    transpose = conv1d_layout(base)  # a quantised GPT-2 Conv1D is a Linear: back to (in, out) for the plain model
    merged, renamed, quant_states = {}, [], []
    lora_layer, modules_to_save = peft_layer_types()
    for name, module in base.named_modules():
        if isinstance(module, lora_layer):
            layer = module.get_base_layer()
            quantized = quantized_layer(layer)
            make = _merger(module, layer, quantized, transpose)
            # a quantised layer's plain shape is known only once dequantised: merged now
            deferred_here = deferred and not quantized
            merged[f"{name}.weight"] = DeferredTensor(layer.weight.shape, make) if deferred_here else make()
            renamed.append((f"{name}.base_layer.", f"{name}."))
            if quantized:
                quant_states += [f"{name}.base_layer.{k}" for k in QUANT_STATE_KEYS]
        elif quantized_layer(module):  # a quantised layer without LoRA: its weight, dequantised
            merged[f"{name}.weight"] = dequantized_weight(module, transpose)
            quant_states += [f"{name}.{k}" for k in QUANT_STATE_KEYS]
        elif isinstance(module, modules_to_save):
            renamed.append((f"{name}.modules_to_save.{module.active_adapter}.", f"{name}."))
            renamed.append((f"{name}.original_module.", None))  # the untrained original: not part of the result
    out, seen = {}, set()
    for key, value in base.state_dict().items():
        if ".lora_" in key or value.data_ptr() in seen or key.startswith(tuple(quant_states)):
            continue  # adapters; a tied weight (GPT-2's lm_head is wte) moves once; bitsandbytes' quantisation state
        seen.add(value.data_ptr())
        for old, new in renamed:
            if key.startswith(old):
                key = None if new is None else new + key[len(old):]
                break
        if key is not None:
            out[key] = merged.get(key, value)
    return out


def _merger(module, layer, quantized: bool, transpose: bool) -> Callable[[], torch.Tensor]:
    """The merged weight of one LoRA layer, base + each active adapter's delta, when called."""

    @torch.no_grad()
    def make() -> torch.Tensor:
        weight = dequantized_weight(layer) if quantized else layer.weight
        if not module.merged and not module.disable_adapters:  # merged: the delta is in the weight already
            for a in (a for a in module.active_adapters if a in module.lora_A):
                # a dequantised weight is our own copy: add in place rather than hold a second full-size tensor
                weight = weight.add_(module.get_delta_weight(a)) if quantized else weight + module.get_delta_weight(a)
        return weight.t() if quantized and transpose else weight

    return make
