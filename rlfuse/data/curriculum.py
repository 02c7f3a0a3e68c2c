"""Prompt curriculum: each iteration draws its prompts from the easiest part of the train prompts, a part that grows
linearly from a starting fraction at the first iteration to every prompt at the last (a linear version of Platanios
et al. 2019's competence-based curriculum).

Pure: the batch is a function of (difficulty scores, iteration, iterations, seed), so a resumed run draws what an
uninterrupted one draws. Difficulty scores are computed once before RL (trainers/rl.py): the prompt's length, or
minus the reward of the SFT model's sample for it (a low reward is hard, so it comes last)."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def uniform_indices(num_prompts: int, iteration: int, n: int, seed: int) -> list[int]:
    """n prompt indices drawn uniformly (with replacement only when there are fewer than n prompts)."""
    rng = np.random.default_rng([seed, iteration])
    return rng.choice(num_prompts, size=n, replace=num_prompts < n).tolist()


def easiest_first(difficulty: Sequence[float]) -> list[int]:
    """Prompt indices sorted by difficulty, ties in index order (a stable sort: no randomness)."""
    return sorted(range(len(difficulty)), key=lambda i: difficulty[i])


def pool_size(num_prompts: int, iteration: int, iterations: int, start_fraction: float) -> int:
    """How many of the easiest prompts iteration `iteration` (0-based) draws from: ceil(fraction * num_prompts), the
    fraction growing linearly from start_fraction at the first iteration to 1 at the last; never below 1."""
    p = iteration / (iterations - 1) if iterations > 1 else 1.0
    fraction = start_fraction + (1.0 - start_fraction) * min(1.0, p)
    return max(1, min(num_prompts, math.ceil(fraction * num_prompts - 1e-9)))


def curriculum_indices(difficulty: Sequence[float], iteration: int, iterations: int, n: int, seed: int,
                       start_fraction: float) -> list[int]:
    """The iteration's n prompt indices: drawn uniformly (uniform_indices) from the pool_size easiest prompts."""
    order = easiest_first(difficulty)
    pool = pool_size(len(order), iteration, iterations, start_fraction)
    return [order[i] for i in uniform_indices(pool, iteration, n, seed)]


def prompt_batch(prompts: list, iteration: int, n: int, seed: int, difficulty: list[float] | None = None,
                 iterations: int = 1, start_fraction: float = 1.0) -> list:
    """The iteration's prompts (or their indices, given range(len(prompts))): a function of (seed, iteration), so no
    data position needs restoring. Uniform, or with difficulty scores (one per prompt) a curriculum over the run's
    iterations (rlfuse/data/curriculum.py)."""
    idx = (uniform_indices(len(prompts), iteration, n, seed) if difficulty is None else
           curriculum_indices(difficulty, iteration, iterations, n, seed, start_fraction))
    return [prompts[i] for i in idx]
