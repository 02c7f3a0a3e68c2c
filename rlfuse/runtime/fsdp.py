"""FSDP2 training on the Ray training workers (rl.train_parallel=fsdp): torch's `fully_shard` on each transformer
block of the trainable roles and at their root, on the process group the workers already form (gloo on CPU, NCCL on
GPU), with sharded checkpoints through torch.distributed.checkpoint (DCP). Nothing here is ours but the wiring:
which modules are shard groups, when the shards are gathered, and where the checkpoint's files go.

Each rank holds 1/world of the actor's (and critic's) weights, gradients and AdamW states, and of the frozen
reference where it holds one. A micro-batch's forward
all-gathers one block at a time and frees it after; its backward reduce-scatters the block's gradient into the
shards (every micro-batch: keeping whole gradients across micro-batches is what sharding is there to avoid). The
loss is computed inside the root's forward (data_parallel.TrainableRoles), as for DDP, so the root's own
parameters (embeddings, final norm, LM head, value head) are gathered before the RL log-probs read them.

Rollouts need whole weights: the engine decodes the actor and the scorer runs the critic and the actor's log-probs
on every worker independently, in whatever order samples finish, which collectives cannot follow. So the training
ranks gather the shard groups once per iteration, when the weights go to the generators (`gather`: one collective,
all ranks at once), decode and score on the whole weights, and free them before the update (`shard_again`): the rank
holds whole weights only while it decodes and scores, never beside whole gradients and optimiser states. Where the
ranks score with the critic they train (flattened), the actor alone is gathered for decoding and the fused reward,
and the frozen reference (sharded too) and the critic after it, each freeing the one before, for one pass each over
the iteration's samples (Scorer.deferred): no two models are ever whole together. Where no rank needs the whole
actor at all (none decodes, and those that score defer the reference: separated), nothing is gathered whole for
the rollout: the generators' weights leave the shards a tensor at a time (ray_train.TrainWorker.streamed_weights). It is FSDP1's summon_full_params and veRL's hybrid engine, on FSDP2's unshard.

Two things FSDP's collectives need that DDP does not: every rank must run the same forwards of the same blocks in
the same order, so a micro-batch slot runs prefix-shared (the body twice: prompts, then responses) on every rank or
on none (learn/update.py decides it per slot from all ranks' micro-batches: `same_forwards`); and which module is
the root is fixed by a first forward through it (`shard`), before any block runs alone in a rollout.

Imports no Ray: ray_train.py's TrainWorker builds a ShardedGroup once its process group is joined.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from rlfuse.errors import UserError
from rlfuse.runtime.data_parallel import DataParallelGroup, TrainableRoles

SHARDS_SUFFIX = ".shards"
"""The DCP folder of a sharded checkpoint sits beside its checkpoint.pt: checkpoint.pt.shards-<iteration>."""

STATE_OPTIONS = StateDictOptions(ignore_frozen_params=True)
"""Checkpoint what trains (with LoRA: the adapters), as learn/checkpoint.py does for replicas."""


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks fully_shard wraps one by one: the modules whose class the transformers model names in
    `_no_split_modules` (LlamaDecoderLayer, GPT2Block, ...), found through a peft wrapper or a ValueModel's body."""
    names: set[str] = set()
    for m in module.modules():
        names |= set(getattr(m, "_no_split_modules", None) or ())
    return [m for m in module.modules() if type(m).__name__ in names]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A shard's whole tensor (an all-gather: every rank calls it), or the tensor itself where it is not sharded."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def whole_trainable_state(module: nn.Module | None) -> dict | None:
    """{name: whole CPU tensor} of what trains, gathered one tensor at a time (every rank calls it together)."""
    if module is None:
        return None
    return {n: full_tensor(p.detach()).cpu().clone() for n, p in module.named_parameters() if p.requires_grad}


def unique_state(module: nn.Module) -> dict:
    """module.state_dict() with a tied weight once, under its first name (models/weights.merged_state_dict's keys
    for a model without LoRA), its sharded tensors as DTensors: what a weight sync sends, read without gathering.
    The same keys in the same order on every rank."""
    named = {n for n, _ in module.named_parameters()}  # tied parameters once
    tied = {n for n, _ in module.named_parameters(remove_duplicate=False)} - named
    return {k: v for k, v in module.state_dict().items() if k not in tied}


