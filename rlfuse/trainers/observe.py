"""What the RL loop records besides its own numbers: learning rates, the share of prompt groups that teach nothing,
a table of sample completions, and held-out evaluation during the run (rl.eval_every, rl.log_samples_every)."""

from __future__ import annotations

import time

from rlfuse.algos.stats import zero_spread_fraction
from rlfuse.config import RLConfig
from rlfuse.evaluation import evaluate
from rlfuse.placement.rollout import sync_weights
from rlfuse.rollout.fusion import Experience

SAMPLES_PER_TABLE = 8
"""Rows of each sample table: the iteration's first samples, which (samples grouped by prompt) cover its first
SAMPLES_PER_TABLE / k prompts."""


def learning_rates(trainer, rl: RLConfig) -> dict:
    """train/lr (and train/critic_lr with a critic) as the optimisers use them now. A trainer without learners in
    this process (placement on Ray) runs the same constant schedule (build_constant_optimizer): the config's rates."""
    learners = getattr(trainer, "learners", None)
    if learners is None:
        return {"train/lr": rl.lr} | ({"train/critic_lr": rl.critic_lr} if rl.algo == "ppo" else {})
    out = {"train/lr": learners.actor.sched.get_last_lr()[0]}
    return out | ({"train/critic_lr": learners.critic.sched.get_last_lr()[0]} if learners.critic is not None else {})


def group_metrics(exp: Experience, k: int) -> dict:
    """reward/frac_zero_spread: with k >= 2 samples per prompt, the fraction of prompts whose samples all got the same
    reward (nothing to learn from them under rloo and grpo; ppo still learns through its critic)."""
    return {"reward/frac_zero_spread": float(zero_spread_fraction(exp.scores, k))} if k > 1 else {}


def sample_table(exp: Experience, tok, gold: bool, n: int = SAMPLES_PER_TABLE) -> list[dict]:
    """The iteration's first n samples: prompt, completion, reward, why it ended (and the gold score on the default
    task), special tokens removed."""
    rows = [{"prompt": tok.decode(exp.prompt_ids[i], skip_special_tokens=True),
             "completion": tok.decode(exp.response_ids[i], skip_special_tokens=True),
             "reward": round(float(exp.scores[i]), 4), "finish": exp.finish_reasons[i]} for i in range(min(n, len(exp)))]
    if gold:
        from rlfuse.data.gold import gold_reward

        for r, g in zip(rows, gold_reward([r["prompt"] + r["completion"] for r in rows])):
            r["gold"] = round(g, 4)
    return rows


def due(every: int, iteration: int) -> bool:
    """Whether 1-based `iteration` is a multiple of `every` (0: never)."""
    return every > 0 and iteration % every == 0


def evaluate_during(trainer, models, engine, prompts: list[list[int]], rl: RLConfig, seed: int, gold: bool) -> dict:
    """The before/after evaluation (same prompts, seed and temperature, so the points line up) on the actor as it is
    now, as eval/* metrics. The trained weights are pulled into this process first (a no-op without Ray) and copied
    into the engine, which the next iteration's sync overwrites anyway."""
    t = time.perf_counter()
    trainer.pull_into(models)
    sync_weights(engine, models.actor)
    metrics, _ = evaluate(models, engine, prompts, rl, seed, gold)
    return {f"eval/{k}": v for k, v in metrics.items()} | {"time/eval": time.perf_counter() - t}
