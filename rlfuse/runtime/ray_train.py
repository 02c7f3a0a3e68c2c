"""Data-parallel training on Ray: one process per rank, joined in a torch.distributed group (gloo on CPU, NCCL on
GPU), the trainable roles wrapped in torch's DistributedDataParallel. Every rank holds a full replica of the
trainable roles (actor; critic for PPO), runs its share of each mini-batch's micro-batches through the same update
functions as one process (learn/update.py `update`, with `group=`), and DDP all-reduces the gradients in buckets
during the last micro-batch's backward, so an update equals the single-process update on the same experience.
Rank 0 sends the actor's merged weights to generators in buckets through the object store, and saves the same
checkpoint file as learn/checkpoint.py (with full replicas it is the whole checkpoint; FSDP2's sharded states and
torch.distributed.checkpoint are for models that do not fit one worker).

The groups themselves (DDP's DataParallelGroup, FSDP2's ShardedGroup) are in data_parallel.py and fsdp.py.

Imports Ray: only a placement on Ray workers imports this module (runtime/backend.py).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from rlfuse.config import Config
from rlfuse.errors import UserError
from rlfuse.files import atomic_path, write_text_atomic
from rlfuse.learn.checkpoint import (CHECKPOINT_KEYS, checkpoint_parts, keep_learning_rates, load_checkpoint,
                                     previous_of, read_checkpoint, save_checkpoint, save_torch, trainable_state)
from rlfuse.learn.learners import build_learners, learner_sets
from rlfuse.learn.update import BadSteps, update
from rlfuse.models.build import build_models
from rlfuse.models.device import pick_device, seed_everything
from rlfuse.models.quantize import choose_cpu_heap
from rlfuse.models.weights import merged_state_dict
from rlfuse.rollout.fusion import Experience
from rlfuse.rollout.score import Scorer
from rlfuse.rollout.weights import weight_buckets
from rlfuse.runtime.data_parallel import DEFAULT_BUCKET_BYTES, DataParallelGroup
from rlfuse.runtime.fsdp import (ShardedGroup, full_tensor, load_shards, remove_unreferenced_shards, save_shards,
                                 unique_state, whole_trainable_state)
from rlfuse.runtime.pipeline import build_pipeline, schedule_record
from rlfuse.runtime.process import free_port, pin_threads
from rlfuse.runtime.ray_common import node_address, put_tensors, start_actors, tensors_of

# ------------------------------------------------------------------------------------------- weight sync


@dataclass
class WeightRefs:
    """The actor's merged weights as object-store buckets (each put_tensors' dict name -> StoredTensor: tensors_of
    reads it), with what sending cost."""
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
        choose_cpu_heap(cfg.run.cpu_heap)
        self.cfg, self.rank, self.world, self.run_dir = cfg, rank, world, Path(run_dir)
        self.device = pick_device(cfg.run)
        # build_models loads every role; a trainer keeps the trainable ones (actor, critic) and those in `keep`
        # ("generator", "ref", "reward_fn": a worker that also decodes or scores) and lets the rest go. One loader,
        # so every role is built exactly as in one process, in its precision (Models.compute_dtype, a bf16 generator
        # copy); a generator copy row-major, as every worker's: auto would time the layouts on each worker apart
        models = build_models(cfg, Path(run_dir), self.device, weight_layout="row")
        for name in {"generator", "ref", "reward_fn"} - set(keep):
            setattr(models, name, None)
        self.models, self.learners = models, build_learners(models, cfg.rl)
        self.group: DataParallelGroup | ShardedGroup | None = None
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
        sets = [[learner.module for learner in learners] for learners in learner_sets(self.learners)]
        if self.cfg.rl.train_parallel == "fsdp":
            self.group = ShardedGroup(self.rank, self.world, self.device)
            self.group.shard(sets)  # from rank 0's weights, as DDP below
            if self.models.ref is not None:  # a worker that scores: its reference in shards too
                self.group.shard_frozen([self.models.ref])
            self.learners = build_learners(self.models, self.cfg.rl)  # optimisers over the shards
            return
        self.group = DataParallelGroup(self.rank, self.world, self.device)
        base = self.models.shared_base  # model.shared_base: each rank holds the base, DDP reduces the adapters
        for modules, learners in zip(sets, learner_sets(self.learners)):  # DDP copies rank 0's weights as it wraps
            trained = [p for learner in learners for p in learner.trained()] if base is not None else None
            self.group.wrap(modules, trained, holder=base)

    @property
    def sharded(self) -> bool:
        return isinstance(self.group, ShardedGroup)

    def begin_rollout(self, everything: bool = True) -> None:
        """Sharded training (fsdp.py): the whole weights gathered for this iteration's decoding, scoring and weight
        sends; every training rank at once (the driver calls them together, before anything else of the iteration).
        everything=False: the actor's shard group alone (reference and critic later: RoleWorker.deferred_passes)."""
        if self.sharded:
            self.group.gather(None if everything else [self._root_of(self.models.actor)])

    def _root_of(self, module):
        """The shard group (fsdp.ShardedGroup's root) holding `module`."""
        sets = [[learner.module for learner in learners] for learners in learner_sets(self.learners)]
        return next(self.group.wrap(modules) for modules in sets if any(m is module for m in modules))

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
        rl = self.cfg.rl
        if self.sharded:  # the whole weights of the rollout freed
            self.group.shard_again()
        stats = update(self.models, self.learners, exp, adv, returns, rl, kl_coef, batches, bad,
                       temperature=temperature, group=self.group)
        return {"stats": stats, "bad": bad, "seconds": time.perf_counter() - t}

    def proximal_pass(self, batches: list[tuple[list[list[int]], list[list[int]]]], temperature: float
                      ) -> tuple[list[list[torch.Tensor]], float]:
        """The actor's own log-probs of each sample's response tokens at `temperature` (the decoupled objective's
        proximal policy, Scorer.score(proximal=True) in one process), under the update's autocast, for a layout whose
        scorers hold no actor (interleaved). batches: (prompts, responses) of the samples a scoring worker scored
        together, each cut into micro-batches as that worker cut them, so that this pass and its reference pass
        round alike (the first iteration's KL is 0, as in one process). -> (per batch one tensor per sample, s)."""
        t = time.perf_counter()
        # the scorer's deferred reference pass, run on the actor itself: one forward per micro-batch, adapters on
        scorer = Scorer(None, self.models.tokenizer.pad_token_id, ref=self.models.actor,
                        micro_batch_size=self.cfg.rollout.micro_batch_size, share_prompt=self.cfg.rl.share_prompt,
                        compute_dtype=self.models.compute_dtype)
        scorer.temperature = temperature
        out = [scorer.deferred_pass("reference", prompts, responses) for prompts, responses in batches]
        return out, time.perf_counter() - t

    def _save_schedule(self) -> None:
        pipe = self.pipeline
        record = schedule_record(pipe.last_spans, pipe.last_schedules, pipe.world, pipe.mode)
        write_text_atomic(self.run_dir / "rl" / "pipeline_schedule.json", json.dumps(record))

    def actor_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, role: str = "actor",
                      adapters: bool = False) -> WeightRefs:
        """The actor's (or role="critic": the critic's) merged weights (models/weights.merged_state_dict) in
        object-store buckets (rank 0 is enough: every rank holds the same replica, or, sharded, the whole weights
        begin_rollout gathered). adapters: only what trains (the LoRA adapters), for generation workers that merge
        them themselves (rollout.weight_sync)."""
        if self.sharded and not self.group.gathered:
            raise RuntimeError("actor_weights on sharded training: begin_rollout first (on every rank)")
        t, refs, nbytes = time.perf_counter(), [], 0
        module = getattr(self.models, role)
        state = trainable_state(module, copy=False) if adapters else merged_state_dict(module)
        for bucket in weight_buckets(state, bucket_bytes):
            nbytes += sum(v.numel() * v.element_size() for v in bucket.values())
            refs.append(put_tensors(bucket))  # serialised now: later steps cannot change what was sent
        return WeightRefs(refs, nbytes, time.perf_counter() - t)

    def streamed_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, role: str = "actor",
                         adapters: bool = False) -> WeightRefs | None:
        """Sharded ranks that neither decode nor score with whole weights: what actor_weights sends (the whole
        state, or adapters: what trains), gathered one tensor at a time (every rank calls it together) into rank 0's
        object-store buckets, so no rank ever holds the whole state dict. Not for LoRA's merged weights (their deltas
        are computed per layer on whole tensors). -> rank 0's WeightRefs, None on the others."""
        t = time.perf_counter()
        module = getattr(self.models, role)
        state = trainable_state(module, copy=False) if adapters else unique_state(module)
        refs, nbytes = self._put_gathered(state.items(), bucket_bytes)
        return WeightRefs(refs, nbytes, time.perf_counter() - t) if self.rank == 0 else None

    def _put_gathered(self, named, bucket_bytes: int) -> tuple[list, int]:
        """Gather (name, shard) pairs whole a tensor at a time (a collective: every rank calls it, in the same order)
        and put them into the object store a bucket at a time from rank 0. -> (refs, bytes) on rank 0, ([], 0)
        elsewhere."""
        refs, nbytes = [], 0
        whole = ((name, full_tensor(value.detach()).cpu()) for name, value in named)
        for bucket in weight_buckets(whole, bucket_bytes):
            if self.rank == 0:
                nbytes += sum(v.numel() * v.element_size() for v in bucket.values())
                refs.append(put_tensors(bucket))
        return refs, nbytes

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

    def save_checkpoint(self, path: str, iteration: int, kl_coef: float, counters: dict) -> dict:
        """Rank 0 writes learn/checkpoint.py's file (replicas are whole; others return at once). Sharded: every
        rank first writes its shards (fsdp.save_shards), then rank 0 the file naming them, without the weights and
        optimiser states, and removes the shard folders no kept checkpoint names. -> {"seconds", "bytes"} this rank
        spent and wrote."""
        t, path, written = time.perf_counter(), Path(path), []
        parts = dict(zip(CHECKPOINT_KEYS, checkpoint_parts(self.models, self.learners)))
        shards = None
        if self.sharded:
            self.group.shard_again()
            shards = save_shards(path, iteration, self.group, learner_sets(self.learners))
            parts = parts | {key: None for key in ("actor", "critic", "opt_actor", "opt_critic")}
            written.append(path.with_name(shards) / f"__{self.rank}_0.distcp")
        if self.rank == 0:
            save_checkpoint(path, **parts, iteration=iteration, kl_coef=kl_coef, counters=counters, shards=shards)
            written.append(path)
        if shards is not None and self.rank == 0:
            prev = previous_of(path)
            keep = {shards} | ({read_checkpoint(prev).get("shards")} if prev.exists() else set())
            remove_unreferenced_shards(path, keep)
        if self.pipeline is not None:
            written.append(Path(f"{path}.stage{self.rank}"))
        return {"seconds": time.perf_counter() - t,
                "bytes": sum(f.stat().st_size for f in written if f.exists())}

    def load_checkpoint(self, path: str) -> dict:
        """Every rank restores the same file; returns its iteration, kl_coef and counters. Sharded: every rank reads
        its shards from the folder the file names (a learning rate changed on resume kept, as load_checkpoint does)."""
        parts = checkpoint_parts(self.models, self.learners)
        if self.sharded:
            self.group.shard_again()
            learners = [learner for s in learner_sets(self.learners) for learner in s]
            configured = [[g["lr"] for g in learner.opt.param_groups] for learner in learners]
            state = load_checkpoint(Path(path), *parts, sharded=True)  # counters, schedules, RNG states
            load_shards(Path(path).with_name(state["shards"]), self.group, learner_sets(self.learners))
            for learner, lrs in zip(learners, configured):
                keep_learning_rates(learner.opt, learner.sched, lrs)
            return {k: state[k] for k in ("iteration", "kl_coef", "counters")}
        state = load_checkpoint(Path(path), *parts)
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
        """{role: {name: tensor}} of what trains (tests compare ranks and processes with it). Sharded: the whole
        tensors, gathered one at a time (every rank calls it together)."""
        roles = {"actor": self.models.actor, "critic": self.models.critic}
        if self.sharded:
            self.group.shard_again()
            return {r: whole_trainable_state(m) for r, m in roles.items() if m is not None}
        return {r: {n: t.cpu() for n, t in trainable_state(m).items()} for r, m in roles.items() if m is not None}

    def trainable_buckets(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, roles: tuple[str, ...] = ("actor",)
                          ) -> dict | None:
        """What trains of `roles`, rank 0 putting it into the object store a bucket at a time: {role: [refs]} on rank
        0, None elsewhere. Sharded, gathered a bucket at a time (every rank together), so no process holds the whole
        state dict at once; the driver loads the buckets one by one into its own models, viewing the store's pages."""
        if self.sharded:
            self.group.shard_again()
        out = {}
        for role in roles:
            module = getattr(self.models, role)
            if module is not None:
                named = ((n, p) for n, p in module.named_parameters() if p.requires_grad)
                out[role] = (self._put_gathered(named, bucket_bytes)[0] if self.sharded else
                             [put_tensors(b) for b in weight_buckets(named, bucket_bytes)])
        return out if self.rank == 0 else None

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- the driver's handle


