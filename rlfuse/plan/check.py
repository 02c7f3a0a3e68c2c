"""What cannot work, found before anything starts: one line per problem, each naming the group or role and the fix.

`check_placement` returns every problem as a list of strings, and `validate_placement` raises one PlacementError
listing them all. A list, not a raise per rule: a user fixing a layout wants every problem at once rather than one
per launch, and a list lets each rule be tested alone and lets `rlfuse validate` print them without a traceback.

Cluster fit checks only necessary conditions (totals, and each worker on the largest node): Ray's placement groups
do the packing, and a check stricter than Ray's would reject layouts that start fine.
"""

from __future__ import annotations

import difflib
from typing import Callable

from rlfuse.config import is_gpu_share
from rlfuse.errors import UserError
from rlfuse.plan.roles import ROLE_NAMES, Roles
from rlfuse.plan.spec import ClusterResources, PlacementSpec, WorkerGroup

MemoryModel = Callable[[WorkerGroup, PlacementSpec], "int | None"]
"""Predicted peak bytes of one worker of a group of a spec, or None where the model cannot tell (the check is then
skipped)."""


class PlacementError(UserError):
    """A placement that cannot work. `problems` holds one line each; `str()` lists them, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__(f"placement: {len(self.problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in self.problems))


def check_placement(spec: PlacementSpec, roles: Roles, cluster: ClusterResources | None = None,
                    memory_of: MemoryModel | None = None, memory_budget: int | None = None) -> list[str]:
    """Every problem of `spec` for an RL run with `roles`, one line each; [] when it can run.

    Args:
        cluster: what the cluster offers; None skips the resource checks (config validation, before Ray is up).
        memory_of: the planner's memory model, bytes per worker of a group of `spec` (called with both: a worker's
            memory depends on where the other roles sit); None skips the memory check.
        memory_budget: bytes one worker may use (device memory on GPU, the worker's RAM share on CPU).
    """
    problems = _check_groups(spec)
    problems += _check_roles(spec, roles)
    problems += _check_colocation(spec, roles)
    problems += _check_training(spec, roles)
    if cluster is not None and spec.uses_ray:
        problems += check_resources(spec, cluster)
    if memory_of is not None and memory_budget is not None:
        problems += _check_memory(spec, memory_of, memory_budget)
    return problems


def validate_placement(spec: PlacementSpec, roles: Roles, cluster: ClusterResources | None = None,
                       memory_of: MemoryModel | None = None, memory_budget: int | None = None) -> PlacementSpec:
    """`check_placement`, raising one PlacementError with all problems; returns the spec when it can run."""
    problems = check_placement(spec, roles, cluster, memory_of, memory_budget)
    if problems:
        raise PlacementError(problems)
    return spec


def _check_groups(spec: PlacementSpec) -> list[str]:
    """Each group well formed: a unique name, at least one worker and one role, resources Ray can grant."""
    out, seen = [], set()
    if not spec.groups:
        out.append("no worker groups; give at least one group with roles, or use placement.strategy=single")
    for g in spec.groups:
        if g.name in seen:
            out.append(f"group {g.name!r}: the name is used twice; give each group its own name")
        seen.add(g.name)
        if g.workers < 1:
            out.append(f"group {g.name!r}: needs at least 1 worker, got {g.workers}; set its workers to 1 or more")
        if g.cpus_per_worker <= 0:
            out.append(f"group {g.name!r}: cpus_per_worker must be > 0 (its torch threads run there), got "
                       f"{g.cpus_per_worker:g}; set it to 1 or more")
        if not is_gpu_share(g.gpus_per_worker):
            out.append(f"group {g.name!r}: gpus_per_worker={g.gpus_per_worker:g} is neither a fraction of one GPU "
                       f"nor a whole number; set it to e.g. 0.5, 1 or 2")
        if not g.roles:
            out.append(f"group {g.name!r}: runs no role; give it roles or remove it")
        for r in sorted({r for r in g.roles if g.roles.count(r) > 1}):
            out.append(f"group {g.name!r}: lists role {r!r} twice; list it once")
        for r in g.roles:
            if r not in ROLE_NAMES:
                close = difflib.get_close_matches(r, ROLE_NAMES, n=1)
                hint = f"did you mean {close[0]}?" if close else f"roles are {', '.join(ROLE_NAMES)}"
                out.append(f"group {g.name!r}: unknown role {r!r}; {hint}")
    return out


def _check_roles(spec: PlacementSpec, roles: Roles) -> list[str]:
    """Every role of the run placed; no role the run lacks placed (an error, not a warning: it would reserve workers
    for a model that never loads, and usually means the groups were written for another algorithm); a trainable
    role in one group only (its weights and optimiser live in one data-parallel group)."""
    out = []
    for r in roles.names:
        if not spec.groups_of(r):
            out.append(f"role {r!r} has no group; add it to a group's roles")
    for r in spec.roles:
        if r in ROLE_NAMES and r not in roles:
            out.append(f"role {r!r} is placed in group(s) {', '.join(spec.groups_of(r))} but this run has no {r} "
                       f"({_absent_why(r)}); remove it from the groups")
    for r in roles.trainable():
        where = spec.groups_of(r)
        if len(where) > 1:
            out.append(f"role {r!r} trains, so it must live in one group, but is in {', '.join(where)}; keep it in "
                       f"one of them (a group of several workers trains it data-parallel)")
    return out


def _check_training(spec: PlacementSpec, roles: Roles) -> list[str]:
    """Every trainable role trains on the actor's workers (one data-parallel group runs the whole update), and a
    group that trains on several workers gives each its own GPU (NCCL runs one rank per device)."""
    out, home = [], set(spec.groups_of("actor"))
    for r in roles.trainable():
        where = set(spec.groups_of(r))
        shared = roles[r].shares_with == "actor"  # then _check_colocation says it; a role in several groups:
        if r != "actor" and home and len(where) == 1 and where != home and not shared:  # _check_roles does
            out.append(f"role {r!r} trains with the actor, on the actor's workers, but is in {_names(where)} while "
                       f"actor is in {_names(home)}; put {r} in {_names(home)}")
    for g in spec.groups:
        if g.name in home and g.workers > 1 and 0 < g.gpus_per_worker < 1:
            out.append(f"group {g.name!r} trains data-parallel on {g.workers} workers sharing GPUs "
                       f"(gpus_per_worker={g.gpus_per_worker:g}), but NCCL needs one GPU per rank; set its "
                       f"gpus_per_worker to 1 or its workers to 1")
    return out


def _absent_why(role: str) -> str:
    return {"critic": "only rl.algo=ppo has a critic"}.get(role, "not derived from this config")


def _check_colocation(spec: PlacementSpec, roles: Roles) -> list[str]:
    """Roles that share weights (Roles.colocated_groups) must sit in exactly the same groups: otherwise a weight
    that exists once would have to live in two processes."""
    out = []
    for shared in roles.colocated_groups():
        if len(shared) < 2:
            continue
        members = [r for r in roles.names if r in shared]
        anchor = next((r for r in members if roles[r].shares_with is None), members[0])
        home = set(spec.groups_of(anchor))
        if not home:  # an unplaced role is _check_roles's problem
            continue
        for r in members:
            where = set(spec.groups_of(r))
            if r == anchor or where == home or not where:
                continue
            out.append(f"role {r!r} must share {anchor}'s process ({roles[r].why}) but is in "
                       f"{_names(where)} while {anchor} is in {_names(home)}; put {r} in {_names(home)} only")
    return out


def _names(groups: set[str]) -> str:
    return ", ".join(sorted(groups)) or "no group"


def check_resources(spec: PlacementSpec, cluster: ClusterResources) -> list[str]:
    """The CPU and GPU problems of `spec` on `cluster` (check_placement's resource checks)."""
    out = []
    layout = " + ".join(f"{g.workers} x {g.cpus_per_worker:g}" for g in spec.groups)
    if spec.cpus > cluster.cpus:
        out.append(f"the placement needs {spec.cpus:g} CPUs ({spec.workers} workers: {layout}) but the cluster has "
                   f"{cluster.cpus:g}; lower placement.workers or cpus_per_worker, or give Ray more CPUs")
    if spec.gpus > cluster.gpus:
        out.append(f"the placement needs {spec.gpus:g} GPUs but the cluster has {cluster.gpus:g}; lower "
                   f"gpus_per_worker or placement.workers, or set gpus_per_worker=0 to run on CPU")
    biggest_cpus = max((n.cpus for n in cluster.nodes), default=0.0)
    biggest_gpus = max((n.gpus for n in cluster.nodes), default=0.0)
    for g in spec.groups:
        if g.cpus_per_worker > biggest_cpus or g.gpus_per_worker > biggest_gpus:
            out.append(f"group {g.name!r}: one worker needs {g.cpus_per_worker:g} CPU and {g.gpus_per_worker:g} GPU, "
                       f"more than any node has ({biggest_cpus:g} CPU, {biggest_gpus:g} GPU); a worker is one process "
                       f"on one node, so lower its cpus_per_worker/gpus_per_worker")
    return out


def _check_memory(spec: PlacementSpec, memory_of: MemoryModel, budget: int) -> list[str]:
    out = []
    for g in spec.groups:
        need = memory_of(g, spec)
        if need is not None and need > budget:
            out.append(f"group {g.name!r}: predicted {_gib(need)} per worker ({', '.join(g.roles)}) exceeds the "
                       f"{_gib(budget)} budget; move roles to another group, shard it over more workers, or turn on model.lora or "
                       f"rl.gradient_checkpointing")
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
