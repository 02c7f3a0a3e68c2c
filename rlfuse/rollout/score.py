"""Scorer: one forward per role (reward, reference log-probs, critic values, and old log-probs where the generator's
own are not trusted) on a micro-batch of finished samples, padded only to that micro-batch's longest sequence.

Token log-probs are computed from the backbone's hidden states at response positions, pushing the LM head over
`logprob_chunk` positions at a time, so the full (B, T, V) logits never exist at once.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

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
    """Right-padded prompt+response sequences and where each response sits."""
    input_ids: Tensor       # (B, L)
    attention_mask: Tensor  # (B, L)
    positions: Tensor       # (B, T): position whose output predicts response token j (prompt_len + j - 1)
    targets: Tensor         # (B, T): response token ids (0 on padding)
    mask: Tensor            # (B, T): 1 on response tokens


def collate(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device) -> MicroBatch:
    seqs = [p + r for p, r in zip(prompts, responses)]
    B, L, T = len(seqs), max(map(len, seqs)), max(map(len, responses))
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros(B, L, dtype=torch.long)
    pos, tgt, mask = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids[b, : len(p) + len(r)] = torch.tensor(p + r)
        attn[b, : len(p) + len(r)] = 1
        pos[b, : len(r)] = torch.arange(len(p) - 1, len(p) + len(r) - 1)
        tgt[b, : len(r)] = torch.tensor(r)
        mask[b, : len(r)] = 1
    return MicroBatch(*(t.to(device) for t in (ids, attn, pos, tgt, mask)))


def response_logprobs(model, mb: MicroBatch, temperature: float = 1.0, chunk: int = 64,
                      with_entropy: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """log p(response token | prefix) under softmax(logits / temperature): (B, T), 0 on padding. Differentiable.
    With with_entropy, also the per-position entropy (B, T)."""
    body, head = backbone_and_head(model)
    hidden = body(input_ids=mb.input_ids, attention_mask=mb.attention_mask).last_hidden_state
    h = hidden.gather(1, mb.positions[..., None].expand(-1, -1, hidden.shape[-1]))  # (B, T, H)
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
    v = critic(input_ids=mb.input_ids, attention_mask=mb.attention_mask)
    return v.gather(1, mb.positions) * mb.mask


def reward_model_fn(rm, eos_id: int, pad_id: int) -> Callable[[list[Sample]], Tensor]:
    """Reward from a scalar-head model on the same input as in training (collate.encode_reward_text: BOS + text +
    EOS). transformers' sequence-classification heads pool at the rightmost token that is not the pad id; rlfuse's
    pad id is the EOS id (GPT-2 tokenizers have no pad token), so the score is read at the last token of the text,
    the one before the trailing EOS, in training and here alike."""
    from rlfuse.data.prompts import model_context

    context = model_context(rm.config)

    def score(samples: list[Sample]) -> Tensor:
        seqs = [s.prompt_ids + s.token_ids + ([] if s.token_ids[-1:] == [eos_id] else [eos_id]) for s in samples]
        if context:  # a full-budget prompt + a length-capped response + EOS is one past the context: keep the end,
            seqs = [s[-context:] for s in seqs]  # as RM training does (collate.encode_reward_text)
        L = max(map(len, seqs))
        dev = next(rm.parameters()).device
        ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
        attn = torch.zeros(len(seqs), L, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)], attn[i, : len(s)] = torch.tensor(s), 1
        return rm(input_ids=ids.to(dev), attention_mask=attn.to(dev)).logits.squeeze(-1).float().cpu()

    return score


def function_reward_fn(fn: Callable, tokenizer) -> Callable[[list[Sample]], Tensor]:
    """Reward from a Python function of texts (prompt + response, special tokens removed)."""

    def score(samples: list[Sample]) -> Tensor:
        texts = [tokenizer.decode(s.prompt_ids + s.token_ids, skip_special_tokens=True) for s in samples]
        return torch.tensor([float(x) for x in fn(texts)], dtype=torch.float32)

    return score


class Scorer:
    """Scores finished samples, one micro-batch of similar lengths at a time, and keeps time per role."""

    def __init__(self, reward_fn, pad_id: int, ref=None, actor=None, critic=None, temperature: float = 1.0,
                 micro_batch_size: int = 16, recompute_old_logprobs: bool = False, unfinished_penalty: float = 0.0):
        self.reward_fn, self.pad_id, self.ref, self.actor, self.critic = reward_fn, pad_id, ref, actor, critic
        self.temperature, self.micro = temperature, micro_batch_size
        self.recompute_old, self.unfinished_penalty = recompute_old_logprobs, unfinished_penalty
        self.times: dict[str, float] = defaultdict(float)

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
        order = sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.token_ids))
        for i in range(0, len(order), self.micro):
            chunk = order[i: i + self.micro]
            dev = next((self.ref or self.actor).parameters()).device
            mb = collate([s.prompt_ids for s in chunk], [s.token_ids for s in chunk], self.pad_id, dev)
            unfinished = torch.tensor([s.finish_reason == "length" for s in chunk], dtype=torch.float32)
            with self._timed("reward"):
                scores = self.reward_fn(chunk) - self.unfinished_penalty * unfinished
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
