"""Per-device Gantt chart of a schedule (simulated or executed), actor and critic in two colours."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from rlfuse.schedule.model import Task

COLORS = {0: ("#4C72B0", "#9DB4DA"), 1: ("#DD8452", "#F0C2A3")}  # model -> (forward, backward)
NAMES = {0: "actor (big)", 1: "critic (small)"}

Span = tuple  # (device, task, start, end)


def gantt(timelines: list[tuple[str, list[Span]]], path: str | Path, title: str = "") -> Path:
    """One panel per timeline, one row per device; micro-batch numbers written on the wider boxes."""
    n_dev = max(d for _, spans in timelines for d, *_ in spans) + 1
    fig, axes = plt.subplots(len(timelines), 1, figsize=(14, 1.3 + 0.4 * n_dev * len(timelines)), squeeze=False)
    for ax, (label, spans) in zip(axes[:, 0], timelines):
        horizon = max(e for *_, e in spans)
        for d, task, s, e in spans:
            fwd, bwd = COLORS[task.model]
            ax.barh(d, e - s, left=s, height=0.8, color=fwd if task.kind == "F" else bwd, edgecolor="white", linewidth=0.3)
            if e - s >= 0.012 * horizon:
                ax.text((s + e) / 2, d, str(task.mb), ha="center", va="center", fontsize=5)
        ax.set_yticks(range(n_dev))
        ax.set_yticklabels([f"dev {d}" for d in range(n_dev)], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, horizon * 1.01)
        ax.set_title(label, fontsize=10, loc="left")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[m][k]) for m in (0, 1) for k in (0, 1)]
    labels = [f"{NAMES[m]} {'forward' if k == 0 else 'backward'}" for m in (0, 1) for k in (0, 1)]
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    axes[-1, 0].set_xlabel("time")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_record(record: dict, path: str | Path) -> Path:
    """A run's executed pipeline schedule above the simulated one (runtime/pipeline.py schedule_record)."""
    spans = lambda rows: [(d, Task(m, r, s, k, mb), a, b) for d, m, r, s, k, mb, a, b in rows]
    mode, m = record["mode"], record["micro_batches"]
    return gantt([(f"executed: bubble {record['bubble_executed']:.3f} (seconds)", spans(record["executed"])),
                  (f"simulated with the measured task times: bubble {record['bubble_simulated']:.3f}",
                   spans(record["simulated"]))], path,
                 f"{mode}: the first mini-batch of the last update, {m} micro-batches on {record['devices']} workers")


def simulated_spans(prob, result) -> list[Span]:
    return [(prob.device_of(t.model, t.replica, t.stage), t, result.start[t], result.end[t]) for t in result.start]
