"""A CPU that other work keeps busy: a stage runs one torch thread per free core (about the fair share), decided at
its start, said in a line, and kept for a resumed stage; run.threads fixes the count."""

import os

import pytest
import torch

from rlfuse.config import RunConfig
from rlfuse.models import cpu_share, device
from rlfuse.models.cpu_share import CpuShare, busy_seconds, measure_share, threads_for


def test_a_core_counts_as_taken_when_others_use_more_than_half_of_it():
    assert [CpuShare(2, busy).free for busy in (0.0, 0.4, 0.6, 1.0, 1.6, 2.0, 3.5)] == [2, 2, 1, 1, 1, 1, 1]
    assert [CpuShare(8, busy).free for busy in (0.0, 2.2, 2.6, 7.9)] == [8, 6, 5, 1]
    assert threads_for(CpuShare(2, 2.0), asked=4, most=2) == 4  # run.threads is taken as given
    assert threads_for(CpuShare(8, 0.0), asked=0, most=2) == 2  # never more than torch's own count


def test_busy_time_is_read_for_the_cores_this_process_may_use(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  900 0 300 5000 0 0 0 0 0 0\n"
                    "cpu0 100 0 50 2000 10 5 5 0 40 0\n"  # guest (40) is inside user already: not added
                    "cpu1 800 0 250 3000 0 0 0 0 0 0\n"
                    "intr 12345\n")
    tick = os.sysconf("SC_CLK_TCK")
    assert busy_seconds({0}, str(stat)) == pytest.approx(160 / tick)
    assert busy_seconds({0, 1}, str(stat)) == pytest.approx((160 + 1050) / tick)
    assert busy_seconds({0}, str(tmp_path / "none")) is None


def test_this_process_own_time_is_not_other_work(monkeypatch):
    readings = iter([10.0, 10.9])  # the cores' busy seconds before and after
    own = iter([3.0, 3.5])  # of which this process's
    monkeypatch.setattr(cpu_share, "busy_seconds", lambda cpus: next(readings))
    monkeypatch.setattr(cpu_share, "own_cpu_seconds", lambda: next(own))
    clock = iter([0.0, 1.0])
    monkeypatch.setattr(cpu_share.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(cpu_share.time, "sleep", lambda s: None)
    monkeypatch.setattr(cpu_share, "allowed_cpus", lambda: {0, 1})
    assert measure_share() == CpuShare(2, pytest.approx(0.4))


def test_a_stage_takes_the_free_cores_says_so_and_a_resumed_stage_keeps_its_count(tmp_path, monkeypatch):
    said, before = [], torch.get_num_threads()
    monkeypatch.setattr(device, "TORCH_THREADS", 2)
    monkeypatch.setattr(device, "_set_by_us", None)
    kept = tmp_path / "rl" / "threads.txt"
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(device, "measure_share", lambda: CpuShare(2, 1.0))  # another job holds a core
        device.setup_runtime(RunConfig(), said.append, kept)
        assert torch.get_num_threads() == 1 and kept.read_text() == "1\n"
        assert said == ["[run] other work keeps 1.0 of 2 cores busy: 1 torch thread(s) instead of 2 for this stage "
                        "(run.threads fixes the count)"]
        monkeypatch.setattr(device, "measure_share", lambda: CpuShare(2, 0.0))  # idle now: the next stage takes 2
        device.setup_runtime(RunConfig(), said.append, tmp_path / "sft" / "threads.txt")
        assert torch.get_num_threads() == 2 and len(said) == 1
        device.setup_runtime(RunConfig(), said.append, kept)  # stopped before its first checkpoint: starts over
        assert torch.get_num_threads() == 2 and kept.read_text() == "2\n"
        kept.write_text("1\n")
        (kept.parent / "checkpoint.pt").write_bytes(b"")
        device.setup_runtime(RunConfig(), said.append, kept)  # resumed: the count it ran with, busy or not
        assert torch.get_num_threads() == 1
        device.setup_runtime(RunConfig(threads=2), said.append, kept)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
