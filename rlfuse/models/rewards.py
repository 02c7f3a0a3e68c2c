"""Reward functions as users write them (TRL's form): `f(prompts, completions, **columns) -> list[float | None]`.

`prompts` are the data set's prompts (text, or message lists for conversational data), `completions` the decoded
responses (text, or `[{"role": "assistant", "content": ...}]` for conversational prompts), and each other column
of the prompt's row (a ground-truth `answer`, say) comes as a keyword list. A function that returns None for a
sample abstains (another function scores that kind of sample); several functions are summed with
`rl.reward_weights`, abstentions left out. The older form, a function of one list of texts (prompt + response),
still works: a function with no `completions` parameter is called that way.

A reward model is the same kind of callable (reward_model_fn): its scalar head on each finished sample, read where
reward-model training read it.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import signal
import sys
import threading
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from rlfuse.data.prompts import model_context
from rlfuse.errors import ConfigError, UserError, first_line
from rlfuse.models import prefix
from rlfuse.models.forward import adapter_of, can_share, pack_continuations, worth_packing, worth_sharing
from rlfuse.models.heads import scalar_head
from rlfuse.models.shared import body


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
    takes_environments: bool = False
    """It takes `environments`: each multi-turn episode's environment instance (None for a single-turn sample)."""


def signature_of(fn: Callable) -> RewardSignature:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins and some callables have no signature: the older form
        return RewardSignature(False, frozenset(), frozenset(), False)
    # environments: a multi-turn episode's environment instances (rollout/episodes.py), not a data set column
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {
        "prompts", "completions", "environments"}
    required = {p.name for p in params if p.name in named and p.default is p.empty}
    return RewardSignature("completions" in {p.name for p in params}, frozenset(named), frozenset(required),
                           any(p.kind == p.VAR_KEYWORD for p in params), "environments" in {p.name for p in params})


def weighted_sum(values: list[list[float | None]], weights: list[float]) -> list[float]:
    """Per sample, the weighted sum of the functions that scored it (None: abstained); 0 where every function
    abstained (as TRL's nansum; FunctionReward counts those samples)."""
    return [sum(w * v for w, v in zip(weights, row) if v is not None) for row in zip(*values)]


REWARD_BOUND = 1e4
"""|reward| above this is reported (reward/beyond_bound, a warning): a value that large is a bug or a scale that
swamps the KL penalty, though training goes on."""


def reward_values(out, n: int, where: str) -> list[float | None]:
    """A reward function's return value as n floats or Nones, or a UserError saying what was wrong with it."""
    if out is None or isinstance(out, (str, bytes, dict)) or not hasattr(out, "__iter__"):
        raise UserError(f"{where} returned {type(out).__name__} {_short(out)}, not a list; return one float (or None "
                        "to abstain) per completion")
    out = list(out)
    if len(out) != n:
        raise UserError(f"{where} returned {len(out)} values for {n} completions; return one float (or None) per "
                        "completion")
    values = []
    for i, v in enumerate(out):
        if v is None:
            values.append(None)
            continue
        try:
            if isinstance(v, (str, bytes)):
                raise TypeError
            x = float(v)
        except (TypeError, ValueError):
            raise UserError(f"{where} returned {type(v).__name__} {_short(v)} for completion {i}; return floats "
                            "(or None to abstain)") from None
        values.append(x)  # a NaN/inf stays: the iteration's update is skipped and counted (learn/update.py)
    return values


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def function_name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


REWARD_TIMEOUT_ENV = "RLFUSE_REWARD_TIMEOUT_S"
REWARD_TIMEOUT_S = 300.0
"""Seconds one call of a reward function may take (on one micro-batch of completions) unless RLFUSE_REWARD_TIMEOUT_S
says otherwise (0: no limit): a call that hangs (a network request, a sandbox that never returns) would otherwise
hold the run without a word."""
REWARD_WARN_S = 60.0
"""A call running this long is said on stderr while it runs (and the limit it is held to)."""


class RewardTimeout(BaseException):
    """Raised inside a reward function that ran past its time limit: a BaseException, so that the function's own
    `except Exception` does not swallow it."""


