"""Which backend runs a run's rollout and trainer (runtime/protocols.py): this process for placement.strategy=single,
else the Ray worker groups of the placement spec."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from rlfuse.config import Config
from rlfuse.errors import UserError
from rlfuse.plan.strategies import spec_from_config
from rlfuse.rollout.engine import DecodeEngine
from rlfuse.rollout.fusion import FusionPolicy
from rlfuse.rollout.score import Scorer
from rlfuse.runtime.local import LocalRollout, LocalTrainer
from rlfuse.runtime.protocols import Rollout, Trainer


def uses_ray(cfg: Config) -> bool:
    """Whether the run's placement runs on Ray workers (nothing starts here)."""
    return spec_from_config(cfg).uses_ray


@contextlib.contextmanager
def build_placement(cfg: Config, run_dir: Path, engine: DecodeEngine, scorer: Scorer, fusion: FusionPolicy,
                    local_trainer: LocalTrainer, log) -> Iterator[tuple[Rollout, Trainer]]:
    """(rollout, trainer): LocalRollout and `local_trainer` in this process, or with placement.strategy != single
    the Ray worker groups of the spec (ray_driver.py's RayRollout and RayTrainer; Ray imported only then), closed on
    exit."""
    spec = spec_from_config(cfg)
    if not spec.uses_ray:
        yield LocalRollout(engine, scorer, fusion), local_trainer
        return
    try:  # Ray (an optional install): imported only for a placement on Ray workers
        from rlfuse.runtime.ray_driver import start_ray_placement
    except ImportError as e:
        if e.name != "ray" and not str(e.name).startswith("ray."):
            raise
        raise UserError(f"placement.strategy={spec.strategy} runs on Ray, which is not installed; "
                        "pip install 'ray==2.60.*' or use placement.strategy=single") from None
    log(spec.describe())
    # reward functions' dataset columns travel with the settings (rewards.attach_rows did it for this process)
    rows = getattr(scorer.reward_fn, "rows", None)
    rollout, trainer, workers = start_ray_placement(cfg, spec, run_dir, log, reward_rows=rows)
    try:
        yield rollout, trainer
    finally:
        workers.close()
