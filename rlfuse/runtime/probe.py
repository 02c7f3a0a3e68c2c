"""Made-up work the machine profile times its calls on (profile.py in this process, profile_ray.py on two Ray
workers): scored samples and an experience shaped as a rollout's, and how far repeated timings spread."""

from __future__ import annotations

import statistics

import torch

from rlfuse.rollout.fusion import build_experience
from rlfuse.rollout.score import ScoredSample
from rlfuse.rollout.state import Sample

PROBE_PROMPT, PROBE_RESPONSE = 4, 16
"""Token counts of the probe's samples and micro-batches (the default task's prompts and responses)."""


def fake_samples(n: int, prompt: int = PROBE_PROMPT, response: int = PROBE_RESPONSE) -> list:
    """n scored samples shaped as a rollout's (token lists, per-token log-probs and values): what a chunk carries."""
    out = []
    for i in range(n):
        s = Sample(i, 0, list(range(1, prompt + 1)), list(range(5, 5 + response)), torch.randn(response), "eos")
        out.append(ScoredSample(s, 0.5, torch.randn(response), torch.randn(response), s.logprobs))
    return out


def fake_experience(n: int, vocab: int, prompt: int = PROBE_PROMPT, response: int = PROBE_RESPONSE):
    """An Experience of n samples with random tokens (every response `response` tokens long: no padding)."""
    g = torch.Generator().manual_seed(0)
    ids = lambda k: torch.randint(1, vocab, (k,), generator=g).tolist()
    scored = []
    for i in range(n):
        lp = -torch.rand(response, generator=g)
        scored.append(ScoredSample(Sample(i, 0, ids(prompt), ids(response), lp, "eos"), 0.0, lp.clone(),
                                   torch.zeros(response), lp))
    return build_experience(scored)


def spread(xs: list[float]) -> float:
    """(max - min) / median: how far apart repeated measurements of one quantity landed."""
    return (max(xs) - min(xs)) / statistics.median(xs)
