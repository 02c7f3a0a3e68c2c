"""Progress that copes with no terminal: a live tqdm bar on a TTY, else a plain log line every ~10% (CI=true)."""

from __future__ import annotations

import os
import sys
import time

from tqdm import tqdm


def interactive(quiet: bool = False) -> bool:
    return not quiet and sys.stderr.isatty() and os.environ.get("CI", "").lower() not in ("1", "true")


class Progress:
    """`with Progress(total, "sft", quiet) as bar: bar.update(loss=..)`: one interface, two renderings."""

    def __init__(self, total: int, desc: str, quiet: bool = False, unit: str = "step", initial: int = 0):
        """initial: steps done before (a resumed run): counted, not timed."""
        self.total, self.desc, self.n, self.unit = total, desc, initial, unit
        self.start = time.perf_counter()
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
        elif self.n >= self._next_log or self.n == self.total:
            self._next_log = self.n + max(1, self.total // 10)
            elapsed = time.perf_counter() - self.start
            extra = " ".join(f"{k}={v}" for k, v in shown.items())
            print(f"[{self.desc}] {self.n}/{self.total} {self.unit}s {elapsed:.0f}s {extra}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
