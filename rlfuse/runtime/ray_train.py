"""Data-parallel training on Ray: one process per rank, joined in a torch.distributed group (gloo on CPU, NCCL on
GPU), the trainable roles wrapped in torch's DistributedDataParallel. Every rank holds a full replica of the
trainable roles (actor; critic for PPO), runs its share of each mini-batch's micro-batches through the same update
functions as one process (learn/update.py `update`, with `group=`), and DDP all-reduces the gradients in buckets
during the last micro-batch's backward, so an update equals the single-process update on the same experience.
Rank 0 sends the actor's merged weights to generators in buckets through the object store, and saves the same
checkpoint file as learn/checkpoint.py (with full replicas it is the whole checkpoint; FSDP2's sharded states and
torch.distributed.checkpoint are for models that do not fit one worker).

How the RL losses meet DDP: DDP reduces the gradients of a backward that follows its own forward, and the RL
log-probs never call the model's forward (response_logprobs runs the body and the LM head apart, to keep the
(B, T, V) logits out of memory). So the trainable modules sit in a `TrainableRoles` container whose forward runs the
micro-batch loss function it is given: the loss is computed inside DDP's forward, DDP's hooks see every gradient.

Imports Ray: only a placement on Ray workers imports this module (runtime/backend.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import ray
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rlfuse.config import Config
from rlfuse.errors import UserError
from rlfuse.files import atomic_path, write_text_atomic
from rlfuse.learn.checkpoint import (CHECKPOINT_KEYS, checkpoint_parts, load_checkpoint, save_checkpoint, save_torch,
                                     trainable_state)
from rlfuse.learn.learners import build_learners, learner_sets
from rlfuse.learn.update import BadSteps, update
from rlfuse.models.build import build_models
from rlfuse.models.device import pick_device, seed_everything
from rlfuse.models.weights import merged_state_dict
from rlfuse.plan.cost import DDP_BUCKET_BYTES
from rlfuse.rollout.fusion import Experience
from rlfuse.rollout.weights import weight_buckets
from rlfuse.runtime.pipeline import build_pipeline, schedule_record
from rlfuse.runtime.process import free_port, pin_threads
from rlfuse.runtime.ray_common import node_address, start_actors

DEFAULT_BUCKET_BYTES = DDP_BUCKET_BYTES  # the planner's cost model counts the same buckets
"""Gradient all-reduce and weight-sync buckets: large enough to amortise a collective's latency, small enough that
one extra bucket of memory does not matter."""


# ------------------------------------------------------------------------------------------- collectives


class TrainableRoles(torch.nn.Module):
    """The modules one optimise() call trains (the actor, with a value head on its body; or the critic), as one
    module for DDP. forward(loss_of, *args) = loss_of(*args): the loss is built inside DDP's forward."""

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
    _wrapped: dict = field(default_factory=dict, repr=False)

    def wrap(self, modules: list[torch.nn.Module]) -> DistributedDataParallel:
        """DDP over these modules, built once per set (every rank builds its sets in the same order, as
        learn/update.py's update calls them). Building broadcasts rank 0's parameters and buffers: LoRA's random init differs per
        process, so every rank starts from rank 0's replica."""
        key = tuple(id(m) for m in modules)
        if key not in self._wrapped:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self._wrapped[key] = DistributedDataParallel(TrainableRoles(modules), device_ids=device_ids,
                                                         bucket_cap_mb=self.bucket_bytes / 2**20,
                                                         forward_sync_buffers=False)
        return self._wrapped[key]

    @contextlib.contextmanager
    def micro_batch(self, modules: list[torch.nn.Module], sync: bool):
        """Around one micro-batch's forward and backward: yields `run(loss_of, *args)`, which computes the loss
        inside DDP's forward and returns (loss x loss_scale, stats). sync=False (all but a mini-batch's last
        micro-batch) accumulates locally; the last one all-reduces."""
        ddp = self.wrap(modules)
        scale = self.world if self.loss_scale is None else self.loss_scale

        def run(loss_of, *args):
            loss, stats = ddp(loss_of, *args)
            return loss * scale, stats

        with contextlib.nullcontext() if sync else ddp.no_sync():
            yield run

    def check_all_used(self, modules: list[torch.nn.Module]) -> None:
        """After a mini-batch's backward: every trainable parameter got a gradient. DDP (find_unused_parameters off,
        which saves a graph walk per forward) would otherwise fail at the next mini-batch with a message that does
        not name the parameter."""
        unused = [n for m in modules for n, p in m.named_parameters() if p.requires_grad and p.grad is None]
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


# ------------------------------------------------------------------------------------------- weight sync


@dataclass
class WeightRefs:
    """The actor's merged weights as object-store buckets (each a dict name -> CPU tensor), with what sending cost."""
    refs: list
    bytes: int
    seconds: float


# ------------------------------------------------------------------------------------------- the worker


