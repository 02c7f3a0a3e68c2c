"""`rlfuse plan` on odd inputs: a huge --workers plans in seconds (it enumerated every split, hours for 100,000);
NaN, inf and negative figures are one line each; a worker with more CPUs than this machine has is refused for a
local plan and taken for a cluster; a path the OS cannot look up (a part over 255 bytes) is one line naming the
flag, not an OSError traceback."""

import math
import time

import pytest

import rlfuse.plan.planner as planner
from rlfuse.cli import main
from rlfuse.cli.plan import check_cpus_per_worker, machine_cores
from rlfuse.config import load_config
from rlfuse.errors import UserError
from rlfuse.plan.cost import HARMONIC_SUMMED_UP_TO, harmonic
from rlfuse.plan.memory import GiB
from rlfuse.plan.profiles import BUILTIN_CPU

from conftest import TINY

LONG = "a" * 300  # a path part over NAME_MAX (255 bytes on ext4, xfs, tmpfs, overlayfs)


def _last_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def test_a_plan_for_100000_workers_ranks_a_sample_of_the_splits_in_seconds():
    prob = planner.problem_from_config(load_config(None, []), BUILTIN_CPU, workers=100_000)
    specs = planner.candidate_specs(prob)
    assert len(specs) < 200  # before: 199,999 (every split, for interleaved and separated)
    t0 = time.perf_counter()
    plans = planner.plan(prob)
    assert plans and time.perf_counter() - t0 < 60  # 2.3 s on the 2-core dev VM; before: hours


def test_the_split_sample_keeps_every_split_of_few_workers_and_the_defaults_of_many():
    assert planner.split_sizes(2) == [1]
    assert planner.split_sizes(planner.EVERY_SPLIT_UP_TO) == list(range(1, planner.EVERY_SPLIT_UP_TO))
    sizes = planner.split_sizes(1000)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == 999
    assert {250, 500, 512, 488, 125, 875} <= set(sizes) and len(sizes) < 60


def test_the_split_sample_finds_each_strategys_best_split_within_one_per_cent(monkeypatch):
    prob = planner.problem_from_config(load_config(None, []), BUILTIN_CPU, workers=64, memory_budget=64 * GiB,
                                       cores=64)
    sampled = planner.plan(prob)
    monkeypatch.setattr(planner, "EVERY_SPLIT_UP_TO", 10**9)
    every = planner.plan(prob)
    for strategy in ("interleaved", "separated", "flattened"):
        best = lambda plans: min(p.iteration_s for p in plans if p.strategy == strategy and p.fits)
        assert best(every) <= best(sampled) <= 1.01 * best(every), strategy


def test_harmonic_numbers_past_the_summed_ones_are_the_series_and_cheap():
    for n in (HARMONIC_SUMMED_UP_TO + 1, 10_000, 100_000):
        assert harmonic(n) == pytest.approx(sum(1 / i for i in range(1, n + 1)), rel=1e-13, abs=0)
    assert harmonic(HARMONIC_SUMMED_UP_TO + 1) > harmonic(HARMONIC_SUMMED_UP_TO)
    t0 = time.perf_counter()
    harmonic(10**12)
    assert time.perf_counter() - t0 < 1.0  # a sum of 10^12 terms would take hours
    assert harmonic(10**12) == pytest.approx(math.log(10**12) + 0.5772156649)


@pytest.mark.parametrize("flag, value, wanted", [
    ("--memory-per-worker", "nan", "a finite number > 0"), ("--memory-per-worker", "inf", "a finite number > 0"),
    ("--memory-per-worker", "-1", "a finite number > 0"), ("--memory-per-worker", "lots", "a number"),
    ("--cpus-per-worker", "nan", "a finite number > 0"), ("--cpus-per-worker", "0", "a finite number > 0"),
    ("--gpus-per-worker", "nan", "a finite number >= 0"), ("--gpus-per-worker", "-1", "a finite number >= 0"),
    ("--workers", "0", "a finite number > 0"), ("--top", "-3", "a finite number > 0"),
])
def test_a_flag_that_is_not_a_finite_figure_is_one_line(flag, value, wanted, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["plan", flag, value, "--out", str(tmp_path / "p.yaml")])
    assert e.value.code == 2
    assert _last_line(capsys) == f"rlfuse plan: error: argument {flag}: expected {wanted}, got {value!r}"
    assert not (tmp_path / "p.yaml").exists()  # before (nan, inf, --gpus-per-worker): a plan written


def test_nan_memory_in_the_config_is_a_config_error(capsys, tmp_path):
    assert main(["plan", "placement.memory_per_worker_gb=nan", "--out", str(tmp_path / "p.yaml")]) == 2
    assert _last_line(capsys).startswith("rlfuse plan: config error: placement.memory_per_worker_gb: must be a "
                                         "finite number, got nan")


@pytest.mark.parametrize("args, flag", [
    (["--cpus-per-worker", "{n}"], "--cpus-per-worker"),
    (["placement.cpus_per_worker={n}"], "placement.cpus_per_worker"),
])
def test_a_worker_with_more_cpus_than_this_machine_is_refused_for_a_local_plan(args, flag, capsys, tmp_path):
    n = machine_cores() + 1
    assert main(["plan", *[a.format(n=n) for a in args], "--out", str(tmp_path / "p.yaml")]) == 2
    assert _last_line(capsys) == (f"rlfuse plan: {flag} {n}: a worker is one process on one machine, and this one "
                                  f"has {machine_cores()} cores; give at most {machine_cores()}, or plan for a cluster "
                                  f"with placement.address=ray://HEAD:10001")
    assert not (tmp_path / "p.yaml").exists()  # before: a plan of workers this machine cannot start


def test_a_cluster_worker_may_have_more_cpus_than_this_machine():
    check_cpus_per_worker(machine_cores() + 64, "--cpus-per-worker", "ray://head:10001")
    check_cpus_per_worker(machine_cores(), "--cpus-per-worker", None)
    with pytest.raises(UserError):
        check_cpus_per_worker(machine_cores() + 0.5, "--cpus-per-worker", None)


@pytest.mark.parametrize("flag, path, fix", [
    ("--out", "{tmp}/{long}/plan.yaml", "give another path for the plan's YAML"),
    ("--lengths-from", "{tmp}/{long}", "give an RL run folder"),
    ("--profile-path", "{tmp}/{long}.json", "give another file"),
])
def test_a_path_part_over_255_bytes_is_one_line_naming_the_flag(flag, path, fix, capsys, tmp_path):
    path = path.format(tmp=tmp_path, long=LONG)
    out = [] if flag == "--out" else ["--out", str(tmp_path / "p.yaml")]
    assert main(["plan", flag, path, *out]) == 2
    assert _last_line(capsys) == f"rlfuse plan: {flag} {path}: File name too long; {fix}"


def test_an_out_file_that_cannot_be_written_is_one_line(capsys, tmp_path, tiny_task):
    folder = tmp_path / "plan.yaml"
    folder.mkdir()  # a folder where the file would go (a read-only folder is writable to root)
    assert main(["plan", *TINY, "--out", str(folder), "--top", "1"]) == 2
    assert _last_line(capsys) == f"rlfuse plan: --out {folder}: cannot write it (Is a directory); give another path"
