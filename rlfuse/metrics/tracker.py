"""Metrics as JSON lines: one object per logged step, flushed at once so a killed run keeps everything so far."""

from __future__ import annotations

import importlib
import json
import math
import os
import statistics
import time
from pathlib import Path

import psutil

from rlfuse.config import config_to_dict, package_installed, tracker_missing
from rlfuse.files import write_text_atomic


class JsonlTracker:
    """JSON lines always (metrics.jsonl, and <name>.jsonl per table); every row and table also goes to `sinks`
    (open_sinks: TensorBoard, wandb, trackio, mlflow by run.report_to). tensorboard=True without sinks: TensorBoard
    event files beside the JSON lines when it is installed (what every stage did before run.report_to)."""

    def __init__(self, path: str | Path, tensorboard: bool = False, sinks: list | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")
        if sinks is None:
            sinks = open_sinks(None if tensorboard else [], self.path.parent)
        self.sinks = sinks

    def log(self, step: int, **metrics) -> None:
        row = {"step": step, "time": time.time()}
        row.update({k: _plain(v) for k, v in metrics.items()})
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        scalars = {k: v for k, v in row.items() if k not in ("step", "time") and isinstance(v, (int, float))
                   and not isinstance(v, bool) and math.isfinite(v)}
        for sink in self.sinks:
            sink.log(step, scalars)

    def log_table(self, step: int, name: str, rows: list[dict]) -> None:
        """A table (rows of the same keys) into <name>.jsonl beside the metrics, one line per row with its step, and
        into every sink (TensorBoard as a markdown text, wandb/trackio as a Table, mlflow as an artifact)."""
        with (self.path.parent / f"{name}.jsonl").open("a", encoding="utf-8") as f:
            f.writelines(json.dumps({"step": step, **{k: _plain(v) for k, v in r.items()}}) + "\n" for r in rows)
        for sink in self.sinks:
            sink.table(step, name, rows)

    def close(self) -> None:
        self._f.close()
        for sink in self.sinks:
            sink.close()


# ------------------------------------------------------------------------------------------- sinks
# One small class per tracker with the same three methods; each imports its package only when it is opened.


def open_sinks(report_to: list | None, stage_dir: Path, run_name: str | None = None, config: dict | None = None) -> list:
    """The sinks of run.report_to for one stage (stage_dir: RUN_DIR/sft, rm or rl). None: TensorBoard when installed,
    nothing otherwise. Each named tracker must be installed (validate() checks it first; this says the same)."""
    names = (["tensorboard"] if package_installed("tensorboard") else []) if report_to is None else list(report_to)
    run_name = run_name or f"{stage_dir.parent.name}-{stage_dir.name}"
    sinks = []
    for name in names:
        try:
            sinks.append(SINKS[name](stage_dir, run_name, config or {}))
        except ImportError:
            for sink in sinks:
                sink.close()
            raise tracker_missing(name) from None
    return sinks


def markdown_table(rows: list[dict]) -> str:
    """Rows of the same keys as a markdown table (TensorBoard renders it), cells on one line, pipes escaped."""
    if not rows:
        return "(no rows)"
    cols = list(rows[0])
    cell = lambda v: " ".join(str(_plain(v)).split()).replace("|", "\\|")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(cell(r.get(c, "")) for c in cols) + " |" for r in rows])


