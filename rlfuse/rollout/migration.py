"""Tail migration across generation workers (RLHFuse, arXiv 2409.13221, section 4): when few samples are still
decoding, move them onto as few workers as decode them at about full speed, so the other workers can score.

Pure: counts in, a plan out. The Ray layer (rlfuse/runtime/ray_rollout.py) gives each decoding worker its pause
point up front (pause_points), waits until every one has reached it, and applies the plan on the counts they report:
once per iteration (a migrated tail never moves back: the freed workers are scoring by then). Taken from counts, not
from when replies arrive, the migration is the same in every run, and so are the samples' log-probs and the weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class MigrationPlan:
    keep: tuple[int, ...]
    """Workers that keep decoding and import the exported rows, most unfinished first."""
    export: tuple[int, ...]
    """Busy workers that export their unfinished rows and then score."""


def plan_migration(unfinished: Sequence[int], total: int, migrate_below: float, rows_per_worker: int,
                   already_migrated: bool = False) -> MigrationPlan | None:
    """Whether to migrate now, and where. unfinished[w]: samples worker w has not finished (live rows and those of
    prompts still waiting); total: the iteration's samples; migrate_below: R_t (0 turns migration off);
    rows_per_worker: rows one worker decodes at about full speed.

    RLHFuse's trigger: under migrate_below of the samples are unfinished -> the tail moves onto
    min(ceil(left / rows_per_worker), busy - 1) workers, the busiest, so the fewest rows move.
    (A second trigger, "the unfinished rows fit on fewer workers", fired at the first finished sample of a small
    batch: SmolLM2 on hh-rlhf, 8 samples on 2 workers, moved 3 rows at 6 of 8 unfinished, and since chat replies run
    to the length limit together, the freed worker had nothing to score until the end while the keeper re-prefilled
    and decoded 7 rows: rollout 28-34 s against 16-25 s without migration. It was removed.)
    None: do nothing (off, done, already migrated, or a single busy worker: moving would free nobody)."""
    if already_migrated or migrate_below <= 0:
        return None
    left = sum(unfinished)
    busy = sorted((w for w, n in enumerate(unfinished) if n > 0), key=lambda w: (-unfinished[w], w))
    if left >= migrate_below * total:
        return None
    m = min(max(1, math.ceil(left / rows_per_worker)), len(busy) - 1)
    if m < 1:
        return None
    return MigrationPlan(keep=tuple(busy[:m]), export=tuple(busy[m:]))


def pause_points(unfinished: Sequence[int], migrate_below: float, rows_per_worker: int) -> list[int] | None:
    """Where each decoding worker stops for the migration: its unfinished count at the first point, as samples
    finish in proportion to each worker's share, where plan_migration would move the tail. unfinished: each worker's
    samples at the start of decoding (together the iteration's). The driver waits until every worker has reached its
    point (a worker's count goes down by one per finished sample, so it stops there exactly), then plans on the counts
    they report: the decision does not depend on which worker replied first. None: no migration this iteration."""
    if migrate_below <= 0 or sum(n > 0 for n in unfinished) < 2:
        return None
    total = sum(unfinished)
    for left in range(total - 1, -1, -1):
        points = [n * left // total for n in unfinished]
        if plan_migration(points, total, migrate_below, rows_per_worker) is not None:
            return points
    return None
