"""Held-out evaluation of a policy (before and after RL) and the gold score of an iteration's samples on the default
task: the numbers that say whether the policy really improved or only fooled the reward model."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import torch

from rlfuse.algos.kl import sequence_kl
from rlfuse.config import RLConfig
from rlfuse.data.chat import end_of_turn_ids
from rlfuse.data.gold import gold_summary
from rlfuse.data.stages import SMALL_HELD_OUT
from rlfuse.models.rewards import runs_a_model
from rlfuse.plan.memory import EVAL_SCORE_ROWS
from rlfuse.files import write_text_atomic
from rlfuse.rollout.engine import DecodeEngine, SamplingParams
from rlfuse.rollout.episodes import episode_metrics
from rlfuse.rollout.fusion import Experience, FusionPolicy, generate_rollouts
from rlfuse.rollout.generator import generate_from_rows
from rlfuse.rollout.score import Scorer

EVAL_SAMPLES_KEPT = 16


def eval_temperature(rl: RLConfig) -> float:
    """The evaluation's fixed temperature: rl.eval_temperature, or rl.temperature when it is null."""
    return rl.eval_temperature if rl.eval_temperature is not None else rl.temperature


def texts_of(exp: Experience, tok) -> list[str]:
    return [tok.decode(p + r, skip_special_tokens=True) for p, r in zip(exp.prompt_ids, exp.response_ids)]


def sampling_params(models, rl: RLConfig, temperature: float) -> SamplingParams:
    """rl's sampling settings at this temperature. A sample ends on EOS, on an rl.stop string, or on any end-of-turn
    id of the tokenizer's chat template and the model's generation config (a chat model's turn ends there)."""
    policy = models.generator if models.generator is not None else models.actor  # None: decodes the shared base
    stop_ids = end_of_turn_ids(models.tokenizer, getattr(policy, "generation_config", None))
    return SamplingParams(rl.max_new_tokens, temperature, rl.top_k, rl.top_p, tuple(rl.stop or ()), stop_ids)


def evaluate(models, engine: DecodeEngine, prompts: list[list[int]], rl: RLConfig, seed: int,
             gold: bool, rows: list | None = None) -> tuple[dict, list[str]]:
    """Held-out prompts, one sample each: reward, KL to the reference, length; gold and grammar on the default task.
    The engine must hold the policy's current weights (the caller syncs them). "kl" is the k1 estimate summed over
    the response (an unbiased estimate of the sequence KL, whatever estimator the training penalty uses)."""
    if not prompts:
        return {}, []
    t = eval_temperature(rl)  # fixed whatever the training schedule: before and after compare
    # under autocast the reference is scored in bf16 while the engine sampled in fp32 (or from a bf16 copy): the
    # actor's own log-probs are scored beside it, in the same arithmetic, or the KL reads the rounding (0.073 before
    # any update on SmolLM2's hh replies, docs/benchmarks/real_model.md)
    scorer = Scorer(models.reward_fn, models.tokenizer.pad_token_id, ref=models.ref, actor=models.actor,
                    temperature=t, micro_batch_size=EVAL_SCORE_ROWS, compute_dtype=models.compute_dtype,
                    recompute_old_logprobs=models.compute_dtype is not None,
                    environment_weight=rl.environment_reward_weight)
    params = sampling_params(models, rl, t)
    exp = generate_rollouts(engine, scorer, prompts, 1, params, seed, FusionPolicy(True), rows=rows)
    texts = texts_of(exp, models.tokenizer)
    out = {
        "reward_mean": float(exp.scores.mean()),
        "kl": float(sequence_kl(exp.logprobs, exp.ref_logprobs, exp.mask)),
        "mean_length": float(exp.mask.sum(1).mean()),
        "n": len(prompts),  # the tables say how many prompts each figure averages
    }
    if gold:
        out.update(gold_summary(texts, [r != "length" for r in exp.finish_reasons]))
    if exp.episodes is not None:  # multi-turn: turns, tool calls and how many were well formed, truncation
        sampled = int(exp.mask.sum())
        m = episode_metrics(exp.episodes, sampled, sum(len(r) for r in exp.response_ids) - sampled)
        out.update({k.removeprefix("episode/"): v for k, v in m.items()
                    if k in ("episode/turns", "episode/tool_calls", "episode/tool_calls_valid", "episode/truncated")})
        # each shown episode with its reward (the report's samples, RLResult.samples_after)
        texts = [f"{t}\n[reward {float(score):.3g}]" for t, score in zip(texts, exp.scores)]
    return out, texts


