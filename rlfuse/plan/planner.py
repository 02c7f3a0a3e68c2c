"""The placement planner: enumerate placements, predict each one's time per stage and memory per worker, rank them.

Pure (no torch, no Ray): `plan(problem) -> list[Plan]`, best first. A candidate is a strategy (flattened,
interleaved, separated), a split of the workers between its groups, a training micro-batch size, gradient
checkpointing on or off, and a tail-migration threshold. Candidates whose roles cannot be placed (e.g. interleaved
when LoRA keeps the reference in the actor's process) or whose predicted memory exceeds the per-worker budget are
dropped, with the reason kept for the printed table.

How a strategy's iteration time is composed (G generating, S scoring, T training workers; stage costs from
rlfuse/plan/cost.py):
- flattened (one group of W): every worker decodes n/W samples, then scores them, then all train data-parallel;
  with migration the tail decodes on one worker while the freed ones score: the overlap is taken off.
- separated (train T, generate G): G decode while T score the finished samples as they stream in (fused), then T
  train; the actor's weights go to the G generating workers each iteration.
- interleaved (train T, score S): T decode while S score concurrently, then T train; the critic's weights go to S.
Plus the weight sync and a fixed per-iteration cost of Ray calls (`MachineProfile.ray_call_s`). Workers computing at
the same moment slow each other (`pair_decode_slowdown`, `pair_train_slowdown`): only the overlapping share of a
stage is slowed (all of flattened's stages; in two groups decoding and scoring as far as they overlap; training on
several ranks).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from rlfuse.config import checkpointing_on
from rlfuse.errors import UserError
from rlfuse.plan import cost
from rlfuse.plan.cost import MachineProfile, ModelShape, policy_shape
from rlfuse.plan.memory import (GiB, MemoryInputs, driver_memory, group_store_bytes, machine_bytes, memory_model,
                                memory_table, pulled_bytes, sent_bytes, weight_bytes, worker_memory)
from rlfuse.plan.profiles import load_profile
from rlfuse.plan.roles import Roles, derive_roles
from rlfuse.plan.spec import PlacementSpec, WorkerResources, dp_micro_size
from rlfuse.plan.strategies import STRATEGY_FNS, single

TP_MAX = 8
"""Largest tensor-parallel degree of a sharded generator (one node's GPUs over NVLink)."""
TP_WEIGHT_SHARE = 0.5
"""Sharded (on paper): the generator's tensor-parallel degree is the smallest power of two that puts at most this
share of a device's memory into its weights, leaving the rest to the KV cache."""
STAGES = ("generate", "score", "rollout", "train", "sync", "migration", "overhead", "iteration")
"""Predicted seconds per iteration. rollout: generate and score as the strategy overlaps them (what the RL loop
logs as time/rollout); iteration = sync + rollout + train + overhead (time/iteration)."""


@dataclass(frozen=True)
class Workload:
    """One RL iteration's work, from the config (and optionally a measured run's response lengths)."""
    samples: int
    """prompts_per_iter x k."""
    prompt_tokens: float
    response_mean: float
    response_max: int
    epochs: int
    mini_batch: int
    score_micro_batch: int
    max_rows: int
    score_singles: int = 0
    """Fused scoring scores each sample that finishes once fewer than rollout.live_below rows are live on its own:
    about that many extra one-sample scoring calls per decoding worker (0 with fusion off)."""
    response_longest: float = 0.0
    """Longest response of an iteration, measured (--lengths-from); 0: unknown, lengths from the mean alone."""
    score_every: int = 16
    """rollout.score_every: a decoding worker reports back (and a fused one scores) every this many samples."""
    prompt_lengths: float = 1.0
    """Distinct token lengths among an iteration's prompts: the engine prefills each length in a call of its own
    (measured by bench/plan.py from the task's prompts; 1 when unknown)."""
    k: int = 1
    """Samples per prompt (rl.k): they share their prompt's prefill."""
    rows_per_worker: int = 16
    """rollout.rows_per_worker: how many workers keep a migrated tail (rollout/migration.py plan_migration)."""
    prompt_longest: float = 0.0
    """The longest prompt tokens among the run's prompts, measured (0: unknown, prompt_tokens): the memory model's
    micro-batches hold it (a peak is the largest micro-batch's, not the mean one's: on smollm2_hh prompts of 115
    tokens on average and up to 160 made the training activations 28% larger than at the mean)."""
    shared_prompt: bool = False
    """rl.share_prompt: the k samples of a prompt in one micro-batch run their prompt's forward (and backward) once
    in scoring and training (models/prefix.py). Without it a short-answer task (word problems: 28 prompt tokens, 4
    answer tokens, k = 8) was predicted at 2.3-3x its training time."""

    def prompt_per_sample(self, rows: float) -> float:
        """Prompt tokens a sample costs in a pass of `rows` samples: the whole prompt, or with shared prompts its
        share among the samples of its group in the pass (micro-batches keep a prompt's samples together)."""
        return self.prompt_tokens / (min(self.k, rows) if self.shares(rows) else 1.0)

    def shares(self, rows: float) -> bool:
        """Whether a pass of `rows` samples runs its prompts once for their group: rl.share_prompt, a prompt repeats
        among them, and that cuts the pass's token positions to cost.SHARE_BELOW of the full ones or less, the test
        the models apply to each micro-batch (models/forward.py worth_sharing), here at the mean prompt and the
        expected longest of `rows` responses, continuations padded to it (the models pack them where their lengths
        differ enough, so they share at least as often as this says)."""
        group = min(self.k, rows)
        if not (self.shared_prompt and group > 1):
            return False
        longest = self.lengths.expected_max(rows)
        full = rows * (self.prompt_tokens + longest)
        shared = rows / group * self.prompt_tokens + rows * max(0.0, longest - 1)
        return shared <= cost.SHARE_BELOW * full

    def passes(self, rows: float) -> int:
        """Model runs per forward of `rows` samples: 2 where they share prompts (the prompts' pass, then the
        continuations'), 1 otherwise."""
        return 2 if self.shares(rows) else 1

    def scored_seq(self, rows: float) -> float:
        """Mean tokens a sample costs in a scoring pass of `rows` samples (prompt, shared where it is, + response;
        scoring sorts by length, so pads little)."""
        return self.prompt_per_sample(rows) + self.response_mean

    def memory_lengths(self, train_rows: int) -> dict:
        """The memory model's sequence lengths (MemoryInputs seq, train_seq, score_seq) at the longest prompt and
        response: the KV cache holds whole sequences, training and scoring passes the tokens their shared prompts
        leave."""
        longest = replace(self, prompt_tokens=max(self.prompt_tokens, self.prompt_longest))
        return {"seq": int(math.ceil(longest.prompt_tokens + self.response_max)),
                "train_seq": longest.prompt_per_sample(train_rows) + self.response_max,
                "score_seq": longest.prompt_per_sample(self.score_micro_batch) + self.response_max}

    @property
    def lengths(self) -> cost.Lengths:
        if self.response_longest:
            return cost.Lengths.from_measured(self.response_mean, self.response_longest, self.samples, self.response_max)
        return cost.Lengths.from_mean(self.response_mean, self.response_max)

    def padded_seq(self, rows: float, ranks: int = 1, calls: float = 1.0) -> float:
        """Tokens per sequence of a training micro-batch of `rows` random samples: padded to its longest; on `ranks`
        data-parallel ranks of `calls` micro-batches per step each, as long as the slowest rank's
        (Lengths.synced_max)."""
        return self.prompt_per_sample(rows) + self.lengths.synced_max(rows, ranks, calls)


@dataclass(frozen=True)
class Problem:
    roles: Roles
    workload: Workload
    memory: MemoryInputs
    profile: MachineProfile
    workers: int
    resources: WorkerResources = WorkerResources()
    memory_budget: float | None = None
    """Bytes one worker may use; None: no memory check."""
    strategies: tuple[str, ...] = ("flattened", "interleaved", "separated")
    micro_batches: tuple[int, ...] = ()
    """Training micro-batch sizes to try; () means every power of two dividing the mini-batch."""
    checkpointing: tuple[bool, ...] = (False, True)
    migrate_below: tuple[float, ...] = (0.0, 0.2)
    staleness: tuple[int, ...] = (0,)
    """rl.max_staleness values to try on the separated placement (0: the synchronous loop; N >= 1: generation runs
    ahead of training, runtime/ray_async.py)."""
    shard: bool = False
    """Shard weights, gradients and optimiser states over each group (FSDP), for the at-scale predictions."""
    address: str | None = None
    train_parallel: tuple[str, ...] = ()
    """rl.train_parallel values to rank where two or more workers train (data: DDP replicas; fsdp: FSDP2 shards,
    runtime/fsdp.py); (): replicas, unlabelled (a pipeline mode the planner prices as data parallelism)."""
    mmap_threshold: float = cost.MMAP_THRESHOLD
    """glibc's mmap threshold on a CPU while an update runs (run.cpu_heap: cost.UPDATE_HEAP_THRESHOLDS): the tensors
    whose pages a training micro-batch faults in afresh."""


@dataclass(frozen=True)
class Plan:
    strategy: str
    spec: PlacementSpec
    micro_batch_size: int
    gradient_checkpointing: bool
    migrate_below: float
    seconds: dict
    """Predicted seconds per stage (STAGES)."""
    memory: dict
    """Group name -> bytes per component of one of its workers."""
    fits: bool
    why_not: str = ""
    max_staleness: int = 0
    """rl.max_staleness of the plan (asynchronous RL on the separated placement when >= 1)."""
    train_parallel: str | None = None
    """rl.train_parallel of the plan (data | fsdp), where the planner chose it; None: the config's own."""

    @property
    def iteration_s(self) -> float:
        return self.seconds["iteration"]

    @property
    def peak_bytes(self) -> float:
        return max(m["total"] for m in self.memory.values())

    @property
    def split(self) -> str:
        return "+".join(f"{g.workers}" for g in self.spec.groups)

    def label(self) -> str:
        return (f"{self.strategy} {self.split}, micro {self.micro_batch_size}, "
                f"ckpt {'on' if self.gradient_checkpointing else 'off'}, migrate {self.migrate_below:g}"
                + (f", async (max_staleness {self.max_staleness})" if self.max_staleness else "")
                + (", fsdp" if self.train_parallel == "fsdp" else ""))

    def config_block(self) -> dict:
        """The plan as config sections: placement (strategy, or custom groups when the split is not the strategy's
        default), rl (micro-batch, checkpointing), rollout (migration)."""
        g0 = self.spec.groups[0]
        if self.strategy == "single":
            return {"placement": {"strategy": "single"}, "rl": {"micro_batch_size": self.micro_batch_size,
                    "gradient_checkpointing": self.gradient_checkpointing}}
        placement = {"strategy": self.strategy, "workers": self.spec.workers, "cpus_per_worker": g0.cpus_per_worker,
                     "gpus_per_worker": g0.gpus_per_worker}
        if not _default_split(self.spec):
            placement = {"strategy": "custom", "cpus_per_worker": g0.cpus_per_worker,
                         "gpus_per_worker": g0.gpus_per_worker,
                         "groups": [{"name": g.name, "workers": g.workers, "roles": list(g.roles)}
                                    for g in self.spec.groups]}
        if self.spec.address:
            placement["address"] = self.spec.address
        return {"placement": placement,
                "rl": {"micro_batch_size": self.micro_batch_size, "gradient_checkpointing": self.gradient_checkpointing}
                | ({"max_staleness": self.max_staleness} if self.max_staleness else {})
                | ({"train_parallel": self.train_parallel} if self.train_parallel else {}),
                "rollout": {"migrate_below": self.migrate_below}}


def _default_split(spec: PlacementSpec) -> bool:
    w = spec.workers
    if spec.strategy == "interleaved":
        return spec.group("score").workers == max(1, w // 4)
    if spec.strategy == "separated":
        return spec.group("generate").workers == max(1, w // 2)
    return True


# ------------------------------------------------------------------------------------------- enumeration


EVERY_SPLIT_UP_TO = 32
"""Up to this many workers every split of them between two groups is ranked; beyond, split_sizes's sample of them:
every split of 512 workers took 18 s to rank (8,546 plans at 2 ms each) and of 100,000 would take hours, while a
group's time changes smoothly with its size: each strategy's best over the sample was within 0.3% of its best over
every split (the default and a GRPO workload, 64 and 100 workers; tests/unit/test_plan_inputs.py)."""


def split_sizes(workers: int) -> list[int]:
    """The sizes of a strategy's second group (score, or generate) to rank for `workers`: all of 1..workers-1 up to
    EVERY_SPLIT_UP_TO, else the sixteenths of `workers`, the powers of two and their complements, and the strategies'
    default splits (a quarter, a half): about 60 sizes for 100,000 workers."""
    if workers <= EVERY_SPLIT_UP_TO:
        return list(range(1, workers))
    sizes = {workers // 4, workers // 2} | {round(workers * i / 16) for i in range(1, 16)}
    power = 1
    while power < workers:
        sizes |= {power, workers - power}
        power *= 2
    return sorted(n for n in sizes if 1 <= n < workers)


def candidate_specs(prob: Problem) -> list[PlacementSpec]:
    """Every strategy x split of prob.workers (split_sizes) the roles allow (strategies that cannot place them are
    skipped); the single process for one worker."""
    if prob.workers == 1:  # one worker is one process: no Ray to pay for
        return [single(prob.roles)]
    out = []
    for name in prob.strategies:
        fn = STRATEGY_FNS[name]
        splits = [None] if name == "flattened" else split_sizes(prob.workers)
        for split in splits:
            kw = {} if split is None else {"score_workers" if name == "interleaved" else "generate_workers": split}
            try:
                out.append(fn(prob.roles, prob.workers, prob.resources, prob.address, **kw))
            except UserError:
                break
    return out


def micro_batch_sizes(prob: Problem) -> tuple[int, ...]:
    if prob.micro_batches:
        return prob.micro_batches
    mb = prob.workload.mini_batch
    return tuple(m for m in (1, 2, 4, 8, 16, 32, 64, 128) if m <= mb and mb % m == 0)


def plan(prob: Problem) -> list[Plan]:
    """Every candidate, predicted; those that fit first, each part ranked by iteration time."""
    plans = []
    for spec in candidate_specs(prob):
        decoders, ranks, seen = _workers_with(spec, "generator"), _workers_with(spec, "actor"), set()
        for micro in micro_batch_sizes(prob):
            rows = dp_micro_size(prob.workload.mini_batch, micro, ranks)
            if rows in seen:  # the same micro-batches per rank as a smaller size already gave: the same plan
                continue
            seen.add(rows)
            # FSDP shards over two or more training ranks; one rank trains whole (data)
            modes = (prob.train_parallel or (None,)) if ranks > 1 else (("data",) if prob.train_parallel else (None,))
            for ckpt in prob.checkpointing:
                for stale in (prob.staleness if spec.strategy == "separated" else (0,)):
                    # an asynchronous rollout decodes each batch whole: no tail migration
                    for migrate in (prob.migrate_below if decoders > 1 and not stale else (0.0,)):
                        for mode in modes:
                            plans.append(predict(prob, spec, micro, ckpt, migrate, stale, mode))
    plans.sort(key=lambda p: (not p.fits, p.iteration_s, p.peak_bytes))
    return plans


def best_plan(prob: Problem) -> Plan:
    return first_fitting(plan(prob), prob.workers)


def first_fitting(plans: list[Plan], workers: int) -> Plan:
    """The first of plan()'s ranking, or a one-line error saying why nothing of `workers` workers fits."""
    if not plans or not plans[0].fits:
        reason = plans[0].why_not if plans else "no strategy can place these roles"
        raise UserError(f"placement planner: nothing fits on {workers} worker(s): {reason}; add workers, "
                        f"raise --memory-per-worker (placement.memory_per_worker_gb), or turn on model.lora or "
                        f"rl.gradient_checkpointing")
    return plans[0]


# --------------------------------------------------------------------------------------------- prediction


def _workers_with(spec: PlacementSpec, role: str) -> int:
    return sum(g.workers for g in spec.groups if role in g.roles)


def predict(prob: Problem, spec: PlacementSpec, micro: int, ckpt: bool, migrate: float, staleness: int = 0,
            train_parallel: str | None = None) -> Plan:
    """Seconds per stage and memory per group of one candidate (staleness >= 1: asynchronous, separated only;
    train_parallel fsdp: the training group's roles in FSDP2 shards)."""
    w, p, m = prob.workload, prob.profile, prob.memory
    gen_w = _workers_with(spec, "generator")
    train_w = _workers_with(spec, "actor")
    fsdp = train_w if train_parallel == "fsdp" and train_w > 1 else 1
    if fsdp > 1:
        prob = replace(prob, memory=replace(m, fsdp=fsdp))
    score_w = _workers_with(spec, "reward") or _workers_with(spec, "reference")
    shard_of = lambda workers: workers if prob.shard else 1
    if staleness:
        seconds = _async_seconds(prob, spec, gen_w, score_w, train_w, micro, ckpt)
    else:
        # workers computing at the same moment slow each other (profile_ray.pair_slowdowns): only where they overlap
        gen_share, score_share = _pair_shares(prob, spec, gen_w, score_w, migrate)
        generate, score, rollout, migration = _rollout_seconds(
            prob, spec, gen_w, score_w, migrate, cost.overlap_slowdown(p.pair_decode_slowdown, gen_share),
            cost.overlap_slowdown(p.pair_train_slowdown, score_share))
        train_slow = cost.overlap_slowdown(p.pair_train_slowdown, 1.0 if train_w > 1 else 0.0)  # ranks step together
        train = _train_seconds(_slowed(prob, train_slow), train_w, micro, ckpt, spec.uses_ray)
        sync = _sync_seconds(prob, spec)
        overhead = p.ray_call_s if spec.uses_ray else 0.0
        seconds = {"generate": generate, "score": score, "rollout": rollout, "train": train, "sync": sync,
                   "migration": migration, "overhead": overhead}
        seconds["iteration"] = sync + rollout + train + overhead
    memory = {}
    rows = dp_micro_size(w.mini_batch, micro, train_w)
    lengths = w.memory_lengths(rows)
    for g in spec.groups:
        replicas = g.workers // _tp(prob, g.workers)  # sharded: tensor-parallel generator replicas
        kv_rows = min(w.max_rows, math.ceil(w.samples / replicas)) if "generator" in g.roles else 0
        mi = replace(m, train_rows=rows, checkpointing=ckpt, **lengths, score_rows=w.score_micro_batch,
                     kv_rows=kv_rows, shard=shard_of(g.workers), generator_shard=_tp(prob, g.workers), fsdp=fsdp)
        # asynchronous: a generation worker holds a copy of the reference too (it takes the log-probs)
        roles = set(g.roles) | ({"reference"} if staleness and "generator" in g.roles and "actor" not in g.roles
                                else set())
        memory[g.name] = worker_memory(roles, replace(mi, store_bytes=group_store_bytes(g, spec, m)), p)
    fits, why = True, ""
    if prob.memory_budget is not None:
        over = [f"{n} needs {mem['total'] / GiB:.2f} GiB" for n, mem in memory.items() if mem["total"] > prob.memory_budget]
        if over:
            fits, why = False, f"{', '.join(over)} per worker, over the {prob.memory_budget / GiB:.2f} GiB budget"
    return Plan(spec.strategy, spec, micro, ckpt, migrate, seconds, memory, fits, why, staleness, train_parallel)


def _async_seconds(prob: Problem, spec: PlacementSpec, gen_w: int, score_w: int, train_w: int, micro: int,
                   ckpt: bool) -> dict:
    """Asynchronous RL on the separated placement (runtime/ray_async.py), in the steady state: the generating
    group decodes the next batch (one call per worker) and takes its reference log-probs, while the training group
    sends the weights, scores the current batch (after its decoding, in one call per worker, the policy's proximal
    log-probs among the passes) and trains; both compute throughout, so both are slowed as a pair. An iteration
    takes the longer of the two sides; the trainer waits for its batch (rollout = scoring + that wait) only when
    generation is the longer."""
    p = prob.profile
    gen_prob = _slowed(prob, cost.overlap_slowdown(p.pair_decode_slowdown, 1.0))
    train_prob = _slowed(prob, cost.overlap_slowdown(p.pair_train_slowdown, 1.0))
    w, m = prob.workload, prob.memory
    per_decoder = w.samples / gen_w
    ref_calls = math.ceil(per_decoder / w.score_micro_batch)
    ref_rows = per_decoder / ref_calls
    reference = cost.forward_seconds(gen_prob.profile, m.policy, ref_rows, w.scored_seq(ref_rows),
                                     weight_bytes(m.policy, m.weight_dtype), ref_calls, w.passes(ref_rows))
    generate = (_generate_seconds(gen_prob, gen_w, _tp(prob, gen_w)) + reference
                + cost.round_trip_seconds(p, 1, per_decoder))
    per_scorer = w.samples / score_w  # one call each, scored in micro-batches
    score = (_score_seconds(train_prob, score_w, math.ceil(per_scorer / w.score_micro_batch), reference=False)
             + _proximal_seconds(train_prob, score_w) + cost.round_trip_seconds(p, 2, per_scorer))  # + set_temperature
    train = _train_seconds(train_prob, train_w, micro, ckpt, True)
    sync, overhead = _sync_seconds(prob, spec), p.ray_call_s
    wait = max(0.0, generate - (sync + score + train + overhead))
    return {"generate": generate, "score": score, "rollout": score + wait, "train": train, "sync": sync,
            "migration": 0.0, "overhead": overhead, "iteration": sync + score + wait + train + overhead}


def _proximal_seconds(prob: Problem, workers: int) -> float:
    """A stale batch's proximal log-probs (Scorer.score(proximal=True)): one more forward of the policy in the
    scoring pass, each scoring worker over its share, in scoring micro-batches; none where the update is one
    optimiser step (its own forward gives them: rollout/fusion.py Experience.proximal_from_update)."""
    w, m, p = prob.workload, prob.memory, prob.profile
    if w.epochs * math.ceil(w.samples / w.mini_batch) == 1:
        return 0.0
    per_worker = w.samples / workers
    calls = math.ceil(per_worker / w.score_micro_batch)
    rows = per_worker / calls
    return cost.forward_seconds(p, m.policy, rows, w.scored_seq(rows), weight_bytes(m.policy, m.weight_dtype), calls,
                                w.passes(rows), "actor" in m.adapter_roles)


def _slowed(prob: Problem, factor: float) -> Problem:
    return prob if factor <= 1 else replace(prob, profile=prob.profile.slowed(factor))


def _pair_shares(prob: Problem, spec: PlacementSpec, gen_w: int, score_w: int, migrate: float) -> tuple[float, float]:
    """(share of decoding, share of scoring) that overlaps another worker's compute. One group: every worker decodes,
    then scores, at the same moment as the others (all of it when there are several; none in one process). Two
    groups: decoding and scoring overlap for at most the shorter of the two (predicted as if alone), unless a group
    has several workers, which then overlap each other throughout."""
    if len(spec.groups) == 1:
        return (1.0, 1.0) if gen_w > 1 else (0.0, 0.0)
    generate, score, _, _ = _rollout_seconds(prob, spec, gen_w, score_w, migrate)
    return (1.0 if gen_w > 1 else min(1.0, score / generate)), (1.0 if score_w > 1 else min(1.0, generate / score))


def _rollout_seconds(prob: Problem, spec: PlacementSpec, gen_w: int, score_w: int, migrate: float,
                     gen_slow: float = 1.0, score_slow: float = 1.0) -> tuple[float, float, float, float]:
    """(generate, score, rollout, migration) seconds. One group (flattened, or one process): each worker decodes its
    share, scoring its own finished samples as it goes, with the tail migrated to fewer workers (the freed ones score
    under it). Two groups: the scoring group starts on the decoders' first chunk and scores each chunk as it comes;
    the last chunk is scored after decoding ends. On Ray every decoding worker replies to the driver in chunks
    (ray_rollout.GenerationWorker.advance), each a round trip carrying its samples; a scoring call is one too.
    gen_slow, score_slow: decoding's and scoring's compute slowed by these (workers computing at the same moment)."""
    w, p = prob.workload, prob.profile
    one_group = len(spec.groups) == 1
    gen_prob, prob = _slowed(prob, gen_slow), _slowed(prob, score_slow)
    generate = _generate_seconds(gen_prob, gen_w, _tp(prob, gen_w))
    score = _score_seconds(prob, score_w)
    calls = 1 if spec.uses_ray else 0  # set_temperature on the scorers before decoding starts
    score_calls = 1
    if spec.uses_ray:
        per_decoder = w.samples / gen_w
        chunks = cost.rollout_chunks(per_decoder, w.score_every)
        generate += cost.round_trip_seconds(p, chunks, per_decoder)
        if not one_group:
            score_calls = max(math.ceil(w.samples / score_w / w.score_every), math.ceil(chunks * gen_w / score_w))
            score = _score_seconds(prob, score_w, score_calls) + cost.round_trip_seconds(p, score_calls,
                                                                                        w.samples / score_w)
    migration, overlap = 0.0, 0.0
    if migrate > 0 and gen_w > 1:
        migration, tail = _migration(gen_prob, gen_w, migrate)
        if migration and spec.uses_ray:
            migration += cost.round_trip_seconds(p, 2)  # export, then import
        overlap = min(tail, score)
    if one_group:
        rollout = generate + score - overlap + migration
    else:
        first = generate * min(1.0, w.score_every / (w.samples / gen_w))  # the first chunk's samples finished
        rollout = max(generate + migration + score / score_calls, first + score)
    return generate, score, rollout + cost.round_trip_seconds(p, calls), migration


def _policy_bytes(m: MemoryInputs) -> float:
    return weight_bytes(m.policy, m.weight_dtype)


def _tp(prob: Problem, workers: int) -> int:
    """Tensor-parallel degree of the generator: 1 unless sharding (on paper), then see TP_WEIGHT_SHARE."""
    if not prob.shard or not prob.memory_budget:
        return 1
    tp, need = 1, _policy_bytes(prob.memory)
    while need / tp > TP_WEIGHT_SHARE * prob.memory_budget and tp * 2 <= min(workers, TP_MAX):
        tp *= 2
    return tp


def _generate_seconds(prob: Problem, workers: int, tp: int) -> float:
    """Each generating worker (or tensor-parallel replica of `tp` workers, with their summed FLOP/s and bandwidth;
    collectives not counted) decodes its share of the samples."""
    w, m, p = prob.workload, prob.memory, prob.profile
    samples = w.samples / (workers // tp)
    if tp > 1:
        p = replace(p, flops=p.flops * tp, decode_flops=p.decode_flops * tp, mem_bw=p.mem_bw * tp)
    prompts = w.samples / w.k
    prefills = cost.distinct_values(w.prompt_lengths, prompts, prompts / (workers // tp))  # this worker's share
    # the rollout ends with the longest sample of every decoder's: one decoder's own longest is shorter
    return cost.decode_seconds(p, m.policy, samples, w.prompt_tokens, w.lengths, w.response_mean,
                               _policy_bytes(m), m.act_bytes, w.max_rows, prefills, w.k, waited_for=w.samples,
                               adapters=m.decodes_adapters)


def _scored_models(m: MemoryInputs, roles: Roles, reference: bool = True) -> list[tuple[ModelShape, bool]]:
    """The forwards scoring runs per sample, each with whether it runs LoRA adapters unmerged: the reference's
    log-probs (unless taken elsewhere; under LoRA the actor with its adapters off), the reward model, the critic's
    values (the critic's own body, or the actor's when the value head sits on it)."""
    out = [(m.policy, False)] if reference else []
    if m.reward is not None:
        out.append((m.reward, "reward" in m.adapter_roles))
    if "critic" in roles:
        out.append((m.critic or m.policy, "critic" in m.adapter_roles))
    return out


def _score_seconds(prob: Problem, workers: int, calls: float | None = None, reference: bool = True) -> float:
    """Data-parallel scoring: each worker runs every scoring forward over its share, in micro-batches, plus the
    fused tail's one-sample calls; or in `calls` calls (a scoring group scores each chunk as it comes). reference:
    the reference's pass among them (False: the generation workers take it, asynchronous RL)."""
    w, m, p = prob.workload, prob.memory, prob.profile
    per_worker = w.samples / workers
    singles = 0.0
    if calls is None:
        singles = min(w.score_singles, per_worker)
        calls = math.ceil((per_worker - singles) / w.score_micro_batch) + singles
    rows = per_worker / calls
    batched = calls - singles
    # the fused tail's one-sample calls repeat no prompt: one pass each; the micro-batches' passes as they share
    passes = (batched * w.passes((per_worker - singles) / batched) + singles) / calls if batched else 1.0
    forwards = sum(cost.forward_seconds(p, s, rows, w.scored_seq(rows), weight_bytes(s, m.weight_dtype), calls,
                                        passes, adapters) for s, adapters in _scored_models(m, prob.roles, reference))
    return forwards + calls * p.score_call_s


def _train_seconds(prob: Problem, workers: int, micro: int, ckpt: bool, ray: bool = False) -> float:
    """Actor then critic: per mini-batch, ceil(micro-batches / workers) micro-batches on each rank (DDP), each
    with the loss path's fixed cost (train_micro_s), an optimiser step, and on several ranks DDP's gradient
    all-reduce (one per bucket) and the all-reduce that checks every rank's loss was finite; per update, the
    ranks' stats gathered (all_gather_object: two collectives). On Ray the driver's call and the experience's trip
    to the ranks. Sharding (on paper) changes the memory, not this: each worker gathers the whole weights for its
    micro-batches, as FSDP does. rlfuse's FSDP (memory.fsdp > 1) instead of DDP's all-reduce: per micro-batch each
    block's weights all-gathered twice (forward, and again in the backward: freed after the forward) and its
    gradient reduce-scattered, one collective per block and per root group; the optimiser steps on a shard."""
    w, m, p = prob.workload, prob.memory, prob.profile
    steps = w.epochs * w.samples / w.mini_batch
    # each rank runs every world-th micro-batch of each mini-batch (micro-batches cut smaller where there are fewer
    # than ranks: spec.dp_micro_size), padded to the same count on every rank (a zero-weight one costs as much)
    rows = dp_micro_size(w.mini_batch, micro, workers)
    calls = steps * math.ceil(math.ceil(w.mini_batch / rows) / workers)
    lora = m.lora_rank > 0
    train_b = 4.0 if m.train_dtype == "fp32" else 2.0
    trained = [(m.policy, m.policy.lora_params(m.lora_rank) if lora else m.policy.params, lora)]
    if "critic" in prob.roles and m.critic is not None:
        on_base = m.shared_base and lora  # the critic is adapters on the shared base too
        trained.append((m.critic, m.critic.lora_params(m.lora_rank) if on_base else m.critic.params, on_base))
    total = 0.0
    for shape, params, frozen in trained:
        wb = weight_bytes(shape, m.weight_dtype)
        seq = w.padded_seq(rows, workers, calls / steps)  # every optimiser step waits for the slowest rank
        total += cost.train_seconds(p, shape, rows, seq, wb, calls, ckpt, frozen, w.passes(rows),
                                    scored=seq - w.prompt_per_sample(rows), mmap_threshold=prob.mmap_threshold)
        total += calls * p.train_micro_s
        total += cost.optimizer_seconds(p, params / (workers if prob.shard or m.fsdp > 1 else 1), steps)
        in_backward = replace(p, allreduce_bytes_s=p.ddp_allreduce_bytes_s or p.allreduce_bytes_s)
        if m.fsdp > 1:  # 2 all-gathers of the weights, 1 reduce-scatter of the trained gradients, per group
            groups = shape.layers + 1
            sharded = replace(in_backward, allreduce_bytes_s=p.fsdp_bytes_s or in_backward.allreduce_bytes_s)
            total += cost.allgather_seconds(sharded, 2 * wb / groups, workers, calls * groups)
            total += cost.allgather_seconds(sharded, params * train_b / groups, workers, calls * groups)
        else:
            buckets = cost.ddp_buckets(params * train_b, cost.DDP_BUCKET_BYTES)
            total += cost.allreduce_seconds(in_backward, params * train_b / buckets, workers, steps * buckets)
        total += cost.allreduce_seconds(p, 4, workers, steps + 2)  # finite-loss check per step; the stats
    if ray:  # the experience goes as a few batched tensors: a round trip, not a per-sample cost
        total += cost.round_trip_seconds(p, 1)
    return total


def _migration(prob: Problem, gen_w: int, migrate_below: float) -> tuple[float, float]:
    """(re-prefill seconds on the keeper, seconds of tail decode the freed workers can score under): the tail starts
    when fewer than `migrate_below` of the samples are unfinished (rollout/migration.py plan_migration)."""
    w, p, m = prob.workload, prob.profile, prob.memory
    per_worker = w.samples / gen_w
    rows = w.lengths.live_rows(per_worker, w.samples)  # the keeper decodes on to the longest of all
    start = next((t for t, r in enumerate(rows) if r < migrate_below * per_worker), len(rows))
    if start >= len(rows) or rows[start] * gen_w < 2:  # under 2 rows left in all: no second busy worker to free
        return 0.0, 0.0
    moved = rows[start] * (gen_w - 1)
    wb = _policy_bytes(m)
    replay = cost.migration_seconds(p, m.policy, moved, w.prompt_tokens + start, wb, m.decodes_adapters)
    tail = len(rows[start:]) * (m.policy.layers * p.decode_call_s(m.decodes_adapters) + wb / p.mem_bw)
    return replay, tail


def _sync_seconds(prob: Problem, spec: PlacementSpec) -> float:
    """The actor's weights to generators outside its group (the object store or NCCL; one receiver after another),
    in-process copies inside it; the critic's weights to scoring groups without it (they compute the values).
    Sharded (on paper): every sender and receiver moves its own shard at once, over min(senders, receivers) links."""
    p, m = prob.profile, prob.memory
    train_b = 4.0 if m.train_dtype == "fp32" else 2.0
    trainers = _workers_with(spec, "actor")
    total = 0.0
    if m.fsdp > 1:  # the shards gathered whole for the rollout (fsdp.ShardedGroup.gather): actor, critic and, on
        # ranks that score, the sharded frozen reference (full fine-tuning)
        sharded = [m.policy] + ([m.critic] if m.critic is not None and "critic" in prob.roles else [])
        scores = any("actor" in g.roles and "reference" in g.roles for g in spec.groups)
        sharded += [m.policy] if scores and not m.lora_rank else []
        total += cost.allgather_seconds(p, sum(weight_bytes(s, m.weight_dtype) for s in sharded), trainers)
    if spec.uses_ray and any({"generator", "actor"} <= set(g.roles) for g in spec.groups):
        total += cost.round_trip_seconds(p, 1)  # the driver asks each such worker to copy its own replica
    for g in spec.groups:
        if "generator" in g.roles:
            if "actor" not in g.roles:  # the merged weights, or the adapters merged there
                total += _send(prob, sent_bytes(m, "actor"), g.workers, trainers)
                if m.sync_adapters and m.lora_rank:
                    total += 2 * m.policy.params * train_b / p.mem_bw  # the base read, the merged weights written
            elif not (m.shared_base and not m.generator_copy):  # decoding the shared base itself: nothing to copy
                total += m.policy.params * train_b / p.mem_bw
        if m.critic is not None and "critic" in prob.roles and "critic" not in g.roles \
                and set(g.roles) & {"reference", "reward"}:
            total += _send(prob, sent_bytes(m, "critic"), g.workers, trainers)
    return total


def _send(prob: Problem, nbytes: float, receivers: int, senders: int) -> float:
    if prob.shard:
        return cost.sync_seconds(prob.profile, nbytes / min(receivers, senders), 1)
    return cost.sync_seconds(prob.profile, nbytes, receivers)


# ----------------------------------------------------------------------------------------------- printing


def plan_table(plans: list[Plan], top: int = 12) -> str:
    """The ranked plans as a markdown table (predicted seconds per stage, peak GiB per worker)."""
    lines = ["| rank | strategy | split | micro | ckpt | migrate | generate s | score s | rollout s | train s | sync s | "
             "iteration s | peak GiB/worker | fits |",
             "|---" * 14 + "|"]
    for i, pl in enumerate(plans[:top], 1):
        s = pl.seconds
        name = f"{pl.strategy}, async {pl.max_staleness}" if pl.max_staleness else pl.strategy
        name += ", fsdp" if pl.train_parallel == "fsdp" else ""
        lines.append(f"| {i} | {name} | {pl.split} | {pl.micro_batch_size} | "
                     f"{'on' if pl.gradient_checkpointing else 'off'} | {pl.migrate_below:g} | {s['generate']:.3g} | "
                     f"{s['score']:.3g} | {s['rollout']:.3g} | {s['train']:.3g} | {s['sync']:.3g} | "
                     f"{s['iteration']:.3g} | {pl.peak_bytes / GiB:.2f} | {'yes' if pl.fits else 'no: ' + pl.why_not} |")
    return "\n".join(lines)


def plan_memory_table(pl: Plan) -> str:
    return memory_table({f"{g.name} ({', '.join(g.roles)})": pl.memory[g.name] for g in pl.spec.groups})


# ------------------------------------------------------------------------------------------ from a config

SYNTHETIC_RESPONSE_MEAN = 17.0
"""Mean response tokens of PPO on the embedded task (median of rollout/length_mean over the 40 iterations of a
default `rlfuse run`, its rl/metrics.jsonl); real data runs to rl.max_new_tokens unless --lengths-from says
otherwise."""
PROMPT_TOKENS = {"synthetic": 4.0, "imdb": 15.0}
"""Mean prompt tokens as the RL stage encodes them (BOS + words; measured by bench/plan.py on the default task and on
IMDb prompts with the default-task tokenizer). Other data: 32. Only a fallback: `rlfuse plan` and
placement.strategy=auto measure the run's own prompts (rlfuse/models/prompt_workload.py) and pass them in."""


def table_prompt_tokens(data_kind: str) -> float:
    """The mean prompt tokens assumed for data.kind when the prompts were not measured."""
    return PROMPT_TOKENS.get(data_kind, 32.0)


def problem_from_config(cfg, profile: MachineProfile, workers: int | None = None, cpus_per_worker: float | None = None,
                        gpus_per_worker: float | None = None, memory_budget: float | None = None,
                        lengths: tuple[float, int] | None = None, prompt_tokens: float | None = None,
                        cores: float | None = None, prompt_lengths: float | None = None,
                        prompt_longest: float | None = None, staleness: tuple[int, ...] | None = None) -> Problem:
    """The planning problem of an RL run on `cfg` (rlfuse.config.Config): roles, shapes and batch sizes from the
    config, placement resources from the arguments or cfg.placement, rates from `profile`. Budget: the argument,
    else a GPU's memory, else the machine's RAM shared by the workers (0 in the profile: no check). lengths:
    (mean, longest) response tokens measured by a run; prompt_tokens: the prompts' measured mean (default
    table_prompt_tokens); prompt_lengths: distinct prompt lengths in an iteration's prompts, measured (default 1:
    one prefill call); prompt_longest: the longest prompt, measured (default: the mean);
    cores: CPU cores the workers share (default this machine's; CPU workers beyond them are slowed); staleness: the
    rl.max_staleness values to rank on the separated placement (default 0, and the config's own where it sets one:
    placement.strategy=auto never turns asynchronous RL on by itself)."""
    rl, pc = cfg.rl, cfg.placement
    roles = derive_roles(cfg)
    shape = policy_shape(cfg.model)
    workers = pc.workers if workers is None else workers
    resources = WorkerResources(pc.cpus_per_worker if cpus_per_worker is None else cpus_per_worker,
                                pc.gpus_per_worker if gpus_per_worker is None else gpus_per_worker)
    if workers < 1 or resources.cpus <= 0 or resources.gpus < 0:
        raise UserError(f"placement planner: {workers} worker(s) of {resources.cpus:g} CPU and {resources.gpus:g} GPU "
                        "each cannot run anything; give at least 1 worker and a positive CPU share")
    if profile.device == "cpu":  # more worker threads than cores: each gets its share of the cores
        profile = profile.slowed(resources.cpus * workers / (cores or os.cpu_count() or 1))
        if workers == 1:  # one process on more cores than the profile timed (the single process of `rlfuse plan`)
            profile = profile.widened(min(resources.cpus, cores or os.cpu_count() or 1))
    if memory_budget is None and profile.memory_bytes:
        memory_budget = profile.memory_bytes if profile.device == "cuda" else profile.memory_bytes / workers
    mean, longest = lengths or ((SYNTHETIC_RESPONSE_MEAN if cfg.data.kind == "synthetic" else rl.max_new_tokens), 0)
    prompt_tokens = prompt_tokens or table_prompt_tokens(cfg.data.kind)
    workload = Workload(samples=rl.prompts_per_iter * rl.k, prompt_tokens=prompt_tokens,
                        response_mean=min(mean, rl.max_new_tokens), response_max=rl.max_new_tokens,
                        epochs=rl.epochs, mini_batch=rl.mini_batch_size, score_micro_batch=cfg.rollout.micro_batch_size,
                        max_rows=cfg.rollout.max_rows,
                        # Ray's decoding workers fuse (auto means on there: scoring overlaps on other workers)
                        score_singles=cfg.rollout.live_below if cfg.rollout.fusion is not False else 0,
                        response_longest=min(longest, rl.max_new_tokens), score_every=cfg.rollout.score_every,
                        rows_per_worker=cfg.rollout.rows_per_worker, k=rl.k, prompt_lengths=prompt_lengths or 1.0,
                        prompt_longest=prompt_longest or 0.0, shared_prompt=rl.share_prompt and rl.k > 1)
    mem = memory_inputs(cfg, roles, shape, profile)
    migrate = tuple(sorted({0.0, cfg.rollout.migrate_below}))
    if staleness is None:
        staleness = (0, rl.max_staleness) if rl.max_staleness else (0,)
    # replicas or shards, ranked side by side (a pipeline mode is priced as replicas and keeps its setting; a
    # shared base trains its adapters on replicas of the base: config/validate.py refuses fsdp there)
    train_parallel = () if rl.train_parallel not in ("data", "fsdp") else ("data",) if cfg.model.shares_base else (
        "data", "fsdp")
    return Problem(roles, workload, mem, profile, workers, resources, memory_budget, migrate_below=migrate,
                   staleness=staleness, address=pc.address, train_parallel=train_parallel,
                   mmap_threshold=cost.UPDATE_HEAP_THRESHOLDS[cfg.run.cpu_heap])


QUANTISED_DTYPE = {"none": "fp32", "4bit": "nf4-dq", "8bit": "int8"}
"""model.quantization -> the frozen weights' dtype in the memory model."""


def memory_inputs(cfg, roles, shape, profile: MachineProfile) -> MemoryInputs:
    """The memory model's inputs as rlfuse runs `cfg`: the base's dtype (model.quantization), one shared base for
    the roles (model.shared_base: the critic and reward as adapters on it; the generator still its own
    full-precision copy today), the optimiser's state size (rl.optimizer), activations in the compute dtype (lean
    SwiGLU MLPs with model.lean_activations)."""
    mc = cfg.model
    shared = mc.lora and mc.shares_base
    critic = "critic" in roles and (roles["critic"].shares_with is None or (shared and roles["critic"].source != "actor"))
    half = cfg.run.precision in ("bf16", "fp16") or (cfg.run.precision == "auto" and profile.device == "cuda")
    return MemoryInputs(policy=shape, critic=shape if critic else None,
                        reward=shape if roles["reward"].has_model else None,
                        weight_dtype=QUANTISED_DTYPE[mc.quantization],
                        act_bytes=2.0 if half and mc.quantization != "none" else 4.0,
                        lora_rank=mc.lora_r if mc.lora else 0,
                        optimizer="adamw8bit" if cfg.rl.optimizer.endswith("8bit") else "adamw",
                        shared_base=shared,  # the engine decodes the shared base: no generator copy
                        sync_adapters=cfg.rollout.syncs_adapters(mc),
                        release_reference=cfg.rl.release_reference and profile.device == "cpu",
                        lean_activations=mc.lean_activations)


def plan_config(cfg, log=None, **kw) -> list[Plan]:
    """Every plan for an RL run on `cfg`, best first, with the machine profile at its default place (or the
    built-in one). Keyword arguments go to problem_from_config."""
    budget = cfg.placement.memory_per_worker_gb
    kw.setdefault("memory_budget", budget * GiB if budget else None)
    return plan(problem_from_config(cfg, load_profile(log=log, shape=policy_shape(cfg.model)), **kw))


def resolve_auto(cfg, log=None, **measured):
    """placement.strategy=auto -> a copy of `cfg` with the best plan applied (placement, rl.micro_batch_size,
    rl.gradient_checkpointing, rollout.migrate_below) and one log line saying what was chosen; other configs as
    they are. Called once before a run by rlfuse.plan.resolve.resolve, so the run folder's config.yaml records the
    choice. measured: problem_from_config's measured inputs (prompt_tokens, prompt_lengths), which only a layer
    that loads data and tokenizers can take (rlfuse/models/prompt_workload.py)."""
    if cfg.placement.strategy != "auto":
        return cfg
    if cfg.rl.tools or cfg.rl.environment:  # the cost model prices single-turn samples only
        if log:
            log("[plan] placement.strategy=auto chose single: the planner does not price multi-turn episodes "
                "(rl.tools, rl.environment) yet; set placement.strategy to run them on Ray workers")
        return replace(cfg, placement=replace(cfg.placement, strategy="single"))
    plans = plan_config(cfg, log, **measured)
    best = first_fitting(plans, cfg.placement.workers)
    block = best.config_block()
    placement = replace(cfg.placement, **block["placement"])
    out = replace(cfg, placement=placement, rl=replace(cfg.rl, **block["rl"]),
                  rollout=replace(cfg.rollout, **block.get("rollout", {})))
    if log:
        log(f"[plan] placement.strategy=auto chose {best.label()}: predicted {best.iteration_s:.2f} s per iteration, "
            f"peak {best.peak_bytes / GiB:.2f} GiB per worker (best of {len(plans)}; `rlfuse plan` prints the table)")
    return out


def _configured_memory(cfg, **measured):
    """(memory inputs with the config's micro-batch, checkpointing and lengths; the workload; the profile).
    measured: as resolve_auto's."""
    prob = problem_from_config(cfg, load_profile(shape=policy_shape(cfg.model)), **measured)
    w = prob.workload

    m = replace(prob.memory, train_rows=cfg.rl.micro_batch_size, checkpointing=checkpointing_on(cfg),
                score_rows=w.score_micro_batch, **w.memory_lengths(cfg.rl.micro_batch_size))
    return m, w, prob


def memory_of_config(cfg, **measured):
    """The checker's `memory_of` hook (rlfuse.plan.check) for an RL run on `cfg` as configured: predicted
    peak bytes of one worker of a group, with the config's micro-batch and checkpointing (measured: as
    resolve_auto's)."""
    m, w, prob = _configured_memory(cfg, **measured)
    return memory_model(m, prob.profile, w.samples, w.max_rows, fsdp=cfg.rl.train_parallel == "fsdp")


def machine_memory(cfg, spec, **measured) -> tuple[dict, float]:
    """An RL run on `cfg` laid out as `spec` on one machine (a local Ray): ({group or "driver": (processes,
    predicted peak bytes of one)}, bytes of them all: the workers, the object store's pages once
    (memory.machine_bytes) and what the driver adds (memory.driver_memory)). measured: as resolve_auto's."""
    m, w, prob = _configured_memory(cfg, **measured)
    memory_of = memory_model(m, prob.profile, w.samples, w.max_rows, fsdp=cfg.rl.train_parallel == "fsdp")
    driver = driver_memory(m, min(cfg.rl.eval_prompts, w.max_rows))
    need = {g.name: (g.workers, memory_of(g, spec)) for g in spec.groups} | {"driver": (1, int(driver))}
    # the final pull passes through the object store too (with the generators beside the actor, nothing else does)
    pulled = pulled_bytes(m) if spec.uses_ray else 0.0
    return need, machine_bytes(spec, memory_of, m, pulled) + driver


def predicted_memory(cfg) -> dict[str, float]:
    """Bytes per component of the single process running every role of `cfg` (the report shows it beside what the
    run measured, rlfuse/metrics/memory.py)."""
    m, w, prob = _configured_memory(cfg)
    return worker_memory(prob.roles.names, replace(m, kv_rows=min(w.max_rows, w.samples)), prob.profile)
