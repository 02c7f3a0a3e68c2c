"""Tail migration decisions (rollout/migration.py) on counts a person can check."""

import pytest

from rlfuse.rollout.fusion import scoring_shares
from rlfuse.rollout.migration import MigrationPlan, pause_points, plan_migration


def test_no_migration_while_the_batch_is_big_and_does_not_fit_on_fewer_workers():
    # 2 workers x 60 unfinished of 256: 47% unfinished (>= 20%), ceil(120 / 16) = 8 workers needed >= 2 busy
    assert plan_migration([60, 60], 256, 0.2, 16) is None


def test_fraction_trigger_moves_the_tail_onto_all_but_one_worker_at_most():
    # 50 unfinished of 256 = 19.5% < 20%: m = ceil(50 / 16) = 4, capped at busy - 1 = 1; worker 1 has more rows: keeps
    assert plan_migration([20, 30], 256, 0.2, 16) == MigrationPlan(keep=(1,), export=(0,))
    # 52 of 256 = 20.3%: not yet
    assert plan_migration([22, 30], 256, 0.2, 16) is None


def test_no_migration_above_the_fraction_even_when_the_rows_fit_on_fewer_workers():
    # 4 workers, 100 of 256 unfinished (39% > 20%), rows_per_worker 64: two workers could hold them, but the freed
    # ones would have little to score yet (the removed capacity trigger, see plan_migration)
    assert plan_migration([10, 40, 20, 30], 256, 0.2, 64) is None
    # SmolLM2 on hh-rlhf: 8 samples on 2 workers, 6 unfinished after the first finished on each: no move
    assert plan_migration([3, 3], 8, 0.2, 16) is None


def test_fraction_trigger_keeps_m_workers_when_more_than_one_is_needed():
    # 4 workers, 40 of 256 (15.6%), rows_per_worker 16: m = ceil(40 / 16) = 3 < 4 busy -> keep the 3 busiest
    assert plan_migration([5, 10, 10, 15], 256, 0.2, 16) == MigrationPlan(keep=(3, 1, 2), export=(0,))


def test_ties_keep_the_lower_worker_index_and_idle_workers_are_not_exported():
    # worker 2 has finished (0 rows): it is not busy, so nothing to export from it
    assert plan_migration([3, 3, 0], 100, 0.2, 8) == MigrationPlan(keep=(0,), export=(1,))


@pytest.mark.parametrize("counts", [[0, 0], [0, 7]])
def test_nothing_to_free_when_at_most_one_worker_is_busy(counts):
    assert plan_migration(counts, 100, 1.0, 8) is None


def test_off_and_once_per_iteration():
    assert plan_migration([3, 3], 100, 0.0, 8) is None  # migrate_below = 0: off
    assert plan_migration([3, 3], 100, 0.2, 8, already_migrated=True) is None
    # forced (migrate_below = 1.0): 1 finished of 12 is enough
    assert plan_migration([5, 6], 12, 1.0, 1) == MigrationPlan(keep=(1,), export=(0,))


def test_pause_points_by_hand():
    # 2 workers x 32 samples, migrate_below 0.2: the first count under 12.8 as both go down in proportion is 6 + 6
    # (13 left -> 6 and 6 by floor; 14 left -> 7 + 7 = 14, not under)
    assert pause_points([32, 32], 0.2, 16) == [6, 6]
    assert plan_migration([6, 6], 64, 0.2, 16) == MigrationPlan(keep=(0,), export=(1,))
    # uneven shares go down in proportion: 40 and 24 -> at 13 left, 40 * 13 // 64 = 8 and 24 * 13 // 64 = 4
    assert pause_points([40, 24], 0.2, 16) == [8, 4]
    # migrate_below=1.0 and 4 rows a worker: at the first count under the total, 22 of 24 (11 each)
    assert pause_points([12, 12], 1.0, 4) == [11, 11]
    # nothing to move: migration off, or one busy worker
    assert pause_points([32, 32], 0.0, 16) is None
    assert pause_points([64, 0], 0.2, 16) is None


def test_scoring_shares_cut_a_chunk_by_count_for_the_scorers():
    # the last chunk of a rollout whose rows all hit the length limit: 7 samples, 2 scorers -> 4 + 3, in order
    assert scoring_shares(list("abcdefg"), 2) == [list("abcd"), list("efg")]
    assert scoring_shares(list("abcdefgh"), 3) == [list("abc"), list("de"), list("fgh")]  # bounds round(i * 8 / 3)
    assert scoring_shares(list("ab"), 4) == [["a"], ["b"]]  # never an empty share
    assert scoring_shares(list("abc"), 1) == [list("abc")]
    assert scoring_shares([], 2) == []
