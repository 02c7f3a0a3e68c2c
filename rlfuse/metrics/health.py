"""Run health: pure checks over a run's metrics that a practitioner should read before the curves.

One so far: the proxy reward rose while the gold score (the default task's ground truth, which the reward model only
approximates) fell, the signature of a policy exploiting its reward."""

from __future__ import annotations

from dataclasses import dataclass

from rlfuse.metrics.panels import finite, series

GOLD_FALL = 0.02
"""Smallest fall of a gold score that counts, however many samples: gold scores and rates lie in [-1, 1]."""


def noise(n) -> float:
    """A fall smaller than this is noise over n samples: two standard errors of a rate at 1/2 (gold scores spread
    less), 1 / sqrt(n); the terminal's before/after table says the same (evaluation.eval_table)."""
    return 1 / n ** 0.5 if finite(n) and n > 0 else 0.0


GOLD_KEYS = (("gold_mean", "gold score"), ("gold_positive_rate", "gold positive rate"))


@dataclass(frozen=True)
class Divergence:
    """The reward went from reward[0] to reward[1] while `gold_name` went from gold[0] to gold[1], on `where`."""
    reward: tuple[float, float]
    gold_name: str
    gold: tuple[float, float]
    where: str

    def message(self) -> str:
        (r0, r1), (g0, g1) = self.reward, self.gold
        return (f"The reward rose from {r0:.3g} to {r1:.3g} while the {self.gold_name} fell from {g0:.3g} to {g1:.3g} "
                f"({self.where}): the policy may be exploiting the reward rather than improving. Read the samples "
                "below and the KL panel; a larger rl.kl_coef, fewer rl.iterations or a reward model trained on more "
                "pairs usually help.")


def _diverges(reward: tuple, gold: tuple, n=None) -> bool:
    """The reward rose and the gold fell by more than GOLD_FALL and the noise of n samples (n unknown: GOLD_FALL)."""
    return (all(finite(v) for v in (*reward, *gold)) and reward[1] > reward[0]
            and gold[0] - gold[1] >= max(GOLD_FALL, noise(n)))


def from_evaluation(eval_result: dict | None) -> Divergence | None:
    """eval.json's held-out evaluation before and after RL (reward_mean, gold_mean / gold_positive_rate; n, the
    held-out prompts, where recorded)."""
    before = (eval_result or {}).get("before") if isinstance(eval_result, dict) else None
    after = (eval_result or {}).get("after") if isinstance(eval_result, dict) else None
    if not isinstance(before, dict) or not isinstance(after, dict):
        return None
    reward = (before.get("reward_mean"), after.get("reward_mean"))
    for key, name in GOLD_KEYS:
        gold = (before.get(key), after.get(key))
        if _diverges(reward, gold, after.get("n", before.get("n"))):
            return Divergence(reward, name, gold, "held-out evaluation, before and after RL")
    return None


def _ends(values: list[float]) -> tuple[float, float]:
    """Mean of the first and of the last third: one noisy iteration at either end decides nothing."""
    n = max(1, len(values) // 3)
    return sum(values[:n]) / n, sum(values[-n:]) / n


def from_series(rows: list[dict]) -> Divergence | None:
    """The training samples' reward/mean against their reward/gold_mean, first third of the iterations to last."""
    xs, reward = series(rows, "reward/mean")
    gold_x, gold = series(rows, "reward/gold_mean")
    both = sorted(set(xs) & set(gold_x))
    if len(both) < 3:
        return None
    r = dict(zip(xs, reward))
    g = dict(zip(gold_x, gold))
    rs, gs = _ends([r[s] for s in both]), _ends([g[s] for s in both])
    counts = dict(zip(*series(rows, "rollout/samples")))
    n = sum(counts.get(s, 0) for s in both[:max(1, len(both) // 3)]) or None  # samples behind each third's mean
    if _diverges(rs, gs, n):
        return Divergence(rs, "gold score", gs, "training samples, first third of the iterations against the last")
    return None


def reward_gold_divergence(rows: list[dict], eval_result: dict | None) -> Divergence | None:
    """The held-out evaluation's finding first (the same prompts before and after), else the training series'."""
    return from_evaluation(eval_result) or from_series(rows)
