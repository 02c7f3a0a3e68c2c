"""Data-parallel training groups: DataParallelGroup (torch's DistributedDataParallel over full replicas) is what
learn/update.py `optimise(group=...)` calls on one rank; rlfuse/runtime/fsdp.py ShardedGroup is the same interface on
FSDP2 shards. Neither imports Ray: the Ray workers (ray_train.py) build them once their process group is joined.

How the RL losses meet DDP (and FSDP): DDP reduces the gradients of a backward that follows its own forward, and the
RL log-probs never call the model's forward (response_logprobs runs the body and the LM head apart, to keep the
(B, T, V) logits out of memory). So the trainable modules sit in a `TrainableRoles` container whose forward runs the
micro-batch loss function it is given: the loss is computed inside DDP's forward, DDP's hooks see every gradient.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rlfuse.errors import UserError
from rlfuse.plan.cost import DDP_BUCKET_BYTES

DEFAULT_BUCKET_BYTES = DDP_BUCKET_BYTES  # the planner's cost model counts the same buckets
"""Gradient all-reduce and weight-sync buckets: large enough to amortise a collective's latency, small enough that
one extra bucket of memory does not matter."""


class TrainableRoles(torch.nn.Module):
    """The modules one optimise() call trains (the actor, with a value head on its body; or the critic), as one
    module for DDP (or FSDP's root). forward(loss_of, *args) = loss_of(*args): the loss is built inside DDP's
    forward."""

    def __init__(self, modules: list[torch.nn.Module]):
        super().__init__()
        self.roles = torch.nn.ModuleList(modules)

    def forward(self, loss_of, *args):
        return loss_of(*args)


@dataclass
class DataParallelGroup:
    """This rank's view of the training group; what learn/update.py `optimise(group=...)` calls."""
    rank: int
    world: int
    device: torch.device
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    loss_scale: float | None = None
    """What each micro-batch loss is multiplied by before backward; None: world. DDP averages gradients over ranks,
    and the micro-batch losses are already scaled by their share of the whole mini-batch (learn/batches.py micro_batches),
    so the sum over ranks is the single-process gradient: world x DDP's mean. (Tests set 1 to show the mean is
    the wrong weighting.)"""
    same_forwards = False
    """Whether every rank must run the same module forwards in each micro-batch slot (FSDP's per-block collectives):
    optimise then decides each slot's prefix sharing for all ranks alike. DDP reduces once per backward."""
    _wrapped: dict = field(default_factory=dict, repr=False)
    _trained: dict = field(default_factory=dict, repr=False)

    def wrap(self, modules: list[torch.nn.Module], trained: list[torch.nn.Parameter] | None = None,
             holder: torch.nn.Module | None = None) -> DistributedDataParallel:
        """DDP over these modules, built once per set (every rank builds its sets in the same order, as
        learn/update.py's update calls them). Building broadcasts rank 0's parameters and buffers: LoRA's random init differs per
        process, so every rank starts from rank 0's replica.

        trained: what this set trains when that is not every trainable parameter of `modules` (model.shared_base:
        the actor's and the critic's adapters live on one peft model, and each role's backward reaches only its own);
        DDP then reduces and broadcasts these alone, and `holder` (the shared base) joins the root where it holds
        tensors the modules do not register (the critic's adapter under its AdapterValueModel)."""
        key = tuple(id(m) for m in modules)
        if key not in self._wrapped:
            root = TrainableRoles(modules + ([holder] if holder is not None and holder not in modules else []))
            if trained is not None:
                self._trained[key] = trained
                mine = {id(p) for p in trained}
                # every rank loads the frozen base and the other role's adapter from the same files (or gets them
                # from the other set's DDP): only this set's tensors are rank 0's to broadcast and everyone's to reduce
                ignore = [n for n, p in root.named_parameters() if id(p) not in mine]
                DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                    root, ignore + [n for n, _ in root.named_buffers()])
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self._wrapped[key] = DistributedDataParallel(root, device_ids=device_ids,
                                                         bucket_cap_mb=self.bucket_bytes / 2**20,
                                                         forward_sync_buffers=False)
        return self._wrapped[key]

    @contextlib.contextmanager
    def micro_batch(self, modules: list[torch.nn.Module], sync: bool):
        """Around one micro-batch's forward and backward: yields `run(loss_of, *args)`, which computes the loss
        inside DDP's forward and returns (loss x loss_scale, stats). sync=False (all but a mini-batch's last
        micro-batch) accumulates locally; the last one all-reduces."""
        ddp = self.wrap(modules)
        with contextlib.nullcontext() if sync else ddp.no_sync(), self._run_in_root(ddp) as run:
            yield run

    @contextlib.contextmanager
    def _run_in_root(self, root: torch.nn.Module):
        """Yields run(loss_of, *args): the loss computed inside root's forward, returned x loss_scale, with stats."""
        scale = self.world if self.loss_scale is None else self.loss_scale

        def run(loss_of, *args):
            loss, stats = root(loss_of, *args)
            return loss * scale, stats

        yield run

    def check_all_used(self, modules: list[torch.nn.Module]) -> None:
        """After a mini-batch's backward: every trainable parameter got a gradient. DDP (find_unused_parameters off,
        which saves a graph walk per forward) would otherwise fail at the next mini-batch with a message that does
        not name the parameter."""
        trained = self._trained.get(tuple(id(m) for m in modules))
        if trained is None:
            trained = [p for m in modules for p in m.parameters() if p.requires_grad]
        root = self.wrap(modules)
        names = {id(p): n for n, p in getattr(root, "module", root).named_parameters()}  # DDP wraps the root
        unused = [names[id(p)] for p in trained if p.grad is None]
        if unused:
            raise UserError(f"data-parallel training: {len(unused)} trainable parameter(s) get no gradient from the "
                            f"RL losses (first: {unused[0]}); freeze them or train with placement.strategy=single")

    def all_finite(self, finite: bool) -> bool:
        """True on every rank iff every rank's losses were finite: one rank's NaN skips the step on all."""
        flag = torch.tensor([int(finite)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # note: a host sync, once per mini-batch
        return bool(flag.item())

    def sum_stats(self, sums: dict, count: int) -> tuple[dict, int]:
        """Per-micro-batch stat sums and counts over all ranks (a rank may have had no micro-batch: no keys)."""
        mine = ({k: float(v) for k, v in sums.items()}, count)
        gathered = [None] * self.world
        dist.all_gather_object(gathered, mine)
        total: dict = {}
        for part, _ in gathered:
            for k, v in part.items():
                total[k] = total.get(k, 0.0) + v
        return total, sum(c for _, c in gathered)
