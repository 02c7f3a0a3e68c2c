"""Per-sample random streams: the uniform a sample's token at position t is drawn with is a pure function of
(seed, prompt id, sample index, t), so samples never depend on which rows share a batch, in what order prompts are
admitted, or which engine decodes them (a migrated row continues its stream where it stopped).

Counter-based: a 32-bit hash of the key words, no generator state. Each word is absorbed splitmix32-style (add the
golden-ratio increment, then the two-round finaliser of hash-prospector, github.com/skeeto/hash-prospector). The
finaliser's multipliers are below 2**31, so on int64 tensors holding 32-bit values every product is exact (no
overflow, no reliance on wrap-around): CPU and CUDA give the same bits. Works on Python ints and int64 tensors alike.
"""

from __future__ import annotations

import torch
from torch import Tensor

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9


def mix32(x):
    """Bijective 32-bit finaliser [16 21f0aaad 15 735a2d97 15]. x: int or int64 tensor with values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & MASK32
    return x ^ (x >> 15)


def absorb(h, word):
    """Fold one 32-bit word into the hash state h (the golden increment keeps the all-zero key away from 0)."""
    return mix32(((h ^ (word & MASK32)) + GOLDEN) & MASK32)


def seed_state(seed: int) -> int:
    """The hash state after the seed. A seed wider than 32 bits (the trainer passes seed * 1_000_003 + iteration)
    is absorbed as two words, low then high, so no two seeds below 2**64 share their first two words."""
    seed &= (1 << 64) - 1
    return absorb(absorb(0, seed & MASK32), seed >> 32)


def stream_keys(seed: int, prompt_ids: Tensor, sample_indices: Tensor) -> Tensor:
    """One key per sample: (R,) int64 in [0, 2**32). The engine computes these once per row, at admission."""
    h = torch.full_like(prompt_ids, seed_state(seed), dtype=torch.int64)
    return absorb(absorb(h, prompt_ids.long()), sample_indices.long())


def stream_uniforms(keys: Tensor, positions: Tensor) -> Tensor:
    """The uniforms at stream positions (tokens drawn so far) of the given keys: (R,) float32 in [0, 1), 24 bits
    (the float32 mantissa; all 2**24 values equally likely)."""
    return (absorb(keys, positions.long()) >> 8).to(torch.float32) * 2.0 ** -24


def sample_uniforms(seed: int, prompt_ids: Tensor, sample_indices: Tensor, positions: Tensor) -> Tensor:
    """The uniform each (prompt id, sample index) row draws its token at `positions` with, under `seed`. All (R,)."""
    return stream_uniforms(stream_keys(seed, prompt_ids, sample_indices), positions)