def reward_timeout_s() -> float | None:
    """The time limit of one reward-function call: RLFUSE_REWARD_TIMEOUT_S, else REWARD_TIMEOUT_S; None: no limit."""
    text = os.environ.get(REWARD_TIMEOUT_ENV, "").strip()
    if not text:
        return REWARD_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not math.isfinite(seconds) or seconds < 0:
        raise UserError(f"{REWARD_TIMEOUT_ENV}={text!r} is not a number of seconds >= 0; set e.g. "
                        f"{REWARD_TIMEOUT_ENV}=600 (0: no limit)")
    return seconds or None


def _can_interrupt() -> bool:
    """Whether a SIGALRM timer may stop this call: only on the main thread (where Python runs signal handlers), on a
    platform with setitimer, and when nothing else (a test runner's timeout) uses the alarm."""
    return (hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None)
            and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0))


@contextlib.contextmanager
def time_limit(seconds: float | None, name: str, n: int):
    """Run the block for at most `seconds` (None: no limit): RewardTimeout is raised inside it when the time is up,
    where it can be (_can_interrupt); elsewhere (a Ray worker's thread) it runs on. Either way a call still running
    after REWARD_WARN_S (or its limit, if sooner) is said on stderr, once."""
    stop = seconds is not None and _can_interrupt()
    warn_at = min(REWARD_WARN_S, seconds) if seconds is not None else REWARD_WARN_S
    t0 = time.monotonic()

    def warn():
        limit = (f"it is stopped at {seconds:g} s" if stop else
                 f"past {seconds:g} s it runs on (it cannot be stopped from here)" if seconds is not None else
                 "it has no time limit")
        print(f"[rl] warning: reward function {name} has run for {time.monotonic() - t0:.0f} s on {n} completions; "
              f"{limit} ({REWARD_TIMEOUT_ENV})", file=sys.stderr, flush=True)

    watchdog = threading.Timer(warn_at, warn) if not (stop and warn_at >= seconds) else None
    if watchdog is not None:
        watchdog.daemon = True
        watchdog.start()
    previous = None
    if stop:
        def alarm(signum, frame):
            raise RewardTimeout()
        previous = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        if stop:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
        if watchdog is not None:
            watchdog.cancel()


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
        self._abstained = self._scored = self._beyond = 0
        self.last_parts: Tensor | None = None
        """(samples, functions): each function's values of the last call, unweighted (0 where it abstained)."""

    def __call__(self, samples) -> Tensor:
        if not self.fns:  # rl.reward=environment: the episodes' environment reward alone (rollout/score.py)
            self._scored += len(samples)
            self.last_parts = torch.zeros(len(samples), 0)
            return torch.zeros(len(samples))
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
        # each function's value per sample (0 where it abstained), for rl.reward_normalization=per_function
        self.last_parts = torch.tensor([[0.0 if v is None else float(v) for v in row] for row in zip(*values)],
                                       dtype=torch.float32).view(len(samples), len(self.fns))
        return torch.tensor(weighted_sum(values, self.weights), dtype=torch.float32)

    def _call(self, fn: Callable, sig: RewardSignature, samples, completions, texts) -> list[float | None]:
        where = f"reward error: rl.reward: {function_name(fn)}, called on {len(samples)} completions,"
        limit = reward_timeout_s()
        try:
            if not sig.takes_completions:  # the older form: one text per sample, prompt and response together
                with time_limit(limit, function_name(fn), len(samples)):
                    out = fn(texts)
            else:
                # an episode's own row (several rows may render to one prompt); else found by the prompt's ids
                rows = [getattr(getattr(s, "episode", None), "row", None) or self.rows.get(tuple(s.prompt_ids))
                        for s in samples]
                prompts = [r[0] if r else self.tokenizer.decode(s.prompt_ids, skip_special_tokens=True)
                           for r, s in zip(rows, samples)]
                completions = [completion_of(s, p, c) for s, p, c in zip(samples, prompts, completions)]
                columns = self._columns(fn, sig, rows)
                if sig.takes_environments:
                    columns["environments"] = [getattr(s.episode, "environment", None) for s in samples]
                with time_limit(limit, function_name(fn), len(samples)):
                    out = fn(prompts=prompts, completions=completions, **columns)
        except RewardTimeout:
            raise UserError(f"{where} did not return within {limit:g} s ({REWARD_TIMEOUT_ENV}); make it faster "
                            "(batch or cache its work, give its own slow calls a timeout), or raise "
                            f"{REWARD_TIMEOUT_ENV} (0: no limit)") from None
        except UserError:
            raise
        except Exception as e:  # the user's code: its failure is theirs to fix, named as theirs, not a traceback of ours
            first = first_line(e)
            raise UserError(f"{where} raised {type(e).__name__}: {first}; fix the function (try it on a few "
                            "completions by hand) or remove it from rl.reward") from None
        values = reward_values(out, len(samples), where)
        nonfinite = [v for v in values if v is not None and not math.isfinite(v)]
        if nonfinite:
            warnings.warn(f"rl.reward: {function_name(fn)} returned {nonfinite[0]} for {len(nonfinite)} of "
                          f"{len(samples)} completions; an iteration with a non-finite reward skips its update, and "
                          "rl.max_bad_steps in a row stop the run", stacklevel=2)
        beyond = sum(1 for v in values if v is not None and math.isfinite(v) and abs(v) > REWARD_BOUND)
        if beyond:
            self._beyond += beyond
            warnings.warn(f"rl.reward: {function_name(fn)} returned {beyond} values beyond +-{REWARD_BOUND:g} "
                          f"(e.g. {max((v for v in values if v is not None and math.isfinite(v)), key=abs):g}); "
                          "rewards that large swamp "
                          "the KL penalty and the advantages' scale: rescale the function", stacklevel=2)
        return values

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
               "scored": self._scored, "beyond_bound": self._beyond}
        self._sums.clear()
        self._abstained = self._scored = self._beyond = 0
        return out

    def metrics(self) -> dict[str, float]:
        return metrics_of_sums([self.take_sums()])


