"""The placement spec: worker groups, the resources of each worker, and the roles each group runs. Plain data, no
torch, no Ray: it is built from the config (strategies.py), checked against roles and a cluster (check.py), printed
in the report, and only then applied by the Ray launcher.

A worker is one process. Groups own disjoint workers, numbered in group order (`worker_ranks`): a group of 2 after
a group of 2 holds workers 2 and 3. All roles of a group live in each of its workers' processes and time-share it;
different groups run concurrently.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerResources:
    """What one worker process reserves from Ray: logical CPUs (its torch threads are pinned to this share) and GPUs
    (fractions below 1 share a device; above 1 must be whole, as Ray requires)."""
    cpus: float = 1.0
    gpus: float = 0.0


@dataclass(frozen=True)
class WorkerGroup:
    name: str
    """Unique name, used in messages, metrics (per-worker time and memory) and the launcher's actor names."""
    workers: int
    """Processes in the group; a trainable role in it trains data-parallel over them."""
    roles: tuple[str, ...]
    """Role names (rlfuse.plan.roles.ROLE_NAMES) every worker of the group holds."""
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0

    @property
    def cpus(self) -> float:
        return self.workers * self.cpus_per_worker

    @property
    def gpus(self) -> float:
        return self.workers * self.gpus_per_worker

    @property
    def resources(self) -> WorkerResources:
        return WorkerResources(self.cpus_per_worker, self.gpus_per_worker)


@dataclass(frozen=True)
class PlacementSpec:
    strategy: str
    """single | flattened | interleaved | separated | custom (explicit groups from the config)."""
    groups: tuple[WorkerGroup, ...]
    address: str | None = None
    """Ray cluster address; None starts a local Ray (`ray.init()`). Unused by the single strategy."""

    @property
    def uses_ray(self) -> bool:
        """The single strategy is today's one process: nothing to launch, Ray never imported."""
        return self.strategy != "single"

    @property
    def workers(self) -> int:
        return sum(g.workers for g in self.groups)

    @property
    def cpus(self) -> float:
        return sum(g.cpus for g in self.groups)

    @property
    def gpus(self) -> float:
        return sum(g.gpus for g in self.groups)

    @property
    def roles(self) -> tuple[str, ...]:
        """Every placed role once, in first-placed order."""
        return tuple(dict.fromkeys(r for g in self.groups for r in g.roles))

    def group(self, name: str) -> WorkerGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def groups_of(self, role: str) -> tuple[str, ...]:
        """Names of the groups holding `role`: one for a trainable role (the checker enforces it), possibly several
        for a frozen one (each group keeps a replica for its own passes)."""
        return tuple(g.name for g in self.groups if role in g.roles)

    def worker_ranks(self, name: str) -> range:
        """Global worker indices of a group: groups are laid out in order on consecutive ranks."""
        start = 0
        for g in self.groups:
            if g.name == name:
                return range(start, start + g.workers)
            start += g.workers
        raise KeyError(name)

    def describe(self) -> str:
        """The layout as the report and `rlfuse validate` print it."""
        where = f" on Ray at {self.address}" if self.address else (" on a local Ray" if self.uses_ray else "")
        lines = [f"placement: {self.strategy}, {self.workers} worker(s){where}"]
        for g in self.groups:
            ranks = self.worker_ranks(g.name)
            lines.append(f"  {g.name:<9} workers {ranks.start}..{ranks.stop - 1}  "
                         f"({g.workers} x {g.cpus_per_worker:g} CPU, {g.gpus_per_worker:g} GPU)  {', '.join(g.roles)}")
        return "\n".join(lines)


def available_memory() -> int | None:
    """Bytes of RAM this machine can still give (MemAvailable of /proc/meminfo); None where that is not known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(frozen=True)
class NodeResources:
    cpus: float
    gpus: float = 0.0


@dataclass(frozen=True)
class ClusterResources:
    """What the cluster offers, node by node (a worker is one process, so it must fit on one node). The Ray layer
    fills it from `ray.nodes()`; tests and the planner build it by hand."""
    nodes: tuple[NodeResources, ...]

    @classmethod
    def one_node(cls, cpus: float, gpus: float = 0.0) -> "ClusterResources":
        return cls((NodeResources(cpus, gpus),))

    @classmethod
    def this_machine(cls) -> "ClusterResources | None":
        """This machine as the one node a local Ray would have: the cores this process may run on and the NVIDIA
        GPUs it sees (device files, narrowed by CUDA_VISIBLE_DEVICES), read without torch or Ray. None where the
        GPUs cannot be told that way (a driver without device files, as under WSL2)."""
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        gpus = len([d for d in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", d)]) if os.path.isdir("/dev") else 0
        if not gpus and shutil.which("nvidia-smi"):
            return None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            gpus = min(gpus, len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"]))
        return cls.one_node(float(cpus), float(gpus))

    @property
    def cpus(self) -> float:
        return sum(n.cpus for n in self.nodes)

    @property
    def gpus(self) -> float:
        return sum(n.gpus for n in self.nodes)


def dp_micro_size(mini_batch: int, micro_batch: int, ranks: int) -> int:
    """Micro-batch size each of `ranks` data-parallel ranks trains with (learn/batches.py micro_batches, and the
    planner): rl.micro_batch_size, or smaller where a mini-batch has fewer micro-batches of it than there are ranks
    (one micro-batch of 16 over 2 ranks: one of 8 each), so that no rank only pads."""
    return min(micro_batch, mini_batch, -(-mini_batch // max(1, ranks)))
