"""Fusion policy: when to score finished samples while the rest still decode, and the rollout loop that applies it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlfuse.rollout.engine import DecodeEngine, SamplingParams
from rlfuse.rollout.score import ScoredSample, Scorer


@dataclass(frozen=True)
class FusionPolicy:
    enabled: bool = True
    score_every: int = 16
    """Score as soon as this many samples have finished."""
    live_below: int = 0
    """...or as soon as the live decode batch has fewer rows than this (the tail), whatever has finished."""

    def should_score(self, pending: int, live_rows: int) -> bool:
        return self.enabled and pending > 0 and (pending >= self.score_every or live_rows < self.live_below)


@dataclass(frozen=True)
class LengthTable:
    """A per-sample length override as data, table[prompt_id][sample_index] (DecodeEngine.generate's `lengths`):
    picklable, so it crosses to generation workers where a lambda would not (benchmarks set tail heaviness with it)."""
    table: tuple[tuple[int, ...], ...]

    def __call__(self, prompt_id: int, sample_index: int) -> int:
        return int(self.table[prompt_id][sample_index])


@dataclass
class Experience:
    """All samples of one iteration, ordered by (prompt, sample index); per-token tensors are (N, T) right-padded."""
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    prompt_index: Tensor   # (N,)
    scores: Tensor         # (N,)
    logprobs: Tensor       # (N, T) old log-probs of the sampled tokens
    ref_logprobs: Tensor   # (N, T)
    values: Tensor | None  # (N, T)
    mask: Tensor           # (N, T)
    finish_reasons: list[str]
    timing: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompt_ids)


def _pad(rows: list[Tensor], width: int) -> Tensor:
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def build_experience(scored: list[ScoredSample]) -> Experience:
    scored = sorted(scored, key=lambda x: (x.sample.prompt_id, x.sample.sample_index))
    T = max(len(x.sample.token_ids) for x in scored)
    return Experience(
        prompt_ids=[x.sample.prompt_ids for x in scored],
        response_ids=[x.sample.token_ids for x in scored],
        prompt_index=torch.tensor([x.sample.prompt_id for x in scored]),
        scores=torch.tensor([x.score for x in scored]),
        logprobs=_pad([x.old_logprobs for x in scored], T),
        ref_logprobs=_pad([x.ref_logprobs for x in scored], T),
        values=None if scored[0].values is None else _pad([x.values for x in scored], T),
        mask=_pad([torch.ones(len(x.sample.token_ids)) for x in scored], T),
        finish_reasons=[x.sample.finish_reason for x in scored],
    )


def generate_rollouts(engine: DecodeEngine, scorer: Scorer, prompts: list[list[int]], k: int, params: SamplingParams,
                      seed: int, fusion: FusionPolicy, lengths=None, prompt_ids: list[int] | None = None) -> Experience:
    """Decode all prompts x k; score finished samples per the fusion policy (fused: while the tail decodes;
    unfused: everything after decoding). Same weights, same seed: the same samples either way (each sample's random
    stream is keyed by seed, prompt id and sample index). prompt_ids: the prompts' global ids (DecodeEngine.generate)."""
    scored, pending = [], []
    score_time_in_decode = 0.0
    t0 = time.perf_counter()
    for sample in engine.generate(prompts, k, params, seed, lengths, prompt_ids):
        pending.append(sample)
        if fusion.should_score(len(pending), engine.live_rows) and engine.live_rows > 0:
            t = time.perf_counter()
            scored += scorer.score(pending)
            score_time_in_decode += time.perf_counter() - t
            pending = []
    t_decoded = time.perf_counter()
    if pending:
        scored += scorer.score(pending)
    t_end = time.perf_counter()
    exp = build_experience(scored)
    exp.timing = {
        "rollout": t_end - t0,
        "generation": (t_decoded - t0) - score_time_in_decode,
        "scoring": score_time_in_decode + (t_end - t_decoded),
        "scoring_during_decode": score_time_in_decode,
        "decode_rows": engine.stats.decode_rows,
        "decode_steps": engine.stats.decode_steps,
    }
    return exp
