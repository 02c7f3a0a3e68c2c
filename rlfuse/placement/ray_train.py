"""Data-parallel training on Ray: one TrainWorker process per rank, joined in a torch.distributed group (gloo on CPU,
NCCL on GPU). Every rank holds a full replica of the trainable roles (actor; critic for PPO), runs its share of each
mini-batch's micro-batches through the same update functions as one process (trainers/rl.py `update`, with
`group=`), and steps on gradients summed over ranks, so an update equals the single-process update on the same
experience. Rank 0 sends the actor's merged weights to generators in buckets through the object store, and saves
the same checkpoint file as trainers/checkpoint.py.

Why not torch's DDP wrapper: DDP all-reduces only after its own forward (which prepares its reducer), and
rl.py's log-probs never call the model's forward: response_logprobs runs the body and the LM head apart, to keep
the (B, T, V) logits out of memory. So gradients are summed here once per mini-batch, with the same collective DDP
issues (all_reduce of flat buckets), only not overlapped with the backward. FSDP2 (fully_shard) and sharded
checkpoints through torch.distributed.checkpoint are the next step; with full replicas, rank 0's file is the
whole checkpoint.

Ray is imported inside functions only: importing this module does not need Ray.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from rlfuse.config import Config
from rlfuse.rollout.fusion import Experience

DEFAULT_BUCKET_BYTES = 32 << 20
"""Gradient all-reduce and weight-sync buckets: large enough to amortise a collective's latency, small enough that
one extra bucket of memory does not matter."""


# ------------------------------------------------------------------------------------------- collectives


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of same-dtype, same-device tensors of about bucket_bytes each (one flat buffer each)."""
    out, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        last = out[-1][-1] if out else None
        if not out or size + nbytes > bucket_bytes or t.dtype != last.dtype or t.device != last.device:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out


@dataclass
class DataParallelGroup:
    """This rank's view of the training group; what trainers/rl.py `optimise(group=...)` calls."""
    rank: int
    world: int
    device: torch.device
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def all_finite(self, finite: bool) -> bool:
        """True on every rank iff every rank's losses were finite: one rank's NaN skips the step on all."""
        flag = torch.tensor([int(finite)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # note: a host sync, once per mini-batch
        return bool(flag.item())

    def sum_gradients(self, modules: list[torch.nn.Module]) -> None:
        """Replace each trainable parameter's gradient by its sum over ranks.

        A sum, not DDP's mean: each micro-batch's loss is already scaled by its share of the whole mini-batch
        (rl.micro_batches), and the ranks' micro-batches partition the mini-batch, so sum over ranks of
        sum over own micro-batches of share * grad = the single-process gradient. A mean would be 1/world of it
        (DDP users scale the loss by world instead). A parameter no rank touched keeps grad None, as in one process."""
        params = list({id(p): p for m in modules for p in m.parameters() if p.requires_grad}.values())
        touched = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=self.device)
        dist.all_reduce(touched)
        live = [p for p, n in zip(params, touched.tolist()) if n]
        for p in live:
            if p.grad is None:  # touched on another rank only (a rank with no micro-batch of this mini-batch)
                p.grad = torch.zeros_like(p)
        for bucket in _buckets([p.grad for p in live], self.bucket_bytes):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat)
            for g, summed in zip(bucket, flat.split([g.numel() for g in bucket])):
                g.copy_(summed.view_as(g))

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

    def broadcast_from_rank0(self, modules: list[torch.nn.Module]) -> None:
        """Every rank starts from rank 0's parameters and buffers (LoRA's random init differs per process)."""
        with torch.no_grad():
            for m in modules:
                for t in list(m.parameters()) + list(m.buffers()):
                    dist.broadcast(t.data, src=0)


# ------------------------------------------------------------------------------------------- weight sync


@dataclass
class WeightRefs:
    """The actor's merged weights as object-store buckets (each a dict name -> CPU tensor), with what sending cost."""
    refs: list
    bytes: int
    seconds: float


def load_weight_refs(engine, weights: WeightRefs) -> dict:
    """Into a DecodeEngine (on any worker) bucket by bucket, one in memory at a time. Returns the iteration's
    `time/weight_sync` (send + receive seconds) and `sync/bytes`."""
    import ray

    t, written = time.perf_counter(), 0
    for ref in weights.refs:
        written += engine.load_weights(ray.get(ref))
    return {"time/weight_sync": weights.seconds + time.perf_counter() - t, "sync/bytes": weights.bytes}


# ------------------------------------------------------------------------------------------- the worker


