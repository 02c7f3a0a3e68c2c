"""The overheads of a run placed on Ray workers, measured the way the run incurs them: two Ray workers of one CPU
each (ray_common.start_actors, as the RL run starts its workers), driven from this process. Part of
`rlfuse plan --profile` (rlfuse/runtime/profile.py); ~15 s on 2 cores, most of it starting Ray and the workers.

What is timed, and which MachineProfile field it gives:
- chunks: both workers decode a few steps (decode_chunk: the rollout engine on the policy's shape) and reply,
  again and again, while the driver waits on whichever replies first and calls it again (MultiWorkerRollout's
  loop). A call's wall time beyond the worker's own compute is `ray_round_trip_s`; the same with replies carrying
  CHUNK_SAMPLES finished samples gives `ray_sample_s`.
- two workers at once (pair_slowdowns): in each of PAIR_ROUNDS rounds, a decode chunk and a few training
  micro-batches (forward + backward) on both workers at once against the same on one worker alone just before and
  on the other just after: the slower worker's time over the lone mean, the median over the rounds, is
  `pair_decode_slowdown` and `pair_train_slowdown` (their (max - min) / median over the rounds goes in
  `pair_decode_spread` and `pair_train_spread`, to say how far to trust them). A Ray worker alone computes as fast
  as a plain process: the plan bench's one-worker training (separated, interleaved) measured 0.97-1.16 s per
  iteration against 0.86-1.52 s in one process, so no factor for it (one timed from decode chunks came out
  1.00-1.44 from draw to draw and only added error).
- collectives: the two workers join a gloo group as training ranks do (ray_train.join_training) and all-reduce a
  4-byte tensor (`allreduce_latency_s`, the median: a collective waits for the slower rank, as in a run) and a
  buffer of the model's gradient size (`allreduce_bytes_s`, ring bytes over the time beyond the latency).
- a training micro-batch: the real one (learn/losses.py micro_policy_loss inside DDP's forward, then backward,
  data_parallel.DataParallelGroup.micro_batch) against the bare model's forward + backward over the same tokens:
  the difference is `train_micro_s`. Then the same micro-batch with the gradient sync against without, on both
  workers at once as a data-parallel step runs it: the gradients' bytes over that difference (less a latency per
  DDP bucket) are `ddp_allreduce_bytes_s`, the all-reduce's bandwidth while the ranks compute.
- FSDP's collectives: the same micro-batch on a copy of the model in FSDP2 shards (runtime/fsdp.py ShardedGroup, as
  rl.train_parallel=fsdp runs it: every block's weights all-gathered for the forward and again for the backward, its
  gradients reduce-scattered) against it on the replicated model without the sync, both workers at once: the bytes
  a rank sends over the difference (less two latencies per block, as the planner prices them) are `fsdp_bytes_s`.

Imports Ray: profile.py imports it only to measure these overheads, and goes on without them where Ray is missing.
"""

from __future__ import annotations

import statistics
import time
from datetime import timedelta

import ray
import torch
import torch.distributed as dist

from rlfuse.config import RLConfig
from rlfuse.learn.losses import micro_policy_loss
from rlfuse.models.load import model_of_shape
from rlfuse.plan.cost import DDP_BUCKET_BYTES, ddp_buckets
from rlfuse.runtime import process
from rlfuse.runtime.probe import (
    PROBE_PROMPT,
    PROBE_RESPONSE,
    decode_chunk,
    extra_seconds,
    fake_experience,
    fake_samples,
    pair_note,
    pinned_note,
    spread,
)
from rlfuse.runtime.process import free_port, pin_threads
from rlfuse.runtime.ray_common import node_address, start_actors
from rlfuse.runtime.data_parallel import DataParallelGroup
from rlfuse.runtime.fsdp import ShardedGroup

CHUNKS = 10
"""Calls per worker in each chunk pattern."""
CHUNK_SAMPLES = 16
"""Finished samples a full chunk carries (rollout.score_every)."""


