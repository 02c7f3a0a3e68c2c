"""Figures of a run, drawn from its metrics file alone, so they work on a finished, running or killed run.

Every figure is a pure function of metric rows (lists of dicts as `read_metrics` returns them) and a path."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

STAGES = [("time/generation", "generation"), ("time/scoring", "scoring"), ("time/training", "training")]
RAY_STAGES = [("time/rollout", "rollout on workers"), ("time/training", "training")]
"""With placement on Ray, scoring overlaps decoding on other workers: one wall-clock bar for both."""
COLORS = {"generation": "#4C72B0", "scoring": "#DD8452", "training": "#55A868", "other": "#B0B0B0",
          "rollout on workers": "#8172B3"}


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, skipping rows without it or with a non-finite value."""
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summary_numbers(rows: list[dict], eval_result: dict | None = None, baseline_rows: list[dict] | None = None) -> dict:
    """The key numbers of the dashboard and the report (each the mean, sum or max of logged values)."""
    _, sps = series(rows, "rollout/samples_per_s")
    _, it_time = series(rows, "time/iteration")
    _, reward = series(rows, "reward/mean")
    _, rss = series(rows, "mem/rss_peak_mb")
    _, cuda = series(rows, "mem/cuda_allocated_peak_mb")
    out = {"iterations": len(it_time), "avg_samples_per_s": mean(sps), "total_time_s": sum(it_time),
           "avg_reward": mean(reward), "peak_memory_mb": max(cuda or rss or [float("nan")]),
           "memory_kind": "CUDA allocated" if cuda else "process RSS"}
    if eval_result:
        for when in ("before", "after"):
            if "gold_positive_rate" in eval_result.get(when, {}):
                out[f"gold_positive_{when}"] = eval_result[when]["gold_positive_rate"]
    if baseline_rows:
        _, base_sps = series(baseline_rows, "rollout/samples_per_s")
        if base_sps:
            out["baseline_samples_per_s"] = mean(base_sps)
            out["measured_speedup"] = out["avg_samples_per_s"] / out["baseline_samples_per_s"]
    return out


