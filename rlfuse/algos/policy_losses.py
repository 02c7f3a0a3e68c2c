"""The policy losses the field uses, as one table of small pure functions, and the one aggregation they share.

Each loss maps per-token log-probs under the policy being trained, the old (sampling or proximal) log-probs, the
advantages and the mask of sampled tokens to a per-token loss (to be minimised) and its statistics; `aggregate` then
reduces it over the batch the way a recipe says (veRL's loss_agg_mode, TRL's loss_type). A recipe is a loss, an
aggregation and a clip range together (rl.recipe: config/algorithms.py RECIPES, named as TRL names them).

Losses (LOSSES):
- ppo: the clipped surrogate (Schulman et al. 2017) with a separate low and high clip (DAPO's clip-higher) and,
  optionally, dual-clip (Ye et al. 2020: a negative advantage's loss bounded by clip_c * |A|);
- gspo: one importance ratio per sequence, the geometric mean of its tokens' (Zheng et al. 2025), clipped per
  sequence; each token's gradient carries it (the token ratio times the detached sequence-to-token ratio);
- cispo: the importance weight clipped and detached, times the log-prob (MiniMax-M1): every token keeps a gradient,
  however far its ratio went;
- gpg: the plain policy gradient -A * log pi (Chu et al. 2025), no ratio, no clip.

Aggregations (AGGREGATIONS): token-mean (every sampled token of the batch weighs the same: DAPO), seq-mean-token-mean
(each sequence's token mean, then the mean over sequences: GRPO), seq-mean-token-sum (each sequence's token sum, then
the mean), seq-mean-token-sum-norm (token sums over a fixed length, then the mean: Dr. GRPO).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


@dataclass(frozen=True)
class LossSettings:
    clip_low: float = 0.2
    """The ratio's lower bound is 1 - clip_low."""
    clip_high: float = 0.2
    """The ratio's upper bound is 1 + clip_high (DAPO: 0.28)."""
    clip_c: float | None = None
    """Dual-clip: a negative advantage's loss is at most clip_c * |A| (Ye et al.: 3); None: off."""


def _per_token(advantages: Tensor, like: Tensor) -> Tensor:
    return advantages[:, None].expand_as(like) if advantages.dim() == 1 else advantages


def _stats(log_ratio: Tensor, clipped: Tensor, mask: Tensor) -> dict:
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        return {"clip_frac": (clipped.to(mask.dtype) * mask).sum() / n,
                "approx_kl": (0.5 * log_ratio ** 2 * mask).sum() / n}


def ppo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
             s: LossSettings) -> tuple[Tensor, dict]:
    """max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) per token, and with dual-clip min(that, clip_c |A|) where A
    < 0."""
    adv, m = _per_token(advantages, logprobs), mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - s.clip_low, 1 + s.clip_high)
    loss = torch.maximum(unclipped, clipped)
    if s.clip_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, s.clip_c * -adv), loss)
    return loss, _stats(log_ratio, clipped > unclipped, m)


def gspo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
              s: LossSettings) -> tuple[Tensor, dict]:
    """GSPO-token: the sequence ratio s_i = exp(mean_t log r_it), clipped per sequence, carried by each token as
    sg(s_i) * r_it / sg(r_it) so that its value is s_i and its gradient flows through every token."""
    adv, m = _per_token(advantages, logprobs), mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs) * m
    seq_log_ratio = log_ratio.sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
    token_log = seq_log_ratio.detach() + logprobs - logprobs.detach()
    ratio = token_log.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - s.clip_low, 1 + s.clip_high)
    return torch.maximum(unclipped, clipped), _stats(log_ratio, clipped > unclipped, m)


def cispo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
               s: LossSettings) -> tuple[Tensor, dict]:
    """-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi per token."""
    adv, m = _per_token(advantages, logprobs), mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    ratio = log_ratio.exp()
    weight = ratio.clamp(1 - s.clip_low, 1 + s.clip_high).detach()
    return -weight * adv * logprobs, _stats(log_ratio, weight != ratio.detach(), m)


def gpg_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
             s: LossSettings) -> tuple[Tensor, dict]:
    """-A * log pi per token."""
    adv, m = _per_token(advantages, logprobs), mask.to(logprobs.dtype)
    return -adv * logprobs, _stats(logprobs - old_logprobs, torch.zeros_like(m, dtype=torch.bool), m)


LOSSES: dict[str, Callable[..., tuple[Tensor, dict]]] = {
    "ppo": ppo_loss, "gspo": gspo_loss, "cispo": cispo_loss, "gpg": gpg_loss}
"""Every policy loss by name: (logprobs, old_logprobs, advantages, mask, LossSettings) -> (per-token loss, stats)."""


def aggregate(loss: Tensor, mask: Tensor, mode: str, max_tokens: int | None = None) -> Tensor:
    """The batch's loss from per-token losses (B, T) over the sampled tokens (mask). max_tokens: the fixed length
    seq-mean-token-sum-norm divides by (the response limit; default the mask's width)."""
    m = mask.to(loss.dtype)
    if mode == "token-mean":
        return (loss * m).sum() / m.sum().clamp(min=1)
    per_seq = (loss * m).sum(1)
    if mode == "seq-mean-token-mean":
        return (per_seq / m.sum(1).clamp(min=1)).mean()
    if mode == "seq-mean-token-sum":
        return per_seq.mean()
    if mode == "seq-mean-token-sum-norm":
        return per_seq.mean() / (max_tokens or m.shape[1])
    raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {mode!r}")


AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
