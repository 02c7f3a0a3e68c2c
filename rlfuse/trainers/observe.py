"""What the RL loop records besides the update's own numbers: the rollout's rewards, KL and lengths, the share of
prompt groups that teach nothing, a table of sample completions, and held-out evaluation during the run
(rl.eval_every, rl.log_samples_every)."""

from __future__ import annotations

import time

import torch

from rlfuse.algos.kl import sequence_kl
from rlfuse.algos.offpolicy import logprob_mismatch
from rlfuse.algos.stats import explained_variance, zero_spread_fraction
from rlfuse.config import RLConfig
from rlfuse.data.gold import gold_reward
from rlfuse.evaluation import evaluate
from rlfuse.rollout.episodes import episode_metrics
from rlfuse.rollout.fusion import Experience
from rlfuse.runtime.local import release_decode_copy, sync_weights

SAMPLES_PER_TABLE = 8
"""Rows of each sample table: the iteration's first samples, which (samples grouped by prompt) cover its first
SAMPLES_PER_TABLE / k prompts."""


def group_metrics(exp: Experience, k: int) -> dict:
    """reward/frac_zero_spread: with k >= 2 samples per prompt, the fraction of prompts whose samples all got the same
    reward (nothing to learn from them under rloo and grpo; ppo still learns through its critic);
    train/trained_fraction: with rl.skip_zero_advantage, the share of the samples the update ran on."""
    out = {"reward/frac_zero_spread": float(zero_spread_fraction(exp.scores, k))} if k > 1 else {}
    return out | ({"train/trained_fraction": float(exp.trained.float().mean())} if exp.trained is not None else {})


def sample_table(exp: Experience, tok, gold: bool, n: int = SAMPLES_PER_TABLE) -> list[dict]:
    """The iteration's first n samples: prompt, completion, reward, why it ended (and the gold score on the default
    task), special tokens removed."""
    rows = [{"prompt": tok.decode(exp.prompt_ids[i], skip_special_tokens=True),
             "completion": tok.decode(exp.response_ids[i], skip_special_tokens=True),
             "reward": round(float(exp.scores[i]), 4), "finish": exp.finish_reasons[i]} for i in range(min(n, len(exp)))]
    if gold:
        for r, g in zip(rows, gold_reward([r["prompt"] + r["completion"] for r in rows])):
            r["gold"] = round(g, 4)
    return rows


def due(every: int, iteration: int) -> bool:
    """Whether 1-based `iteration` is a multiple of `every` (0: never)."""
    return every > 0 and iteration % every == 0


def evaluate_during(trainer, models, engine, prompts: list[list[int]], rl: RLConfig, seed: int, gold: bool,
                    rows: list | None = None) -> dict:
    """The before/after evaluation (same prompts, seed and temperature, so the points line up) on the actor as it is
    now, as eval/* metrics. The trained weights are pulled into this process first (a no-op without Ray) and copied
    into the engine, which the next iteration's sync overwrites anyway."""
    t = time.perf_counter()
    trainer.pull_into(models)
    sync_weights(engine, models.actor)
    metrics, _ = evaluate(models, engine, prompts, rl, seed, gold, rows)
    release_decode_copy(engine)
    return {f"eval/{k}": v for k, v in metrics.items()} | {"time/eval": time.perf_counter() - t}


def rollout_metrics(exp: Experience, kl, returns, kl_coef: float, max_new: int) -> dict:
    """reward/ (mean, spread, non-finite, KL by the configured estimator and by k1, and its coefficient), rollout/
    (response lengths, the share that hit rl.max_new_tokens, the prompts' lengths: what `rlfuse plan --lengths-from`
    reads back), with a critic train/explained_variance of the iteration's experience, and mismatch/ (the sampler's
    log-probs against the trainer's, algos/offpolicy.py logprob_mismatch) where the batch was scored with both."""
    lengths, finite = exp.mask.sum(1), exp.scores[torch.isfinite(exp.scores)]
    prompt_lengths = [len(p) for p in exp.prompt_ids]  # each prompt k times: its mean is the prompts' mean
    m = {
        "reward/mean": float(finite.mean()) if len(finite) else float("nan"),
        "reward/std": float(finite.std()) if len(finite) > 1 else 0.0,
        "reward/nonfinite": len(exp) - len(finite),
        "reward/kl": float(kl.sum(1).mean()), "reward/kl_coef": kl_coef,
        "reward/kl_k1": float(sequence_kl(exp.logprobs, exp.ref_logprobs, exp.mask)),
        "rollout/length_mean": float(lengths.mean()), "rollout/length_p50": float(lengths.median()),
        "rollout/length_p95": float(torch.quantile(lengths, 0.95)), "rollout/length_max": float(lengths.max()),
        "rollout/hit_limit": float((lengths >= max_new).float().mean()), "rollout/samples": len(exp),
        "rollout/prompt_length_mean": sum(prompt_lengths) / len(prompt_lengths),
        "rollout/prompt_lengths_distinct": len(set(prompt_lengths)),
        "rollout/prompt_length_max": max(prompt_lengths),
    }
    if "prefill_tokens" in exp.timing:  # what the engine(s) prefilled: prompts, re-prefills, episodes' new turns
        m["rollout/prefill_tokens"] = exp.timing["prefill_tokens"]
    if returns is not None and not m["reward/nonfinite"]:
        m["train/explained_variance"] = float(explained_variance(exp.values, returns, exp.mask))
    if exp.proximal_logprobs is not None:  # scored beside the sampler's: the train-inference gap
        m |= logprob_mismatch(exp.logprobs, exp.proximal_logprobs, exp.mask)
    if exp.episodes is not None:  # multi-turn: turns, tool calls and faults, truncation, sampled vs appended tokens
        sampled = int(exp.mask.sum())
        m |= episode_metrics(exp.episodes, sampled, sum(len(r) for r in exp.response_ids) - sampled)
    return m
