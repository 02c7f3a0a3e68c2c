"""The Ray driver's pure parts (metric names, cluster resources from ray.nodes()) and the single-process path's
promise: choosing the rollout for placement.strategy=single never imports Ray."""

import subprocess
import sys

import pytest

pytest.importorskip("ray", reason="ray is not installed: the Ray driver imports it (and nothing can import Ray here)")
from rlfuse.plan.spec import ClusterResources, NodeResources  # noqa: E402
from rlfuse.runtime.ray_driver import cluster_resources, worker_metrics  # noqa: E402


def test_worker_metrics_names_migration_and_each_worker_by_its_rank():
    timing = {"rollout": 2.0, "scoring": 0.5, "migrated": 1.0, "migration/rows_moved": 3, "migration/reprefill_s": 0.1,
              "busy/worker0": 1.5, "busy/worker1": 0.25, "decode_rows": 40}
    got = worker_metrics(timing, ranks=[1, 2], rss_mb=[(300.0, 350.0), (200.0, 210.0)])
    assert got == {"time/rollout": 2.0, "time/scoring": 0.5, "migration/migrated": 1.0, "migration/rows_moved": 3,
                   "migration/reprefill_s": 0.1, "worker/1/busy_s": 1.5, "worker/1/rss_mb": 300.0,
                   "worker/1/rss_peak_mb": 350.0, "worker/2/busy_s": 0.25, "worker/2/rss_mb": 200.0,
                   "worker/2/rss_peak_mb": 210.0}


def test_cluster_resources_count_alive_nodes_only():
    nodes = [{"Alive": True, "Resources": {"CPU": 2.0, "memory": 1e9}},
             {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}},
             {"Alive": True, "Resources": {"CPU": 8.0, "GPU": 1.0}}]
    assert cluster_resources(nodes) == ClusterResources((NodeResources(2.0, 0.0), NodeResources(8.0, 1.0)))


def test_single_placement_never_imports_ray():
    code = ("import sys; import rlfuse.trainers.rl; from rlfuse.config import load_config; "
            "from rlfuse.runtime.backend import build_placement; from rlfuse.runtime.local import LocalRollout; "
            "cm = build_placement(load_config(None, []), None, None, None, None, 'local trainer', None, print); "
            "r, t = cm.__enter__(); assert isinstance(r, LocalRollout) and t == 'local trainer'; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_failed_sharded_checkpoint_on_a_full_disk_is_the_one_line_of_a_full_disk(tmp_path, monkeypatch):
    # DCP's writer reports a full disk as a failed zip write (RuntimeError in a CheckpointException): with under
    # 64 MiB free it becomes ENOSPC, which the CLI prints as one line naming the folder and the fix
    import shutil
    from collections import namedtuple

    from rlfuse.errors import os_error_line
    from rlfuse.runtime import fsdp

    usage = namedtuple("usage", "total used free")
    folder = tmp_path / "checkpoint.pt.shards-000002.tmp"
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10 * 2**30, 10 * 2**30 - 2**20, 2**20))
    error = fsdp.disk_full(folder)
    line = os_error_line(error, "rl", "RUN")
    assert str(folder) in line and "No space left" in line and "--resume RUN" in line
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10 * 2**30, 2**30, 9 * 2**30))
    assert fsdp.disk_full(folder) is None  # another failure stays itself
