"""The KV cache's keyword and output field in the installed transformers: `cache` from 5.x, where `past_key_values`
warns and goes in 5.40; `past_key_values` before (rlfuse supports transformers >= 4.57). Read once from the
signatures, not from a version number."""

from __future__ import annotations

import inspect

from transformers import LlamaModel
from transformers.masking_utils import create_causal_mask

CACHE_KEYWORD = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"
MASK_CACHE_KEYWORD = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def with_cache(cache) -> dict:
    """The keyword argument that hands a model's forward this KV cache (None: none)."""
    return {CACHE_KEYWORD: cache}


def mask_cache(cache) -> dict:
    """The same for transformers' create_causal_mask."""
    return {MASK_CACHE_KEYWORD: cache}


def cache_of(output):
    """The KV cache a forward returned."""
    return getattr(output, CACHE_KEYWORD)
