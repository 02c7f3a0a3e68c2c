"""One Ray actor per worker of a placement spec, holding its group's roles: a `RoleWorker` decodes if its group has
the generator, scores (reference, reward and the critic's values, one pass over finished samples) if it has the
reference or the reward, and trains as one rank of data-parallel training if it has the actor. A worker that both
trains and decodes (flattened) or trains and scores (separated) shares its models between those jobs, as the single
process does: it decodes its actor replica itself (full fine-tuning in fp32), or copies the actor's (merged) weights
into its generator in-process (a bf16 copy, made at each sync and freed before the update as in one process; LoRA's
merged copy in bf16), and its scorer reads the critic it trains. Its models are built by models/build.py as the single
process's are, so its passes autocast as that process's do (run.precision, Models.compute_dtype).

Imports Ray: only a placement on Ray workers imports this module (runtime/backend.py).
"""

from __future__ import annotations

import time

import torch

from rlfuse.models.device import dtype_name
from rlfuse.models.weights import merged_weights
from rlfuse.runtime.local import behaviour_differs, decode_engine, local_scorer, release_decode_copy
from rlfuse.runtime.process import pin_threads
from rlfuse.runtime.ray_common import start_actors
from rlfuse.runtime.ray_rollout import GenerationWorker, RolloutSettings, WorkerModels, with_episodes
from rlfuse.runtime.ray_train import TrainWorker


class RoleWorker(GenerationWorker, TrainWorker):
    """GenerationWorker's calls (start, advance, export, import_rows, score, load_weights) where the worker decodes
    or scores, TrainWorker's (join, update, actor_weights, checkpoints) where it trains."""

    def __init__(self, cfg, run_dir: str, models: WorkerModels, settings: RolloutSettings, threads: int = 1,
                 rank: int | None = None, world: int = 1):
        pin_threads(threads)
        self.trains = rank is not None
        if not self.trains:
            GenerationWorker.__init__(self, models, settings, threads)
            return
        keep = (("generator",) if models.decodes else ()) + (("ref", "reward_fn") if models.scores else ())
        TrainWorker.__init__(self, cfg, run_dir, rank, world, threads, keep)
        self._setup(*self._own_engine_and_scorer(cfg, models, settings), settings)

    def _own_engine_and_scorer(self, cfg, models: WorkerModels, settings: RolloutSettings):
        """An engine on this worker's generator (LoRA) or its actor replica itself (local.decode_engine) and a scorer
        on its reference, reward and the critic it trains."""
        engine = decode_engine(self.models, settings.max_rows, settings.eos_token_id) if models.decodes else None
        engine = with_episodes(engine, self.models.tokenizer, settings)
        return engine, local_scorer(self.models, cfg) if models.scores else None

    def arithmetic(self) -> dict:
        """GenerationWorker.arithmetic of a worker that trains: its passes compute in its Models.compute_dtype, its
        engine (if it decodes) in its generator's dtype, or the replica's own where it decodes that."""
        if not self.trains:
            return GenerationWorker.arithmetic(self)
        compute = self.models.compute_dtype
        differs = (behaviour_differs(self.engine, self.models.actor, compute) if self.engine is not None else
                   compute is not None)
        return {"compute": dtype_name(compute or torch.float32),
                "decode": None if self.engine is None else dtype_name(self.engine.dtype), "behaviour_differs": differs}

    def update(self, *args, **kwargs) -> dict:
        """TrainWorker.update, the generator's per-sync copy freed first (full fine-tuning's bf16 copy, as
        LocalRollout frees it after the rollout): the update's peak is without it; the next sync makes it again."""
        if self.engine is not None:
            release_decode_copy(self.engine)
        return TrainWorker.update(self, *args, **kwargs)

    def defer_passes(self) -> tuple[str, ...]:
        """Sharded training on a worker that scores: the fused scoring leaves out the passes of its sharded reference
        and of a separate critic, and deferred_passes runs them after the decoding, one model gathered whole at a
        time, never beside the whole actor. -> the passes deferred (none: nothing to defer)."""
        separate_critic = self.learners.critic is not None and not self.learners.shared_body
        self.scorer.deferred = (("reference",) if self.group.frozen else ()) + (("critic",) if separate_critic else ())
        return self.scorer.deferred

    def deferred_passes(self, prompts: list[list[int]], responses: list[list[int]]) -> tuple[dict, float]:
        """The deferred passes over this rank's share of the iteration's samples: for each, the whole weights held
        until now freed and that model's gathered (a collective: every training rank calls it, with a share or
        none), one pass, freed again. -> ({pass: one tensor per sample}, seconds)."""
        t, out = time.perf_counter(), {}
        try:
            for role in self.scorer.deferred:
                self.group.shard_again()
                self.group.gather(self.group.frozen if role == "reference" else [self._root_of(self.models.critic)])
                out[role] = self.scorer.deferred_pass(role, prompts, responses) if prompts else []
        finally:
            self.group.shard_again()
        return out, time.perf_counter() - t

    def sync_from_actor(self) -> tuple[int, float]:
        """The actor's weights into this worker's own generator (it holds a replica): no transfer; none at all where
        the engine decodes the replica itself. -> (bytes, s)."""
        if self.engine.shares_weights:
            return 0, 0.0
        t = time.perf_counter()
        return self.engine.load_weights(merged_weights(self.models.actor, deferred=True)), time.perf_counter() - t


def start_role_workers(cfg, run_dir, n: int, models: WorkerModels, settings: RolloutSettings, cpus_per_worker: float,
                       gpus_per_worker: float, placement_group, first_bundle: int, trains: bool,
                       pin_cores: bool = False, wait: bool = True) -> list:
    """n RoleWorker actors in bundles first_bundle.. of placement_group (ray_common.start_actors), ranks 0..n-1 of
    training if `trains`, each on its own cores if `pin_cores`; returns once their models are loaded (at once with
    wait=False: ray_common.wait_ready)."""
    threads = max(1, int(cpus_per_worker))
    return start_actors(RoleWorker, n, lambda i: (cfg, str(run_dir), models, settings, threads, i if trains else None,
                                                  n), cpus_per_worker, gpus_per_worker, placement_group, first_bundle,
                        pin_cores, wait)
