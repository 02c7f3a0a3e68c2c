"""Prompt curriculum: a pure function of (difficulty, iteration, iterations, seed), checked on cases a person can
verify: early iterations draw only from the easiest prompts, the pool grows to every prompt by the last iteration,
and the same seed gives the same batch."""

import numpy as np

from rlfuse.data.curriculum import curriculum_indices, easiest_first, pool_size, uniform_indices
from rlfuse.data.curriculum import prompt_batch

# prompt i has difficulty DIFF[i]; easiest first: 3 (0.1), 0 (0.2), 5 (0.3), 1 (0.5), 6 (0.5), 2 (0.7), 7 (0.8), 4 (0.9)
DIFF = [0.2, 0.5, 0.7, 0.1, 0.9, 0.3, 0.5, 0.8]


def test_easiest_first_is_a_stable_sort():
    assert easiest_first(DIFF) == [3, 0, 5, 1, 6, 2, 7, 4]  # 1 before 6: equal difficulty keeps index order


def test_pool_grows_linearly_from_the_start_fraction_to_all_prompts():
    # 8 prompts, start 0.25, 5 iterations: fractions 0.25, 0.4375, 0.625, 0.8125, 1 -> ceil(8 f) = 2, 4, 5, 7, 8
    assert [pool_size(8, i, 5, 0.25) for i in range(5)] == [2, 4, 5, 7, 8]
    assert pool_size(8, 0, 1, 0.25) == 8  # a one-iteration run uses every prompt
    assert pool_size(8, 0, 5, 0.01) == 1  # never an empty pool
    assert [pool_size(8, i, 3, 1.0) for i in range(3)] == [8, 8, 8]


def test_early_iterations_draw_only_the_easiest_prompts():
    first = curriculum_indices(DIFF, 0, 5, 16, seed=3, start_fraction=0.25)
    assert len(first) == 16 and set(first) <= {3, 0}  # the 2 easiest (with replacement: 16 > 2)
    assert set(first) == {3, 0}
    second = curriculum_indices(DIFF, 1, 5, 4, seed=3, start_fraction=0.25)
    assert set(second) <= {3, 0, 5, 1} and len(set(second)) == 4  # 4 from a pool of 4: no repeats


def test_last_iteration_draws_from_all_prompts():
    last = curriculum_indices(DIFF, 4, 5, 8, seed=0, start_fraction=0.25)
    assert sorted(last) == list(range(8))  # 8 of 8 without replacement: every prompt once, hardest included


def test_same_seed_same_batch_other_seed_other_batch():
    a = curriculum_indices(DIFF, 2, 5, 4, seed=7, start_fraction=0.25)
    assert a == curriculum_indices(DIFF, 2, 5, 4, seed=7, start_fraction=0.25)
    assert any(curriculum_indices(DIFF, 2, 5, 4, seed=s, start_fraction=0.25) != a for s in range(8, 12))


def test_uniform_draw_is_unchanged_from_before_the_curriculum():
    """No curriculum keeps the draw rlfuse always made, so runs without one repeat earlier runs."""
    rng = np.random.default_rng([5, 3])
    assert uniform_indices(10, 3, 4, 5) == rng.choice(10, size=4, replace=False).tolist()
    prompts = [[i] for i in range(10)]
    assert prompt_batch(prompts, 3, 4, 5) == [[i] for i in uniform_indices(10, 3, 4, 5)]
    # the trainer's curriculum path: prompts 0..9 with difficulty = minus the index draw from the hardest-numbered
    hard_last = prompt_batch(prompts, 0, 6, 5, difficulty=[-i for i in range(10)], iterations=4, start_fraction=0.2)
    assert {p[0] for p in hard_last} <= {9, 8}
