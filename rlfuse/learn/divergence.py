"""Divergence that is not a NaN: a loss that blows up while staying finite. SFT at lr 0.9 without clipping went from
6.9 nats to 59 at its second step and stayed between 33 and 129 for 40 steps, and the stage saved that model with
exit 0; the NaN/inf path (update.py BadSteps) never saw it. Pure Python (no torch): the trainers feed it numbers.

- SFT and the reward model: LossWatch follows the stage's training loss (cross-entropy per token, the pairwise loss
  per pair: both >= 0, in nats) and says when it has blown up, when a checkpoint may be written (no step of the
  recent window looks blown), and whether a written one came before the blow-up.
- RL: its clipped objective is bounded by construction and says nothing of the policy's state (on a PPO run at lr
  0.2 it went 0.44, 0.51, 0.0 while the policy collapsed onto one word); rl_blowup reads the update's own move
  instead, train/approx_kl (rlfuse/algos/losses.py: half the mean squared log-ratio of the sampled tokens between
  the policy being trained and the one that sampled them), which on that run went 50, then 537 nats per token.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

WINDOW = 5
"""The loss is smoothed by the median of the last WINDOW steps: one hard (or easy) batch does not move it, and a
blow-up that lasts shows in it after ceil(WINDOW / 2) = 3 steps."""
RATIO = 2.0
"""A blown loss is above RATIO times its best (smoothed) value so far. A healthy stage's smoothed loss falls, or creeps
up by some per cent when it overfits; the early spike of a stage at a learning rate too high to train well but not
blowing up (tiny SFT at lr 0.3 without clipping: 6.1 -> 8.9, back to 4.3 by step 60) stays under 1.5 times."""
RISE = 1.0
"""... and at least RISE nats above it, so a loss near zero does not count doubling as a blow-up (a reward model's
pairwise loss 0.05 -> 0.1 is noise). One nat above the best is a text e times less likely per token, or a reward
model ranking its pairs worse than chance (log 2 = 0.69) from below 0.7."""
PATIENCE = 3
"""Steps in a row the smoothed loss must stay over the limit: a spike that training recovers from is not a blow-up.
With WINDOW, a loss that blows up is stopped about 5 steps after it did."""
SETTLE = 3
"""The best is taken from medians of at least SETTLE losses, so one odd batch at the start is never the reference (a
completion-only batch of hh-rlhf cut before its answer had loss 0 at step 1, and a healthy 6.0 looked blown)."""
STEP_KL = 10.0
"""RL: an update that moved the policy by more than STEP_KL nats per token on its own samples (train/approx_kl) blew
it apart. Healthy PPO/GRPO updates move it by 0.001 to 0.1 (target-KL conventions are 0.01 to 0.05); GRPO at lr 0.05
without clipping reached 4.1 once and recovered; PPO at lr 0.2 reached 50 at its first update and collapsed onto
one repeated word (entropy 0, value loss 0.06 -> 69). One iteration is enough: its figure is already a mean over every
token of every optimiser step of the iteration."""


@dataclass(frozen=True)
class Blowup:
    """What LossWatch found: at `step` the smoothed loss was `loss` (the median of `window` losses), against
    `reference`, the best at `best_step` (0: the know-nothing loss LossWatch was given, `reference_name`)."""
    step: int
    loss: float
    window: int
    reference: float
    best_step: int
    reference_name: str = ""

    def against(self) -> str:
        return (f"{self.reference:.3g} at its best (step {self.best_step})" if self.best_step else
                f"{self.reference:.3g}, {self.reference_name}")


class LossWatch:
    """One stage's training loss, step by step (add); blown when the median of the last `window` losses stays above
    max(ratio x reference, reference + rise) for `patience` steps in a row. The reference is the lower of the best
    such median so far (of at least `settle` losses) and `chance`, the loss of a model that knows nothing (SFT: the log
    of its vocabulary, a uniform guess), so that a loss blowing up at step 2 is measured against something too.
    Non-finite losses are the NaN path's (BadSteps) and are left out."""

    def __init__(self, chance: float = math.inf, chance_name: str = "", window: int = WINDOW, ratio: float = RATIO,
                 rise: float = RISE, patience: int = PATIENCE, settle: int = SETTLE):
        self.chance, self.chance_name = chance, chance_name
        self.window, self.ratio, self.rise, self.patience, self.settle = window, ratio, rise, patience, settle
        self.losses: dict[int, float] = {}
        self.recent: list[float] = []
        self.high: list[bool] = []  # whether each of `recent` was over the limit of its own step
        self.best, self.best_step, self.streak, self.smoothed = math.inf, 0, 0, math.nan

    def reference(self) -> float:
        return min(self.best, self.chance)

    def limit(self) -> float:
        """The smoothed loss over which a step counts towards a blow-up (inf before any reference)."""
        ref = self.reference()
        return max(self.ratio * ref, ref + self.rise)

    def add(self, step: int, loss: float) -> Blowup | None:
        """The loss of `step` (computed on the weights after step - 1); a Blowup once it has blown up."""
        if not math.isfinite(loss):
            return None
        self.losses[step] = loss
        self.recent = (self.recent + [loss])[-self.window:]
        self.smoothed = statistics.median(self.recent)
        self.streak = self.streak + 1 if self.smoothed > self.limit() else 0
        if self.streak == 0 and len(self.recent) >= self.settle and self.smoothed < self.best:
            self.best, self.best_step = self.smoothed, step
        self.high = (self.high + [loss > self.limit()])[-self.window:]
        return self.blowup(step) if self.streak >= self.patience else None

    def blowup(self, step: int) -> Blowup:
        ref_step = self.best_step if self.best <= self.chance else 0
        return Blowup(step, self.smoothed, len(self.recent), self.reference(), ref_step, self.chance_name)

    def rising(self) -> bool:
        """Whether the smoothed loss is over the limit now (a stage that ends here ends blown, however short the
        streak)."""
        return self.streak > 0

    def calm(self) -> bool:
        """Whether a checkpoint may be written now: no loss of the window was over its limit. A checkpoint due while
        the loss is rising is skipped, so one written is never from inside a blow-up (at worst from the step just
        before it, which before_blowup tells)."""
        return self.streak == 0 and not any(self.high)

    def before_blowup(self, step: int) -> bool:
        """Whether a checkpoint of `step` (the weights after it) is from before the blow-up: the loss measured on
        its weights (at step + 1) was under the limit, or it is older than what this watch saw (a checkpoint of an
        earlier process, before the one this process resumed from)."""
        if step + 1 not in self.losses:
            return not self.losses or step + 1 < min(self.losses)
        return self.losses[step + 1] <= self.limit()


