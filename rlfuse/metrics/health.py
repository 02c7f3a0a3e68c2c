"""Run health: pure checks over a run's metrics that a practitioner should read before the curves.

DETECTORS is one table of rules over the per-iteration series (length drift, KL acceleration, entropy collapse, group
collapse, one reward dominating, reward up while gold or held-out score down, value-loss blow-up, clip or importance
weight runaway); `audit` runs them all on a run's rows, `HealthWatch` runs them live. The thresholds are the constants
beside each rule, validated by `python -m bench.audit` on planted hacks and clean runs (docs/health.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from rlfuse.metrics.panels import finite, metric_keys, series

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

    def summary(self) -> str:
        (r0, r1), (g0, g1) = self.reward, self.gold
        return (f"The reward rose from {r0:.3g} to {r1:.3g} while the {self.gold_name} fell from {g0:.3g} to {g1:.3g} "
                f"({self.where})")

    def message(self) -> str:
        return (f"{self.summary()}: the policy may be exploiting the reward rather than improving. Read the samples "
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


# ---- run health detectors -------------------------------------------------------------------------------------
# Each detector is a pure function of the per-iteration series (metrics.jsonl rows) and a few run facts; its rule and
# thresholds are in its docstring and the constants beside it. Series are smoothed by a trailing mean over SMOOTH
# iterations, and a rule must hold for SUSTAIN iterations in a row: one noisy iteration never alerts.

SMOOTH = 3
"""Iterations in the trailing mean every rule reads (one iteration's 32-128 samples are noisy)."""
SUSTAIN = 2
"""Smoothed iterations in a row a rule must hold before it alerts; the onset is the first of them."""
BASELINE = 3
"""The first iterations, sampled from the model RL started from: the run's own reference for length and entropy."""


@dataclass(frozen=True)
class RunFacts:
    """What the detectors read beyond the metrics: from the run's config.yaml and eval.json where present."""
    reward_weights: dict = field(default_factory=dict)
    """Reward function name -> its weight in the sum (rl.reward, rl.reward_weights); missing names weigh 1."""
    eval_result: dict | None = None


@dataclass(frozen=True)
class Finding:
    detector: str
    title: str
    onset: int
    """The RL iteration at which the rule first held (and kept holding for SUSTAIN iterations)."""
    strength: str
    """How far past the threshold, in the metric's own words."""
    advice: str
    panel: str
    """The report's dashboard panel (panels.PANELS name) where the onset is marked."""

    def line(self) -> str:
        return f"{self.title} from iteration {self.onset}: {self.strength}. {self.advice}"


def smoothed(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, trailing mean over SMOOTH iterations) of one metric; the first SMOOTH-1 points average fewer."""
    xs, ys = series(rows, key)
    return xs, [sum(ys[max(0, i - SMOOTH + 1):i + 1]) / (i + 1 - max(0, i - SMOOTH + 1)) for i in range(len(ys))]


def baseline(rows: list[dict], key: str) -> float | None:
    """Mean of the metric over the first BASELINE iterations that logged it; None with fewer."""
    _, ys = series(rows, key)
    return sum(ys[:BASELINE]) / BASELINE if len(ys) >= BASELINE else None


def first_sustained(xs: list[int], holds: list[bool], start: int = 0) -> int | None:
    """The step where `holds` first stays true for SUSTAIN points in a row, from index `start` on."""
    run = 0
    for i in range(start, len(holds)):
        run = run + 1 if holds[i] else 0
        if run >= SUSTAIN:
            return xs[i - SUSTAIN + 1]
    return None


LENGTH_RATIO = 2.0
"""Length drift: the smoothed mean response length above 2x (or below half) the first iterations' mean..."""
LENGTH_MIN_TOKENS = 4.0
"""...and at least this many tokens away from it (a 3-token answer growing to 5 is not drift)."""
LIMIT_PILE = 0.5
"""Or: at least half the samples stop at the token limit, where the first iterations had under LIMIT_BASE."""
LIMIT_BASE = 0.25


def length_drift(rows: list[dict], facts: RunFacts) -> tuple[int, str] | None:
    """Mean response length moving away from the starting model's (LENGTH_RATIO and LENGTH_MIN_TOKENS), or piling up
    at the token limit (LIMIT_PILE of the samples truncated, from under LIMIT_BASE)."""
    base = baseline(rows, "rollout/length_mean")
    found = []
    if base:
        xs, ys = smoothed(rows, "rollout/length_mean")
        holds = [(y / base >= LENGTH_RATIO or y / base <= 1 / LENGTH_RATIO) and abs(y - base) >= LENGTH_MIN_TOKENS
                 for y in ys]
        if (at := first_sustained(xs, holds, BASELINE)) is not None:
            y = max(ys[xs.index(at):], key=lambda v: abs(v - base))
            found.append((at, f"mean length {base:.1f} -> {y:.1f} tokens ({y / base:.1f}x)"))
    hit_base = baseline(rows, "rollout/hit_limit")
    if hit_base is not None and hit_base < LIMIT_BASE:
        xs, ys = smoothed(rows, "rollout/hit_limit")
        if (at := first_sustained(xs, [y >= LIMIT_PILE for y in ys], BASELINE)) is not None:
            found.append((at, f"{max(ys):.0%} of samples stop at the token limit (first iterations: {hit_base:.0%})"))
    return min(found) if found else None


KL_WINDOW = 5
"""KL acceleration: over the last KL_WINDOW iterations the smoothed KL grew by at least KL_GROWTH nats..."""
KL_GROWTH = 2.0
KL_FACTOR = 2.0
"""...to at least KL_FACTOR times its value KL_WINDOW iterations before, and faster than over the window before..."""
KL_PER_TOKEN = 1.0
"""...and past 1 nat per response token (reward/kl over rollout/length_mean): healthy runs of the shipped configs stay
under half that, and an adaptive controller's early climb to its target accelerates too but stays small per token."""


def kl_acceleration(rows: list[dict], facts: RunFacts) -> tuple[int, str] | None:
    """The KL to the reference growing faster and faster: the policy leaving the reference model at an accelerating
    rate (a healthy run's KL grows, then levels off under its coefficient)."""
    xs, ys = smoothed(rows, "reward/kl")
    length = dict(zip(*smoothed(rows, "rollout/length_mean")))
    w = KL_WINDOW
    holds = [False] * len(ys)
    for i in range(2 * w, len(ys)):
        grew, before = ys[i] - ys[i - w], ys[i - w] - ys[i - 2 * w]
        per_token = ys[i] / length[xs[i]] if length.get(xs[i]) else ys[i]  # no length logged: per sequence
        holds[i] = (grew >= KL_GROWTH and ys[i] >= KL_FACTOR * max(ys[i - w], 1e-9) and grew > before
                    and per_token >= KL_PER_TOKEN)
    if (at := first_sustained(xs, holds)) is None:
        return None
    i = xs.index(at)
    return at, f"KL {ys[i - w]:.2f} -> {ys[i]:.2f} nats in {w} iterations, {max(ys):.1f} at its peak"


ENTROPY_RATIO = 0.15
"""Entropy collapse: the smoothed entropy under 15% of the first iterations' and under ENTROPY_FLOOR nats/token.
Sharpening on a task with one right answer halves it or more; a collapsed policy's is near zero."""
ENTROPY_FLOOR = 0.05


def entropy_collapse(rows: list[dict], facts: RunFacts) -> tuple[int, str] | None:
    """The policy's per-token entropy falling to almost nothing: it samples one answer, exploration stops (or, with
    the reward at its best, reward_when, it has learned the one right answer to its training prompts)."""
    base = baseline(rows, "train/entropy")
    if not base:
        return None
    xs, ys = smoothed(rows, "train/entropy")
    holds = [y <= ENTROPY_RATIO * base and y <= ENTROPY_FLOOR for y in ys]
    if (at := first_sustained(xs, holds, BASELINE)) is None:
        return None
    confirmed = xs[xs.index(at) + SUSTAIN - 1]
    return at, f"entropy {base:.3f} -> {min(ys):.4f} nats/token ({min(ys) / base:.0%} of the start)" + \
        reward_when(rows, confirmed)


GROUP_COLLAPSE = 0.95
"""Group collapse: in at least 95% of the prompt groups every sample scored alike (smoothed), for GROUP_SUSTAIN
iterations: the group-relative advantage is zero almost everywhere and the run learns from almost nothing."""
GROUP_SUSTAIN = 3


SOLVED_NEAR_BEST = 0.1
"""An entropy or group collapse may be a solved task where the smoothed reward rose and sits within 10% of that rise
of its best so far: nearly every sample earns the top reward, rather than the policy being stuck."""


def group_collapse(rows: list[dict], facts: RunFacts) -> tuple[int, str] | None:
    """Groups whose k samples all score alike (reward/frac_zero_spread, GRPO and RLOO): too low a temperature, a
    reward with too few values, or prompts all too easy or too hard. The strength gives the reward (reward_when): a
    run that learned its training prompts collapses too, and may stop there."""
    xs, ys = smoothed(rows, "reward/frac_zero_spread")
    run = 0
    for i, y in enumerate(ys):
        run = run + 1 if y >= GROUP_COLLAPSE else 0
        if run >= GROUP_SUSTAIN:
            at = xs[i - GROUP_SUSTAIN + 1]
            return at, f"{max(ys[i - GROUP_SUSTAIN + 1:]):.0%} of the groups have no reward spread" + \
                reward_when(rows, xs[i])
    return None


def reward_when(rows: list[dict], step: int) -> str:
    """', reward/mean X' at `step` (smoothed), adding that the prompts may be solved where the reward rose to its
    best so far (SOLVED_NEAR_BEST); '' where the run logs no reward."""
    reward = [(x, y) for x, y in zip(*smoothed(rows, "reward/mean")) if x <= step]
    if not reward:
        return ""
    start, now, best = reward[0][1], reward[-1][1], max(y for _, y in reward)
    if now > start and best - now <= SOLVED_NEAR_BEST * (best - start):
        return f", reward/mean {now:.3g} (from {start:.3g}), at its best: the training prompts may be solved (then " \
               "stop here, or add harder ones)"
    return f", reward/mean {now:.3g}"


DOMINANT_SHARE = 0.8
"""Reward domination: since the first iterations, one function's weighted mean moved by at least 80% of what all the
functions' weighted means moved together (sum of |changes|)..."""
DOMINANT_MIN_CHANGE = 1.0
"""...and by at least 1 standard deviation of the reward over the first iterations' samples (reward/std): smaller
moves are noise, whoever makes them."""


def reward_dominance(rows: list[dict], facts: RunFacts) -> tuple[int, str] | None:
    """One reward component making the progress of a weighted sum of several (rl.reward with two or more functions):
    the policy found the one term it can push, often not the one that matters."""
    keys = metric_keys(rows, "reward/fn/")
    spread = baseline(rows, "reward/std")
    if len(keys) < 2 or not spread:
        return None
    weight = {k: float(facts.reward_weights.get(k.removeprefix("reward/fn/"), 1.0)) for k in keys}
    curves = {k: dict(zip(*smoothed(rows, k))) for k in keys}
    steps = sorted(set.intersection(*(set(c) for c in curves.values())))
    if len(steps) < BASELINE + SUSTAIN:
        return None
    start = {k: sum(curves[k][s] for s in steps[:BASELINE]) / BASELINE for k in keys}
    moved = {s: {k: weight[k] * (curves[k][s] - start[k]) for k in keys} for s in steps}
    for k in keys:
        share = {s: abs(m[k]) / sum(abs(v) for v in m.values()) if any(m.values()) else 0.0 for s, m in moved.items()}
        holds = [share[s] >= DOMINANT_SHARE and abs(moved[s][k]) >= DOMINANT_MIN_CHANGE * spread for s in steps]
        if (at := first_sustained(steps, holds, BASELINE)) is not None:
            name, last = k.removeprefix("reward/fn/"), steps[-1]
            return at, (f"{name} made {share[last]:.0%} of the weighted reward's change ({moved[last][k]:+.3g}, the "
                        f"others {sum(v for n, v in moved[last].items() if n != k):+.3g})")
    return None


GOLD_DROP = 0.15
"""Proxy against gold: the smoothed gold score (or held-out score) at least 0.15 below its best so far (a full
SMOOTH-iteration mean) while the smoothed reward is above its value at that best: the reward rises, the real quality
falls. Gold scores lie in [-1, 1]; 0.15 is about two standard errors of the difference of two 3-iteration means of
32 samples."""
GOLD_SERIES = ("reward/gold_mean", "reward/gold_grammatical_rate", "eval/gold_mean", "eval/gold_positive_rate")
"""The gold's sentiment score and the share of sentences its grammar accepts (default task), and held-out scores."""


def proxy_gold_divergence(rows: list[dict], facts: RunFacts) -> tuple[int, str] | None:
    """The reward (the proxy) rising while a gold or held-out score falls, where the run logs one (the default task's
    gold scorer; rl.eval_every's held-out evaluation); else the before/after evaluation of eval.json."""
    reward = dict(zip(*smoothed(rows, "reward/mean")))
    for key in GOLD_SERIES:
        xs, gold = smoothed(rows, key)
        best, best_step, holds = -math.inf, None, []
        for n, (s, g) in enumerate(zip(xs, gold)):
            if g > best and n >= SMOOTH - 1:  # a full mean: the first points average fewer iterations
                best, best_step = g, s
            r_now, r_then = reward.get(s), reward.get(best_step)
            holds.append(r_now is not None and r_then is not None and best - g >= GOLD_DROP and r_now >= r_then)
        if (at := first_sustained(xs, holds, BASELINE)) is not None:
            low = min(gold[xs.index(at):])
            return at, f"{key} fell from {max(gold):.3f} to {low:.3f} while reward/mean kept rising"
    found = from_evaluation(facts.eval_result)
    if found is not None and (steps := series(rows, "reward/mean")[0]):
        return steps[-1], found.summary()
    return None


VALUE_BLOWUP = 10.0
"""Value-loss blow-up: the smoothed critic loss above 10x its lowest smoothed value so far."""


def value_loss_blowup(rows: list[dict], facts: RunFacts) -> tuple[int, str] | None:
    """The critic's loss exploding after it had learned (PPO): its targets moved faster than it can follow."""
    xs, ys = smoothed(rows, "train/value_loss")
    low, holds = math.inf, []
    for y in ys:
        low = min(low, y)
        holds.append(low > 0 and y >= VALUE_BLOWUP * low)
    if (at := first_sustained(xs, holds, BASELINE)) is None:
        return None
    return at, f"value loss {min(ys):.3g} -> {max(ys[xs.index(at):]):.3g}"


CLIP_RUNAWAY = 0.3
"""Clip or weight runaway: the smoothed policy clip fraction above 0.3 (healthy updates clip a few percent), or the
largest importance weight of the sampler's tokens (train/behaviour_weight_max) above WEIGHT_RUNAWAY."""
WEIGHT_RUNAWAY = 10.0


def clip_runaway(rows: list[dict], facts: RunFacts) -> tuple[int, str] | None:
    """Each update moving the policy further than the clip range allows, or the sampler and the trainer disagreeing
    ever more (the importance weights correcting for it grow without bound)."""
    found = []
    xs, ys = smoothed(rows, "train/clip_frac")
    if (at := first_sustained(xs, [y >= CLIP_RUNAWAY for y in ys], 1)) is not None:
        found.append((at, f"clip fraction {max(ys[xs.index(at):]):.0%} of tokens"))
    xs, ys = smoothed(rows, "train/behaviour_weight_max")
    if (at := first_sustained(xs, [y >= WEIGHT_RUNAWAY for y in ys], 1)) is not None:
        found.append((at, f"importance weights up to {max(ys):.3g}"))
    return min(found) if found else None


@dataclass(frozen=True)
class Detector:
    name: str
    title: str
    check: Callable[[list[dict], RunFacts], tuple[int, str] | None]
    advice: str
    panel: str


DETECTORS: tuple[Detector, ...] = (
    Detector("length_drift", "Length drift", length_drift,
             "The reward may favour length: check it for a length bias, set rl.overlong_buffer or add a length "
             "term, or raise rl.kl_coef.", "length"),
    Detector("kl_acceleration", "KL acceleration", kl_acceleration,
             "The policy is leaving the reference fast: raise rl.kl_coef (or set rl.kl_target), lower rl.lr.", "kl"),
    Detector("entropy_collapse", "Entropy collapse", entropy_collapse,
             "The policy samples one answer: lower rl.lr, raise rl.kl_coef or rl.entropy_coef, or raise "
             "rl.temperature.", "entropy"),
    Detector("group_collapse", "Group collapse", group_collapse,
             "Groups give no learning signal: raise rl.temperature or rl.k, use rl.dynamic_sampling=true, or change "
             "the prompt mix.", "zero_spread"),
    Detector("reward_dominance", "One reward dominates", reward_dominance,
             "The policy pushes one term: cap or rescale it (rl.reward_weights, "
             "rl.reward_normalization=per_function) and read the samples.", "reward_fn"),
    Detector("proxy_gold_divergence", "Reward up, gold down", proxy_gold_divergence,
             "The policy may be exploiting the reward: read the samples, raise rl.kl_coef, stop earlier or train "
             "the reward model on more pairs.", "gold"),
    Detector("value_loss_blowup", "Value loss blow-up", value_loss_blowup,
             "Lower rl.critic_lr, clip values (rl.vf_clip), or normalise rewards.", "value_loss"),
    Detector("clip_runaway", "Clip / weight runaway", clip_runaway,
             "Updates are too large: lower rl.lr, fewer rl.epochs, or a smaller rl.clip.", "clip_frac"),
)


def audit(rows: list[dict], facts: RunFacts | None = None) -> list[Finding]:
    """Every detector's finding on a run's metric rows, in order of onset."""
    facts = facts or RunFacts()
    out = []
    for d in DETECTORS:
        if (hit := d.check(rows, facts)) is not None:
            out.append(Finding(d.name, d.title, hit[0], hit[1], d.advice, d.panel))
    return sorted(out, key=lambda f: f.onset)


class HealthWatch:
    """Live: the detectors over the rows so far, each finding reported once per run (a resumed run reads the rows it
    already has and does not repeat what they showed)."""

    def __init__(self, facts: RunFacts | None = None, rows: list[dict] | None = None):
        self.facts, self.rows = facts or RunFacts(), list(rows or [])
        self.seen = {f.detector for f in audit(self.rows, self.facts)}

    def update(self, row: dict) -> list[Finding]:
        self.rows.append(row)
        new = [f for f in audit(self.rows, self.facts) if f.detector not in self.seen]
        self.seen |= {f.detector for f in new}
        return new
