"""Step 1 of the RL loop (weight sync, then generate and score), wherever it runs: `LocalRollout` in this process,
or with placement.strategy != single `RayRollout` on Ray worker groups (ray_driver.py). trainers/rl.py calls
`build_rollout` once and then only these methods:

    with build_rollout(...) as rollout:
        sync = rollout.sync_weights(models)          # actor -> generator(s); critic -> scoring workers on Ray
        exp = rollout.generate(prompts, k, params, seed)
        row |= rollout.metrics(exp)                  # time/..., and on Ray migration/... and worker/<i>/...

Ray is imported only when the spec uses it.
"""

from __future__ import annotations

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
    """The actor's current weights into the generator, by an explicit copy."""
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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def build_rollout(cfg: Config, run_dir: Path, engine: DecodeEngine, scorer: Scorer, fusion: FusionPolicy, log):
    """LocalRollout, or with placement.strategy != single the Ray worker groups of the spec (Ray imported only then)."""
    from rlfuse.placement.strategies import spec_from_config

    spec = spec_from_config(cfg)
    if not spec.uses_ray:
        return LocalRollout(engine, scorer, fusion)
    from rlfuse.placement.ray_driver import start_ray_rollout

    log(spec.describe())
    return start_ray_rollout(cfg, spec, run_dir, log)
