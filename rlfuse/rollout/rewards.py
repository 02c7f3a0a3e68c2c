"""Reward functions as users write them (TRL's form): `f(prompts, completions, **columns) -> list[float | None]`.

`prompts` are the data set's prompts (text, or message lists for conversational data), `completions` the decoded
responses (text, or `[{"role": "assistant", "content": ...}]` for conversational prompts), and each other column
of the prompt's row (a ground-truth `answer`, say) comes as a keyword list. A function that returns None for a
sample abstains (another function scores that kind of sample); several functions are summed with
`rl.reward_weights`, abstentions left out. The older form, a function of one list of texts (prompt + response),
still works: a function with no `completions` parameter is called that way.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from rlfuse.errors import ConfigError, UserError


@dataclass(frozen=True)
class RewardSignature:
    """How a reward function is called, read once from its signature."""
    takes_completions: bool
    """TRL's form f(prompts, completions, **columns); False: the older f(texts)."""
    columns: frozenset
    """Named parameters besides prompts and completions: data set columns it asks for."""
    required: frozenset
    """Those of them without a default."""
    any_column: bool
    """It takes **kwargs: every column is passed."""


def signature_of(fn: Callable) -> RewardSignature:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins and some callables have no signature: the older form
        return RewardSignature(False, frozenset(), frozenset(), False)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"prompts", "completions"}
    required = {p.name for p in params if p.name in named and p.default is p.empty}
    return RewardSignature("completions" in {p.name for p in params}, frozenset(named), frozenset(required),
                           any(p.kind == p.VAR_KEYWORD for p in params))


def weighted_sum(values: list[list[float | None]], weights: list[float]) -> list[float]:
    """Per sample, the weighted sum of the functions that scored it (None: abstained); 0 where every function
    abstained (as TRL's nansum; FunctionReward counts those samples)."""
    return [sum(w * v for w, v in zip(weights, row) if v is not None) for row in zip(*values)]


def function_name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


class FunctionReward:
    """The reward as Python functions of finished samples (Scorer's reward_fn). `rows` maps a prompt's token ids to
    (the prompt as the data set gives it, its other columns); the trainer fills it before RL. `metrics()` returns
    and resets each function's mean over the samples scored since the last call."""

    def __init__(self, fns: list[Callable], weights: list[float] | None, tokenizer):
        if weights is not None and len(weights) != len(fns):
            raise ConfigError("rl.reward_weights", f"{len(weights)} weights for {len(fns)} reward functions",
                              "give one weight per function in rl.reward, or none (all 1.0)")
        self.fns, self.weights, self.tokenizer = fns, list(weights or [1.0] * len(fns)), tokenizer
        self.signatures = [signature_of(fn) for fn in fns]
        self.rows: dict[tuple[int, ...], tuple[object, dict]] = {}
        self._sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        self._abstained = self._scored = 0

    def __call__(self, samples) -> Tensor:
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
        forms = {sig.takes_completions for sig in self.signatures}  # decode only what some function reads
        completions = [decode(s.token_ids) for s in samples] if True in forms else None
        texts = [decode(s.prompt_ids + s.token_ids) for s in samples] if False in forms else None
        values = [self._call(fn, sig, samples, completions, texts) for fn, sig in zip(self.fns, self.signatures)]
        self._abstained += sum(all(v is None for v in row) for row in zip(*values))
        self._scored += len(samples)
        for fn, vals in zip(self.fns, values):
            acc = self._sums[function_name(fn)]
            for v in vals:
                if v is not None:
                    acc[0], acc[1] = acc[0] + float(v), acc[1] + 1
        return torch.tensor(weighted_sum(values, self.weights), dtype=torch.float32)

    def _call(self, fn: Callable, sig: RewardSignature, samples, completions, texts) -> list[float | None]:
        if not sig.takes_completions:  # the older form: one text per sample, prompt and response together
            out = list(fn(texts))
        else:
            rows = [self.rows.get(tuple(s.prompt_ids)) for s in samples]
            prompts = [r[0] if r else self.tokenizer.decode(s.prompt_ids, skip_special_tokens=True)
                       for r, s in zip(rows, samples)]
            completions = [[{"role": "assistant", "content": c}] if isinstance(p, list) else c
                           for p, c in zip(prompts, completions)]
            out = list(fn(prompts=prompts, completions=completions, **self._columns(fn, sig, rows)))
        if len(out) != len(samples):
            raise UserError(f"reward error: rl.reward: {function_name(fn)} returned {len(out)} values for "
                            f"{len(samples)} completions; return one float (or None) per completion")
        return [None if v is None else float(v) for v in out]

    def _columns(self, fn: Callable, sig: RewardSignature, rows) -> dict[str, list]:
        known = set().union(*(r[1].keys() for r in rows if r)) if any(rows) else set()
        wanted = known if sig.any_column else sig.columns & known
        missing = sig.required - known
        if missing:
            raise UserError(f"reward error: rl.reward: {function_name(fn)} takes column(s) {', '.join(sorted(missing))}"
                            f" but the prompts' rows have {', '.join(sorted(known)) or 'no other columns'}; add the "
                            "column to the data set, or give the parameter a default")
        return {c: [r[1].get(c) if r else None for r in rows] for c in wanted}

    def take_sums(self) -> dict:
        """The raw tallies since the last call, then reset: {"fn": {name: (sum, count)}, "abstained": n,
        "scored": n}. Tallies add across processes (each Ray scoring worker keeps its own); means do not."""
        out = {"fn": {name: (s, n) for name, (s, n) in self._sums.items()}, "abstained": self._abstained,
               "scored": self._scored}
        self._sums.clear()
        self._abstained = self._scored = 0
        return out

    def metrics(self) -> dict[str, float]:
        return metrics_of_sums([self.take_sums()])


def metrics_of_sums(tallies: list[dict | None]) -> dict[str, float]:
    """reward/fn/<name> (each function's mean over the samples it scored) and reward/all_abstained (the fraction
    every function abstained on) from FunctionReward.take_sums of one or more processes (None: a reward model)."""
    fn: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    abstained = scored = 0
    for t in filter(None, tallies):
        for name, (s, n) in t["fn"].items():
            fn[name][0], fn[name][1] = fn[name][0] + s, fn[name][1] + n
        abstained, scored = abstained + t["abstained"], scored + t["scored"]
    out = {f"reward/fn/{name}": s / n for name, (s, n) in fn.items() if n}
    if scored:
        out["reward/all_abstained"] = abstained / scored
    return out


def attach_rows(reward_fn, prompt_ids: list[list[int]], rows) -> None:
    """Give function rewards each prompt's row (data/stages.py PromptRow), keyed by the prompt's token ids as the
    samples carry them; a reward model needs none."""
    if isinstance(reward_fn, FunctionReward):
        reward_fn.rows = {tuple(ids): (r.prompt, r.columns) for ids, r in zip(prompt_ids, rows)}


def reward_metrics(reward_fn) -> dict[str, float]:
    """Each reward function's mean since the last call (reward/fn/<name>), and the fraction every function
    abstained on; {} for a reward model."""
    return reward_fn.metrics() if isinstance(reward_fn, FunctionReward) else {}


def take_reward_sums(reward_fn) -> dict | None:
    """The reward functions' raw tallies since the last call, then reset (FunctionReward.take_sums); None for a
    reward model."""
    return reward_fn.take_sums() if isinstance(reward_fn, FunctionReward) else None


def reset_reward_metrics(reward_fn) -> None:
    """Forget the calls so far (an evaluation's are not an iteration's)."""
    take_reward_sums(reward_fn)
