"""metrics.memory.peak_rise: the rise of the process's peak over its level before a call, which the machine profile
takes for what a training micro-batch holds resident."""

import torch

from rlfuse.metrics.memory import peak_rise

MiB = 2**20


def test_peak_rise_sees_a_buffer_freed_inside_the_call_and_not_an_idle_one():
    # 64 MiB made, touched and freed within the call: gone from the RSS after it, still in its peak
    held = peak_rise(lambda: float(torch.ones(64 * MiB // 4).sum()))
    assert 60 * MiB < held < 200 * MiB, held / MiB
    assert peak_rise(lambda: None) < 16 * MiB
