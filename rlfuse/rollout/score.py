"""Scorer: one forward per role (reward, reference log-probs, critic values, and old log-probs where the generator's
own are not trusted) on a micro-batch of finished samples, padded only to that micro-batch's longest sequence.

Token log-probs are computed from the backbone's hidden states at response positions, pushing the LM head over
`logprob_chunk` positions at a time, so the full (B, T, V) logits never exist at once.

With share_prompt, a micro-batch holding several samples of one prompt runs that prompt through each model once and
its samples' responses after it (rlfuse/models/prefix.py): the same numbers, prompt tokens x (k - 1) fewer
token-forwards per pass, the saving counted in `Scorer.prompt_tokens_shared`.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from rlfuse.models import prefix
from rlfuse.models.heads import backbone_and_head
from rlfuse.rollout.engine import Sample


@dataclass
class ScoredSample:
    sample: Sample
    score: float
    ref_logprobs: Tensor
    values: Tensor | None
    old_logprobs: Tensor
    """The engine's sampling log-probs (or a recomputed forward when the scorer has the `old_logprobs` role)."""


@dataclass
class MicroBatch:
    """Right-padded prompt+response sequences (or, shared, each prompt once: `prefix`) and where each response
    sits."""
    input_ids: Tensor | None       # (B, L); None when shared
    attention_mask: Tensor | None  # (B, L); None when shared
    positions: Tensor       # (B, T): position whose output predicts response token j (prompt_len + j - 1)
    targets: Tensor         # (B, T): response token ids (0 on padding)
    mask: Tensor            # (B, T): 1 on response tokens
    prefix: prefix.PrefixBatch | None = None
    """Set when the micro-batch runs prefix-shared: distinct prompts once, each response without its last token
    (nothing reads the state after it)."""


SHARE_BELOW = 0.8
"""A micro-batch runs prefix-shared only where that cuts its forward (forward_tokens, padding included) to this
fraction of the full one or less: the shared forward is two passes with explicit masks, which costs more than it
saves where prompts are short next to their responses (bench/prefix_sharing.py)."""


def _token_counts(prompts: list[list[int]], responses: list[list[int]]) -> tuple[int, int]:
    """(full, shared) token positions of a micro-batch's forward, padding included: rows x longest sequence, and
    distinct prompts x longest prompt + rows x longest response less its last token."""
    distinct = {tuple(p) for p in prompts}
    full = len(prompts) * max(len(p) + len(r) for p, r in zip(prompts, responses))
    return full, len(distinct) * max(map(len, distinct)) + len(responses) * (max(map(len, responses)) - 1)


def worth_sharing(prompts: list[list[int]], responses: list[list[int]]) -> bool:
    """Whether these samples' forward runs prefix-shared (with rl.share_prompt): a prompt repeats and sharing cuts
    the forward to SHARE_BELOW of the full one or less."""
    if prefix.prompt_tokens_saved(prompts) == 0:
        return False
    full, shared = _token_counts(prompts, responses)
    return shared <= SHARE_BELOW * full


def forward_tokens(prompts: list[list[int]], responses: list[list[int]], share_prompt: bool) -> int:
    """Token positions collate's micro-batch puts through a model, padding included (_token_counts)."""
    full, shared = _token_counts(prompts, responses)
    return shared if share_prompt and worth_sharing(prompts, responses) else full


def collate(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device,
            share_prompt: bool = False) -> MicroBatch:
    """share_prompt: group samples of one prompt (prefix-shared forwards) where that pays (worth_sharing)."""
    B, T = len(prompts), max(map(len, responses))
    shared = share_prompt and worth_sharing(prompts, responses)
    pos, tgt, mask = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        pos[b, : len(r)] = torch.arange(len(p) - 1, len(p) + len(r) - 1)
        tgt[b, : len(r)] = torch.tensor(r)
        mask[b, : len(r)] = 1
    pos, tgt, mask = pos.to(device), tgt.to(device), mask.to(device)
    if shared:
        return MicroBatch(None, None, pos, tgt, mask, prefix.group_by_prompt(prompts, [r[:-1] for r in responses],
                                                                             pad_id, device))
    seqs = [p + r for p, r in zip(prompts, responses)]
    L = max(map(len, seqs))
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros(B, L, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)], attn[b, : len(s)] = torch.tensor(s), 1
    return MicroBatch(ids.to(device), attn.to(device), pos, tgt, mask)


