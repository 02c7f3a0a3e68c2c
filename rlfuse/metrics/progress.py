"""Progress that copes with no terminal: a live tqdm bar on a TTY; elsewhere (nohup, Slurm, CI, `| tee`) a plain line
with the rate and the time left every 10% of the work or every 30 seconds, whichever comes first; nothing with
run.quiet."""

from __future__ import annotations

import os
import sys
import time

from tqdm import tqdm

LINE_EVERY_S = 30.0
"""Away from a terminal, the longest silence between two progress lines (while steps keep finishing)."""


def interactive(quiet: bool = False) -> bool:
    return not quiet and sys.stderr.isatty() and os.environ.get("CI", "").lower() not in ("1", "true")


def duration(seconds: float) -> str:
    """'42s', '3m05s', '1h02m': short enough for a progress line."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_line(desc: str, done: int, total: int, unit: str, elapsed: float, counted: int, stats: str = "") -> str:
    """'[sft] 120/600 steps, 1m02s, 1.94 steps/s, 4m07s left loss=2.31': `counted` steps took `elapsed` seconds
    (a resumed run's earlier steps are done but not timed here)."""
    rate = counted / elapsed if elapsed > 0 else 0.0
    left = f", {duration((total - done) / rate)} left" if rate > 0 and done < total else ""
    speed = f"{rate:.3g} {unit}s/s" if rate >= 1 or rate == 0 else f"{1 / rate:.3g} s/{unit}"
    return f"[{desc}] {done}/{total} {unit}s, {duration(elapsed)}, {speed}{left}" + (f"  {stats}" if stats else "")


class Progress:
    """`with Progress(total, "sft", quiet) as bar: bar.update(loss=..)`: one interface, three renderings (a bar, lines,
    nothing)."""

    def __init__(self, total: int, desc: str, quiet: bool = False, unit: str = "step", initial: int = 0):
        """initial: steps done before (a resumed run): counted, not timed."""
        self.total, self.desc, self.n, self.unit, self.quiet = total, desc, initial, unit, quiet
        self.initial = initial
        self.start = self._last_line = time.perf_counter()
        self._next_log = initial + max(1, total // 10)
        self._bar = None
        if interactive(quiet):
            self._bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=True, initial=initial)

    def update(self, n: int = 1, **stats) -> None:
        self.n += n
        # None: not measured yet (a held-out figure before the first evaluation), shown as nothing rather than nan
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in stats.items() if v is not None}
        if self._bar is not None:
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(n)
            return
        now = time.perf_counter()
        if self.quiet or not (self.n >= self._next_log or now - self._last_line >= LINE_EVERY_S or self.n == self.total):
            return
        self._next_log, self._last_line = self.n + max(1, self.total // 10), now
        extra = " ".join(f"{k}={v}" for k, v in shown.items())
        print(progress_line(self.desc, self.n, self.total, self.unit, now - self.start, self.n - self.initial, extra),
              file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
