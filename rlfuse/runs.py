"""Run folders: one per run, holding the resolved config, per-stage outputs and metrics."""

from __future__ import annotations

import time
from pathlib import Path

from rlfuse.config import Config, save_config


def make_run_dir(cfg: Config, command: str) -> Path:
    """`run.dir` if given, else a new runs/<command>-<timestamp>; the resolved config is saved into it."""
    if cfg.run.dir:
        run_dir = Path(cfg.run.dir)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = Path("runs") / f"{command}-{stamp}"
        i = 1
        while run_dir.exists():
            run_dir = Path("runs") / f"{command}-{stamp}-{i}"
            i += 1
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir)
    return run_dir
