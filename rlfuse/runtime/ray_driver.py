"""Steps 1 and 4 of the RL loop (weight sync, generate, score; update) on Ray worker groups laid out by a
PlacementSpec.

trainers/rl.py asks `build_placement` for a rollout and a trainer; with placement.strategy != single it gets a
`RayRollout` and a `RayTrainer` from here. Every worker of the spec is one Ray actor (runtime/ray_worker.py
RoleWorker) in one placement group (one bundle per worker, PACK), holding only the roles of its group: a group with
the generator decodes; one with the reference or the reward scores; the group with the actor trains, its workers
joined data-parallel (DDP, gloo on CPU). What this gives per strategy:

- flattened: every worker decodes, scores and trains (with tail migration: freed workers score the finished
  samples); the generators get the actor's weights by an in-process copy on each worker;
- separated: the "generate" workers decode only, with weights from the trainer's rank 0 through the object store;
  the "train" workers score while they decode, then train;
- interleaved: the "train" workers decode and train; the "score" workers score while they decode, and get the
  critic's weights from rank 0 each iteration (their copy computes the values).

Every worker computes in the precision of the resolved config (run.precision, rollout.generator_dtype), as the single
process does; the driver checks that they agree (agreed_arithmetic) and, where their sampler's arithmetic is not the
update's, has the proximal log-probs scored for the decoupled objective (RayRollout.generate), as LocalRollout does.

The driver keeps the loop, the evaluation and the saved model (rank 0's weights pulled back at the end). This module
and the other ray_*.py import Ray: runtime/backend.py imports it only for a placement on Ray workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import placement_group

from rlfuse.errors import UserError, first_line
from rlfuse.learn.update import BadSteps
from rlfuse.plan.check import validate_placement
from rlfuse.plan.roles import derive_roles
from rlfuse.plan.spec import ClusterResources, NodeResources, PlacementSpec
from rlfuse.rollout.fusion import scores_proximal
from rlfuse.runtime.ray_common import wait_ready
from rlfuse.rollout.generator import ENGINES
from rlfuse.runtime.ray_rollout import MultiWorkerRollout, RolloutSettings, WorkerModels
from rlfuse.runtime.ray_train import TrainGroup, join_training
from rlfuse.runtime.ray_worker import start_role_workers

SCORING_ROLES = ("reference", "reward")
TRAIN_PARALLEL_WORDS = {"data": "data-parallel", "fsdp": "data-parallel on FSDP2 shards"}


def start_ray(spec: PlacementSpec) -> bool:
    """ray.init unless Ray is up already (a test, or a notebook, started it): local with the spec's CPUs, or the
    cluster at placement.address. Returns whether this call started it (so the run shuts down only its own Ray)."""
    if ray.is_initialized():
        return False
    if spec.address:
        reachable(spec.address)
        try:
            ray.init(address=spec.address, include_dashboard=False, log_to_driver=False)
        except ConnectionError as e:
            raise UserError(f"placement.address {spec.address}: Ray did not connect ({first_line(e)}); check that "
                            "the cluster is up (`ray status` there) and the address is its head's") from None
    else:
        context = ray.init(num_cpus=max(1, int(round(spec.cpus))), num_gpus=int(spec.gpus + 0.999),
                           include_dashboard=False, log_to_driver=False)
        _watch_driver(context.address_info.get("session_dir"))
    return True


_watchdog: subprocess.Popen | None = None


def _watch_driver(session_dir: str | None) -> None:
    """A process that ends this local Ray's session if this driver dies without ray.shutdown (ray_watchdog.py)."""
    global _watchdog
    if session_dir:
        _watchdog = subprocess.Popen([sys.executable, "-m", "rlfuse.runtime.ray_watchdog", str(os.getpid()),
                                      session_dir], start_new_session=True, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_ray() -> None:
    """ray.shutdown of a Ray this run started, and its watchdog with it."""
    global _watchdog
    ray.shutdown()
    if _watchdog is not None:
        _watchdog.terminate()
        _watchdog.wait()
        _watchdog = None


def reachable(address: str, timeout_s: float = 5.0) -> None:
    """Something listens at placement.address, or a UserError within timeout_s: ray.init would retry for long."""
    if address in ("auto", "local"):  # Ray finds the cluster of this machine itself (and says so if none)
        return
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"placement.address {address!r}: expected host:port, ray://host:port or auto, e.g. "
                        "10.0.0.5:6379")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        why = f"no answer within {timeout_s:g} s" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__)
        raise UserError(f"placement.address {address}: nothing answers there ({why}); start "
                        "the cluster (`ray start --head` on that machine) or fix the address") from None


