"""Small pieces every Ray-side module shares: starting worker actors in placement-group bundles, a worker's CPU share
and a rendezvous address (Ray itself is started by ray_driver.start_ray). Ray is imported inside the functions, so
importing this module never needs Ray."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Callable


def start_actors(cls, n: int, args_of: Callable[[int], tuple], cpus_per_worker: float = 1, gpus_per_worker: float = 0,
                 placement_group=None, first_bundle: int = 0) -> list:
    """n Ray actors of `cls`, actor i built with args_of(i), in bundle first_bundle + i of placement_group (else
    Ray places them); returns once every constructor has run (their models loaded). The actors import the same
    rlfuse as this process (its folder goes first on their PYTHONPATH), and one that reserved no GPU sees none:
    Ray no longer hides the GPUs from it, and run.device=auto must not take a device another worker owns."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    import rlfuse

    src = str(Path(rlfuse.__file__).resolve().parents[1])
    env = {"PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    if not gpus_per_worker:
        env["CUDA_VISIBLE_DEVICES"] = ""
    remote = ray.remote(cls)
    actors = []
    for i in range(n):
        opts = {"num_cpus": cpus_per_worker, "num_gpus": gpus_per_worker, "runtime_env": {"env_vars": env}}
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
