"""Figures of a run, drawn from its metrics file alone, so they work on a finished, running or killed run.

Every figure is a pure function of metric rows (lists of dicts as `read_metrics` returns them) and a path. The
dashboard's panels are chosen in rlfuse/metrics/panels.py; this module only draws them."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from rlfuse.metrics.panels import OFF_CHART, Panel, finite, panel_lines, select_panels, series  # noqa: E402

STAGES = [("time/generation", "generation"), ("time/scoring", "scoring"), ("time/training", "training")]
RAY_STAGES = [("time/rollout", "rollout on workers"), ("time/training", "training")]
"""With placement on Ray, scoring overlaps decoding on other workers: one wall-clock bar for both."""
COLORS = {"generation": "#4C72B0", "scoring": "#DD8452", "training": "#55A868", "other": "#B0B0B0",
          "rollout on workers": "#8172B3"}
DASHBOARD_COLUMNS = 6
"""At most six small panels a row (about 225 px each on a 1400 px screen): a PPO run's 17 curves in three rows, all
on the first screen."""
PANEL_HEIGHT = 2.1
"""Inches (at the dashboard's 100 dpi, 210 px); the grid is 13.6 inches wide, the report's page width."""


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def value(row: dict, key: str, default: float = 0.0) -> float:
    """row[key] as a float where it is a finite number, else `default` (a missing or "nan" time adds nothing)."""
    v = row.get(key)
    return float(v) if finite(v) else default


def short(v: float) -> str:
    """A number in a few characters: 0.123, 12.3, 1,764, 1.2e+30."""
    if not finite(v):
        return str(v)
    a = abs(v)
    if a >= 1e6 or 0 < a < 1e-3:
        return f"{v:.2g}"
    return f"{v:,.0f}" if a >= 100 else f"{v:.3g}"


def summary_numbers(rows: list[dict], eval_result: dict | None = None, baseline_rows: list[dict] | None = None) -> dict:
    """The key numbers of the report (each the mean, sum or max of logged values)."""
    _, sps = series(rows, "rollout/samples_per_s")
    _, tps = series(rows, "rollout/tokens_per_s")
    _, it_time = series(rows, "time/iteration")
    _, reward = series(rows, "reward/mean")
    _, rss = series(rows, "mem/rss_peak_mb")
    _, cuda = series(rows, "mem/cuda_allocated_peak_mb")
    out = {"iterations": len(it_time), "avg_samples_per_s": mean(sps), "avg_tokens_per_s": mean(tps),
           "total_time_s": sum(it_time), "avg_reward": mean(reward), "peak_memory_mb": max(cuda or rss or [math.nan]),
           "memory_kind": "CUDA allocated" if cuda else "process RSS"}
    if isinstance(eval_result, dict):
        for when in ("before", "after"):
            part = eval_result.get(when)
            if isinstance(part, dict) and "gold_positive_rate" in part:
                out[f"gold_positive_{when}"] = part["gold_positive_rate"]
    if baseline_rows:
        _, base_sps = series(baseline_rows, "rollout/samples_per_s")
        if base_sps:
            out["baseline_samples_per_s"] = mean(base_sps)
            out["measured_speedup"] = out["avg_samples_per_s"] / out["baseline_samples_per_s"]
    return out


# ------------------------------------------------------------------------------------------- the dashboard


def dashboard_grid(n: int) -> tuple[int, int]:
    """(rows, columns) for n panels: the fewest rows of at most DASHBOARD_COLUMNS, then the fewest columns that
    hold them, so the last row is never mostly empty (20 panels: 4 x 5, not 4 x 6 with four blanks)."""
    rows = max(1, math.ceil(n / DASHBOARD_COLUMNS))
    return rows, max(1, math.ceil(n / rows))


def summary_dashboard(rows: list[dict], path: Path, panels: list[Panel] | None = None,
                      marks: dict[str, list[tuple[int, str]]] | None = None) -> Path:
    """The run on one screen: a grid of small panels (panels.select_panels), the x axis of each the RL iteration.
    marks: panel name -> (iteration, label) of health findings, drawn as a dashed red line at their onset."""
    panels = select_panels(rows) if panels is None else panels
    n_rows, n_cols = dashboard_grid(len(panels))
    width = 13.6 / max(n_cols, 4)  # a full-width row from four panels up; fewer keep a four-panel width each
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(width * n_cols, PANEL_HEIGHT * n_rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        draw_panel(ax, panel, rows)
        for step, label in (marks or {}).get(panel.name, []):
            ax.axvline(step, color="#C44E52", linestyle="--", linewidth=1.1)
            ax.text(step, 0.97, f" {label}", transform=ax.get_xaxis_transform(), fontsize=7, color="#C44E52",
                    va="top")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    return _save(fig, path, dpi=100)


def draw_panel(ax, panel: Panel, rows: list[dict]) -> None:
    """One panel: its lines (and band), the last value of its first line top right, values beyond OFF_CHART marked
    at the top edge instead of drawn."""
    lines = panel_lines(panel, rows)
    off: list[tuple[int, float]] = []
    for i, (key, label) in enumerate(lines):
        xs, ys = series(rows, key)
        shown = [(x, y) for x, y in zip(xs, ys) if abs(y) < OFF_CHART]
        off += [(x, y) for x, y in zip(xs, ys) if abs(y) >= OFF_CHART]
        (line,) = ax.plot([x for x, _ in shown], [y for _, y in shown], marker=".", markersize=4, linewidth=1.4,
                          label=label)
        if i == 0 and panel.band:
            _band(ax, rows, key, panel.band, line.get_color())
    for x, y in off:
        ax.plot(x, 1.0, marker="^", color="#C44E52", transform=ax.get_xaxis_transform(), clip_on=False)
    if off:
        ax.text(0.02, 0.9, f"off the chart: {short(off[0][1])} at iteration {off[0][0]}"
                + (f" (+{len(off) - 1} more)" if len(off) > 1 else ""), transform=ax.transAxes, fontsize=7,
                color="#C44E52", va="top")
    ax.set_title(panel.title, loc="left", fontsize=9.5, fontweight="bold")
    last = series(rows, lines[0][0])[1][-1] if lines else float("nan")
    ax.set_title(short(last), loc="right", fontsize=8.5, color="#555")
    ax.set_ylabel(panel.unit, fontsize=7.5)
    ax.tick_params(labelsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=6))
    ax.grid(alpha=0.3)
    if len(lines) > 1:
        ax.legend(fontsize=7, frameon=False)


def _band(ax, rows: list[dict], key: str, band_key: str, color: str) -> None:
    """key +/- band_key where both are logged and within the chart (reward/mean +/- reward/std)."""
    pts = [(r["step"], float(r[key]), float(r[band_key])) for r in rows
           if finite(r.get("step")) and finite(r.get(key)) and finite(r.get(band_key))
           and abs(r[key]) + abs(r[band_key]) < OFF_CHART]
    if pts:
        xs, ms, ss = zip(*pts)
        ax.fill_between(xs, [m - s for m, s in zip(ms, ss)], [m + s for m, s in zip(ms, ss)], color=color, alpha=0.18,
                        linewidth=0)


def temperature_twin(ax, rows: list[dict]):
    """The sampling temperature on a right-hand axis of `ax`, dashed; returns its line, or None without
    rollout/temperature. The report no longer draws it (a constant temperature on a second axis reads as a threshold
    crossing the reward; a schedule gets its own panel); tests/integration/test_rl.py still reads the schedule
    through it."""
    xs, ys = series(rows, "rollout/temperature")
    if not xs:
        return None
    twin = ax.twinx()
    (line,) = twin.plot(xs, ys, linestyle="--", color="#C44E52", label="sampling temperature")
    lo, hi = min(ys), max(ys)
    twin.set_ylim(lo - 0.1 * (hi - lo or 1.0), hi + 0.1 * (hi - lo or 1.0))
    return line


def reward_distribution(rewards: list, path: Path) -> Path:
    """Histogram of the last iteration's sample rewards (rl/last_rewards.json); NaN, inf and values beyond OFF_CHART
    are counted in the title, not binned (one of them would stretch the bins over the whole float range)."""
    shown = [float(v) for v in rewards if finite(v) and abs(v) < OFF_CHART]
    left_out = len(rewards) - len(shown)
    fig, ax = plt.subplots(figsize=(5.6, 3.2))
    if shown:
        ax.hist(shown, bins=min(30, max(5, len(shown) // 3)), color="#8172B2", alpha=0.85)
        ax.axvline(mean(shown), color="black", linestyle="--", linewidth=1, label=f"mean {short(mean(shown))}")
        ax.legend(fontsize=8, frameon=False)
    ax.set_title(f"Reward of the last iteration's {len(rewards)} samples"
                 + (f" ({left_out} NaN, inf or beyond ±{OFF_CHART:.0e}: not drawn)" if left_out else ""), fontsize=10)
    ax.set_xlabel("reward", fontsize=8)
    ax.set_ylabel("samples", fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def stage_breakdown(rows: list[dict], path: Path) -> Path:
    timed = [r for r in rows if finite(r.get("time/iteration")) and finite(r.get("step"))]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 3.2), gridspec_kw={"width_ratios": [3, 1]})
    steps = [r["step"] for r in timed]
    bottom = [0.0] * len(steps)
    totals = {}
    on_ray = any("time/rollout" in r and "time/generation" not in r for r in rows)
    for key, name in RAY_STAGES if on_ray else STAGES:
        vals = [value(r, key) for r in timed]
        ax.bar(steps, vals, bottom=bottom, color=COLORS[name], label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
        totals[name] = sum(vals)
    other = [value(r, "time/iteration") - b for r, b in zip(timed, bottom)]
    ax.bar(steps, [max(0.0, o) for o in other], bottom=bottom, color=COLORS["other"], label="other")
    totals["other"] = max(0.0, sum(other))
    ax.set_xlabel("iteration")
    ax.set_ylabel("seconds")
    ax.set_title("Time per stage per iteration")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8)
    nonzero = {k: v for k, v in totals.items() if v > 0}
    if nonzero:
        ax2.pie(list(nonzero.values()), labels=[f"{k}\n{v / sum(nonzero.values()):.0%}" for k, v in nonzero.items()],
                colors=[COLORS[k] for k in nonzero], startangle=90)
    ax2.set_title("Share of total time")
    return _save(fig, path)


def _line(ax, rows, key, label, color=None, title=None):
    xs, ys = series(rows, key)
    if xs:
        ax.plot(xs, ys, marker=".", label=label, color=color)
    else:
        ax.text(0.5, 0.5, f"no {key} logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_title(title or label, fontsize=10)
    ax.set_xlabel("iteration", fontsize=8)
    ax.grid(alpha=0.3)


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


def _per_iteration(ax, ylabel: str, title: str) -> None:
    ax.set_xlabel("iteration")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()


def _save(fig, path: Path, dpi: int = 90) -> Path:
    try:
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)  # also when the folder cannot be written: no figure left open in a long-lived process
    return path