@dataclass
class ShardedGroup(DataParallelGroup):
    """DataParallelGroup's interface (learn/update.py optimise) over FSDP2 shards instead of DDP replicas."""
    gathered: bool = False
    """Between gather() and shard_again(): every shard group's whole parameters are registered on its modules."""
    same_forwards = True  # each block's forward all-gathers: a prefix-shared forward (two passes) on one rank only
                          # would leave the other waiting
    _mesh: object = field(default=None, repr=False)
    frozen: list = field(default_factory=list, repr=False)
    """The frozen roles' roots (shard_frozen), gathered with the actor for the rollout."""

    def shard(self, module_sets: list[list[nn.Module]]) -> None:
        """fully_shard each set's blocks, then its root (a TrainableRoles over the set): every rank at once. Every
        rank starts from rank 0's weights (LoRA's initialisation differs per process), as DDP's wrap does. The
        optimisers must be built after this: the modules' parameters are now the shards."""
        self._mesh = init_device_mesh(self.device.type, (self.world,))
        for modules in module_sets:
            for m in modules:
                for t in m.state_dict().values():
                    dist.broadcast(t, 0)
            for block in [b for m in modules for b in transformer_blocks(m)]:
                fully_shard(block, mesh=self._mesh)
            root = TrainableRoles(modules)
            fully_shard(root, mesh=self._mesh)
            with torch.no_grad():  # FSDP takes the first module to run forward as the root: this one, not a block
                root(lambda: None)  # that a rollout runs alone
            root.reshard()
            self._wrapped[tuple(id(m) for m in modules)] = root

    def shard_frozen(self, modules: list[nn.Module]) -> list[TrainableRoles]:
        """Frozen roles held beside the trained ones (the reference): sharded too, gathered whole for the rollout's
        scoring with the actor (begin_rollout) and in shards through the update, which never runs them. Every rank
        loaded them from the same folder, so nothing is broadcast; they are not checkpointed (they reload from it).
        -> their roots, to gather."""
        roots = []
        for m in modules:
            for block in transformer_blocks(m):
                fully_shard(block, mesh=self._mesh)
            root = TrainableRoles([m])
            fully_shard(root, mesh=self._mesh)
            with torch.no_grad():
                root(lambda: None)
            root.reshard()
            roots.append(root)
        self.frozen += roots
        return roots

    def wrap(self, modules: list[nn.Module]) -> TrainableRoles:
        return self._wrapped[tuple(id(m) for m in modules)]

    @property
    def roots(self) -> list[TrainableRoles]:
        """Every shard group's root: the trained sets', then the frozen roles'."""
        return list(self._wrapped.values()) + self.frozen

    def micro_batch(self, modules: list[nn.Module], sync: bool):
        """As DataParallelGroup.micro_batch; every micro-batch's backward reduce-scatters (sync is not needed)."""
        return self._run_in_root(self.wrap(modules))

    def gather(self, roots: list[TrainableRoles] | None = None) -> None:
        """Every shard group's (or those of `roots`') whole parameters, all-gathered and kept registered on the
        modules (and their blocks' forwards told not to free them) until shard_again: the rollout's decoding and
        scoring then run on whole weights with no collective. A collective: every training rank calls it at once."""
        if self.gathered:
            return
        for module in self._fsdp_modules(roots):
            module.set_reshard_after_forward(False, recurse=False)
            module.unshard()
        self.gathered = True

    def shard_again(self) -> None:
        """Free the whole parameters gather() kept; blocks free theirs after each forward again (the root keeps its
        own until the backward, FSDP's default). The rollout's forwards, each rank's own number of them, are also
        forgotten (reset_iter_state: FSDP records every forward's order to prefetch in the backward, and order left
        over from a rollout made the ranks' first backward prefetch different blocks: a deadlock in the collectives)."""
        if not self.gathered:
            return
        roots = {id(r) for r in self.roots}
        for root in self.roots:
            root.reset_iter_state()  # also reshards every group, freeing the whole parameters
        for module in self._fsdp_modules():
            module.set_reshard_after_forward(id(module) not in roots, recurse=False)
        self.gathered = False

    def _fsdp_modules(self, roots: list[TrainableRoles] | None = None) -> list[FSDPModule]:
        return [m for root in (self.roots if roots is None else roots) for m in root.modules()
                if isinstance(m, FSDPModule)]


