"""Scorer: one forward per role (reward, reference log-probs, critic values, and old log-probs where the generator's
own are not trusted) on a micro-batch of finished samples, padded only to that micro-batch's longest sequence
(rlfuse/models/forward.py: the same forward the update runs).

With share_prompt, a micro-batch holding several samples of one prompt runs that prompt through each model once and
its samples' responses after it (rlfuse/models/prefix.py): the same numbers, prompt tokens x (k - 1) fewer
token-forwards per pass, the saving counted in `Scorer.prompt_tokens_shared`.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor

from rlfuse.algos.offpolicy import logprob_mismatch
from rlfuse.models.device import autocast_to
from rlfuse.models.forward import can_share, collate, forward_tokens, response_logprobs, response_values
from rlfuse.models.rewards import runs_a_model
from rlfuse.models.shared import adapters_off
from rlfuse.rollout.state import Sample


@dataclass
class ScoredSample:
    sample: Sample
    score: float
    ref_logprobs: Tensor | None
    """None: a pass the scorer defers (Scorer.deferred), filled in over the whole iteration later."""
    values: Tensor | None
    old_logprobs: Tensor
    """The engine's sampling log-probs (or a recomputed forward when the scorer has the `old_logprobs` role)."""
    proximal_logprobs: Tensor | None = None
    """score(proximal=True): the actor's own log-probs now (asynchronous RL's proximal policy for a stale sample)."""
    reward_parts: Tensor | None = None
    """(functions,) each reward function's value, unweighted, where the reward is several functions (their
    weighted sum is `score`); None for a reward model."""


