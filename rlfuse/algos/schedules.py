"""Per-iteration schedules of a scalar (the RL sampling temperature): a pure function of (start, final, iteration,
iterations), so a resumed run recomputes the value of any iteration with nothing to restore.

Progress runs from 0 at the first iteration to 1 at the last, so the first iteration uses `start` and the last
`final` exactly (temperature annealing as in the IMDb/DistilGPT2 pipeline rlfuse was started from)."""

from __future__ import annotations

import math


def progress(iteration: int, iterations: int) -> float:
    """0 at iteration 0, 1 at iteration iterations - 1 (0-based); 0 throughout a one-iteration run."""
    return iteration / (iterations - 1) if iterations > 1 else 0.0


def constant_fraction(p: float) -> float:
    return 0.0


def linear_fraction(p: float) -> float:
    return p


def cosine_fraction(p: float) -> float:
    """Half a cosine: flat at both ends, fastest in the middle (Loshchilov & Hutter's SGDR shape)."""
    return 0.5 * (1.0 - math.cos(math.pi * p))


SCHEDULE_FNS = {"constant": constant_fraction, "linear": linear_fraction, "cosine": cosine_fraction}
"""Schedule name -> the fraction of the way from start to final at a given progress in [0, 1]."""


def scheduled_value(kind: str, start: float, final: float, iteration: int, iterations: int) -> float:
    """The value at 0-based `iteration` of a run of `iterations`: start + (final - start) * fraction(progress)."""
    return start + (final - start) * SCHEDULE_FNS[kind](progress(iteration, iterations))