def completion_of(sample, prompt, text: str):
    """A sample's completion as a reward function reads it: for a conversational prompt the messages after it (a
    multi-turn episode's every turn and answer; a single turn's one assistant message), otherwise the text."""
    episode = getattr(sample, "episode", None)
    if isinstance(prompt, list):
        return list(episode.messages) if episode is not None else [{"role": "assistant", "content": text}]
    return text


def metrics_of_sums(tallies: list[dict | None]) -> dict[str, float]:
    """reward/fn/<name> (each function's mean over the samples it scored), reward/all_abstained (the fraction
    every function abstained on) and reward/beyond_bound (values past REWARD_BOUND) from FunctionReward.take_sums of one or more processes (None: a reward model)."""
    fn: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    abstained = scored = beyond = 0
    for t in filter(None, tallies):
        for name, (s, n) in t["fn"].items():
            fn[name][0], fn[name][1] = fn[name][0] + s, fn[name][1] + n
        abstained, scored, beyond = abstained + t["abstained"], scored + t["scored"], beyond + t.get("beyond_bound", 0)
    out = {f"reward/fn/{name}": s / n for name, (s, n) in fn.items() if n}
    if scored:
        out["reward/all_abstained"] = abstained / scored
        out["reward/beyond_bound"] = beyond
    return out


def attach_rows(reward_fn, prompt_ids: list[list[int]], rows) -> int:
    """Give function rewards each prompt's row (data/stages.py PromptRow), keyed by the prompt's token ids as the
    samples carry them; a reward model needs none. Returns how many rows share their prompt's tokens with a row of
    other columns: a single-turn sample finds one row per prompt text (the last), so their functions read it."""
    if not isinstance(reward_fn, FunctionReward):
        return 0
    reward_fn.rows = {tuple(ids): (r.prompt, r.columns) for ids, r in zip(prompt_ids, rows)}
    columns: dict[tuple, list[dict]] = defaultdict(list)
    for ids, r in zip(prompt_ids, rows):
        columns[tuple(ids)].append(r.columns)
    return sum(len(c) for c in columns.values() if any(x != c[0] for x in c[1:]))


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


def _reward_body_and_head(rm):
    """(transformer body, score head) of a sequence-classification reward model (also peft-wrapped) or of an
    AdapterRewardModel."""
    if hasattr(rm, "_shared"):
        return body(rm._shared), rm.score
    base = rm.get_base_model() if hasattr(rm, "get_base_model") else rm
    return getattr(base, base.base_model_prefix), base.score


def runs_a_model(reward_fn) -> bool:
    """Whether a reward function is a reward model's (reward_model_fn: it counts the prompt tokens it shares, and runs
    under the scoring passes' autocast) rather than Python functions of texts."""
    return hasattr(reward_fn, "prompt_tokens_shared")


