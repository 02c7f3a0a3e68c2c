"""Metrics as JSON lines: one object per logged step, flushed at once so a killed run keeps everything so far."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path


class JsonlTracker:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")

    def log(self, step: int, **metrics) -> None:
        row = {"step": step, "time": time.time()}
        row.update({k: _plain(v) for k, v in metrics.items()})
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


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
