"""A CPU that other work keeps busy: how many of the cores this process may use are free, read from the kernel's
counters when a stage starts, so that torch runs as many threads as can run at once. OpenMP threads wait for each
other at the end of every parallel region, spinning a while first; one whose partner the OS has put off the core
stalls the step until it is back, which made a run on a shared 2-core machine 4-30 times slower rather than the 2
times a fair share costs. One thread per free core gives about the fair share; letting waiting threads sleep instead
(OMP_WAIT_POLICY=PASSIVE) cost an idle machine a fifth of its decode speed (docs/benchmarks/busy_cpu.md)."""

from __future__ import annotations

import math
import os
import resource
import time
from dataclasses import dataclass

BUSY_CORE = 0.5
"""A core counts as taken when other work used more than this share of it while we looked."""


@dataclass(frozen=True)
class CpuShare:
    cores: int
    """Cores this process may run on (its affinity mask)."""
    busy: float
    """Cores' worth of time other processes used on them while we looked (0 where the counters cannot be read)."""

    @property
    def free(self) -> int:
        """Whole cores left for this process, at least one."""
        taken = math.floor(self.busy + (1 - BUSY_CORE))
        return max(1, min(self.cores, self.cores - taken))


def allowed_cpus() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def busy_seconds(cpus: set[int], stat: str = "/proc/stat") -> float | None:
    """CPU seconds the kernel counts as busy on `cpus` since boot (Linux's per-CPU lines of /proc/stat: user, nice,
    system, irq, softirq, steal; idle and iowait are not busy, guest time is already inside user); None elsewhere."""
    try:
        with open(stat) as f:
            lines = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
    except (OSError, IndexError):
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0.0
    for fields in lines:
        if int(fields[0][3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (float(x) for x in (fields[1:9] + ["0"] * 8)[:8])
            total += user + nice + system + irq + softirq + steal
    return total / tick


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure_share(seconds: float = 0.2) -> CpuShare:
    """How busy the cores this process may use are now: others' CPU time on them over `seconds` (this process's
    own, its background threads', taken out)."""
    cpus = allowed_cpus()
    before, own, t0 = busy_seconds(cpus), own_cpu_seconds(), time.monotonic()
    time.sleep(seconds)
    after, own_after, t1 = busy_seconds(cpus), own_cpu_seconds(), time.monotonic()
    if before is None or after is None or t1 <= t0:
        return CpuShare(len(cpus), 0.0)
    return CpuShare(len(cpus), max(0.0, (after - before) - (own_after - own)) / (t1 - t0))


def threads_for(share: CpuShare, asked: int, most: int) -> int:
    """Torch threads for a stage: what run.threads asks for (asked > 0), else as many as there are free cores, never
    more than `most` (what torch would take on an idle machine)."""
    if asked > 0:
        return asked
    return max(1, min(most, share.free))
