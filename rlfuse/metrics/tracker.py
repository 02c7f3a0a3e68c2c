"""Metrics as JSON lines: one object per logged step, flushed at once so a killed run keeps everything so far."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path


class JsonlTracker:
    """JSON lines always; TensorBoard event files beside them when `tensorboard` is installed (tensorboard=True)."""

    def __init__(self, path: str | Path, tensorboard: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.path.parent / "tensorboard"))
            except ImportError:
                pass

    def log(self, step: int, **metrics) -> None:
        row = {"step": step, "time": time.time()}
        row.update({k: _plain(v) for k, v in metrics.items()})
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k not in ("step", "time") and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


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
    import resource

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
    """mem/ metrics: process RSS now and its peak so far; CUDA allocated/reserved peaks since the last call."""
    import psutil
    import torch

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
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(path)