@dataclass
class TrainGroup:
    """The driver's handle on the training ranks: step 4 of the RL loop and the trainer side of weight sync."""
    workers: list
    sharded: bool = False
    """rl.train_parallel=fsdp on two or more ranks (fsdp.py): the gathers are collectives, every rank called."""

    def begin_rollout(self, everything: bool = True) -> None:
        """Sharded: every rank gathers the whole weights for this iteration's rollout (TrainWorker.begin_rollout;
        everything=False: the actor's alone)."""
        if self.sharded:
            get_failing_fast([w.begin_rollout.remote(everything) for w in self.workers])

    def deferred_passes(self, exp: Experience) -> float:
        """Sharded ranks that score with the models they hold (RoleWorker.defer_passes): exp.ref_logprobs and
        exp.values from one pass each over the samples, each rank a contiguous share. -> the slowest rank's seconds."""
        shares = torch.arange(len(exp)).tensor_split(len(self.workers))
        outs = get_failing_fast([w.deferred_passes.remote([exp.prompt_ids[i] for i in share],
                                                          [exp.response_ids[i] for i in share])
                                 for w, share in zip(self.workers, shares)])
        for role, field_name in (("reference", "ref_logprobs"), ("critic", "values")):
            if role not in outs[0][0]:
                continue
            whole = torch.zeros_like(exp.mask)
            for share, (passes, _) in zip(shares, outs):
                for i, v in zip(share.tolist(), passes[role]):
                    whole[i, : len(v)] = v
            setattr(exp, field_name, whole)
        return max(seconds for _, seconds in outs)

    def proximal_pass(self, exp: Experience, temperature: float, batches: list[list[int]]) -> float:
        """exp.proximal_logprobs from the training ranks' actor (TrainWorker.proximal_pass): `batches` (indices into
        exp, each the samples a scoring worker scored together) dealt to the ranks in contiguous shares. -> the slowest
        rank's seconds."""
        shares = torch.arange(len(batches)).tensor_split(len(self.workers))
        parts = [[batches[b] for b in share.tolist()] for share in shares]
        outs = get_failing_fast([w.proximal_pass.remote([([exp.prompt_ids[i] for i in b],
                                                          [exp.response_ids[i] for i in b]) for b in part], temperature)
                                 for w, part in zip(self.workers, parts)])
        whole = torch.zeros_like(exp.mask)
        for part, (per_batch, _) in zip(parts, outs):
            for b, logprobs in zip(part, per_batch):
                for i, lp in zip(b, logprobs):
                    whole[i, : len(lp)] = lp
        exp.proximal_logprobs = whole
        return max(seconds for _, seconds in outs)

    def update(self, exp: Experience, adv, returns, kl_coef: float, batches: list[list[int]], bad: BadSteps,
               temperature: float | None = None) -> tuple[dict, dict, list[float]]:
        """-> (stats, bad counters, seconds per rank) of learn/update.py's update run data-parallel; the experience goes once into
        the object store and every rank reads it from there."""
        exp_ref, adv_ref, ret_ref = ray.put(exp), ray.put(adv), ray.put(returns)
        outs = get_failing_fast([w.update.remote(exp_ref, adv_ref, ret_ref, kl_coef, batches, bad, temperature)
                                 for w in self.workers])
        return outs[0]["stats"], outs[0]["bad"], [o["seconds"] for o in outs]

    def pull_into(self, models) -> None:
        """Rank 0's trained actor into the driver's own (its evaluations and the saved model; the critic stays with
        the workers' checkpoints: nothing in the driver reads it), a bucket at a time (TrainWorker.trainable_buckets;
        sharded, every rank takes part in the gathers)."""
        workers = self.workers if self.sharded else self.workers[:1]
        parts = get_failing_fast([w.trainable_buckets.remote() for w in workers])[0]
        for role, refs in parts.items():
            for ref in refs:
                state = tensors_of(ray.get(ref))
                unexpected = getattr(models, role).load_state_dict(state, strict=False).unexpected_keys
                if unexpected:  # a naming mismatch would otherwise save the untrained model
                    raise RuntimeError(f"the trained {role} has parameters the driver's {role} lacks: "
                                       f"{unexpected[:3]}")

    def actor_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, role: str = "actor",
                      adapters: bool = False) -> WeightRefs:
        return ray.get(self.workers[0].actor_weights.remote(bucket_bytes, role, adapters))

    def streamed_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, role: str = "actor",
                         adapters: bool = False) -> WeightRefs:
        """Sharded: every rank gathers a tensor at a time, rank 0 sends (TrainWorker.streamed_weights)."""
        return get_failing_fast([w.streamed_weights.remote(bucket_bytes, role, adapters) for w in self.workers])[0]

    def save_checkpoint(self, path, iteration: int, kl_coef: float, counters: dict) -> list[dict]:
        """-> each rank's {"seconds", "bytes"} (TrainWorker.save_checkpoint)."""
        # with pipeline stages every rank saves its own optimiser states first, then rank 0 the checkpoint: a kill
        # in between leaves the previous checkpoint, whose stage files it never reads again (the new ones are newer)
        get_failing_fast([w.save_stage_state.remote(str(path), iteration) for w in self.workers])
        return get_failing_fast([w.save_checkpoint.remote(str(path), iteration, kl_coef, counters)
                                 for w in self.workers])

    def load_checkpoint(self, path) -> dict:
        return ray.get([w.load_checkpoint.remote(str(path)) for w in self.workers])[0]

    def trainable_states(self) -> list[dict]:
        return get_failing_fast([w.trainable_state.remote() for w in self.workers])

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
    return TrainGroup(workers, sharded=cfg.rl.train_parallel == "fsdp" and world > 1)


def join_training(workers: list) -> None:
    """The training ranks into one torch.distributed group (world > 1 only: one rank trains alone)."""
    if len(workers) > 1:
        host, port = ray.get(workers[0].rendezvous.remote())
        ray.get([w.join.remote(host, port) for w in workers])
