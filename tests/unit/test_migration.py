"""Tail migration decisions (rollout/migration.py) on counts a person can check."""

import pytest

from rlfuse.rollout.migration import MigrationPlan, pause_points, plan_migration


def test_no_migration_while_the_batch_is_big_and_does_not_fit_on_fewer_workers():
    # 2 workers x 60 unfinished of 256: 47% unfinished (>= 20%), ceil(120 / 16) = 8 workers needed >= 2 busy
    assert plan_migration([60, 60], 256, 0.2, 16) is None


def test_fraction_trigger_moves_the_tail_onto_all_but_one_worker_at_most():
    # 50 unfinished of 256 = 19.5% < 20%: m = ceil(50 / 16) = 4, capped at busy - 1 = 1; worker 1 has more rows: keeps
    assert plan_migration([20, 30], 256, 0.2, 16) == MigrationPlan(keep=(1,), export=(0,))
    # 52 of 256 = 20.3%: not yet
    assert plan_migration([22, 30], 256, 0.2, 16) is None


def test_capacity_trigger_fires_above_the_fraction_when_the_rows_fit_on_fewer_workers():
    # 4 workers, 100 of 256 unfinished (39% > 20%), rows_per_worker 64: m = ceil(100 / 64) = 2 < 4 busy
    plan = plan_migration([10, 40, 20, 30], 256, 0.2, 64)
    assert plan == MigrationPlan(keep=(1, 3), export=(2, 0))


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
    # 2 workers x 32 samples, rows_per_worker 16: the capacity trigger first fires at 16 left (one worker holds them
    # at full speed), 8 on each
    assert pause_points([32, 32], 0.2, 16) == [8, 8]
    assert plan_migration([8, 8], 64, 0.2, 16) == MigrationPlan(keep=(0,), export=(1,))
    # uneven shares go down in proportion: 40 and 24 -> at 16 left, 10 and 6
    assert pause_points([40, 24], 0.2, 16) == [10, 6]
    # migrate_below=1.0 and 4 rows a worker: at the first count under the total, 22 of 24 (11 each)
    assert pause_points([12, 12], 1.0, 4) == [11, 11]
    # nothing to move: migration off, or one busy worker
    assert pause_points([32, 32], 0.0, 16) is None
    assert pause_points([64, 0], 0.2, 16) is None