def response_hidden(body, mb: MicroBatch) -> Tensor:
    """The body's last hidden state at mb.positions: (B, T, H), one full forward or the prefix-shared pair."""
    if mb.prefix is not None:
        return prefix.hidden_at(*prefix.prefix_shared_hidden(body, mb.prefix), mb.prefix, mb.positions)
    hidden = body(input_ids=mb.input_ids, attention_mask=mb.attention_mask).last_hidden_state
    return hidden.gather(1, mb.positions[..., None].expand(-1, -1, hidden.shape[-1]))


def response_logprobs(model, mb: MicroBatch, temperature: float = 1.0, chunk: int = 64,
                      with_entropy: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """log p(response token | prefix) under softmax(logits / temperature): (B, T), 0 on padding. Differentiable.
    With with_entropy, also the per-position entropy (B, T)."""
    body, head = backbone_and_head(model)
    h = response_hidden(body, mb)  # (B, T, H)
    out, ent = [], []
    for s in range(0, h.shape[1], chunk):
        logits = head(h[:, s: s + chunk]).float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        out.append(logp.gather(-1, mb.targets[:, s: s + chunk, None]).squeeze(-1))
        if with_entropy:  # a diagnostic: kept out of the autograd graph, which would save another (B, T, V)
            with torch.no_grad():
                ent.append(-(logp.exp() * logp).sum(-1))
    lp = torch.cat(out, 1) * mb.mask
    return (lp, torch.cat(ent, 1) * mb.mask) if with_entropy else lp


def response_values(critic, mb: MicroBatch) -> Tensor:
    """Critic value of the state before each response token: (B, T), 0 on padding."""
    if mb.prefix is None:
        v = critic(input_ids=mb.input_ids, attention_mask=mb.attention_mask)
        return v.gather(1, mb.positions) * mb.mask
    with _adapter_of(critic):
        h = response_hidden(critic.backbone, mb)
    return critic.head(h.to(critic.head.weight.dtype)).squeeze(-1).float() * mb.mask


def _adapter_of(role):
    """A role on the shared base (models/shared.py AdapterValueModel, AdapterRewardModel) runs the base with its own
    adapter active, as its forward does; any other role needs nothing."""
    if hasattr(role, "adapter") and hasattr(role, "_shared"):
        from rlfuse.models.shared import use_adapter

        return use_adapter(role._shared, role.adapter)
    return contextlib.nullcontext()


def can_share(model) -> bool:
    """Whether `model` (a causal LM, ValueModel or reward model, peft-wrapped or on the shared base) has a body the
    prefix-shared forward supports."""
    return model is not None and prefix.supports(getattr(model, "backbone", model))


def _reward_body_and_head(rm):
    """(transformer body, score head) of a sequence-classification reward model (also peft-wrapped) or of an
    AdapterRewardModel."""
    if hasattr(rm, "_shared"):
        from rlfuse.models.shared import body

        return body(rm._shared), rm.score
    base = rm.get_base_model() if hasattr(rm, "get_base_model") else rm
    return getattr(base, base.base_model_prefix), base.score


def reward_model_fn(rm, eos_id: int, pad_id: int, share_prompt: bool = True) -> Callable[[list[Sample]], Tensor]:
    """Reward from a scalar-head model on the same input as in training (collate.encode_reward_text: BOS + text +
    EOS). transformers' sequence-classification heads pool at the rightmost token that is not the pad id; rlfuse's
    pad id is the EOS id (GPT-2 tokenizers have no pad token), so the score is read at the last token of the text,
    the one before the trailing EOS, in training and here alike. share_prompt: samples of one prompt run it once
    (where the model supports it and no sequence is cut to the context); the saving is counted in
    `score.prompt_tokens_shared`."""
    from rlfuse.data.prompts import model_context

    context = model_context(rm.config)
    supported = can_share(rm)

    def score(samples: list[Sample], share_prompt: bool = share_prompt) -> Tensor:
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
        L = max(map(len, seqs))
        ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
        attn = torch.zeros(len(seqs), L, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)], attn[i, : len(s)] = torch.tensor(s), 1
        return rm(input_ids=ids.to(dev), attention_mask=attn.to(dev)).logits.squeeze(-1).float().cpu()

    score.prompt_tokens_shared = 0
    return score