@torch.no_grad()
def sample_rewards(models, engine: DecodeEngine, prompts: list[list[int]], rl: RLConfig, seed: int,
                   micro_batch_size: int = 32, rows: list | None = None) -> list[float]:
    """One sample per prompt from the engine's current weights at the evaluation temperature, scored by rl.reward:
    (len(prompts),) rewards in prompt order. The reward alone: no reference or critic pass."""
    params = sampling_params(models, rl, eval_temperature(rl))
    samples = sorted(generate_from_rows(engine, prompts, 1, params, seed, rows=rows),
                     key=lambda s: len(s.prompt_ids) + len(s.token_ids))
    rewards = [0.0] * len(prompts)
    for i in range(0, len(samples), micro_batch_size):  # similar lengths together: little padding
        chunk = samples[i: i + micro_batch_size]
        with models.autocast() if runs_a_model(models.reward_fn) else contextlib.nullcontext():
            scores = models.reward_fn(chunk).tolist()  # a reward model under the update's autocast, as in scoring
        for s, r in zip(chunk, scores):
            rewards[s.prompt_id] = float(r)
    return rewards


def prompt_difficulty(models, engine: DecodeEngine, prompts: list[list[int]], rl: RLConfig, seed: int, path: Path,
                      log=print, rows: list | None = None) -> list[float] | None:
    """rl.curriculum's difficulty per train prompt (None without a curriculum): its length in tokens, or minus the
    reward of the SFT model's sample for it (sample_rewards; the engine must hold the SFT weights). Computed once and
    kept in `path`, so a resumed run, whose actor has moved, orders the prompts as the interrupted one did."""
    if rl.curriculum == "none":
        return None
    if path.exists():
        return json.loads(path.read_text())["difficulty"]
    t = time.perf_counter()
    difficulty = ([float(len(p)) for p in prompts] if rl.curriculum == "length" else
                  [-r for r in sample_rewards(models, engine, prompts, rl, seed, rows=rows)])
    seconds = time.perf_counter() - t
    write_text_atomic(path, json.dumps({"curriculum": rl.curriculum, "seconds": seconds, "difficulty": difficulty}))
    log(f"[rl] curriculum by {rl.curriculum}: {len(prompts)} train prompts scored in {seconds:.1f} s")
    return difficulty


def evaluate_before(path: Path, models, engine: DecodeEngine, prompts, rl: RLConfig, seed: int, gold: bool,
                    rows: list | None = None) -> dict:
    """The "before" evaluation, computed once and kept in `path` (eval_before.json, with a few samples), so a resumed
    run compares against the same numbers. Returns the metrics without the samples."""
    if path.exists():
        before = json.loads(path.read_text())
    else:
        metrics, texts = evaluate(models, engine, prompts, rl, seed, gold, rows)
        # the prompts beside the samples (prompt + completion), so the report marks where each prompt ends
        shown = [models.tokenizer.decode(p, skip_special_tokens=True) for p in prompts[:EVAL_SAMPLES_KEPT]]
        before = metrics | {"samples": texts[:EVAL_SAMPLES_KEPT], "prompts": shown}
        write_text_atomic(path, json.dumps(before, indent=2))
    return {k: v for k, v in before.items() if k not in ("samples", "prompts")}


def iteration_gold(exp: Experience, tok, gold: bool) -> dict:
    """Default task: the gold score of this iteration's samples, to watch real improvement beside the reward."""
    if not gold:
        return {}

    g = gold_summary(texts_of(exp, tok), [r != "length" for r in exp.finish_reasons])
    return {"reward/gold_mean": g["gold_mean"], "reward/gold_positive_rate": g["gold_positive_rate"],
            "reward/gold_grammatical_rate": g["grammatical_rate"]}


def eval_table(result: dict) -> str:
    """Before/after table of an RL result ({"before": ..., "after": ...}) for the terminal."""
    keys = ["gold_positive_rate", "gold_mean", "reward_mean", "kl", "grammatical_rate", "mean_length"]
    n = result["after"].get("n", result["before"].get("n"))
    few = f"; few: differences under ~{2 / max(1, n) ** 0.5:.1f} std are noise" if n and n < SMALL_HELD_OUT else ""
    lines = [f"  {'metric':<20}{'before':>10}{'after':>10}" + (f"    ({n} held-out prompts{few})" if n else "")]
    for k in keys:
        if k in result["before"] or k in result["after"]:
            b, a = result["before"].get(k, math.nan), result["after"].get(k, math.nan)
            lines.append(f"  {k:<20}{_cell(b)}{_cell(a)}")
    return "\n".join(lines)



def _cell(v: float) -> str:
    """Ten characters: three decimals, or a mantissa and exponent where those would not fit (a runaway reward)."""
    return f"{v:>10.3f}" if abs(v) < 1e5 or not math.isfinite(v) else f"{v:>10.3g}"