class Scorer:
    """Scores finished samples, one micro-batch of similar lengths at a time, and keeps time per role.

    share_prompt: a prompt's samples go into one micro-batch together (as far as they have finished) and its
    forward runs once per role (where every role's model supports it)."""

    def __init__(self, reward_fn, pad_id: int, ref=None, actor=None, critic=None, temperature: float = 1.0,
                 micro_batch_size: int = 16, recompute_old_logprobs: bool = False, unfinished_penalty: float = 0.0,
                 share_prompt: bool = True, compute_dtype: torch.dtype | None = None,
                 environment_weight: float = 1.0):
        self.reward_fn, self.pad_id, self.ref, self.actor, self.critic = reward_fn, pad_id, ref, actor, critic
        self.compute_dtype = compute_dtype
        """The passes' autocast dtype (Models.compute_dtype: the update's, so that log-probs scored here and the
        update's own are computed alike); None: fp32. A Python reward function runs outside it."""
        self.deferred: tuple[str, ...] = ()
        """Passes score() leaves out ("reference", "critic": their fields None) for deferred_pass to run later, over
        the whole iteration: FSDP training ranks (runtime/fsdp.py) gather each of those models whole only for its own
        pass, never beside the decoding actor."""
        self.temperature, self.micro = temperature, micro_batch_size
        self.recompute_old, self.unfinished_penalty = recompute_old_logprobs, unfinished_penalty
        self.environment_weight = environment_weight
        """Weight of a multi-turn episode's environment reward (Sample.episode.reward) in the sum with reward_fn's."""
        self.times: dict[str, float] = defaultdict(float)
        roles = [ref or actor] + ([critic] if critic is not None else []) + ([actor] if recompute_old_logprobs else [])
        self.share_prompt, self.share = share_prompt, share_prompt and all(map(can_share, roles))
        self._shared_here = 0

    @property
    def prompt_tokens_shared(self) -> int:
        """Prompt token-forwards saved so far by prefix sharing: every scoring pass, the reward model's included."""
        return self._shared_here + getattr(self.reward_fn, "prompt_tokens_shared", 0)

    def _reward(self, chunk: list[Sample]) -> Tensor:
        """The reward; a reward model's (reward_model_fn) follows this scorer's share_prompt, a Python function of
        texts has nothing to share."""
        reward = (self.reward_fn(chunk, share_prompt=self.share_prompt) if runs_a_model(self.reward_fn)
                  else self.reward_fn(chunk))
        return reward + self.environment_weight * environment_rewards(chunk)

    def _order(self, samples: list[Sample]) -> list[Sample]:
        """Similar lengths together (less padding), or, sharing, a prompt's samples together where that puts fewer
        tokens through the models (forward_tokens): with short prompts the length order wins."""
        by_length = sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.token_ids))
        if not self.share:
            return by_length
        by_prompt = sorted(samples, key=lambda s: (len(s.prompt_ids), s.prompt_ids, len(s.token_ids)))

        def tokens(order: list[Sample], share: bool) -> int:
            chunks = [order[i: i + self.micro] for i in range(0, len(order), self.micro)]
            return sum(forward_tokens([s.prompt_ids for s in c], [s.token_ids for s in c], share) for c in chunks)

        return by_prompt if tokens(by_prompt, True) < tokens(by_length, False) else by_length

    def autocast(self):
        """The passes' mixed-precision context (compute_dtype)."""
        model = next((m for m in (self.ref, self.actor, self.critic) if m is not None), None)
        device = next(model.parameters()).device if model is not None else "cpu"
        return autocast_to(device, self.compute_dtype)

    @contextlib.contextmanager
    def _timed(self, role: str, cast: bool = True):
        t = time.perf_counter()
        with self.autocast() if cast else contextlib.nullcontext():
            yield
        self.times[role] += time.perf_counter() - t

    def _ref_context(self):
        # with LoRA the reference is the actor's own base with adapters switched off: no second copy of the weights
        if self.ref is None and self.actor is not None and hasattr(self.actor, "disable_adapter"):
            return adapters_off(self.actor)
        return contextlib.nullcontext()

    @torch.no_grad()
    def score(self, samples: list[Sample], proximal: bool = False) -> list[ScoredSample]:
        """proximal: also the actor's log-probs of the sampled tokens as its weights are now (the proximal policy of
        a stale batch, rlfuse/algos/offpolicy.py), beside the sampling ones: the old-log-probs pass, kept apart."""
        out = []
        order = self._order(samples)
        actor_pass = self.recompute_old or proximal
        with_ref, with_critic = "reference" not in self.deferred, self.critic is not None and "critic" not in self.deferred
        passes = with_ref + with_critic + actor_pass
        for i in range(0, len(order), self.micro):
            chunk = order[i: i + self.micro]
            dev = next((self.ref or self.actor).parameters()).device
            mb = collate([s.prompt_ids for s in chunk], [s.token_ids for s in chunk], self.pad_id, dev, self.share)
            taken = all(s.ref_logprobs is not None for s in chunk)  # where the samples were decoded
            self._shared_here += (passes - (taken and with_ref)) * (mb.prefix.saved_tokens if mb.prefix is not None else 0)
            unfinished = torch.tensor([s.finish_reason == "length" for s in chunk], dtype=torch.float32)
            with self._timed("reward", cast=runs_a_model(self.reward_fn)):
                scores = self._reward(chunk) - self.unfinished_penalty * unfinished
                parts = getattr(self.reward_fn, "last_parts", None)
            if taken:
                ref_lp = [s.ref_logprobs for s in chunk]
            elif not with_ref:
                ref_lp = [None] * len(chunk)
            else:
                with self._timed("reference"), self._ref_context():
                    ref_lp = response_logprobs(self.ref or self.actor, mb, self.temperature).cpu()
            values = actor_lp = None
            if with_critic:
                with self._timed("critic"):
                    values = response_values(self.critic, mb).cpu()
            if actor_pass:
                with self._timed("proximal" if proximal else "old_logprobs"):
                    actor_lp = response_logprobs(self.actor, mb, self.temperature).cpu()
            for b, s in enumerate(chunk):
                n = len(s.token_ids)
                own = None if actor_lp is None else actor_lp[b, :n]
                out.append(ScoredSample(s, float(scores[b]), None if ref_lp[b] is None else ref_lp[b][:n],
                                        None if values is None else values[b, :n],
                                        own if self.recompute_old else s.logprobs, own if proximal else None,
                                        None if parts is None else parts[b]))
        return out

    @torch.no_grad()
    def deferred_pass(self, role: str, prompts: list[list[int]], responses: list[list[int]]) -> list[Tensor]:
        """A pass score() left out (self.deferred): the reference's log-probs (at self.temperature) or the critic's
        values of each sample's response tokens, in micro-batches as score() forms them; one (len(response),)
        tensor per sample, in the order given."""
        model = {"reference": self.ref, "critic": self.critic}[role]
        samples = [Sample(0, 0, p, r, logprobs=None, finish_reason="") for p, r in zip(prompts, responses)]
        position = {id(s): i for i, s in enumerate(samples)}
        out: list[Tensor | None] = [None] * len(samples)
        dev = next(model.parameters()).device
        order = self._order(samples)
        with self._timed(role):
            for i in range(0, len(order), self.micro):
                chunk = order[i: i + self.micro]
                mb = collate([s.prompt_ids for s in chunk], [s.token_ids for s in chunk], self.pad_id, dev, self.share)
                self._shared_here += mb.prefix.saved_tokens if mb.prefix is not None else 0
                v = (response_values(model, mb) if role == "critic" else
                     response_logprobs(model, mb, self.temperature)).cpu()
                for b, s in enumerate(chunk):
                    out[position[id(s)]] = v[b, : len(s.token_ids)]
        return out

    @torch.no_grad()
    def reference_logprobs(self, samples: list[Sample], temperature: float) -> float:
        """The reference's log-probs of each sample's tokens at `temperature`, stored on the sample (Sample.ref_logprobs:
        score() then skips that pass), in micro-batches as score() forms them. For a generation worker holding the
        reference, between its decoding calls (asynchronous RL: time it would otherwise wait). -> seconds."""
        t = time.perf_counter()
        order = self._order(samples)
        for i in range(0, len(order), self.micro):
            chunk = order[i: i + self.micro]
            mb = collate([s.prompt_ids for s in chunk], [s.token_ids for s in chunk], self.pad_id,
                         next(self.ref.parameters()).device, self.share)
            self._shared_here += mb.prefix.saved_tokens if mb.prefix is not None else 0
            with self.autocast():
                lp = response_logprobs(self.ref, mb, temperature).cpu()
            for b, s in enumerate(chunk):
                s.ref_logprobs = lp[b, : len(s.token_ids)]
        self.times["reference"] += time.perf_counter() - t
        return time.perf_counter() - t