def _shared_reward(rm, prompts, ends, seqs, pad_id: int, dev) -> Tensor:
    """reward_model_fn's score, prefix-shared: the body's state at each sequence's rightmost non-pad token (its
    pooling) through the score head."""
    pooled = torch.tensor([max((i for i, t in enumerate(s) if t != pad_id), default=0) for s in seqs])
    pb = prefix.group_by_prompt(prompts, ends, pad_id, dev)
    body, head = _reward_body_and_head(rm)
    with _adapter_of(rm):
        h = prefix.hidden_at(*prefix.prefix_shared_hidden(body, pb), pb, pooled[:, None].to(dev))[:, 0]
    return head(h.to(head.weight.dtype)).squeeze(-1).float().cpu()


class Scorer:
    """Scores finished samples, one micro-batch of similar lengths at a time, and keeps time per role.

    share_prompt: a prompt's samples go into one micro-batch together (as far as they have finished) and its
    forward runs once per role (where every role's model supports it)."""

    def __init__(self, reward_fn, pad_id: int, ref=None, actor=None, critic=None, temperature: float = 1.0,
                 micro_batch_size: int = 16, recompute_old_logprobs: bool = False, unfinished_penalty: float = 0.0,
                 share_prompt: bool = True):
        self.reward_fn, self.pad_id, self.ref, self.actor, self.critic = reward_fn, pad_id, ref, actor, critic
        self.temperature, self.micro = temperature, micro_batch_size
        self.recompute_old, self.unfinished_penalty = recompute_old_logprobs, unfinished_penalty
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
        if hasattr(self.reward_fn, "prompt_tokens_shared"):
            return self.reward_fn(chunk, share_prompt=self.share_prompt)
        return self.reward_fn(chunk)

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

    @contextlib.contextmanager
    def _timed(self, role: str):
        t = time.perf_counter()
        yield
        self.times[role] += time.perf_counter() - t

    def _ref_context(self):
        # with LoRA the reference is the actor's own base with adapters switched off: no second copy of the weights
        if self.ref is None and self.actor is not None and hasattr(self.actor, "disable_adapter"):
            return self.actor.disable_adapter()
        return contextlib.nullcontext()

    @torch.no_grad()
    def score(self, samples: list[Sample]) -> list[ScoredSample]:
        out = []
        order = self._order(samples)
        passes = 1 + (self.critic is not None) + self.recompute_old
        for i in range(0, len(order), self.micro):
            chunk = order[i: i + self.micro]
            dev = next((self.ref or self.actor).parameters()).device
            mb = collate([s.prompt_ids for s in chunk], [s.token_ids for s in chunk], self.pad_id, dev, self.share)
            self._shared_here += passes * (mb.prefix.saved_tokens if mb.prefix is not None else 0)
            unfinished = torch.tensor([s.finish_reason == "length" for s in chunk], dtype=torch.float32)
            with self._timed("reward"):
                scores = self._reward(chunk) - self.unfinished_penalty * unfinished
            with self._timed("reference"), self._ref_context():
                ref_lp = response_logprobs(self.ref or self.actor, mb, self.temperature).cpu()
            values = old = None
            if self.critic is not None:
                with self._timed("critic"):
                    values = response_values(self.critic, mb).cpu()
            if self.recompute_old:
                with self._timed("old_logprobs"):
                    old = response_logprobs(self.actor, mb, self.temperature).cpu()
            for b, s in enumerate(chunk):
                n = len(s.token_ids)
                out.append(ScoredSample(s, float(scores[b]), ref_lp[b, :n], None if values is None else values[b, :n],
                                        s.logprobs if old is None else old[b, :n]))
        return out