class TensorBoardSink:
    def __init__(self, stage_dir: Path, run_name: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter  # an optional tracker: only where run.report_to names it

        self.writer = SummaryWriter(str(stage_dir / "tensorboard"))

    def log(self, step: int, scalars: dict) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def table(self, step: int, name: str, rows: list[dict]) -> None:
        self.writer.add_text(name, markdown_table(rows), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One wandb run per stage, grouped by run folder; project from WANDB_PROJECT (default rlfuse)."""
    module = "wandb"

    def __init__(self, stage_dir: Path, run_name: str, config: dict):
        self.lib = importlib.import_module(self.module)
        self.run = self.lib.init(**self._init_args(stage_dir, run_name, config))

    def _init_args(self, stage_dir: Path, run_name: str, config: dict) -> dict:
        return {"project": os.environ.get("WANDB_PROJECT", "rlfuse"), "name": run_name, "group": stage_dir.parent.name,
                "dir": str(stage_dir), "config": config}

    def log(self, step: int, scalars: dict) -> None:
        self.run.log(scalars, step=step)

    def table(self, step: int, name: str, rows: list[dict]) -> None:
        if rows:
            cols = list(rows[0])
            self.run.log({name: self.lib.Table(columns=cols, data=[[_plain(r.get(c)) for c in cols] for r in rows])},
                         step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioSink(WandbSink):
    """trackio follows wandb's API (init, log, Table, finish); project from TRACKIO_PROJECT (default rlfuse)."""
    module = "trackio"

    def _init_args(self, stage_dir: Path, run_name: str, config: dict) -> dict:
        return {"project": os.environ.get("TRACKIO_PROJECT", "rlfuse"), "name": run_name, "config": config}


class MlflowSink:
    """One mlflow run per stage (experiment and tracking URI from mlflow's own MLFLOW_* variables); the config as
    params (section.field), tables as JSON artifacts."""

    def __init__(self, stage_dir: Path, run_name: str, config: dict):
        import mlflow  # an optional tracker: only where run.report_to names it

        self.lib = mlflow
        self.run = mlflow.start_run(run_name=run_name)
        flat = {f"{s}.{k}": v for s, fields in config.items() if isinstance(fields, dict) for k, v in fields.items()}
        if flat:
            mlflow.log_params({k: str(v)[:500] for k, v in flat.items()})

    def log(self, step: int, scalars: dict) -> None:
        self.lib.log_metrics(scalars, step=step)

    def table(self, step: int, name: str, rows: list[dict]) -> None:
        if rows:
            data = {c: [_plain(r.get(c)) for r in rows] for c in rows[0]}
            self.lib.log_table(data=data, artifact_file=f"{name}/step_{step:06d}.json")

    def close(self) -> None:
        self.lib.end_run()


SINKS = {"tensorboard": TensorBoardSink, "wandb": WandbSink, "trackio": TrackioSink, "mlflow": MlflowSink}


def _plain(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_metrics(path: str | Path) -> list[dict]:
    """Rows of a metrics file; a torn last line (killed mid-write) is ignored."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def peak_rss_mb() -> float:
    """Peak resident memory of this process since start or since the last reset_peak_rss() (Linux VmHWM; elsewhere
    the lifetime peak from getrusage)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource  # Unix only

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> bool:
    """Restart the peak from the current RSS (Linux), so a transient such as loading a checkpoint does not count."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_metrics(device) -> dict:
    """mem/ metrics: process RSS now and its peak since the stage began (stage_tracker); CUDA allocated/reserved
    peaks since the last call."""
    import torch  # torch: `rlfuse report` and `rlfuse plan` read metrics without it

    out = {"mem/rss_mb": psutil.Process().memory_info().rss / 2**20, "mem/rss_peak_mb": peak_rss_mb()}
    if getattr(device, "type", str(device)) == "cuda":
        out["mem/cuda_allocated_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["mem/cuda_reserved_peak_mb"] = torch.cuda.max_memory_reserved() / 2**20
        torch.cuda.reset_peak_memory_stats()
    return out


def truncate_metrics(path: str | Path, step: int) -> None:
    """Drop rows logged after `step` (a resumed run logs those steps again), by writing a copy then renaming."""
    path = Path(path)
    if path.exists():
        rows = [r for r in read_metrics(path) if r.get("step", 0) <= step]
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


TABLES = ("samples",)
"""The tables stages log (JsonlTracker.log_table), each in stage_dir/<name>.jsonl."""


def stage_tracker(cfg, stage_dir: str | Path, from_step: int = 0) -> JsonlTracker:
    """A stage's tracker: stage_dir/metrics.jsonl and the sinks of cfg.run.report_to, each given the run's config.
    Rows a folder already holds after `from_step` are dropped first: a new run into a folder that held one starts
    its metrics afresh (not appended to the old run's), a resumed one logs its steps after from_step again. The
    process's peak memory restarts here, after the stage has loaded its models."""
    stage_dir = Path(stage_dir)
    stage_dir.mkdir(parents=True, exist_ok=True)
    # mem/rss_peak_mb is the stage's own peak: in one `rlfuse run` process the RL stage would otherwise read SFT's and
    # RM's high-water mark, a flat line above its own (Linux; elsewhere the process's lifetime peak stays)
    reset_peak_rss()
    for name in ("metrics", *TABLES):
        truncate_metrics(stage_dir / f"{name}.jsonl", from_step)
    return JsonlTracker(stage_dir / "metrics.jsonl", sinks=open_sinks(cfg.run.report_to, stage_dir,
                                                                       config=config_to_dict(cfg)))


def measured_prompts(run_dir) -> tuple[float, float, int] | None:
    """(mean prompt tokens, mean distinct prompt lengths per iteration, the longest prompt of any iteration) over the
    iterations of a run folder's rl/metrics.jsonl (the planner's prompt_tokens, prompt_lengths and prompt_longest;
    the longest 0 where the run did not record it, before rollout/prompt_length_max), or None where it records
    neither of the first two (a run from before rollout/prompt_length_mean)."""
    f = Path(run_dir) / "rl" / "metrics.jsonl"
    rows = [r for r in read_metrics(f) if "rollout/prompt_length_mean" in r] if f.is_file() else []
    if not rows:
        return None
    return (statistics.mean(r["rollout/prompt_length_mean"] for r in rows),
            statistics.mean(r["rollout/prompt_lengths_distinct"] for r in rows),
            int(max(r.get("rollout/prompt_length_max", 0) for r in rows)))


def measured_lengths(run_dir) -> tuple[float, int] | None:
    """(median response mean, median of each iteration's longest response) from a run folder's rl/metrics.jsonl,
    or None: one iteration's figures (Workload.response_longest), not the longest over all its iterations."""
    f = Path(run_dir) / "rl" / "metrics.jsonl"
    if not f.is_file():
        return None
    rows = read_metrics(f)
    means = [r["rollout/length_mean"] for r in rows if "rollout/length_mean" in r]
    if not means:
        return None
    return statistics.median(means), int(statistics.median(r.get("rollout/length_max", 0) for r in rows))
