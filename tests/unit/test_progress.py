"""Progress away from a terminal: a line with the rate and the time left every 10% of the work and at least every
30 seconds; nothing at all with run.quiet."""

import pytest

from rlfuse.metrics import progress
from rlfuse.metrics.progress import Progress, duration, progress_line


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(progress.time, "perf_counter", c)
    return c


def test_a_line_says_the_rate_and_the_time_left():
    assert progress_line("sft", 120, 600, "step", 60.0, 120, "loss=2.3") == \
        "[sft] 120/600 steps, 1m00s, 2 steps/s, 4m00s left  loss=2.3"
    assert progress_line("rl/ppo", 2, 40, "iter", 30.0, 2) == "[rl/ppo] 2/40 iters, 30s, 15 s/iter, 9m30s left"
    # a resumed run: 10 iterations were done before, 2 timed now
    assert progress_line("rl/ppo", 12, 40, "iter", 30.0, 2).endswith("15 s/iter, 7m00s left")
    assert progress_line("rl/ppo", 40, 40, "iter", 600.0, 40) == "[rl/ppo] 40/40 iters, 10m00s, 15 s/iter"
    assert [duration(s) for s in (0, 59.4, 61, 3599, 3725)] == ["0s", "59s", "1m01s", "59m59s", "1h02m"]


def test_slow_steps_still_print_every_30_seconds(clock, capsys):
    with Progress(1000, "rl/grpo", unit="iter") as bar:
        for _ in range(5):  # 5 iterations of 20 s: far from 10% of 1000, but a minute and a half passes
            clock.t += 20
            bar.update(reward=0.5)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines  # at 40 s (two steps after the start) and at 80 s
    assert lines[0].startswith("[rl/grpo] 2/1000 iters, 40s, 20 s/iter, 5h32m left")


def test_fast_steps_print_every_tenth(clock, capsys):
    with Progress(100, "sft") as bar:
        for _ in range(100):
            clock.t += 0.01
            bar.update()
    assert len(capsys.readouterr().err.splitlines()) == 10


def test_quiet_prints_nothing(clock, capsys):
    with Progress(10, "sft", quiet=True) as bar:
        for _ in range(10):
            clock.t += 60
            bar.update(loss=1.0)
    assert capsys.readouterr().err == ""
