"""Small pieces every Ray-side module shares: starting worker actors in placement-group bundles, a worker's CPU share
and a rendezvous address (Ray itself is started by ray_driver.start_ray). Ray is imported inside the functions, so
importing this module never needs Ray."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Callable


CORE_OFFSET_ENV = "RLFUSE_CORE_OFFSET"
"""Set on a worker whose threads are pinned to cores: where its cores start among its node's (pin_threads)."""
PINNED: list[int] = []
"""The cores this process's threads were pinned to by pin_threads ([]: not pinned, the OS places them)."""


def start_actors(cls, n: int, args_of: Callable[[int], tuple], cpus_per_worker: float = 1, gpus_per_worker: float = 0,
                 placement_group=None, first_bundle: int = 0, pin_cores: bool = False) -> list:
    """n Ray actors of `cls`, actor i built with args_of(i), in bundle first_bundle + i of placement_group (else
    Ray places them); returns once every constructor has run (their models loaded). The actors import the same
    rlfuse as this process (its folder goes first on their PYTHONPATH), and one that reserved no GPU sees none:
    Ray no longer hides the GPUs from it, and run.device=auto must not take a device another worker owns.
    pin_cores: each actor's threads keep to its own whole cores of its node (core_offsets; pin_threads applies it);
    without a placement group the actors are taken to share one node."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    src = str(Path(__file__).resolve().parents[2])  # the folder holding this rlfuse package
    env = {"PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    if not gpus_per_worker:
        env["CUDA_VISIBLE_DEVICES"] = ""
    offsets = [None] * (first_bundle + n)
    if pin_cores and placement_group is not None:
        nodes = ray.util.placement_group_table(placement_group)["bundles_to_node_id"]
        specs = placement_group.bundle_specs
        offsets = core_offsets([b.get("CPU", 0) for b in specs], [nodes[i] for i in range(len(specs))])
    elif pin_cores:
        offsets = core_offsets([cpus_per_worker] * (first_bundle + n), [None] * (first_bundle + n))
    remote = ray.remote(cls)
    actors = []
    for i in range(n):
        offset = offsets[first_bundle + i]
        pinned = {} if offset is None else {CORE_OFFSET_ENV: str(offset)}
        opts = {"num_cpus": cpus_per_worker, "num_gpus": gpus_per_worker, "runtime_env": {"env_vars": env | pinned}}
        if placement_group is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group, placement_group_bundle_index=first_bundle + i)
        actors.append(remote.options(**opts).remote(*args_of(i)))
    ray.get([a.ready.remote() for a in actors])  # models loaded: later timings (weight sync) exclude the start
    return actors


def pin_threads(threads: int) -> None:
    """Keep a worker's torch (intra-op and inter-op) and OpenMP threads to its CPU share: two workers with one core
    each that both spread over all cores only slow each other down."""
    import torch

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


def node_address() -> str:
    """This process's node IP as Ray sees it (reachable from the other nodes of the cluster)."""
    import ray

    return ray.util.get_node_ip_address()
