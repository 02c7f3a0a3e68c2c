"""What a worker process sets up for itself, on Ray or not: its torch threads kept to its CPU share and, where it
owns whole cores, pinned to them; and a free port for a process group's rendezvous."""

from __future__ import annotations

import os
import socket

import torch

CORE_OFFSET_ENV = "RLFUSE_CORE_OFFSET"
"""Set on a worker whose threads are pinned to cores: where its cores start among its node's (pin_threads)."""


PINNED: list[int] = []
"""The cores this process's threads were pinned to by pin_threads ([]: not pinned, the OS places them)."""


def pin_threads(threads: int) -> None:
    """Keep a worker's torch (intra-op and inter-op) and OpenMP threads to its CPU share: two workers with one core
    each that both spread over all cores only slow each other down."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    try:  # settable once per process, before any parallel work; a worker that already ran some keeps its value
        torch.set_num_interop_threads(threads)
    except RuntimeError:
        pass
    global PINNED
    if os.environ.get(CORE_OFFSET_ENV):  # once: a worker's constructors may call this again
        PINNED = pin_to_cores(int(os.environ.pop(CORE_OFFSET_ENV)), threads)


def core_offsets(cpus: list[float], nodes: list) -> list[int | None]:
    """Per worker (a placement bundle of `cpus` CPUs on node `nodes[i]`), where its own cores start among its
    node's: after the whole cores of the workers before it on that node. None for a fractional share (it has no
    whole core of its own: it floats, as Ray leaves every worker)."""
    used: dict = {}
    out: list[int | None] = []
    for c, node in zip(cpus, nodes):
        if c < 1 or c != int(c):
            out.append(None)
            continue
        out.append(used.get(node, 0))
        used[node] = used.get(node, 0) + int(c)
    return out


def pin_to_cores(offset: int, count: int) -> list[int]:
    """Keep every thread of this process (torch's and Ray's) on cores offset .. offset+count-1 of those it may run
    on: two compute-bound workers left to the OS scheduler get moved between cores and slow each other (the
    pipeline bench: each task 1.2-1.8x longer while both ranks compute, unpinned). Returns the cores; [] (left as
    is) where the node has too few or the OS cannot pin (not Linux)."""
    if not hasattr(os, "sched_setaffinity"):
        return []
    cores = sorted(os.sched_getaffinity(0))[offset: offset + count]
    if len(cores) < count:
        return []
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that ended meanwhile
            pass
    return cores


def free_port() -> int:
    """A TCP port free on this node now (the OS picks it); the caller binds it soon after. The usual Ray
    rendezvous: rank 0 picks (its node's IP, this port) and the driver hands it to every rank."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
