"""APP's placement strategies (Xiao et al. 2023, arXiv 2312.11819) as constructors over (roles, workers, resources).

Each returns a PlacementSpec that passes `check_placement` for the roles it was given: a constructor moves whole
colocated groups (`Roles.colocated_groups()`), so the LoRA reference stays with the actor and a value head on the
actor stays on its body, whatever the strategy would otherwise do with them.

- single: one process, as before this module existed; no Ray.
- flattened: every role on every worker, time-shared. No device idles, but every worker holds every model.
- interleaved: the independent inference roles (reference, reward) on a "score" group of their own, running
  concurrently with the "train" group (actor, critic, generator).
- separated: the generator on a "generate" group of its own, its weights synced from the "train" group each
  iteration.
"""

from __future__ import annotations

from rlfuse.config import MIN_WORKERS
from rlfuse.errors import UserError
from rlfuse.plan.roles import Roles, derive_roles
from rlfuse.plan.spec import PlacementSpec, WorkerGroup, WorkerResources


def single(roles: Roles) -> PlacementSpec:
    """Every role in the driver's own process (today's path). One worker, nothing to launch."""
    return PlacementSpec("single", (WorkerGroup("main", 1, roles.names),))


def flattened(roles: Roles, workers: int, resources: WorkerResources = WorkerResources(),
              address: str | None = None) -> PlacementSpec:
    """One group "all": every role on every worker, the roles taking turns (generate, score, train).

    Why: no worker ever waits on another stage, and the trainable roles train data-parallel on all workers. The price
    is memory: every worker holds every model, its optimiser states and the KV cache, and the stages cannot overlap.
    """
    _need_workers("flattened", workers)
    return PlacementSpec("flattened", (WorkerGroup("all", workers, roles.names, resources.cpus, resources.gpus),), address)


def interleaved(roles: Roles, workers: int, resources: WorkerResources = WorkerResources(),
                address: str | None = None, score_workers: int | None = None) -> PlacementSpec:
    """Group "train" (actor, critic, generator) and group "score" (reference, reward), running concurrently: the
    reference and reward passes on finished samples overlap generation and training on the other group.

    Split: `score_workers` default max(1, workers // 4), the rest train. Scoring is forward-only (two frozen
    forwards per sample) against the train group's decode plus epochs x (forward + backward) of the actor and
    critic, so a quarter of the workers keeps up with the stream; at least one so the group exists.
    A role colocated with a trainable one (the LoRA reference) stays on "train".
    """
    _need_workers("interleaved", workers)
    score_workers = max(1, workers // 4) if score_workers is None else score_workers
    _need_split("interleaved", "score_workers", score_workers, workers)
    scoring = _movable(roles, {"reference", "reward"})
    if not scoring:
        raise UserError("placement.strategy=interleaved: neither reference nor reward can leave the actor's process, "
                        "so there is nothing to interleave; use placement.strategy=flattened")
    train = tuple(r for r in roles.names if r not in scoring)
    return PlacementSpec("interleaved", (
        WorkerGroup("train", workers - score_workers, train, resources.cpus, resources.gpus),
        WorkerGroup("score", score_workers, tuple(r for r in roles.names if r in scoring), resources.cpus, resources.gpus),
    ), address)


def separated(roles: Roles, workers: int, resources: WorkerResources = WorkerResources(),
              address: str | None = None, generate_workers: int | None = None) -> PlacementSpec:
    """Group "train" (actor, critic, reference, reward) and group "generate" (generator). The generator's weights
    come from the actor by an explicit sync each iteration; the reference and reward passes run on "train" while
    "generate" still decodes, so the train group does not idle during rollout.

    Split: `generate_workers` default max(1, workers // 2): decoding is the longest stage of an RLHF iteration
    (memory-bound, token by token), so it gets half; the train group gets the odd worker, since it holds gradients
    and optimiser states.
    """
    _need_workers("separated", workers)
    generate_workers = max(1, workers // 2) if generate_workers is None else generate_workers
    _need_split("separated", "generate_workers", generate_workers, workers)
    if not _movable(roles, {"generator"}):
        raise UserError("placement.strategy=separated: the generator shares a process with a trainable role, so it "
                        "cannot run on its own workers; use placement.strategy=flattened or interleaved")
    return PlacementSpec("separated", (
        WorkerGroup("train", workers - generate_workers, tuple(r for r in roles.names if r != "generator"),
                    resources.cpus, resources.gpus),
        WorkerGroup("generate", generate_workers, ("generator",), resources.cpus, resources.gpus),
    ), address)


STRATEGY_FNS = {"flattened": flattened, "interleaved": interleaved, "separated": separated}


def spec_from_config(cfg) -> PlacementSpec:
    """The placement of an RL run on `cfg` (a rlfuse.config.Config), roles from `derive_roles(cfg)`. Nothing loads."""
    p, roles = cfg.placement, derive_roles(cfg)
    if p.strategy == "auto":  # planned once, where the plan's micro-batch and migration are applied too
        raise UserError("placement.strategy=auto is planned once before a run (the CLI and the API call "
                        "rlfuse.plan.resolve.resolve, which runs the planner's resolve_auto); a Config used directly: "
                        "pass it through rlfuse.plan.resolve.resolve first")
    if p.strategy == "single":
        return single(roles)
    if p.strategy == "custom":
        return PlacementSpec("custom", tuple(_group_from_config(g, p) for g in p.groups), p.address)
    return STRATEGY_FNS[p.strategy](roles, p.workers, WorkerResources(p.cpus_per_worker, p.gpus_per_worker), p.address)


def _group_from_config(entry: dict, p) -> WorkerGroup:
    """One `placement.groups` entry (validated by rlfuse.config) -> WorkerGroup; resources default to the section's."""
    roles = entry["roles"]
    roles = tuple(r.strip() for r in roles.split(",")) if isinstance(roles, str) else tuple(roles)
    return WorkerGroup(entry["name"], entry["workers"], roles, float(entry.get("cpus_per_worker", p.cpus_per_worker)),
                       float(entry.get("gpus_per_worker", p.gpus_per_worker)))


def _movable(roles: Roles, wanted: set[str]) -> set[str]:
    """Roles of `wanted` (present in the run) whose whole colocated group is frozen and inside `wanted`, so they can
    move to another group without splitting shared weights."""
    out: set[str] = set()
    for group in roles.colocated_groups():
        if group <= wanted and not any(roles[r].trainable for r in group):
            out |= group
    return out


def _need_workers(strategy: str, workers: int) -> None:
    least = MIN_WORKERS[strategy]
    if workers < least:
        raise UserError(f"placement.strategy={strategy} needs at least {least} workers, got {workers}; "
                        f"set placement.workers={least} or more" + (" or use placement.strategy=single" if least > 1 else ""))


def _need_split(strategy: str, name: str, value: int, workers: int) -> None:
    if not 1 <= value <= workers - 1:
        raise UserError(f"placement.strategy={strategy}: {name}={value} must leave both groups at least one of the "
                        f"{workers} workers; pick 1..{workers - 1}")
