"""Supervised losses as pure tensor functions (the RL losses live beside them in later modules)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rlfuse.algos.stats import level_mean


def sft_loss(logits: Tensor, labels: Tensor, normalizer: float | Tensor | None = None) -> Tensor:
    """Next-token cross-entropy over labelled tokens (labels == -100 are ignored: prompt or padding).

    logits: (B, T, V); labels: (B, T), aligned with the inputs (shifted here). `normalizer` is the number of
    labelled tokens in the whole optimiser batch, so that micro-batches sum to the batch's token mean.
    """
    shift_logits = logits[:, :-1].reshape(-1, logits.size(-1)).float()
    shift_labels = labels[:, 1:].reshape(-1)
    total = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")
    if normalizer is None:
        normalizer = (shift_labels != -100).sum().clamp(min=1)
    return total / normalizer


def pairwise_reward_loss(r_chosen: Tensor, r_rejected: Tensor) -> Tensor:
    """Bradley-Terry loss, mean of -log sigmoid(r_chosen - r_rejected) (Ouyang et al. 2022, eq. 1). Shapes (B,)."""
    return -F.logsigmoid(r_chosen - r_rejected).mean()


def ppo_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_eps: float,
                    level: str = "token") -> tuple[Tensor, dict]:
    """Clipped surrogate objective (Schulman et al. 2017, eq. 7), negated for minimisation.

    logprobs, old_logprobs, mask: (B, T); advantages: (B, T), or (B,) for one advantage per sequence.
    level="token" averages over all response tokens of the batch; "sequence" averages within each sequence first
    (every sequence weighs the same, as in the GRPO paper). Returns (loss, {clip_frac, approx_kl}).
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    m = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_eps, 1 + clip_eps)
    loss = level_mean(torch.maximum(unclipped, clipped), m, level)
    with torch.no_grad():
        n = m.sum().clamp(min=1)
        clip_frac = ((clipped > unclipped).to(m.dtype) * m).sum() / n
        approx_kl = (0.5 * log_ratio ** 2 * m).sum() / n
    return loss, {"clip_frac": clip_frac, "approx_kl": approx_kl}


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_eps: float) -> tuple[Tensor, dict]:
    """Clipped value loss (as in OpenAI's PPO2 / Ziegler et al.): 0.5 * max((V - R)^2, (V_clip - R)^2), masked
    token mean. values, old_values, returns, mask: (B, T). Returns (loss, {clip_frac})."""
    m = mask.to(values.dtype)
    v_clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (v_clipped - returns) ** 2
    n = m.sum().clamp(min=1)
    loss = 0.5 * (torch.maximum(loss_unclipped, loss_clipped) * m).sum() / n
    with torch.no_grad():
        clip_frac = ((loss_clipped > loss_unclipped).to(m.dtype) * m).sum() / n
    return loss, {"clip_frac": clip_frac}
