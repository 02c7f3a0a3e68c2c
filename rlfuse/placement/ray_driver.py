"""Step 1 of the RL loop (weight sync, generate, score) on Ray worker groups laid out by a PlacementSpec.

trainers/rl.py asks `build_rollout` for a rollout object; with placement.strategy != single it gets a `RayRollout`
from here. Every group of the spec becomes Ray actors (rlfuse/placement/ray_rollout.py GenerationWorker), one per
worker, in one placement group (one bundle per worker, PACK), each holding only the inference roles of its group:
a group with the generator decodes; a group with the reference or the reward scores (reference log-probs, reward
and the critic's values, which go together: one pass over the finished samples). What this gives per strategy:

- flattened: every worker decodes and scores (with tail migration: freed workers score the finished samples);
- separated: the "generate" workers decode only; the "train" workers score while they decode;
- interleaved: the "train" workers decode; the "score" workers score while they decode.

The trainable roles (actor and critic updates) stay in the driver process until the data-parallel train workers
(ray_train.py) are wired in: with 2 workers, separated and interleaved both run as one decoding worker and one
scoring worker, and differ only in which group the trainer will join. Ray is imported inside the functions, so
importing this module never needs Ray.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from rlfuse.errors import UserError
from rlfuse.models.weights import merged_state_dict
from rlfuse.placement.spec import ClusterResources, NodeResources, PlacementSpec

SCORING_ROLES = ("reference", "reward")


def start_ray(spec: PlacementSpec) -> bool:
    """ray.init unless Ray is up already (a test, or a notebook, started it): local with the spec's CPUs, or the
    cluster at placement.address. Returns whether this call started it (so the run shuts down only its own Ray)."""
    try:
        import ray
    except ImportError:
        raise UserError(f"placement.strategy={spec.strategy} runs on Ray, which is not installed; "
                        "pip install 'ray==2.60.*' or use placement.strategy=single") from None
    if ray.is_initialized():
        return False
    if spec.address:
        ray.init(address=spec.address, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(num_cpus=max(1, int(round(spec.cpus))), num_gpus=int(spec.gpus + 0.999),
                 include_dashboard=False, log_to_driver=False)
    return True


def cluster_resources(nodes: list[dict]) -> ClusterResources:
    """ClusterResources from `ray.nodes()` (alive nodes' CPU and GPU totals)."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
    return ClusterResources(tuple(NodeResources(float(r.get("CPU", 0)), float(r.get("GPU", 0))) for r in alive))


def worker_metrics(timing: dict, ranks: list[int], rss_mb: list[float]) -> dict:
    """exp.timing of a multi-worker rollout -> the metrics row: time/ for seconds, migration/ under its own name,
    worker/<rank>/busy_s and worker/<rank>/rss_mb per worker (rank: the worker's global index in the spec)."""
    out = {"time/rollout": timing["rollout"], "time/scoring": timing["scoring"],
           "migration/migrated": timing["migrated"]}
    out |= {k: v for k, v in timing.items() if k.startswith("migration/")}
    for i, rank in enumerate(ranks):
        out[f"worker/{rank}/busy_s"] = timing[f"busy/worker{i}"]
        out[f"worker/{rank}/rss_mb"] = rss_mb[i]
    return out


@dataclass
class RayRollout:
    """The rollout object of trainers/rl.py (sync_weights, generate, metrics, close) on Ray generation workers."""
    spec: PlacementSpec
    driver: object
    """ray_rollout.MultiWorkerRollout over every worker, knowing which decode and which score."""
    ranks: list[int]
    migrate: bool
    placement_group: object = None
    started_ray: bool = False
    critic_on_workers: bool = False
    groups: list[str] = field(default_factory=list)
    """The spec group of each worker (messages name the worker by rank and group)."""

    def sync_weights(self, models) -> dict:
        """Actor -> every decoding worker, bucketed; and the critic -> every scoring worker when it trains (their
        frozen copies compute the values). Seconds and bytes summed over both."""
        with self._naming_dead_workers():
            out = self.driver.sync_weights(merged_state_dict(models.actor), role="generator")
            if self.critic_on_workers and models.critic is not None:
                critic = self.driver.sync_weights(merged_state_dict(models.critic), role="critic")
                out = {k: out[k] + critic[k] for k in out}
        return out

    def generate(self, prompts, k: int, params, seed: int):
        with self._naming_dead_workers():
            return self.driver.generate(prompts, k, params, seed, migrate=self.migrate)

    @contextlib.contextmanager
    def _naming_dead_workers(self):
        """A worker process that died (killed, out of memory) ends the run with one line naming it; the iteration
        under way is not logged, so `--resume` repeats it from the last checkpoint (kept in the driver)."""
        from ray.exceptions import RayActorError

        try:
            yield
        except RayActorError as e:
            ids = [w._actor_id.hex() for w in self.driver.workers]
            i = ids.index(e.actor_id) if e.actor_id in ids else None
            who = f"worker {self.ranks[i]} (group {self.groups[i]})" if i is not None else "a worker"
            raise UserError(f"placement: Ray {who} died during the rollout ({type(e).__name__}); the last "
                            f"checkpoint is kept: continue with `rlfuse rl --resume RUN_DIR`") from None

    def metrics(self, exp) -> dict:
        with self._naming_dead_workers():
            return worker_metrics(exp.timing, self.ranks, self.driver.rss_mb())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """End the workers and their placement group (and Ray, if this run started it)."""
        import ray

        if not ray.is_initialized():
            return
        for w in self.driver.workers:
            ray.kill(w)
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
        if self.started_ray:
            ray.shutdown()


def start_ray_rollout(cfg, spec: PlacementSpec, run_dir, log=print) -> RayRollout:
    """Validate the spec against the cluster, reserve one bundle per worker (PACK), start each group's workers with
    the models of its roles, and return the RL loop's rollout object."""
    import ray
    from ray.util.placement_group import placement_group

    from rlfuse.models.roles import derive_roles
    from rlfuse.placement.check import validate_placement
    from rlfuse.placement.ray_rollout import (MultiWorkerRollout, RolloutSettings, WorkerModels,
                                              start_generation_workers)

    started = start_ray(spec)
    try:
        validate_placement(spec, derive_roles(cfg), cluster_resources(ray.nodes()))
        bundles = [{"CPU": g.cpus_per_worker, **({"GPU": g.gpus_per_worker} if g.gpus_per_worker else {})}
                   for g in spec.groups for _ in range(g.workers)]
        pg = placement_group(bundles, strategy="PACK")
        ray.get(pg.ready(), timeout=120)
        models, settings = WorkerModels.from_config(cfg, run_dir), RolloutSettings.from_config(cfg)
        workers, ranks, groups, decoders, scorers = [], [], [], [], []
        t = time.perf_counter()
        for g in spec.groups:
            decodes, scores = "generator" in g.roles, any(r in g.roles for r in SCORING_ROLES)
            if not (decodes or scores):  # only trainable roles: they train in the driver for now
                continue
            first = len(workers)
            group_ranks = list(spec.worker_ranks(g.name))
            workers += start_generation_workers(g.workers, models.holding(decodes, scores), settings,
                                                g.cpus_per_worker, pg, first_bundle=group_ranks[0])
            ranks += group_ranks
            groups += [g.name] * g.workers
            decoders += list(range(first, len(workers))) if decodes else []
            scorers += list(range(first, len(workers))) if scores else []
            log(f"[placement] group {g.name}: {g.workers} worker(s) "
                f"{'decode' if decodes else ''}{' + ' if decodes and scores else ''}{'score' if scores else ''}")
        pids = ray.get([w.pid.remote() for w in workers])
        log(f"[placement] {len(workers)} Ray worker(s) up in {time.perf_counter() - t:.1f}s (pids "
            f"{', '.join(f'{r}:{p}' for r, p in zip(ranks, pids))}); actor and critic updates run in the driver")
        driver = MultiWorkerRollout(workers, settings, decoders=decoders, scorers=scorers)
        critic_trains = models.critic is not None
        return RayRollout(spec, driver, ranks, cfg.rollout.migrate_below > 0, pg, started, critic_trains, groups)
    except BaseException:
        if started:
            ray.shutdown()
        raise
