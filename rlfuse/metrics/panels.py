"""The report's dashboard as data: one table of panels (metric keys, title, unit, when to draw) and the pure functions
that pick the panels a run's metrics can fill. No matplotlib here: plots.summary_dashboard draws what this picks.

A panel is drawn only when the run logged at least one finite value of its metrics, and its own condition holds
(several reward functions, a coefficient that moves): an algorithm that has no critic gets no critic panel, an old
run without a metric gets no empty box."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

OFF_CHART = 1e12
"""Beyond this a value is marked, not drawn: one reward of 1e30 flattens every other point of its panel, and values
near 1e308 overflow matplotlib's axis arithmetic. No metric the panels draw is legitimately this large."""


def finite(v) -> bool:
    """A number the report can show: not a bool, not NaN/inf (the tracker writes those as the strings "nan", "inf")."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, skipping rows without it or with a non-finite value."""
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if finite(v) and finite(r.get("step")):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def metric_keys(rows: list[dict], key: str) -> list[str]:
    """`key` itself, or where it ends in "/" every logged metric under it (reward/fn/ -> each function's)."""
    if not key.endswith("/"):
        return [key]
    return sorted({k for r in rows for k in r if k.startswith(key)})


def moves(key: str) -> Callable[[list[dict]], bool]:
    """Condition: the metric takes more than one value (a fixed KL coefficient or temperature is a note, not a line)."""
    def check(rows: list[dict]) -> bool:
        _, ys = series(rows, key)
        return len(ys) > 1 and max(ys) - min(ys) > 1e-9 * max(1.0, abs(max(ys)))
    return check


def several(prefix: str) -> Callable[[list[dict]], bool]:
    """Condition: at least two metrics under `prefix` (one reward function's mean is the reward panel again)."""
    return lambda rows: len(metric_keys(rows, prefix)) >= 2


@dataclass(frozen=True)
class Panel:
    name: str
    title: str
    unit: str
    lines: tuple[tuple[str, str], ...]
    """(metric key, legend label); a key ending in "/" is every metric under it, each labelled by its last part."""
    band: str | None = None
    """A metric drawn as a +/- band around the first line (reward/std around reward/mean)."""
    when: Callable[[list[dict]], bool] | None = field(default=None, compare=False)


PANELS: tuple[Panel, ...] = (
    Panel("reward", "reward ± std", "reward (mean over samples)", (("reward/mean", "mean"),), band="reward/std"),
    Panel("gold", "gold score", "score / fraction (default task)",
          (("reward/gold_mean", "gold mean"), ("reward/gold_positive_rate", "positive rate"),
           ("reward/gold_grammatical_rate", "grammatical"))),
    Panel("reward_fn", "reward per fn", "mean reward of each function", (("reward/fn/", ""),),
          when=several("reward/fn/")),
    Panel("kl", "KL to reference", "nats / sequence", (("reward/kl", "KL"),)),
    Panel("kl_coef", "KL coefficient", "coefficient (adaptive)", (("reward/kl_coef", "coefficient"),),
          when=moves("reward/kl_coef")),
    Panel("entropy", "entropy", "nats / token", (("train/entropy", "entropy"),)),
    Panel("clip_frac", "clip fraction", "fraction of tokens",
          (("train/clip_frac", "policy"), ("train/value_clip_frac", "value"))),
    Panel("approx_kl", "approx KL", "nats / token, per update", (("train/approx_kl", "approx KL"),)),
    Panel("mismatch", "sampler vs trainer", "log-prob gap / token",
          (("mismatch/logprob_abs_mean", "mean |gap|"), ("mismatch/kl_k3", "KL (k3)"))),
    Panel("grad_norm", "grad norm", "L2 norm, before clipping",
          (("train/grad_norm", "actor"), ("train/critic_grad_norm", "critic"))),
    Panel("policy_loss", "policy loss", "loss", (("train/policy_loss", "policy loss"),)),
    Panel("value_loss", "value loss", "critic loss", (("train/value_loss", "value loss"),)),
    Panel("explained_variance", "explained var.", "critic, 1 = perfect",
          (("train/explained_variance", "explained variance"),)),
    Panel("length", "response length", "tokens",
          (("rollout/length_mean", "mean"), ("rollout/length_p95", "p95"), ("rollout/length_max", "max"))),
    Panel("truncated", "truncated", "fraction hitting the length limit", (("rollout/hit_limit", "truncated"),)),
    Panel("zero_spread", "zero-spread", "fraction of prompts, all k equal",
          (("reward/frac_zero_spread", "zero spread"),)),
    Panel("eval_reward", "held-out reward", "reward (rl.eval_every)", (("eval/reward_mean", "reward"),)),
    Panel("eval_gold", "held-out gold", "score / fraction",
          (("eval/gold_mean", "gold mean"), ("eval/gold_positive_rate", "positive rate"))),
    Panel("samples_per_s", "samples / s", "samples / s, end to end", (("rollout/samples_per_s", "samples/s"),)),
    Panel("tokens_per_s", "tokens / s", "generated tokens / s", (("rollout/tokens_per_s", "tokens/s"),)),
    Panel("compute_fraction", "MFU", "share of bare matmul rate",
          (("perf/compute_fraction", "compute fraction"),)),
    # the RL stage's own peak: stage_tracker restarts the process's high-water mark when the stage begins, so SFT's
    # and RM's peaks in the same `rlfuse run` process do not draw a flat line above RL's
    Panel("memory", "memory (RL)", "MiB",
          (("mem/cuda_allocated_peak_mb", "CUDA allocated, peak"), ("mem/cuda_reserved_peak_mb", "CUDA reserved, peak"),
           ("mem/rss_peak_mb", "RSS, peak since RL began"), ("mem/rss_mb", "RSS, end of iteration"))),
    Panel("temperature", "temperature", "sampling temperature", (("rollout/temperature", "temperature"),),
          when=moves("rollout/temperature")),
)


def panel_lines(panel: Panel, rows: list[dict]) -> list[tuple[str, str]]:
    """(metric key, label) of the panel's lines that have at least one finite value in `rows`."""
    out = []
    for key, label in panel.lines:
        for k in metric_keys(rows, key):
            if series(rows, k)[1]:
                out.append((k, label or k.removeprefix(key)))
    return out


def select_panels(rows: list[dict]) -> list[Panel]:
    """The panels of PANELS the run's rows can fill, in the table's order."""
    return [p for p in PANELS if panel_lines(p, rows) and (p.when is None or p.when(rows))]


def with_evaluations(rows: list[dict], eval_result: dict | None) -> list[dict]:
    """rl.eval_every: the rows with the before (iteration 0) and after (last iteration) evaluations of eval.json added
    as eval/ points, so the held-out curves start and end where the run did. Without eval/ rows (rl.eval_every=0)
    the rows are returned as they are: two points are the before/after table's, not a curve."""
    if not any(k.startswith("eval/") for r in rows for k in r):
        return rows
    ev = eval_result if isinstance(eval_result, dict) else {}
    steps = [r["step"] for r in rows if finite(r.get("step"))]
    points = []
    for when, step in (("before", 0), ("after", max(steps, default=0))):
        part = ev.get(when)
        if isinstance(part, dict):
            points.append({"step": step, **{f"eval/{k}": v for k, v in part.items() if finite(v)}})
    return points[:1] + rows + points[1:]
