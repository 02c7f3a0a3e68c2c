"""Which backend runs a run's rollout and trainer (runtime/protocols.py): this process for placement.strategy=single,
else the Ray worker groups of the placement spec."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from rlfuse.config import Config
from rlfuse.errors import UserError
from rlfuse.plan.strategies import spec_from_config
from rlfuse.rollout.generator import Generator
from rlfuse.rollout.fusion import FusionPolicy
from rlfuse.rollout.score import Scorer
from rlfuse.runtime.local import LocalRollout, LocalTrainer
from rlfuse.runtime.protocols import Rollout, Trainer


def uses_ray(cfg: Config) -> bool:
    """Whether the run's placement runs on Ray workers (nothing starts here)."""
    return spec_from_config(cfg).uses_ray


def runs_async(cfg: Config) -> bool:
    """Whether rl.max_staleness applies: generation on workers of its own (placement.strategy=separated), where it
    can run ahead of training. Elsewhere the same workers generate and train: nothing to overlap."""
    return cfg.rl.max_staleness > 0 and spec_from_config(cfg).strategy == "separated"


@contextlib.contextmanager
def build_placement(cfg: Config, run_dir: Path, engine: Generator, scorer: Scorer, fusion: FusionPolicy,
                    local_trainer: LocalTrainer, requests, log, max_model_len: int | None = None
                    ) -> Iterator[tuple[Rollout, Trainer]]:
    """(rollout, trainer): LocalRollout and `local_trainer` in this process, or with placement.strategy != single
    the Ray worker groups of the spec (ray_driver.py's RayRollout and RayTrainer; Ray imported only then; with
    rl.max_staleness on the separated placement ray_async.py's AsyncRollout, which asks `requests(iteration)` for
    the batches it decodes ahead), closed on exit. max_model_len: the longest prompt plus rl.max_new_tokens, what a
    vLLM generation worker sizes its requests for."""
    spec = spec_from_config(cfg)
    if cfg.rl.max_staleness and not runs_async(cfg):
        log(f"[rl] rl.max_staleness={cfg.rl.max_staleness} has no effect with placement.strategy={spec.strategy}: "
            "the same workers generate and train, so the loop stays synchronous (asynchronous RL runs with "
            "placement.strategy=separated)")
    if not spec.uses_ray:
        yield LocalRollout(engine, scorer, fusion, cfg.rl), local_trainer
        return
    try:  # Ray (an optional install): imported only for a placement on Ray workers
        from rlfuse.runtime.ray_async import AsyncRollout
        from rlfuse.runtime.ray_driver import start_ray_placement
    except ImportError as e:
        if e.name != "ray" and not str(e.name).startswith("ray."):
            raise
        raise UserError(f"placement.strategy={spec.strategy} runs on Ray, which is not installed; "
                        "pip install 'ray==2.60.*' or use placement.strategy=single") from None
    log(spec.describe())
    # reward functions' dataset columns travel with the settings (rewards.attach_rows did it for this process), and
    # episodes' environments read the same rows
    rows = getattr(scorer.reward_fn, "rows", None) or getattr(getattr(engine, "episodes", None), "rows", None)
    rollout, trainer, workers = start_ray_placement(cfg, spec, run_dir, log, reward_rows=rows,
                                                    max_model_len=max_model_len)
    if runs_async(cfg):
        rollout = AsyncRollout(rollout, requests, cfg.rl, log)
        log(f"[rl] asynchronous: iteration i trains the batch the weights of update max(0, i - "
            f"{cfg.rl.max_staleness}) generated (rl.max_staleness={cfg.rl.max_staleness})")
    try:
        yield rollout, trainer
    finally:
        workers.close()