PROBE_ROWS, TRAIN_CALLS = 4, 6
"""Rows of a probe training micro-batch, and micro-batches per timed unit (about as long as a decode chunk)."""
PAIR_ROUNDS = 9
"""Rounds of (one worker alone, both at once) per kind of work: the median over them, and their spread, are kept."""


class ProbeWorker:
    """One probe process (a Ray actor): a model of the policy's shape with random weights, one rank of a gloo group."""

    def __init__(self, shape, rank: int, world: int, threads: int = 1):
        pin_threads(threads)
        self.shape, self.rank, self.world = shape, rank, world
        self.model = model_of_shape(shape, "cpu").train()
        self._samples, self._runs, self._group = {}, {}, None

    def ready(self) -> bool:
        return True

    def cores(self) -> list[int]:
        return process.PINNED

    def chunk(self, steps: int, samples: int) -> tuple[float, list]:
        """The rollout engine decoding CHUNK_ROWS rows for `steps` tokens (decode_chunk), then a reply with `samples`
        finished samples. -> (seconds computed, samples)."""
        if samples not in self._samples:
            self._samples[samples] = fake_samples(samples)
        return decode_chunk(self.model, steps), self._samples[samples]

    def compute(self, kind: str, steps: int) -> float:
        """Seconds of one unit of work alone in this process: `decode` is a rollout chunk (decode_chunk),
        `train` is TRAIN_CALLS forwards + backwards of the bare model over PROBE_ROWS probe-length rows."""
        if kind == "decode":
            return decode_chunk(self.model, steps)

        ids = torch.randint(1, self.shape.vocab, (PROBE_ROWS, PROBE_PROMPT + PROBE_RESPONSE))
        t0 = time.perf_counter()
        for _ in range(TRAIN_CALLS):
            self.model(input_ids=ids).logits.float().log_softmax(-1)[..., 0].mean().backward()
        return time.perf_counter() - t0

    def rendezvous(self) -> tuple[str, int]:
        return node_address(), free_port()

    def join(self, host: str, port: int) -> None:
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=60))

    def collectives(self, nbytes: int, repeats: int = 20) -> tuple[float, float]:
        """(median seconds of a 4-byte all-reduce, median seconds of an all-reduce of nbytes)."""
        small, big = torch.zeros(1), torch.zeros(max(1, nbytes // 4))

        def timed(t, n):
            dist.all_reduce(t)  # warm-up: the first call sets the connection up
            out = []
            for _ in range(n):
                t0 = time.perf_counter()
                dist.all_reduce(t)
                out.append(time.perf_counter() - t0)
            return statistics.median(out)

        return timed(small, repeats), timed(big, 5)

    def _micro_batch(self, rows: int):
        """The probe model's training micro-batch as a DDP rank runs it (_policy_micro_batch), built once per
        `rows`."""
        if rows not in self._runs:
            if self._group is None:  # one DDP wrapper of the model for every micro-batch kind
                self._group = DataParallelGroup(self.rank, self.world, torch.device("cpu"))
            self._runs[rows] = _policy_micro_batch(self.model, self._group, rows, self.shape.vocab)
        return self._runs[rows]

    def micro_batch_overhead(self, rows: int = 4, repeats: int = 15) -> float:
        """Seconds a real training micro-batch (policy loss inside DDP's forward, no gradient sync) takes beyond the
        bare forward + backward over the same tokens: the median over `repeats` pairs."""
        real = lambda: self._micro_batch(rows)(False)
        ids = torch.randint(1, self.shape.vocab, (rows, PROBE_PROMPT + PROBE_RESPONSE))

        def bare():
            self.model(input_ids=ids).logits.float().log_softmax(-1)[..., 0].mean().backward()

        return extra_seconds(real, bare, repeats)

    def ddp_sync_seconds(self, rows: int = 4, repeats: int = 15) -> float:
        """Seconds a data-parallel step's last micro-batch takes beyond the same micro-batch without the gradient
        sync: DDP's all-reduce of every gradient inside the backward, while the other rank computes and syncs the
        same (call it on every rank at once), as each optimiser step of a run pays it. The median over `repeats`
        pairs."""
        run = self._micro_batch(rows)
        return extra_seconds(lambda: run(True), lambda: run(False), repeats)

    def fsdp_sync_seconds(self, rows: int = 4, repeats: int = 5) -> float:
        """Seconds a micro-batch on the model in FSDP2 shards takes beyond the same micro-batch on the replicated
        model without a gradient sync (call it on every rank at once: each block's all-gathers and reduce-scatter
        are collectives). The median over `repeats` pairs."""
        sharded_model = model_of_shape(self.shape, "cpu").train()
        group = ShardedGroup(self.rank, self.world, torch.device("cpu"))
        group.shard([[sharded_model]])
        sharded, replicated = _policy_micro_batch(sharded_model, group, rows, self.shape.vocab), self._micro_batch(rows)
        return extra_seconds(lambda: sharded(True), lambda: replicated(False), repeats)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _policy_micro_batch(model, group, rows: int, vocab: int):
    """A real training micro-batch of `model` as a rank of `group` runs it (learn/losses.py's policy loss inside the
    group's forward, then the backward), as a function of `sync`: False, gradients accumulate locally (DDP); True,
    the backward syncs them (DDP's all-reduce; FSDP's reduce-scatter, every micro-batch), so every rank must call it
    at the same time."""
    exp = fake_experience(rows, vocab)
    adv, rl, idx, share = torch.randn(exp.mask.shape), RLConfig(), list(range(rows)), {"token": 1.0, "sequence": 1.0}

    def loss_of(i, sh):
        loss, stats = micro_policy_loss(model, exp, i, adv, rl, 0.1, 0, 1.0)
        return loss * sh[rl.loss_share], stats

    def run(sync: bool):
        with group.micro_batch([model], sync=sync) as step:
            loss, _ = step(loss_of, idx, share)
            loss.backward()

    return run


def _chunk_pattern(workers: list, steps: int, samples: int) -> tuple[float, float]:
    """(median wall seconds of a call beyond the worker's compute, median compute seconds of a call), the workers
    called as the rollout driver calls its generation workers (ray.wait on whichever replies first, then call it
    again)."""
    inflight, extra, busy = {}, [], []
    calls = {i: 0 for i in range(len(workers))}

    def submit(i):
        inflight[workers[i].chunk.remote(steps, samples)] = (i, time.perf_counter())
        calls[i] += 1

    for i in range(len(workers)):
        submit(i)
    while inflight:
        ready, _ = ray.wait(list(inflight), num_returns=1)
        i, t0 = inflight.pop(ready[0])
        b, _ = ray.get(ready[0])
        extra.append(time.perf_counter() - t0 - b)
        busy.append(b)
        if calls[i] < CHUNKS:
            submit(i)
    n = len(workers)  # the first call of each worker warms its path up
    return statistics.median(extra[n:]), statistics.median(busy[n:])


def pair_slowdowns(workers: list, steps: int) -> dict:
    """{kind: [ratio per round]} for kind in (decode, train): in each round, the work on both workers at once (the
    slower one's time: a flattened rollout or a data-parallel step waits for it) over the mean of the same work on
    one worker alone just before and on the other just after (so a load that rises or falls during the round, or one
    slower worker, weighs on both sides alike)."""
    out = {"decode": [], "train": []}
    for kind in ("decode", "train"):  # warm-up: each worker's first call of each kind
        ray.get([w.compute.remote(kind, steps) for w in workers])
    for _ in range(PAIR_ROUNDS):
        for kind in ("decode", "train"):
            before = ray.get(workers[0].compute.remote(kind, steps))
            pair = max(ray.get([w.compute.remote(kind, steps) for w in workers]))
            solo = (before + ray.get(workers[-1].compute.remote(kind, steps))) / 2
            out[kind].append(pair / solo)
    return out


def measure_ray_overheads(shape, threads: int = 1, log=print, steps: int = 16) -> dict:
    """The Ray-side MachineProfile fields (module docstring), measured on 2 Ray workers of `threads` CPUs each, with
    chunks of `steps` decode steps. Starts a local Ray when none is up (and shuts it down); then the two workers
    keep to cores of their own, as a run's workers do when it starts its own Ray (placement.pin_cores)."""
    t_start = time.perf_counter()
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2 * threads, include_dashboard=False, log_to_driver=False)
    workers = []
    try:
        workers = start_actors(ProbeWorker, 2, lambda i: (shape, i, 2, threads), threads, pin_cores=started)
        empty, _ = _chunk_pattern(workers, steps, 0)
        full, _ = _chunk_pattern(workers, steps, CHUNK_SAMPLES)
        pairs = pair_slowdowns(workers, steps)
        host, port = ray.get(workers[0].rendezvous.remote())
        ray.get([w.join.remote(host, port) for w in workers])
        nbytes = max(4 * 2**20, 4 * shape.params)
        latency, t_big = ray.get([w.collectives.remote(nbytes) for w in workers])[0]
        micro = statistics.mean(ray.get([w.micro_batch_overhead.remote() for w in workers]))
        in_backward = statistics.median(ray.get([w.ddp_sync_seconds.remote() for w in workers]))
        in_fsdp = statistics.median(ray.get([w.fsdp_sync_seconds.remote() for w in workers]))
        cores = ray.get([w.cores.remote() for w in workers])
        ray.get([w.shutdown.remote() for w in workers])
    finally:
        for w in workers:
            ray.kill(w)
        if started:
            ray.shutdown()
    pair_decode, pair_train = (max(1.0, statistics.median(pairs[k])) for k in ("decode", "train"))

    grads = 4.0 * shape.params  # fp32 gradients of the probe's model, in DDP's buckets
    buckets = ddp_buckets(grads, DDP_BUCKET_BYTES)
    idle_rate = nbytes / max(t_big - latency, 1e-6)  # 2 ranks: each sends 2 (w-1)/w = 1 buffer
    # FSDP over 2 ranks: each sends half of the weights twice (forward, backward) and half of the gradients, less
    # two latencies per block and per root (the weights' pair and the gradients: as the planner prices them)
    fsdp_bytes, fsdp_calls = 0.5 * (2 * 4.0 * shape.params + grads), 2 * (shape.layers + 1)
    fsdp_s = in_fsdp - fsdp_calls * latency
    out = {"ray_round_trip_s": max(1e-5, empty), "ray_sample_s": max(0.0, (full - empty) / CHUNK_SAMPLES),
           "allreduce_latency_s": latency,
           "allreduce_bytes_s": idle_rate,
           # the gradients moved by DDP inside a backward, each bucket paying the latency; never faster than idle
           "ddp_allreduce_bytes_s": min(idle_rate, grads / max(in_backward - buckets * latency, 1e-9)),
           # 0 (not measured: the planner takes DDP's) where the difference drowned in the noise
           "fsdp_bytes_s": min(idle_rate, fsdp_bytes / fsdp_s) if fsdp_s > 0 else 0.0,
           # measured with both ranks busy: stored as one worker alone pays it (the planner slows it again)
           "train_micro_s": micro / pair_train,
           "pair_decode_slowdown": pair_decode, "pair_train_slowdown": pair_train,
           "pair_decode_spread": spread(pairs["decode"]), "pair_train_spread": spread(pairs["train"])}
    log(f"[profile] Ray, 2 workers: {time.perf_counter() - t_start:.1f} s; round trip {empty * 1e3:.2f} ms, "
        f"{out['ray_sample_s'] * 1e6:.0f} us per sample, all-reduce {latency * 1e3:.2f} ms + "
        f"{out['allreduce_bytes_s'] / 1e9:.2f} GB/s (in a backward {in_backward * 1e3:.2f} ms, "
        f"{out['ddp_allreduce_bytes_s'] / 1e9:.2f} GB/s; FSDP's {in_fsdp * 1e3:.2f} ms, "
        f"{out['fsdp_bytes_s'] / 1e9:.2f} GB/s), training micro-batch +{micro * 1e3:.2f} ms; "
        f"{pinned_note(cores)}; {pair_note(out, PAIR_ROUNDS)}")
    return out