class TrainWorker:
    """One rank of data-parallel training (a Ray actor; start them with start_train_workers)."""

    def __init__(self, cfg: Config, run_dir: str, rank: int, world: int, threads: int = 1):
        from rlfuse.models.build import build_models
        from rlfuse.placement.ray_common import pin_threads
        from rlfuse.trainers.common import pick_device, seed_everything
        from rlfuse.trainers.rl import build_learners

        pin_threads(threads)
        seed_everything(cfg.run.seed)
        self.cfg, self.rank, self.world = cfg, rank, world
        self.device = pick_device(cfg.run)
        # build_models loads every role; a trainer keeps the trainable ones (actor, critic) and lets the rest go.
        # One loader, so the actor and critic are built exactly as in one process.
        models = build_models(cfg, Path(run_dir), self.device)
        models.generator = models.ref = models.reward_fn = None
        self.models, self.learners = models, build_learners(models, cfg.rl)
        self.group: DataParallelGroup | None = None

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: the TCP address every rank joins at (this node's IP, a free port)."""
        from rlfuse.placement.ray_common import free_port, node_address

        return node_address(), free_port()

    def join(self, host: str, port: int, timeout_s: float = 300) -> None:
        """Join the process group (every rank at once: the call blocks until all have joined), then copy rank 0's
        weights everywhere."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=timeout_s))
        self.group = DataParallelGroup(self.rank, self.world, self.device)
        self.group.broadcast_from_rank0(self._trainable_modules())

    def _trainable_modules(self) -> list[torch.nn.Module]:
        return [l.module for l in (self.learners.actor, self.learners.critic) if l is not None]

    def update(self, exp: Experience, adv, returns, kl_coef: float, batches: list[list[int]], bad: dict,
               temperature: float | None = None) -> dict:
        """One update on this rank's share of the experience (sampled at `temperature`, None: rl.temperature); every
        rank returns the same {"stats", "bad"}."""
        from rlfuse.trainers.rl import update

        stats = update(self.models, self.learners, exp, adv, returns, self.cfg.rl, kl_coef, batches, bad,
                       temperature=temperature, group=self.group)
        return {"stats": stats, "bad": bad}

    def actor_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> WeightRefs:
        """The actor's merged weights (models/weights.merged_state_dict) in object-store buckets (rank 0 is enough:
        every rank holds the same replica)."""
        import ray

        from rlfuse.models.weights import merged_state_dict
        from rlfuse.rollout.weights import weight_buckets

        t, refs, nbytes = time.perf_counter(), [], 0
        for bucket in weight_buckets(merged_state_dict(self.models.actor), bucket_bytes):
            bucket = {k: v.detach().cpu() for k, v in bucket.items()}  # the object store holds host memory
            nbytes += sum(v.numel() * v.element_size() for v in bucket.values())
            refs.append(ray.put(bucket))  # serialised now: later steps cannot change what was sent
        return WeightRefs(refs, nbytes, time.perf_counter() - t)

    def save_checkpoint(self, path: str, iteration: int, kl_coef: float, counters: dict) -> None:
        """Rank 0 writes trainers/checkpoint.py's file (replicas are whole; others return at once)."""
        from rlfuse.trainers.checkpoint import save_checkpoint
        from rlfuse.trainers.rl import CHECKPOINT_KEYS, checkpoint_parts

        if self.rank == 0:
            save_checkpoint(Path(path), **dict(zip(CHECKPOINT_KEYS, checkpoint_parts(self.models, self.learners))),
                            iteration=iteration, kl_coef=kl_coef, counters=counters)

    def load_checkpoint(self, path: str) -> dict:
        """Every rank restores the same file; returns its iteration, kl_coef and counters."""
        from rlfuse.trainers.checkpoint import load_checkpoint
        from rlfuse.trainers.rl import checkpoint_parts

        state = load_checkpoint(Path(path), *checkpoint_parts(self.models, self.learners))
        return {k: state[k] for k in ("iteration", "kl_coef", "counters")}

    def trainable_state(self) -> dict:
        """{role: {name: tensor}} of what trains (tests compare ranks and processes with it)."""
        from rlfuse.trainers.checkpoint import trainable_state

        roles = {"actor": self.models.actor, "critic": self.models.critic}
        return {r: trainable_state(m) for r, m in roles.items() if m is not None}

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- the driver's handle


@dataclass
class TrainGroup:
    """The driver's handle on the training ranks: step 4 of the RL loop and the trainer side of weight sync."""
    workers: list

    def update(self, exp: Experience, adv, returns, kl_coef: float, batches: list[list[int]], bad: dict,
               temperature: float | None = None) -> tuple[dict, dict]:
        """-> (stats, bad counters) of rl.update run data-parallel; the experience goes once into the object store
        and every rank reads it from there."""
        import ray

        exp_ref, adv_ref, ret_ref = ray.put(exp), ray.put(adv), ray.put(returns)
        outs = ray.get([w.update.remote(exp_ref, adv_ref, ret_ref, kl_coef, batches, bad, temperature)
                        for w in self.workers])
        return outs[0]["stats"], outs[0]["bad"]

    def actor_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> WeightRefs:
        import ray

        return ray.get(self.workers[0].actor_weights.remote(bucket_bytes))

    def save_checkpoint(self, path, iteration: int, kl_coef: float, counters: dict) -> None:
        import ray

        ray.get(self.workers[0].save_checkpoint.remote(str(path), iteration, kl_coef, counters))

    def load_checkpoint(self, path) -> dict:
        import ray

        return ray.get([w.load_checkpoint.remote(str(path)) for w in self.workers])[0]

    def trainable_states(self) -> list[dict]:
        import ray

        return ray.get([w.trainable_state.remote() for w in self.workers])

    def shutdown(self, timeout_s: float = 30) -> None:
        """Leave the process group, then end the actors (also those stuck in a collective past timeout_s)."""
        import ray

        ray.wait([w.shutdown.remote() for w in self.workers], num_returns=len(self.workers), timeout=timeout_s)
        for w in self.workers:
            ray.kill(w)


def start_train_workers(cfg: Config, run_dir, world: int, cpus_per_worker: int = 1, gpus_per_worker: float = 0,
                        placement_group=None, first_bundle: int = 0) -> TrainGroup:
    """world TrainWorker actors (in placement_group's bundles first_bundle.. if given), joined in one process group.
    Ray must be started (ray_driver.start_ray, or ray.init)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    def options(rank: int) -> dict:
        opts = {"num_cpus": cpus_per_worker, "num_gpus": gpus_per_worker}
        if placement_group is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group, placement_group_bundle_index=first_bundle + rank)
        return opts

    remote = ray.remote(TrainWorker)
    workers = [remote.options(**options(r)).remote(cfg, str(run_dir), r, world, max(1, int(cpus_per_worker)))
               for r in range(world)]
    host, port = ray.get(workers[0].rendezvous.remote())
    ray.get([w.join.remote(host, port) for w in workers])
    return TrainGroup(workers)