# ------------------------------------------------------------------------------------------- checkpoints


def shards_folder(path: Path, iteration: int) -> Path:
    return path.with_name(f"{path.name}{SHARDS_SUFFIX}-{iteration:06d}")


def _sets_state(group: ShardedGroup, learner_sets: list) -> dict:
    """{"set<i>": {"model", "optim"}}: each shard group's trainable weights and its learners' optimiser states, as
    DTensors (DCP writes each rank's shards and records how to put them back together)."""
    state = {}
    for i, learners in enumerate(learner_sets):
        root = group.wrap([learner.module for learner in learners])
        model, optim = get_state_dict(root, [learner.opt for learner in learners], options=STATE_OPTIONS)
        state[f"set{i}"] = {"model": model, "optim": optim}
    return state


def save_shards(path: Path, iteration: int, group: ShardedGroup, learner_sets: list) -> str:
    """Every rank writes its shards of the weights and optimiser states of `iteration` into a new DCP folder beside
    the checkpoint (a collective); returns the folder's name, which rank 0's checkpoint.pt then records. The folder
    is written under .tmp and renamed by rank 0 once complete: a kill while writing leaves the previous checkpoint's
    folder, which its checkpoint.pt still names."""
    final = shards_folder(path, iteration)
    tmp = final.with_name(final.name + ".tmp")
    if group.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a killed save's; the other ranks write only after the planning
        # collective inside dcp.save, which waits for rank 0
    try:
        dcp.save(_sets_state(group, learner_sets), checkpoint_id=str(tmp))
    except Exception:
        full = disk_full(tmp)
        if full is None:
            raise
        raise full from None
    dist.barrier()
    if group.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    dist.barrier()
    return final.name


DISK_NEARLY_FULL = 64 * 2**20
"""Free bytes under which a failed checkpoint write is taken for a full disk."""


def disk_full(folder: Path) -> OSError | None:
    """An OSError(ENOSPC) for `folder` if its file system has under DISK_NEARLY_FULL bytes free, else None. DCP's
    writer reports a full disk as a failed zip write (a RuntimeError inside a CheckpointException, not ENOSPC), which
    the driver would print as a traceback; as an OSError it is the one line every full disk gets (errors.os_error_line),
    and --resume goes on from the previous checkpoint, which the failed write left in place."""
    free = shutil.disk_usage(folder.parent).free
    if free >= DISK_NEARLY_FULL:
        return None
    return OSError(errno.ENOSPC, f"No space left on device ({free // 2**20} MiB free while writing the sharded "
                   "checkpoint)", str(folder))


def load_shards(folder: Path, group: ShardedGroup, learner_sets: list) -> None:
    """Every rank reads its shards of a save_shards folder into the sharded modules and their optimisers (DCP
    reshards them if the checkpoint was written by another number of ranks)."""
    if not (folder / ".metadata").exists():
        raise UserError(f"{folder}: the sharded checkpoint's folder is missing or incomplete; go back one checkpoint "
                        f"(checkpoint.pt.prev) or start the RL stage again")
    state = _sets_state(group, learner_sets)  # the current states: DCP loads into their shapes and placements
    dcp.load(state, checkpoint_id=str(folder))
    for i, learners in enumerate(learner_sets):
        root = group.wrap([learner.module for learner in learners])
        set_state_dict(root, [learner.opt for learner in learners], model_state_dict=state[f"set{i}"]["model"],
                       optim_state_dict=state[f"set{i}"]["optim"], options=STATE_OPTIONS)


def remove_unreferenced_shards(path: Path, keep: set[str]) -> None:
    """Remove the DCP folders beside `path` that no kept checkpoint (checkpoint.pt, checkpoint.pt.prev) names."""
    for folder in path.parent.glob(f"{path.name}{SHARDS_SUFFIX}-*"):
        if folder.name not in keep:
            shutil.rmtree(folder, ignore_errors=True)
