"""Weights into an engine's own model by an explicit copy (the trainer -> generator sync), never by sharing the
optimiser's tensors: the generator may live in another process, on another device, in another dtype."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import Tensor

from rlfuse.models.weights import DeferredTensor

NamedTensors = Mapping[str, Tensor | DeferredTensor] | Iterable[tuple[str, Tensor | DeferredTensor]]


def copy_weights(model: torch.nn.Module, tensors: NamedTensors) -> int:
    """Copy named tensors (names of model.state_dict(), e.g. `transformer.h.0.attn.c_attn.weight`) into the model in
    place, converting dtype and device. Checks every name and shape before copying anything. Tied weights (GPT-2's
    lm_head.weight is transformer.wte.weight) share storage, so either name updates both. A DeferredTensor (a merged
    LoRA weight, models/weights.py merged_weights) is computed as it is copied. Returns bytes written."""
    items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    own = model.state_dict(keep_vars=True)
    for name, t in items:
        if name not in own:
            raise ValueError(f"load_weights: '{name}' is not a tensor of the engine's {type(model).__name__} "
                             f"(expected state_dict names such as '{next(iter(own))}')")
        if tuple(t.shape) != tuple(own[name].shape):
            raise ValueError(f"load_weights: '{name}' has shape {tuple(t.shape)}, the engine's model has "
                             f"{tuple(own[name].shape)}")
    written = 0
    with torch.no_grad():
        for name, t in items:
            dst = own[name]
            dst.copy_(t.make() if isinstance(t, DeferredTensor) else t)
            written += dst.numel() * dst.element_size()
    return written


def weight_buckets(named_tensors: NamedTensors, bucket_bytes: int) -> Iterator[dict[str, Tensor]]:
    """Split named tensors into dicts of about bucket_bytes each, in order (a tensor larger than bucket_bytes is a
    bucket of its own). For sending weights in pieces that fit a transfer buffer."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    bucket, size = {}, 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += nbytes
    if bucket:
        yield bucket