def _line(ax, rows, key, label, color=None, title=None):
    xs, ys = series(rows, key)
    if xs:
        ax.plot(xs, ys, marker=".", label=label, color=color)
    else:
        ax.text(0.5, 0.5, f"no {key} logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_title(title or label, fontsize=10)
    ax.set_xlabel("iteration", fontsize=8)
    ax.grid(alpha=0.3)


def temperature_twin(ax, rows: list[dict]):
    """The sampling temperature per iteration (rl.temperature_schedule) on a right-hand axis of `ax`, dashed; returns
    its line, or None when no row logged rollout/temperature (runs from before it was logged)."""
    xs, ys = series(rows, "rollout/temperature")
    if not xs:
        return None
    twin = ax.twinx()
    (line,) = twin.plot(xs, ys, linestyle="--", color="#C44E52", label="sampling temperature")
    twin.set_ylabel("temperature", fontsize=8, color="#C44E52")
    lo, hi = min(ys), max(ys)
    twin.set_ylim(lo - 0.1 * (hi - lo or 1.0), hi + 0.1 * (hi - lo or 1.0))
    twin.legend(fontsize=8, loc="lower right")
    return line


def training_metrics(rows: list[dict], path: Path, reward_samples: list[float] | None = None) -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    _line(axes[0, 0], rows, "reward/mean", "reward (mean per iteration)")
    xs, gold = series(rows, "reward/gold_mean")
    if xs:
        axes[0, 0].plot(xs, gold, marker=".", label="gold score (default task)")
        axes[0, 0].legend(fontsize=8)
    temperature_twin(axes[0, 0], rows)
    _line(axes[0, 1], rows, "train/policy_loss", "actor (policy) loss")
    _line(axes[1, 0], rows, "train/value_loss", "critic (value) loss")
    ax = axes[1, 1]
    _, rewards = series(rows, "reward/mean")
    # a NaN/inf reward (a skipped iteration's) has no place on a histogram's axis
    dist = [v for v in (reward_samples or rewards) if isinstance(v, (int, float)) and math.isfinite(v)]
    if dist:
        ax.hist(dist, bins=min(30, max(5, len(dist) // 3)), color="#8172B2", alpha=0.8)
        ax.axvline(mean(dist), color="black", linestyle="--", label=f"mean {mean(dist):.3f}")
        ax.legend(fontsize=8)
    ax.set_title("reward distribution" + (" (last iteration's samples)" if reward_samples else " (iteration means)"), fontsize=10)
    fig.suptitle("Training metrics")
    return _save(fig, path)


def throughput_over_time(rows: list[dict], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(9, 4))
    xs, ys = series(rows, "rollout/samples_per_s")
    ax.plot(xs, ys, marker=".", label="samples/s")
    if ys:
        ax.axhline(mean(ys), color="black", linestyle="--", label=f"average {mean(ys):.2f} samples/s")
    _per_iteration(ax, "samples / s (end to end)", "Throughput per iteration")
    return _save(fig, path)


def memory_usage(rows: list[dict], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(9, 4))
    drawn = False
    for key, label in (("mem/cuda_allocated_peak_mb", "CUDA allocated (peak)"), ("mem/cuda_reserved_peak_mb", "CUDA reserved (peak)"),
                       ("mem/rss_peak_mb", "process RSS (peak so far)"), ("mem/rss_mb", "process RSS (end of iteration)")):
        xs, ys = series(rows, key)
        if xs:
            ax.plot(xs, ys, marker=".", label=label)
            drawn = True
    if not drawn:
        ax.text(0.5, 0.5, "no memory metrics logged", ha="center", va="center", transform=ax.transAxes)
    _per_iteration(ax, "MiB", "Memory per iteration")
    return _save(fig, path)


def stage_breakdown(rows: list[dict], path: Path) -> Path:
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 1]})
    steps = [r["step"] for r in rows if "time/iteration" in r]
    bottom = [0.0] * len(steps)
    totals = {}
    on_ray = any("time/rollout" in r and "time/generation" not in r for r in rows)
    for key, name in RAY_STAGES if on_ray else STAGES:
        vals = [float(r.get(key, 0.0)) for r in rows if "time/iteration" in r]
        ax.bar(steps, vals, bottom=bottom, color=COLORS[name], label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
        totals[name] = sum(vals)
    other = [float(r["time/iteration"]) - b for r, b in zip([r for r in rows if "time/iteration" in r], bottom)]
    ax.bar(steps, [max(0.0, o) for o in other], bottom=bottom, color=COLORS["other"], label="other")
    totals["other"] = max(0.0, sum(other))
    ax.set_xlabel("iteration")
    ax.set_ylabel("seconds")
    ax.set_title("Time per stage per iteration")
    ax.legend(fontsize=8)
    nonzero = {k: v for k, v in totals.items() if v > 0}
    if nonzero:
        ax2.pie(list(nonzero.values()), labels=[f"{k}\n{v / sum(nonzero.values()):.0%}" for k, v in nonzero.items()],
                colors=[COLORS[k] for k in nonzero], startangle=90)
    ax2.set_title("Share of total time")
    return _save(fig, path)


def worker_ranks(rows: list[dict]) -> list[int]:
    """Ranks of the Ray workers that logged worker/<rank>/busy_s (none in a single-process run)."""
    return sorted({int(k.split("/")[1]) for r in rows for k in r if k.startswith("worker/") and k.endswith("/busy_s")})


def worker_usage(rows: list[dict], path: Path) -> Path:
    """Per Ray worker: busy seconds per iteration (decoding, scoring, migration; training) and resident memory."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    for rank in worker_ranks(rows):
        _line(ax, rows, f"worker/{rank}/busy_s", f"worker {rank}")
        if any(f"worker/{rank}/train_s" in r for r in rows):
            _line(ax, rows, f"worker/{rank}/train_s", f"worker {rank} training")
        _line(ax2, rows, f"worker/{rank}/rss_mb", f"worker {rank}")
    _line(ax2, rows, "mem/rss_mb", "driver", color="black")
    _per_iteration(ax, "busy seconds", "Busy time per worker (wall time of the rollout: time/rollout)")
    _line(ax, rows, "time/rollout", "rollout wall time", color="black")
    _per_iteration(ax2, "MiB", "Resident memory per process")
    return _save(fig, path)


def is_async(rows: list[dict]) -> bool:
    """Whether the run trained asynchronously (rl.max_staleness on the separated placement)."""
    return any("async/staleness_mean" in r for r in rows)


def async_training(rows: list[dict], path: Path) -> Path:
    """Asynchronous RL: the staleness of the trained samples, the behaviour importance weights of the decoupled
    objective, and the mean length of generated against trained samples (apart: a length bias)."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ages = sorted({int(k.rsplit("_", 1)[1]) for r in rows for k in r if k.startswith("async/staleness_")
                   and k.rsplit("_", 1)[1].isdigit()})
    steps = [r["step"] for r in rows if "async/staleness_mean" in r]
    bottom = [0.0] * len(steps)
    for a in ages:
        share = [float(r.get(f"async/staleness_{a}", 0.0)) for r in rows if "async/staleness_mean" in r]
        axes[0].bar(steps, share, bottom=bottom, label=f"{a} update{'s' if a != 1 else ''} old")
        bottom = [b + v for b, v in zip(bottom, share)]
    axes[0].legend(fontsize=8)
    _per_iteration(axes[0], "share of trained samples", "Staleness of trained samples")
    _line(axes[1], rows, "train/behaviour_weight_mean", "weight mean")
    _line(axes[1], rows, "train/behaviour_weight_max", "weight max (mean over micro-batches)")
    _line(axes[1], rows, "train/behaviour_beyond_cap", "share of tokens beyond the cap",
          title="Importance weights pi_prox / pi_behav")
    axes[1].legend(fontsize=8)
    _line(axes[2], rows, "rollout/mean_length_generated", "generated")
    _line(axes[2], rows, "rollout/mean_length_trained", "trained", title="Mean response length (tokens)")
    axes[2].legend(fontsize=8)
    return _save(fig, path)


