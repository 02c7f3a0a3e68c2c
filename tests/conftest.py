import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers on CI's two cores: one torch thread each (their CLI and Ray children inherit it), since OpenMP
    # threads that spin on a core the other worker holds made small tests far slower (an engine test of 0.4 s took 46 s)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
# every CPU computes the suite alike: fp32, as on a CPU without native bf16 (an AMX Xeon would otherwise train under
# bf16 autocast and decode a bf16 generator copy, run.precision's and rollout.generator_dtype's auto); the bf16 paths
# have tests of their own that set it to 1 (CLI and Ray children inherit it). RLFUSE_NATIVE_BF16=1 python -m pytest
# runs the suite as such hardware would (slowly where bf16 is emulated)
os.environ.setdefault("RLFUSE_NATIVE_BF16", "0")
ROOT = Path(__file__).resolve().parents[1]


def reads_absent_shared_data(config: Path) -> bool:
    """A shipped config whose data.path is in ../shared/data, on a checkout without it (CI runs beside it; a clone
    elsewhere may not): its data cannot load, and the tests of that data skip with "shared data file"."""
    return "../shared/data/" in config.read_text() and not (config.parent.parent.parent / "shared" / "data").is_dir()


# Tiny settings of the default task: a 2-layer, 64-dim GPT-2 on 400 reviews trains in seconds.
TINY = ["data.num_reviews=400", "model.n_layer=2", "model.n_embd=64", "model.n_head=2", "data.max_length=96",
        "sft.steps=6", "sft.batch_size=8", "sft.micro_batch_size=4", "sft.eval_every=3", "sft.eval_samples=4",
        "rm.steps=4", "rm.batch_size=8", "rm.micro_batch_size=4", "rm.eval_every=2", "rm.num_pairs=64",
        "run.quiet=true"]


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    os.environ["RLFUSE_CACHE"] = str(tmp_path_factory.mktemp("rlfuse-cache"))
    os.environ.setdefault("CI", "true")
    yield


@pytest.fixture(scope="session")
def tiny_task():
    from rlfuse.data.task import build_default_task

    return build_default_task(400, 0, 2, 64, 2, log=lambda *_: None)


# The suite runs on 2 pytest-xdist workers (pyproject's addopts: -n 2 --dist loadgroup; -n 0 runs it in one process).
# Much of a Ray or CLI test is process start-up and waiting, so two workers on CI's 2 cores finish in about 0.75 of
# the time of one (1194 against 1588 s on the AMD VM at stop 37; 723 s since, 703 tests). A module with a module-scoped fixture (a Ray session, trained
# folders, a reference run) stays on one worker, so the fixture is built once; a long module splits itself with
# @pytest.mark.split_group(name): each name's tests share a worker and build the fixtures again, for less than the
# split saves. A test that reuses another's run (a second run to compare bits with) names the same group, or it
# would run that first run again. Other tests are scheduled one by one.


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        scopes = {d.scope for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs}
        if scopes & {"module", "class"}:
            split = item.get_closest_marker("split_group")
            part = f"#{split.args[0]}" if split else ""
            item.add_marker(pytest.mark.xdist_group(f"{item.path.parent.name}/{item.path.name}{part}"))


# Skips of what CI provides. CI (.ci/run) installs the real model and Chromium and runs beside ../shared/data; a
# failed install or a missing folder used to turn their tests into quiet skips among the expected ones (Ray absent,
# no glibc, ...). Each such skip is recognised by its reason (the texts the tests skip with, in the files named);
# with its variable set to 1 (.ci/run sets it for the real model) the skip is a failure, and every session ends
# with their count.
REQUIRED_SKIPS = {
    "RLFUSE_REQUIRE_SHARED_DATA": ("shared data file", "../shared/data (IMDb, hh-rlhf) is absent",
                                   "test_stages.py, test_sources.py, test_real_pipelines.py, test_qlora.py"),
    "RLFUSE_REQUIRE_REAL_MODEL": ("the real model is not installed",
                                  "the real model is not installed (bash scripts/install.sh smollm2)",
                                  "test_smollm2.py"),
    "RLFUSE_REQUIRE_VLLM": ("vLLM is not installed", "vLLM is not installed (bash scripts/install.sh vllm; CI: "
                            ".venv-vllm)", "test_vllm.py"),
    "RLFUSE_REQUIRE_BROWSER": ("no Chromium on this machine", "no headless Chromium (CI installs Debian's chromium)",
                               "test_report.py"),
}


def required_skip(reason: str) -> str | None:
    """The REQUIRED_SKIPS variable whose resource a skip's reason says is missing; None for any other skip."""
    return next((var for var, (text, _, _) in REQUIRED_SKIPS.items() if text in reason), None)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, (tuple, list)) and len(longrepr) == 3 else str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    var = required_skip(_skip_reason(report))
    if var and os.environ.get(var) == "1":
        report.outcome = "failed"
        report.longrepr = (f"{_skip_reason(report)}\n[required] {var}=1: {REQUIRED_SKIPS[var][1]}, which this run "
                           f"requires: a failure, not a skip (unset {var} to let it skip)")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The count of skips and failures for a missing resource CI provides, loudly, at the end of every session."""
    counts: dict = {}
    for kind in ("skipped", "failed", "error"):  # a skip in setup (skipif, a fixture) that fails is an error
        for report in terminalreporter.stats.get(kind, []):
            reason = _skip_reason(report) if kind == "skipped" else str(getattr(report, "longrepr", ""))
            var = required_skip(reason) if kind == "skipped" else next(
                (v for v in REQUIRED_SKIPS if f"[required] {v}=1" in reason), None)
            if var:
                key = (var, "skipped" if kind == "skipped" else "failed")
                counts[key] = counts.get(key, 0) + 1
    if not counts:
        return
    terminalreporter.write_sep("=", "tests that did not run for a missing resource", red=True, bold=True)
    for (var, kind), n in sorted(counts.items()):
        how = "failed (required)" if kind == "failed" else f"skipped ({var}=1 makes them fail)"
        terminalreporter.write_line(f"[required] {n} test(s) {how}: {REQUIRED_SKIPS[var][1]}", red=True, bold=True)
