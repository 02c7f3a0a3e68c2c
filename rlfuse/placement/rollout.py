"""Where steps 1 and 4 of the RL loop run: `build_placement` gives trainers/rl.py a rollout (weight sync, then
generate and score) and a trainer (update, checkpoints). With placement.strategy=single they are `LocalRollout`
and rl.py's `LocalTrainer` in this process; otherwise ray_driver.py's `RayRollout` and `RayTrainer` on Ray worker
groups. trainers/rl.py calls only these methods:

    with build_placement(...) as (rollout, trainer):
        sync = rollout.sync_weights(models)          # actor -> generator(s); critic -> scoring workers on Ray
        exp = rollout.generate(prompts, k, params, seed)
        stats = trainer.update(exp, adv, returns, kl_coef, batches, bad, temperature)
        row |= rollout.metrics(exp)                  # time/..., and on Ray migration/... and worker/<i>/...
        trainer.save_checkpoint(path, iteration, kl_coef, counters)
    trainer.pull_into(models)                        # the trained weights into this process's models

Ray is imported only when the spec uses it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rlfuse.config import Config
from rlfuse.models.build import Models
from rlfuse.models.weights import merged_state_dict
from rlfuse.rollout.engine import DecodeEngine, SamplingParams
from rlfuse.rollout.fusion import Experience, FusionPolicy, generate_rollouts
from rlfuse.rollout.score import Scorer


def sync_weights(engine: DecodeEngine, actor: torch.nn.Module) -> dict:
    """The actor's current weights into the generator, by an explicit copy; none when the engine decodes the actor's
    own shared base (model.shared_base), which reports 0 bytes."""
    if engine.shares_weights:
        return {"time/weight_sync": 0.0, "sync/bytes": 0}
    t = time.perf_counter()
    n = engine.load_weights(merged_state_dict(actor))
    return {"time/weight_sync": time.perf_counter() - t, "sync/bytes": n}


@dataclass
class LocalRollout:
    """Step 1 of the loop in this process: weight sync, then generate and score (fusion). With placement on Ray the
    loop gets rlfuse/placement/ray_driver.py's RayRollout instead, with the same methods."""
    engine: DecodeEngine
    scorer: Scorer
    fusion: FusionPolicy

    def sync_weights(self, models: Models) -> dict:
        return sync_weights(self.engine, models.actor)  # the critic is this process's own module: nothing to copy

    def generate(self, prompts: list[list[int]], k: int, params: SamplingParams, seed: int) -> Experience:
        before, self.scorer.temperature = dict(self.scorer.times), params.temperature
        exp = generate_rollouts(self.engine, self.scorer, prompts, k, params, seed, self.fusion)
        exp.timing |= {f"score_{role}": t - before.get(role, 0.0) for role, t in self.scorer.times.items()}
        return exp

    def metrics(self, exp: Experience) -> dict:
        return {f"time/{k}": v for k, v in exp.timing.items() if not k.startswith("decode")}


def uses_ray(cfg: Config) -> bool:
    """Whether the run's placement runs on Ray workers (nothing starts here)."""
    from rlfuse.placement.strategies import spec_from_config

    return spec_from_config(cfg).uses_ray


def local_scorer(models: Models, cfg: Config) -> Scorer:
    """The scorer of a process holding the roles itself (this one, or a Ray worker that also trains): reference
    (the actor with adapters off where it has no model of its own), reward, and the critic being trained."""
    rl = cfg.rl
    return Scorer(models.reward_fn, models.tokenizer.pad_token_id, ref=models.ref, actor=models.actor,
                  critic=models.critic, temperature=rl.temperature, micro_batch_size=cfg.rollout.micro_batch_size,
                  unfinished_penalty=rl.unfinished_penalty, share_prompt=rl.share_prompt)


@contextlib.contextmanager
def build_placement(cfg: Config, run_dir: Path, engine: DecodeEngine, scorer: Scorer, fusion: FusionPolicy,
                    local_trainer, log):
    """(rollout, trainer): LocalRollout and `local_trainer` in this process, or with placement.strategy != single
    the Ray worker groups of the spec (Ray imported only then), closed on exit."""
    from rlfuse.placement.strategies import spec_from_config

    spec = spec_from_config(cfg)
    if not spec.uses_ray:
        yield LocalRollout(engine, scorer, fusion), local_trainer
        return
    from rlfuse.placement.ray_driver import start_ray_placement

    log(spec.describe())
    # reward functions' dataset columns travel with the settings (rewards.attach_rows did it for this process)
    rows = getattr(scorer.reward_fn, "rows", None)
    rollout, trainer, workers = start_ray_placement(cfg, spec, run_dir, log, reward_rows=rows)
    try:
        yield rollout, trainer
    finally:
        workers.close()