def pins_cores(setting: bool | None, started_ray: bool, address: str | None) -> bool:
    """placement.pin_cores resolved: as set, or (null) only on a local Ray this run started itself, where no other
    job's workers share the cores (on a cluster they may: each worker would take cores 0.. of its node)."""
    return setting if setting is not None else started_ray and not address


def core_list(cores: list[int]) -> str:
    """[2, 3] -> "2-3", [0] -> "0", [0, 2] -> "0,2", [] (not pinned) -> ""."""
    if cores and cores == list(range(cores[0], cores[-1] + 1)) and len(cores) > 1:
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def cluster_resources(nodes: list[dict]) -> ClusterResources:
    """ClusterResources from `ray.nodes()` (alive nodes' CPU and GPU totals)."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
    return ClusterResources(tuple(NodeResources(float(r.get("CPU", 0)), float(r.get("GPU", 0))) for r in alive))


def worker_metrics(timing: dict, ranks: list[int], rss_mb: list[tuple[float, float]]) -> dict:
    """exp.timing of a multi-worker rollout -> the metrics row: time/ for seconds, migration/ under its own name,
    worker/<rank>/busy_s, worker/<rank>/rss_mb and worker/<rank>/rss_peak_mb per worker (rank: the worker's global
    index in the spec; rss_mb: (now, peak) per worker)."""
    out = {"time/rollout": timing["rollout"], "time/scoring": timing["scoring"],
           "migration/migrated": timing["migrated"]}
    out |= {k: v for k, v in timing.items() if k.startswith("migration/")}
    out |= {"time/deferred_scoring": timing["deferred_scoring"]} if "deferred_scoring" in timing else {}
    out |= {"time/proximal_pass": timing["proximal_pass"]} if "proximal_pass" in timing else {}
    for i, rank in enumerate(ranks):
        out[f"worker/{rank}/busy_s"] = timing[f"busy/worker{i}"]
        out[f"worker/{rank}/rss_mb"], out[f"worker/{rank}/rss_peak_mb"] = rss_mb[i]
    return out


@dataclass
class RayWorkers:
    """The Ray actors of a spec, by global rank, and what each does; names a dead worker in one line."""
    handles: list
    ranks: list[int]
    groups: list[str]
    decoders: list[int] = field(default_factory=list)
    scorers: list[int] = field(default_factory=list)
    trainers: list[int] = field(default_factory=list)
    placement_group: object = None
    started_ray: bool = False

    @contextlib.contextmanager
    def naming_dead_workers(self, during: str):
        """A worker process that died (killed, out of memory) ends the run with one line naming it; the iteration
        under way is not logged, so `--resume` repeats it from the last checkpoint (written by rank 0)."""
        try:
            yield
        except RayTaskError as e:  # a user-facing error on a worker (divergence, a bad reward, a full disk under
            # rank 0's checkpoint) is the driver's, printed as one line
            if isinstance(e.cause, (UserError, OSError)):
                raise e.cause from None
            raise
        except RayActorError as e:
            ids = [w._actor_id.hex() for w in self.handles]
            i = ids.index(e.actor_id) if e.actor_id in ids else None
            who = f"worker {self.ranks[i]} (group {self.groups[i]})" if i is not None else "a worker"
            raise UserError(f"placement: Ray {who} died during the {during} ({type(e).__name__}); the last "
                            f"checkpoint is kept: continue with `rlfuse rl --resume RUN_DIR`") from None

    def close(self) -> None:
        """End the workers and their placement group (and Ray, if this run started it)."""
        if not ray.is_initialized():
            return
        for w in self.handles:
            ray.kill(w)
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
        if self.started_ray:
            stop_ray()


@dataclass
class RayTrainer:
    """Step 4 of the loop and its checkpoints on the training workers (the trainer object of trainers/rl.py)."""
    group: object
    """ray_train.TrainGroup over the workers holding the actor."""
    workers: RayWorkers
    train_parallel: str = "data"
    """rl.train_parallel: data (replicas), fsdp (shards) or pipeline_* (one stage of each model per rank)."""
    rates: dict = field(default_factory=dict)
    """train/lr (and train/critic_lr): every rank steps the same constant schedule (learn/optim.py
    build_constant_optimizer), so the config's rates are the optimisers' own."""

    def learning_rates(self) -> dict:
        return self.rates

    def update(self, exp, adv, returns, kl_coef: float, batches, bad: BadSteps, temperature: float | None = None) -> dict:
        with self.workers.naming_dead_workers("update"):
            stats, counters, seconds = self.group.update(exp, adv, returns, kl_coef, batches, bad, temperature)
        bad.skipped, bad.consecutive, bad.why = counters.skipped, counters.consecutive, counters.why  # every rank's
        ranks = [self.workers.ranks[i] for i in self.workers.trainers]
        key = "train/pipeline_stages" if self.train_parallel.startswith("pipeline") else "train/data_parallel_ranks"
        return stats | {key: len(ranks)} | {
            f"worker/{r}/train_s": s for r, s in zip(ranks, seconds)}

    def save_checkpoint(self, path, iteration: int, kl_coef: float, counters: dict) -> None:
        """Every rank's part, then one line of rl/checkpoints.jsonl: the seconds each rank spent and the bytes it
        wrote (a checkpoint is written after its iteration's metrics row, so it has no column there)."""
        with self.workers.naming_dead_workers("checkpoint"):
            ranks = self.group.save_checkpoint(path, iteration, kl_coef, counters)
        line = {"iteration": iteration, "train_parallel": self.train_parallel,
                "seconds": [r["seconds"] for r in ranks], "bytes": [r["bytes"] for r in ranks]}
        with open(Path(path).with_name("checkpoints.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")

    def load_checkpoint(self, path) -> dict:
        with self.workers.naming_dead_workers("resume"):
            return self.group.load_checkpoint(path)

    def pull_into(self, models) -> None:
        with self.workers.naming_dead_workers("final weight pull"):
            self.group.pull_into(models)


@dataclass
class RayRollout:
    """The rollout object of trainers/rl.py (sync_weights, generate, metrics) on the spec's workers."""
    driver: object
    """ray_rollout.MultiWorkerRollout over every worker, knowing which decode and which score."""
    workers: RayWorkers
    group: object
    """ray_train.TrainGroup: where the weights come from."""
    migrate: bool
    critic_trains: bool = False
    adapters: bool = False
    """rollout.weight_sync sends the actor's adapters alone: the generation workers merge them (merge_adapter)."""
    deferred: bool = False
    """FSDP ranks that score with the critic they train: the actor alone is gathered for the rollout, the
    reference and the critic after it, one at a time, for a pass each (TrainGroup.deferred_passes)."""
    streamed: bool = False
    """FSDP ranks that need no whole weights for the rollout (they neither decode nor score with the actor): nothing
    is gathered whole; the weights go out a tensor at a time (TrainGroup.streamed_weights)."""
    rl: object = None
    """config.RLConfig: whether a batch's update is one optimiser step, and its KL coefficient (scores_proximal)."""
    behaviour_differs: bool = False
    """The workers sample in other arithmetic than the update computes in (a bf16 generator copy, or passes under
    bf16 autocast: run.precision), as LocalRollout.behaviour_differs in one process: the update then runs the
    decoupled objective around the trained policy's own log-probs (proximal)."""
    actor_on_scorers: bool = True
    """Every scoring worker trains the actor, so it scores the proximal log-probs beside the others (flattened,
    separated); else the training ranks take them in a pass of their own after the rollout (interleaved)."""

    def sync_weights(self, models=None) -> dict:
        """Actor -> every decoding worker; critic -> every scoring worker that does not train it (its frozen copy
        computes the values). A worker holding an actor replica copies in-process; the others load rank 0's
        buckets from the object store. `time/weight_sync`: wall seconds; `sync/bytes`: bytes loaded into one
        generator (plus one scorer's critic when sent); `sync/sent_bytes`: bytes put into the object store."""
        w = self.workers
        t, sent, per_holder, calls = time.perf_counter(), 0, {}, []
        with w.naming_dead_workers("weight sync"):
            if not self.streamed:
                self.group.begin_rollout(everything=not self.deferred)  # sharded: whole weights for the rollout
            send = self.group.streamed_weights if self.streamed else self.group.actor_weights
            local = [w.handles[i].sync_from_actor.remote() for i in w.decoders if i in w.trainers]
            for role, target, holders in (("actor", "generator", [i for i in w.decoders if i not in w.trainers]),
                                          ("critic", "critic", [i for i in w.scorers if i not in w.trainers])):
                if not holders or (role == "critic" and not self.critic_trains):
                    continue
                adapters = self.adapters and role == "actor"
                refs = send(self.driver.bucket_bytes, role, adapters)
                sent, per_holder[target] = sent + refs.bytes, refs.bytes
                calls += [w.handles[i].load_weights.remote("adapter" if adapters else target, ref)
                          for ref in refs.refs for i in holders]
                calls += [w.handles[i].merge_adapter.remote() for i in holders] if adapters else []
            copied = ray.get(local)
            ray.get(calls)
        if copied:
            per_holder["generator"] = copied[0][0]
        return {"time/weight_sync": time.perf_counter() - t, "sync/bytes": sum(per_holder.values()),
                "sync/sent_bytes": sent} | ({"sync/streamed": 1.0} if self.streamed else {})

    def generate(self, request):
        one_step = self.rl is not None and self.rl.optimiser_steps(len(request.prompts) * request.k) == 1
        proximal = scores_proximal(self.behaviour_differs, one_step, self.rl.kl_coef if self.rl else 0.0)
        with self.workers.naming_dead_workers("rollout"):
            exp = self.driver.generate(request.prompts, request.k, request.params, request.seed, migrate=self.migrate,
                                       proximal=proximal and self.actor_on_scorers, rows=request.rows)
            if proximal and not self.actor_on_scorers:
                seconds = self.group.proximal_pass(exp, request.params.temperature, self._scored_batches(exp))
                exp.timing["rollout"] += seconds
                exp.timing["scoring"] += seconds
                exp.timing["proximal_pass"] = seconds
            exp.proximal_from_update = self.behaviour_differs and not proximal
            if self.deferred:
                seconds = self.group.deferred_passes(exp)
                exp.timing["rollout"] += seconds
                exp.timing["scoring"] += seconds
                exp.timing["deferred_scoring"] = seconds
            return exp

    def _scored_batches(self, exp) -> list[list[int]]:
        """The samples each scoring call scored together (MultiWorkerRollout.last_batches), as indices into exp
        (ordered by prompt id, then sample index, as build_experience orders them)."""
        position, seen = {}, {}
        for i, pid in enumerate(exp.prompt_index.tolist()):
            seen[pid] = seen.get(pid, -1) + 1
            position[(pid, seen[pid])] = i
        return [[position[key] for key in batch] for batch in self.driver.last_batches]

    def metrics(self, exp) -> dict:
        with self.workers.naming_dead_workers("rollout"):
            # the reward functions ran on the scoring workers: their means come from there
            return (worker_metrics(exp.timing, self.workers.ranks, self.driver.rss_mb())
                    | self.driver.reward_metrics())

    def save_in_flight(self, path, iteration: int) -> None:
        """Nothing is in flight between two iterations of the synchronous loop."""

    def begin_at(self, path, iteration: int) -> None:
        """The synchronous loop keeps nothing between iterations but the trainer's checkpoint."""


def agreed_arithmetic(cfg, workers: RayWorkers, log=print) -> bool:
    """Every worker's GenerationWorker.arithmetic, checked to agree: the passes of those that score or train in one
    dtype, the engines of those that decode in one, as every process of the run reads run.precision and
    rollout.generator_dtype from the same config (resolved before the run where it runs on this machine's CPUs:
    plan/resolve.py; auto on GPUs or a cluster's CPUs, each worker on its own device). One line says what they
    compute in. -> whether the samples' arithmetic differs from the update's (RayRollout.behaviour_differs)."""
    seen = ray.get([w.arithmetic.remote() for w in workers.handles])
    computes = sorted({a["compute"] for a in seen if a["compute"] is not None})
    decodes = sorted({a["decode"] for a in seen if a["decode"] is not None})
    if len(computes) > 1 or len(decodes) > 1:
        which = "; ".join(f"worker {r}: passes {a['compute'] or '-'}, decoding {a['decode'] or '-'}"
                          for r, a in zip(workers.ranks, seen))
        raise UserError(f"placement: the workers resolved run.precision={cfg.run.precision} and "
                        f"rollout.generator_dtype={cfg.rollout.generator_dtype} on their own devices and disagree "
                        f"({which}): their samples would depend on where they run; set run.precision and "
                        "rollout.generator_dtype (bf16 or fp32) for every worker")
    log(f"[placement] the workers score and train in {computes[0] if computes else 'float32'}"
        f"{' autocast' if computes and computes[0] != 'float32' else ''}, decode in "
        f"{decodes[0] if decodes else 'float32'} (run.precision={cfg.run.precision}, "
        f"rollout.generator_dtype={cfg.rollout.generator_dtype})")
    return any(a["behaviour_differs"] for a in seen)


def start_ray_placement(cfg, spec: PlacementSpec, run_dir, log=print, reward_rows: dict | None = None,
                        max_model_len: int | None = None
                        ) -> tuple[RayRollout, RayTrainer, RayWorkers]:
    """Validate the spec against the cluster, reserve one bundle per worker (PACK), start each group's workers with
    the models of its roles, join the training ranks, and return the RL loop's rollout and trainer objects (and the
    workers, to close)."""
    workers = RayWorkers([], [], [], started_ray=start_ray(spec))
    try:  # whatever fails from here (a timeout, a worker's constructor, Ctrl-C) releases what was reserved
        validate_placement(spec, derive_roles(cfg), cluster_resources(ray.nodes()))
        bundles = [{"CPU": g.cpus_per_worker, **({"GPU": g.gpus_per_worker} if g.gpus_per_worker else {})}
                   for g in spec.groups for _ in range(g.workers)]
        workers.placement_group = placement_group(bundles, strategy="PACK")
        ray.get(workers.placement_group.ready(), timeout=120)
        pg = workers.placement_group
        models, settings = WorkerModels.from_config(cfg, run_dir), RolloutSettings.from_config(cfg, reward_rows)
        settings = dataclasses.replace(settings, max_model_len=max_model_len)
        pin = pins_cores(cfg.placement.pin_cores, workers.started_ray, spec.address)
        t = time.perf_counter()
        for g in spec.groups:
            decodes, scores = "generator" in g.roles, any(r in g.roles for r in SCORING_ROLES)
            trains, first = "actor" in g.roles, len(workers.handles)
            group_ranks = list(spec.worker_ranks(g.name))
            holds = models.holding(decodes, scores, reference=decodes and settings.reference_on_decoders)
            workers.handles += start_role_workers(cfg, run_dir, g.workers, holds, settings,
                                                  g.cpus_per_worker, g.gpus_per_worker, pg, group_ranks[0], trains,
                                                  pin, wait=False)
            mine = list(range(first, len(workers.handles)))
            workers.ranks += group_ranks
            workers.groups += [g.name] * g.workers
            workers.decoders += mine if decodes else []
            workers.scorers += mine if scores else []
            workers.trainers += mine if trains else []
            jobs = [job for job, on in (("decode", decodes), ("score", scores), ("train", trains),
                                        ("reference log-probs", decodes and not scores and settings.reference_on_decoders))
                    if on]
            log(f"[placement] group {g.name}: {g.workers} worker(s) {' + '.join(jobs)}")
        # every group's workers start side by side: each spends seconds importing torch and loading its models, and
        # waiting group by group added those seconds up (20 s for 2 groups of 1 worker on 2 cores, 13 s together)
        wait_ready(workers.handles)
        train = TrainGroup([workers.handles[i] for i in workers.trainers],
                           sharded=cfg.rl.train_parallel == "fsdp" and len(workers.trainers) > 1)
        join_training(train.workers)
        pids = ray.get([w.pid.remote() for w in workers.handles])
        cores = ray.get([w.cores.remote() for w in workers.handles]) if pin else []
        where = ", ".join(f"{r}:{core_list(c) or 'not pinned'}" for r, c in zip(workers.ranks, cores))
        pinned = f"; on cores {where}" if cores else ""
        log(f"[placement] {len(workers.handles)} Ray worker(s) up in {time.perf_counter() - t:.1f}s (pids "
            f"{', '.join(f'{r}:{p}' for r, p in zip(workers.ranks, pids))}){pinned}; {len(train.workers)} train "
            f"{TRAIN_PARALLEL_WORDS.get(cfg.rl.train_parallel, 'as ' + cfg.rl.train_parallel + ' stages')}")
        driver = MultiWorkerRollout(workers.handles, settings, decoders=workers.decoders, scorers=workers.scorers)
        # sharded and synchronous, every scorer a training rank: the reference's and the critic's passes after the
        # decoding, each model gathered alone; where no rank then needs the whole actor (none decodes, and those that
        # score defer the reference), none gathers it: the weights go out a tensor at a time
        trainers, sync_mode = set(workers.trainers), train.sharded and cfg.rl.max_staleness == 0
        passes = (ray.get([workers.handles[i].defer_passes.remote() for i in workers.scorers])
                  if sync_mode and set(workers.scorers) <= trainers else [])
        deferred = any(passes)
        actor_needed = bool(trainers & set(workers.decoders)) or bool(trainers & set(workers.scorers)) and not (
            passes and all("reference" in p for p in passes))
        streamed = sync_mode and not actor_needed and (not cfg.model.lora or models.adapter is not None)
        differs = agreed_arithmetic(cfg, workers, log)
        driver.behaviour_differs = differs  # the asynchronous loop's scoring (score_in_order) takes it from there
        # vLLM's rows stay put, and so do an episode's (its turns are answered where it decodes)
        migrates = (cfg.rollout.migrate_below > 0 and ENGINES[settings.engine].migrates_rows
                    and settings.episodes is None)
        rollout = RayRollout(driver, workers, train, migrates, models.critic is not None,
                             models.adapter is not None, deferred, streamed, cfg.rl, differs,
                             set(workers.scorers) <= trainers)
        rates = {"train/lr": cfg.rl.lr} | ({"train/critic_lr": cfg.rl.critic_lr} if models.critic is not None else {})
        return rollout, RayTrainer(train, workers, cfg.rl.train_parallel, rates), workers
    except BaseException:
        workers.close()
        raise