def speedup_comparison(rows: list[dict], baseline_rows: list[dict], path: Path, names=("this run", "baseline")) -> Path:
    """Throughput of this run against a measured baseline run; the ratio is of the two measured averages."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [2, 1]})
    for r, name in ((rows, names[0]), (baseline_rows, names[1])):
        xs, ys = series(r, "rollout/samples_per_s")
        ax.plot(xs, ys, marker=".", label=name)
    _per_iteration(ax, "samples / s", "Throughput per iteration")
    a, b = mean(series(rows, "rollout/samples_per_s")[1]), mean(series(baseline_rows, "rollout/samples_per_s")[1])
    ax2.bar([names[0], names[1]], [a, b], color=["#4C72B0", "#B0B0B0"])
    ax2.set_title(f"average samples/s: measured speedup {a / b:.2f}x" if b else "average samples/s")
    return _save(fig, path)


def summary_dashboard(rows: list[dict], numbers: dict, path: Path) -> Path:
    fig = plt.figure(figsize=(13, 8))
    grid = fig.add_gridspec(3, 3)
    text = fig.add_subplot(grid[0, :])
    text.axis("off")
    lines = [
        f"average throughput  {numbers['avg_samples_per_s']:.2f} samples/s",
        f"total RL time  {numbers['total_time_s']:.0f} s over {numbers['iterations']} iterations",
        f"average reward  {numbers['avg_reward']:.3f}",
        f"peak memory  {numbers['peak_memory_mb']:.0f} MiB ({numbers['memory_kind']})",
    ]
    if "gold_positive_before" in numbers:
        lines.append(f"gold positive rate  {numbers['gold_positive_before']:.3f} -> {numbers.get('gold_positive_after', float('nan')):.3f}")
    if "measured_speedup" in numbers:
        lines.append(f"measured speedup vs baseline  {numbers['measured_speedup']:.2f}x")
    for i, line in enumerate(lines):
        text.text(0.02 + 0.5 * (i % 2), 0.85 - 0.3 * (i // 2), line, fontsize=13, transform=text.transAxes)
    panels = [("reward/mean", "reward"), ("rollout/samples_per_s", "samples/s"), ("reward/kl", "KL to reference"),
              ("train/policy_loss", "actor loss"), ("train/value_loss", "critic loss"), ("rollout/length_mean", "response length")]
    for i, (key, title) in enumerate(panels):
        ax = fig.add_subplot(grid[1 + i // 3, i % 3])
        _line(ax, rows, key, title)
        if key == "reward/mean":
            temperature_twin(ax, rows)
    fig.suptitle("rlfuse run summary", fontsize=15)
    return _save(fig, path)


def _per_iteration(ax, ylabel: str, title: str) -> None:
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
