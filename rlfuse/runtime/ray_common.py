"""Small pieces every Ray-side module shares: starting worker actors in placement-group bundles (each pinned to its
cores through runtime/process.py) and a node's address for a rendezvous (Ray itself is started by
ray_driver.start_ray). Imported only where a run uses Ray (runtime/backend.py)."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlfuse.config.callables import USER_PATH_ENV
from rlfuse.runtime.process import CORE_OFFSET_ENV, core_offsets


def start_actors(cls, n: int, args_of: Callable[[int], tuple], cpus_per_worker: float = 1, gpus_per_worker: float = 0,
                 placement_group=None, first_bundle: int = 0, pin_cores: bool = False, wait: bool = True) -> list:
    """n Ray actors of `cls`, actor i built with args_of(i), in bundle first_bundle + i of placement_group (else
    Ray places them); returns once every constructor has run (their models loaded), or at once with wait=False
    (then wait_ready: several groups' workers start side by side). The actors import the same
    rlfuse as this process (its folder goes first on their PYTHONPATH), and one that reserved no GPU sees none:
    Ray no longer hides the GPUs from it, and run.device=auto must not take a device another worker owns.
    pin_cores: each actor's threads keep to its own whole cores of its node (core_offsets; pin_threads applies it);
    without a placement group the actors are taken to share one node."""
    src = str(Path(__file__).resolve().parents[2])  # the folder holding this rlfuse package
    env = {"PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           USER_PATH_ENV: os.getcwd()}  # a reward package beside the driver's folder imports there too (last)
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
    return wait_ready(actors) if wait else actors


def wait_ready(actors: list) -> list:
    """Block until every actor's constructor has run (raising its error if one failed); returns the actors."""
    ray.get([a.ready.remote() for a in actors])  # models loaded: later timings (weight sync) exclude the start
    return actors


def node_address() -> str:
    """This process's node IP as Ray sees it (reachable from the other nodes of the cluster)."""
    return ray.util.get_node_ip_address()


@dataclass(frozen=True)
class StoredTensor:
    """A tensor the way Ray's object store hands it back without a copy: its bytes as a NumPy array (a reader maps
    NumPy arrays in place, where a pickled torch tensor is unpickled into a fresh copy: on SmolLM2 the driver's pull
    of the trained weights held 540 MiB more for it), with the dtype and shape to view them as."""
    data: np.ndarray
    dtype: torch.dtype
    shape: tuple[int, ...]


def put_tensors(named: dict[str, torch.Tensor]):
    """ray.put of named tensors as StoredTensors (host memory, any dtype: bf16 goes as its bytes): the object's
    readers view its pages instead of copying them (tensors_of)."""
    stored = {}
    for name, t in named.items():
        t = t.detach().cpu().contiguous()
        stored[name] = StoredTensor(t.reshape(-1).view(torch.uint8).numpy(), t.dtype, tuple(t.shape))
    return ray.put(stored)


def tensors_of(stored) -> dict[str, torch.Tensor]:
    """The named tensors of a put_tensors object (read-only views on the object store's pages: copy from them,
    never into them); plain tensors (a dict or (name, tensor) pairs handed over in-process) pass through."""
    out = {}
    with warnings.catch_warnings():  # the store's arrays are read-only, and only ever read
        warnings.simplefilter("ignore", UserWarning)
        for name, s in (stored.items() if isinstance(stored, dict) else stored):
            out[name] = (torch.from_numpy(s.data).view(s.dtype).view(s.shape) if isinstance(s, StoredTensor)
                         else s)
    return out
