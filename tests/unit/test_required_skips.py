"""The skip accounting of tests/conftest.py: a test skipped for a resource CI provides (../shared/data, the real
model, Chromium, vLLM) fails where its RLFUSE_REQUIRE_* variable is 1 (.ci/run sets them), and every session ends with the
count of such skips, so a failed install or a missing folder cannot pass CI as a quiet skip."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REQUIRED_SKIPS, ROOT, required_skip

SKIPPING = '''
import pytest

def test_data():
    pytest.skip("shared data file /nowhere/imdb_reviews_2000.csv not present")

@pytest.mark.skipif(True, reason="the real model is not installed: bash scripts/install.sh smollm2")
def test_model():
    pass

@pytest.fixture
def browser():
    pytest.skip("no Chromium on this machine (CI installs Debian's chromium package)")

def test_browser(browser):
    pass

def test_other():
    pytest.skip("ray is not installed")

def test_vllm():
    pytest.skip("vLLM is not installed: bash scripts/install.sh vllm")
'''


def run_session(tmp_path, **env):
    """A pytest session on SKIPPING with this suite's conftest.py: (exit code, output)."""
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    clean = {k: v for k, v in os.environ.items() if k not in REQUIRED_SKIPS and not k.startswith("PYTEST_XDIST")}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-rs",
                          str(tmp_path)], cwd=tmp_path, env=clean | env, capture_output=True, text=True, timeout=120)
    return out.returncode, out.stdout + out.stderr


def test_required_skips_fail_where_ci_requires_them(tmp_path):
    """Every variable at 1: the four resource skips are failures that say what is missing (errors where the skip came
    in setup: a skipif mark, a fixture), the other skip stays."""
    code, out = run_session(tmp_path, **{var: "1" for var in REQUIRED_SKIPS})
    assert code == 1, out
    assert re.search(r"2 failed, 1 skipped, 2 errors", out), out
    for var, (_, what, _) in REQUIRED_SKIPS.items():
        assert f"[required] {var}=1: {what}" in out
        assert f"[required] 1 test(s) failed (required): {what}" in out


def test_required_skips_are_counted_where_they_may_skip(tmp_path):
    """No variable set (a developer's machine): they skip, and the session's end counts them, red, apart from the
    other skips."""
    code, out = run_session(tmp_path)
    assert code == 0, out
    assert re.search(r"5 skipped", out), out
    assert "tests that did not run for a missing resource" in out
    for var, (_, what, _) in REQUIRED_SKIPS.items():
        assert f"[required] 1 test(s) skipped ({var}=1 makes them fail): {what}" in out
    assert "ray is not installed" in out and "[required] 1 test(s) skipped" in out


@pytest.mark.parametrize("var", list(REQUIRED_SKIPS))
def test_the_reasons_matched_are_the_ones_the_tests_skip_with(var):
    """Each pattern occurs in the skip reasons of the test files it names: a reworded reason would otherwise slip
    out of the accounting unnoticed."""
    text, _, files = REQUIRED_SKIPS[var]
    for name in files.split(", "):
        path = next(ROOT.glob(f"tests/*/{name}"))
        assert text in path.read_text(), f"{path} no longer skips with {text!r}"
    assert required_skip(f"xx {text} yy") == var and required_skip("ray is not installed") is None
