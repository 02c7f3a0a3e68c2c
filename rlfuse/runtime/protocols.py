"""The two objects trainers/rl.py's loop sees, whichever backend runs them (backend.py build_placement): a rollout
(steps 1 and 2: weight sync, then generate and score) and a trainer (step 4: the update, and its checkpoints). In
this process they are local.py's LocalRollout and LocalTrainer; on Ray, ray_driver.py's RayRollout and RayTrainer
(ray_async.py's AsyncRollout with rl.max_staleness on the separated placement).

    with build_placement(...) as (rollout, trainer):
        sync = rollout.sync_weights(models)          # actor -> generator(s); critic -> scoring workers on Ray
        exp = rollout.generate(request)              # request: the iteration's prompts, k, sampling, seed
        stats = trainer.update(exp, adv, returns, kl_coef, batches, bad, temperature)
        row |= rollout.metrics(exp)                  # time/..., and on Ray migration/... and worker/<i>/...
        rollout.save_in_flight(path, iteration)      # async: the batches generated ahead
        trainer.save_checkpoint(path, iteration, kl_coef, counters)
    trainer.pull_into(models)                        # the trained weights into this process's models
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from rlfuse.learn.update import BadSteps
from rlfuse.models.build import Models
from rlfuse.rollout.fusion import Experience
from rlfuse.rollout.state import RolloutRequest


class Rollout(Protocol):
    def sync_weights(self, models: Models) -> dict:
        """The actor's weights into the generator(s) (and on Ray the critic's into scoring workers that do not train
        it): time/weight_sync and sync/bytes."""

    def generate(self, request: RolloutRequest) -> Experience:
        """The request's k samples per prompt, each scored (reward, reference log-probs, critic values) as it
        finishes. Asynchronous (ray_async.py): the batch was decoded ahead, by weights up to rl.max_staleness
        updates old (exp.staleness)."""

    def metrics(self, exp: Experience) -> dict:
        """The rollout's own metrics of that experience (time/..., on Ray migration/... and worker/<rank>/...)."""

    def save_in_flight(self, path: Path, iteration: int) -> None:
        """Beside the trainer's checkpoint of `iteration`: the batches generated ahead and not yet trained
        (asynchronous RL), so a resumed run trains the very samples the uninterrupted one would."""

    def begin_at(self, path: Path, iteration: int) -> None:
        """The run starts at `iteration`: 0, or a resumed checkpoint's (path), whose batches in flight it takes back."""


class Trainer(Protocol):
    def update(self, exp: Experience, adv, returns, kl_coef: float, batches: list[list[int]], bad: BadSteps,
               temperature: float | None = None) -> dict:
        """One update of the actor (and critic) on the experience; skipped steps are counted in `bad`."""

    def learning_rates(self) -> dict:
        """train/lr (and train/critic_lr) as the optimisers use them now."""

    def save_checkpoint(self, path: Path, iteration: int, kl_coef: float, counters: dict) -> None:
        """Everything a resumed run needs to repeat the uninterrupted one (rlfuse/learn/checkpoint.py)."""

    def load_checkpoint(self, path: Path) -> dict:
        """Restore it; returns its iteration, kl_coef and counters."""

    def pull_into(self, models: Models) -> None:
        """The trained weights into this process's models (its evaluation and the saved model)."""