class TrainWorker:
    """One rank of data-parallel training (a Ray actor; start them with start_train_workers)."""

    def __init__(self, cfg: Config, run_dir: str, rank: int, world: int, threads: int = 1,
                 keep: tuple[str, ...] = ()):
        pin_threads(threads)
        seed_everything(cfg.run.seed)
        self.cfg, self.rank, self.world, self.run_dir = cfg, rank, world, Path(run_dir)
        self.device = pick_device(cfg.run)
        # build_models loads every role; a trainer keeps the trainable ones (actor, critic) and those in `keep`
        # ("generator", "ref", "reward_fn": a worker that also decodes or scores) and lets the rest go. One loader,
        # so every role is built exactly as in one process.
        models = build_models(cfg, Path(run_dir), self.device)
        for name in {"generator", "ref", "reward_fn"} - set(keep):
            setattr(models, name, None)
        self.models, self.learners = models, build_learners(models, cfg.rl)
        self.group: DataParallelGroup | None = None
        self.pipeline = None  # rl.train_parallel=pipeline_*: this rank's stages (rlfuse/runtime/pipeline.py)

    def ready(self) -> bool:
        """Returns once the actor is built (its models loaded): Ray runs __init__ before any other call."""
        return True

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: the TCP address every rank joins at (this node's IP, a free port)."""
        return node_address(), free_port()

    def join(self, host: str, port: int, timeout_s: float = 300) -> None:
        """Join the process group (every rank at once: the call blocks until all have joined), then copy rank 0's
        weights everywhere."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=timeout_s))
        if self.cfg.rl.train_parallel.startswith("pipeline"):  # stages instead of replicas: no DDP
            self.pipeline = build_pipeline(self.models.actor, self.models.critic, self.cfg.rl,
                                           self.cfg.rl.train_parallel, self.models.tokenizer.pad_token_id)
            return
        self.group = DataParallelGroup(self.rank, self.world, self.device)

        for learners in learner_sets(self.learners):  # DDP copies rank 0's weights to every rank as it wraps
            self.group.wrap([learner.module for learner in learners])

    def update(self, exp: Experience, adv, returns, kl_coef: float, batches: list[list[int]], bad: BadSteps,
               temperature: float | None = None) -> dict:
        """One update on this rank's share of the experience (sampled at `temperature`, None: rl.temperature); every
        rank returns the same {"stats", "bad"}."""
        t = time.perf_counter()
        if self.pipeline is not None:
            stats = self.pipeline.update(exp, adv, returns, kl_coef, batches, bad, temperature)
            self.pipeline.sync_whole_models()  # rank 0 hands out, evaluates and saves the whole models
            if self.rank == 0:  # the last update's schedule, executed and simulated, for the report
                self._save_schedule()
            return {"stats": stats, "bad": bad, "seconds": time.perf_counter() - t}
        stats = update(self.models, self.learners, exp, adv, returns, self.cfg.rl, kl_coef, batches, bad,
                       temperature=temperature, group=self.group)
        return {"stats": stats, "bad": bad, "seconds": time.perf_counter() - t}

    def _save_schedule(self) -> None:
        pipe = self.pipeline
        record = schedule_record(pipe.last_spans, pipe.last_schedules, pipe.world, pipe.mode)
        write_text_atomic(self.run_dir / "rl" / "pipeline_schedule.json", json.dumps(record))

    def actor_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, role: str = "actor") -> WeightRefs:
        """The actor's (or role="critic": the critic's) merged weights (models/weights.merged_state_dict) in
        object-store buckets (rank 0 is enough: every rank holds the same replica)."""
        t, refs, nbytes = time.perf_counter(), [], 0
        for bucket in weight_buckets(merged_state_dict(getattr(self.models, role)), bucket_bytes):
            bucket = {k: v.detach().cpu() for k, v in bucket.items()}  # the object store holds host memory
            nbytes += sum(v.numel() * v.element_size() for v in bucket.values())
            refs.append(ray.put(bucket))  # serialised now: later steps cannot change what was sent
        return WeightRefs(refs, nbytes, time.perf_counter() - t)

    def save_stage_state(self, path: str, iteration: int) -> None:
        """Pipeline stages: this rank's optimiser states of `iteration`, one file per rank beside the checkpoint
        (checkpoint.pt.stage<rank>), the previous one kept as .prev: a run killed between the ranks' writes and rank
        0's checkpoint resumes from the previous checkpoint with the stage files of its iteration."""
        if self.pipeline is None:
            return
        current = Path(f"{path}.stage{self.rank}")
        if current.exists():
            os.replace(current, current.with_name(current.name + ".prev"))
        with atomic_path(current) as tmp:
            save_torch({"iteration": iteration, "state": self.pipeline.optimizer_state()}, tmp)

    def save_checkpoint(self, path: str, iteration: int, kl_coef: float, counters: dict) -> None:
        """Rank 0 writes learn/checkpoint.py's file (replicas are whole; others return at once)."""
        if self.rank == 0:
            save_checkpoint(Path(path), **dict(zip(CHECKPOINT_KEYS, checkpoint_parts(self.models, self.learners))),
                            iteration=iteration, kl_coef=kl_coef, counters=counters)

    def load_checkpoint(self, path: str) -> dict:
        """Every rank restores the same file; returns its iteration, kl_coef and counters."""
        state = load_checkpoint(Path(path), *checkpoint_parts(self.models, self.learners))
        if self.pipeline is not None:
            self.pipeline.load_optimizer_state(self._stage_state_of(Path(f"{path}.stage{self.rank}"), state["iteration"]))
        return {k: state[k] for k in ("iteration", "kl_coef", "counters")}

    @staticmethod
    def _stage_state_of(current: Path, iteration: int) -> dict:
        """The stage file (this one or the previous) saved at `iteration`, the checkpoint's."""
        for f in (current, current.with_name(current.name + ".prev")):
            if f.exists():
                saved = torch.load(f, weights_only=False)
                if saved.get("iteration") == iteration:
                    return saved["state"]
        raise UserError(f"{current}: no pipeline stage state of the checkpoint's iteration {iteration} (the run was "
                        "stopped while saving it and the previous one is gone); start the RL stage again")

    def trainable_state(self) -> dict:
        """{role: {name: tensor}} of what trains (tests compare ranks and processes with it)."""
        roles = {"actor": self.models.actor, "critic": self.models.critic}
        return {r: {n: t.cpu() for n, t in trainable_state(m).items()} for r, m in roles.items() if m is not None}

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- the driver's handle


