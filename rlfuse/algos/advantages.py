"""Advantage estimators. Sequence-level ones (k samples per prompt, grouped contiguously) sit in ADVANTAGE_FNS."""

from __future__ import annotations

import torch
from torch import Tensor


def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16), vectorised over time.

    rewards, values, mask: (B, T), responses right-padded (mask 1 on response tokens). The value after a response's
    last token is 0 (the episode ends). A_t = sum_{s>=t} (gamma*lam)^(s-t) delta_s, computed as one (T, T) matmul.
    Returns (advantages, returns = advantages + values), both (B, T) and 0 on padding.
    """
    m = mask.to(values.dtype)
    v = values * m
    r = rewards * m
    next_v = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
    delta = (r + gamma * next_v - v) * m
    t = torch.arange(delta.shape[1], device=delta.device)
    power = (t[None, :] - t[:, None]).to(delta.dtype)  # (T, T): s - t
    discount = torch.where(power >= 0, (gamma * lam) ** power.clamp(min=0), torch.zeros_like(power))
    adv = delta @ discount.T
    return adv * m, (adv + v) * m


def rloo_advantages(rewards: Tensor, k: int) -> Tensor:
    """Leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024). rewards: (n_prompts*k,), the k samples of a
    prompt contiguous; each sample's baseline is the mean of the other k-1. Returns the same shape."""
    r = rewards.view(-1, k)
    baseline = (r.sum(1, keepdim=True) - r) / (k - 1)
    return (r - baseline).view(-1)


def grpo_advantages(rewards: Tensor, k: int, eps: float = 1e-4) -> Tensor:
    """Group-normalised advantages (Shao et al. 2024, DeepSeekMath eq. 3): (r - group mean) / (group std + eps).
    rewards: (n_prompts*k,), grouped by prompt. Returns the same shape."""
    r = rewards.view(-1, k)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1)


ADVANTAGE_FNS = {"rloo": rloo_advantages, "grpo": grpo_advantages}
