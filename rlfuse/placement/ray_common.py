"""Small pieces every Ray-side module shares: a worker's CPU share and a rendezvous address (Ray itself is started by
ray_driver.start_ray). Ray is imported inside the functions, so importing this module never needs Ray."""

from __future__ import annotations

import os
import socket


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
