"""bench/rss_trace.py: a command's processes sample their own RSS with the Python stack running, and the summary
names each one's peak and the phase it fell in."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_peak_is_found_in_the_function_that_made_it(tmp_path):
    # a fake rlfuse module (its file path names rlfuse) that holds 300 MiB inside one function for a moment
    pkg = tmp_path / "rlfuse_fake"
    pkg.mkdir()
    (pkg / "work.py").write_text(textwrap.dedent("""
        import time

        def hold_a_lot():
            buf = bytearray(300 * 2**20)
            buf[::4096] = b"x" * len(buf[::4096])  # touch every page
            time.sleep(0.5)
            return len(buf)

        def small():
            time.sleep(0.3)
    """))
    script = "import sys; sys.path.insert(0, %r); import work; work.small(); work.hold_a_lot(); work.small()" % str(pkg)
    out = subprocess.run([sys.executable, "-m", "bench.rss_trace", "--out", str(tmp_path / "trace"), "--every-ms",
                          "5", "--", sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    peak_line = next(line for line in out.stdout.splitlines() if line.strip().startswith("peak"))
    peak_mib = float(peak_line.split()[1])
    assert peak_mib > 300 and "work.py:hold_a_lot" in peak_line
    assert any("work.py:small" in line for line in out.stdout.splitlines())  # its other phase, listed below it