@dataclass
class TrainGroup:
    """The driver's handle on the training ranks: step 4 of the RL loop and the trainer side of weight sync."""
    workers: list

    def update(self, exp: Experience, adv, returns, kl_coef: float, batches: list[list[int]], bad: BadSteps,
               temperature: float | None = None) -> tuple[dict, dict, list[float]]:
        """-> (stats, bad counters, seconds per rank) of learn/update.py's update run data-parallel; the experience goes once into
        the object store and every rank reads it from there."""
        exp_ref, adv_ref, ret_ref = ray.put(exp), ray.put(adv), ray.put(returns)
        outs = get_failing_fast([w.update.remote(exp_ref, adv_ref, ret_ref, kl_coef, batches, bad, temperature)
                                 for w in self.workers])
        return outs[0]["stats"], outs[0]["bad"], [o["seconds"] for o in outs]

    def pull_into(self, models) -> None:
        """Rank 0's trainable weights into the driver's own models (its evaluation and the saved model)."""
        for role, state in ray.get(self.workers[0].trainable_state.remote()).items():
            unexpected = getattr(models, role).load_state_dict(state, strict=False).unexpected_keys
            if unexpected:  # a naming mismatch would otherwise save the untrained model
                raise RuntimeError(f"the trained {role} has parameters the driver's {role} lacks: {unexpected[:3]}")

    def actor_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, role: str = "actor") -> WeightRefs:
        return ray.get(self.workers[0].actor_weights.remote(bucket_bytes, role))

    def save_checkpoint(self, path, iteration: int, kl_coef: float, counters: dict) -> None:
        # with pipeline stages every rank saves its own optimiser states first, then rank 0 the checkpoint: a kill
        # in between leaves the previous checkpoint, whose stage files it never reads again (the new ones are newer)
        ray.get([w.save_stage_state.remote(str(path), iteration) for w in self.workers])
        ray.get([w.save_checkpoint.remote(str(path), iteration, kl_coef, counters) for w in self.workers])

    def load_checkpoint(self, path) -> dict:
        return ray.get([w.load_checkpoint.remote(str(path)) for w in self.workers])[0]

    def trainable_states(self) -> list[dict]:
        return ray.get([w.trainable_state.remote() for w in self.workers])

    def shutdown(self, timeout_s: float = 30) -> None:
        """Leave the process group, then end the actors (also those stuck in a collective past timeout_s)."""
        ray.wait([w.shutdown.remote() for w in self.workers], num_returns=len(self.workers), timeout=timeout_s)
        for w in self.workers:
            ray.kill(w)


def get_failing_fast(refs: list) -> list:
    """ray.get of every ref, raising as soon as any fails: a rank that died leaves the others blocked in a
    collective (until its timeout), so waiting on them in order could hang for minutes first."""
    pending, done = list(refs), {}
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        done[ready[0]] = ray.get(ready[0])
    return [done[r] for r in refs]


def start_train_workers(cfg: Config, run_dir, world: int, cpus_per_worker: int = 1, gpus_per_worker: float = 0,
                        placement_group=None, first_bundle: int = 0) -> TrainGroup:
    """world TrainWorker actors (ray_common.start_actors), joined in one process group. Ray must be started
    (ray_driver.start_ray, or ray.init)."""
    threads = max(1, int(cpus_per_worker))
    workers = start_actors(TrainWorker, world, lambda r: (cfg, str(run_dir), r, world, threads), cpus_per_worker,
                           gpus_per_worker, placement_group, first_bundle)
    join_training(workers)
    return TrainGroup(workers)


def join_training(workers: list) -> None:
    """The training ranks into one torch.distributed group (world > 1 only: one rank trains alone)."""
    if len(workers) > 1:
        host, port = ray.get(workers[0].rendezvous.remote())
        ray.get([w.join.remote(host, port) for w in workers])