def environment_rewards(samples: list[Sample]) -> Tensor:
    """Each sample's environment reward (a multi-turn episode's, rollout/episodes.py), 0 where it has none."""
    return torch.tensor([float(getattr(s.episode, "reward", None) or 0.0) for s in samples])


@torch.no_grad()
def sampler_gap(model, samples: list[Sample], temperature: float = 1.0) -> dict[str, float]:
    """How far the log-probs an engine recorded for its samples are from `model`'s own forward of the same tokens
    (the mismatch/* metrics, algos/offpolicy.py logprob_mismatch), in one padded batch: for benchmarks and tests
    that compare an engine with the trainer outside a run."""
    mb = collate([s.prompt_ids for s in samples], [s.token_ids for s in samples], 0, next(model.parameters()).device)
    trainer = response_logprobs(model, mb, temperature).float().cpu()
    behaviour = torch.nn.utils.rnn.pad_sequence([s.logprobs for s in samples], batch_first=True)
    # the tokens the sampler drew: an episode's tool and observation tokens have no sampling log-prob
    sampled = torch.nn.utils.rnn.pad_sequence([torch.ones(len(s.token_ids)) if s.sampled is None else
                                               torch.tensor(s.sampled, dtype=torch.float32) for s in samples],
                                              batch_first=True)
    return logprob_mismatch(behaviour, trainer, mb.mask.cpu() * sampled)
