"""Supervised losses as pure tensor functions (the RL losses live beside them in later modules)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


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