def reward_model_fn(rm, eos_id: int, pad_id: int, share_prompt: bool = True) -> Callable[[list], Tensor]:
    """Reward from a scalar-head model on the same input as in training (collate.encode_reward_text: BOS + text +
    EOS). transformers' sequence-classification heads pool at the rightmost token that is not the pad id; rlfuse's
    pad id is the EOS id (GPT-2 tokenizers have no pad token), so the score is read at the last token of the text,
    the one before the trailing EOS, in training and here alike. share_prompt: samples of one prompt run it once
    (where the model supports it and no sequence is cut to the context); the saving is counted in
    `score.prompt_tokens_shared`; where no prompt repeats, sequences of mixed lengths run packed (worth_packing).
    The samples are the engine's (rollout/state.py Sample: prompt_ids, token_ids)."""
    context = model_context(rm.config)
    supported = can_share(rm)

    def score(samples: list, share_prompt: bool = share_prompt) -> Tensor:
        ends = [s.token_ids + ([] if s.token_ids[-1:] == [eos_id] else [eos_id]) for s in samples]
        seqs = [s.prompt_ids + e for s, e in zip(samples, ends)]
        dev = next(rm.parameters()).device
        prompts = [s.prompt_ids for s in samples]
        share = share_prompt and supported and worth_sharing(prompts, ends)
        if share and not (context and max(map(len, seqs)) > context):
            saved = prefix.prompt_tokens_saved(prompts)
            score.prompt_tokens_shared += saved
            return _shared_reward(rm, prompts, ends, seqs, pad_id, dev)
        if context:  # a full-budget prompt + a length-capped response + EOS is one past the context: keep the end,
            seqs = [s[-context:] for s in seqs]  # as RM training does (collate.encode_reward_text)
        if share_prompt and supported and worth_packing(seqs):
            return _packed_reward(rm, seqs, pad_id, dev)
        L = max(map(len, seqs))
        ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
        attn = torch.zeros(len(seqs), L, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)], attn[i, : len(s)] = torch.tensor(s), 1
        if not torch.is_autocast_enabled(dev.type):
            return rm(input_ids=ids.to(dev), attention_mask=attn.to(dev)).logits.squeeze(-1).float().cpu()
        # under autocast the body in its dtype, the score head (transformers' pooling: the rightmost non-pad token) not
        body, head = _reward_body_and_head(rm)
        with adapter_of(rm):
            h = body(input_ids=ids.to(dev), attention_mask=attn.to(dev)).last_hidden_state
        pooled = torch.tensor([_pooled_at(s, pad_id) for s in seqs], device=dev)
        return scalar_head(head, h[torch.arange(len(seqs), device=dev), pooled]).cpu()

    score.prompt_tokens_shared = 0
    return score


def _pooled_at(seq: list[int], pad_id: int) -> int:
    """transformers' sequence-classification pooling: the rightmost token that is not the pad id."""
    return max((i for i, t in enumerate(seq) if t != pad_id), default=0)


def _packed_reward(rm, seqs, pad_id: int, dev) -> Tensor:
    """reward_model_fn's score over sequences packed end to end (models/prefix.py pack_sequences, as collate packs the
    other scoring passes): the body's state at each sequence's pooling position through the score head."""
    pk = prefix.pack_sequences(seqs, pad_id, dev)
    width = pk.ids.shape[1]
    pooled = torch.tensor([row * width + col + _pooled_at(s, pad_id) for (row, col), s in zip(pk.starts, seqs)],
                          device=dev)
    body, head = _reward_body_and_head(rm)
    with adapter_of(rm):
        h = prefix.packed_hidden(body, pk)
    h = h.reshape(-1, h.shape[-1])[pooled]
    return scalar_head(head, h).cpu()


def _shared_reward(rm, prompts, ends, seqs, pad_id: int, dev) -> Tensor:
    """reward_model_fn's score, prefix-shared: the body's state at each sequence's rightmost non-pad token (its
    pooling) through the score head."""
    pooled = torch.tensor([_pooled_at(s, pad_id) for s in seqs])
    pb = prefix.group_by_prompt(prompts, ends, pad_id, dev, pack_continuations(prompts, ends))
    body, head = _reward_body_and_head(rm)
    with adapter_of(rm):
        h = prefix.hidden_at(*prefix.prefix_shared_hidden(body, pb), pb, pooled[:, None].to(dev))[:, 0]
    return scalar_head(head, h).cpu()
