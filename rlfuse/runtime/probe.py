"""The machine profile's probe work and arithmetic, Ray-free (profile.py times them in this process, profile_ray.py
on two Ray workers): scored samples and an experience shaped as a rollout's, a decode chunk, paired timings, how far
repeated timings spread, and the log's notes."""

from __future__ import annotations

import statistics
import time

import torch

from rlfuse.rollout.engine import DecodeEngine, SamplingParams
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


CHUNK_ROWS = 8


def decode_chunk(model, steps: int) -> float:
    """Seconds the rollout engine takes to decode CHUNK_ROWS rows for `steps` tokens: a chunk's work, timed the same
    way in the profile's own process (alone) and on two Ray workers at once."""
    engine = DecodeEngine(model, eos_token_id=-1, max_rows=64)
    prompts = [[1 + i, 2, 3, 4] for i in range(CHUNK_ROWS)]
    t0 = time.perf_counter()
    with torch.no_grad():
        list(engine.generate(prompts, 1, SamplingParams(max_new_tokens=steps), seed=0))
    return time.perf_counter() - t0


def extra_seconds(with_it, without, repeats: int) -> float:
    """Median seconds `with_it()` takes beyond `without()`, at least 0: after one warm-up call of each (DDP's first
    forward builds its buckets), timed in `repeats` back-to-back pairs, so both sides of a pair see the same load."""
    with_it(), without()
    diffs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with_it()
        t1 = time.perf_counter()
        without()
        diffs.append((t1 - t0) - (time.perf_counter() - t1))
    return max(0.0, statistics.median(diffs))


def pinned_note(cores: list[list[int]]) -> str:
    """Where the probe's workers ran: on cores of their own (as a run on a local Ray pins its workers) or not."""
    if all(cores):
        return "workers on cores " + " and ".join(",".join(map(str, c)) for c in cores)
    return "workers not pinned to cores"


def pair_note(out: dict, rounds) -> str:
    """One clause saying how much slower both workers compute at once than one alone, and how far its rounds
    spread."""
    spread_of = lambda kind: (f"spread {out[f'pair_{kind}_spread'] * 100:.0f}%" if out[f"pair_{kind}_spread"]
                              else "spread not measured")  # a profile from before the rounds
    parts = [f"{kind} {out[f'pair_{kind}_slowdown']:.2f}x ({spread_of(kind)})" for kind in ("decode", "train")]
    return f"both workers computing at once against one alone, median of {rounds} rounds: {', '.join(parts)}"