def blown_at(losses: list[float], **kwargs) -> Blowup | None:
    """The first blow-up of a series of losses (steps 1, 2, ...), or None: LossWatch over a whole series."""
    watch = LossWatch(**kwargs)
    for step, loss in enumerate(losses, 1):
        if (found := watch.add(step, loss)) is not None:
            return found
    return None


def rl_blowup(approx_kl: float | None, limit: float = STEP_KL) -> bool:
    """Whether an RL update blew the policy apart: it moved the log-probabilities of its own samples by more than
    `limit` nats per token (train/approx_kl, None where the update was skipped). A single optimiser step per iteration
    (rl.epochs=1 and one mini-batch) measures its loss before it moves, so approx_kl is 0 there and cannot tell."""
    return approx_kl is not None and math.isfinite(approx_kl) and approx_kl > limit


def stage_blowup_line(stage: str, found: Blowup, kept: str, fix: str) -> str:
    """'sft diverged at step 212: loss 54.1 (the median of its last 5 steps) against 2.3 at its best (step 150);
    <kept>; <fix>'."""
    return (f"{stage} diverged at step {found.step}: loss {found.loss:.3g} (the median of its last {found.window} "
            f"steps) against {found.against()}; {kept}; {fix}")


def rl_blowup_line(iteration: int, approx_kl: float, kept: str, fix: str) -> str:
    return (f"rl diverged at iteration {iteration}: its update moved the policy by {approx_kl:.3g} nats per token on "
            f"its own samples (train/approx_kl; healthy updates move it by under 0.1, the limit is {STEP_KL:g}); "
            f"{kept}; {fix}")
