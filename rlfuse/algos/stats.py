"""Masked statistics over variable-length responses. mask: 1 on response tokens, 0 on padding."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x where mask is 1. x, mask: same shape; dim=None reduces everything."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def level_mean(x: Tensor, mask: Tensor, level: str) -> Tensor:
    """Mean of per-token x over a batch of responses. x, mask: (B, T). "token": over all response tokens of the batch;
    "sequence": within each response first, then over responses (every response weighs the same, as GRPO)."""
    if level == "token":
        return masked_mean(x, mask)
    if level == "sequence":
        return masked_mean(x, mask, dim=1).mean()
    raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of the masked entries (Bessel-corrected by default, as TRL/OpenAI's `whiten`)."""
    mean = masked_mean(x, mask)
    n = mask.sum()
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return var


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over masked entries; padding stays 0. Ziegler et al. 2019 normalise advantages this way."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask.to(x.dtype)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var[returns - values] / Var[returns] over masked entries (1 is a perfect critic, <= 0 a useless one)."""
    var_r = masked_var(returns, mask)
    return 1 - masked_var(returns - values, mask) / var_r.clamp(min=1e-8)


def zero_spread_fraction(rewards: Tensor, k: int) -> Tensor:
    """Fraction of prompt groups whose k rewards are all equal: their rloo/grpo advantages are all zero, so they teach
    nothing (TRL's frac_reward_zero_std). rewards: (n_prompts * k,), grouped by prompt; returns a scalar."""
    r = rewards.view(-1, k)
    return (r.max(1).values == r.min(1).values).float().mean()


def in_spread_groups(rewards: Tensor, k: int) -> Tensor:
    """(n_prompts * k,) bool: the samples of the prompts whose k rewards are not all equal (rloo and grpo give the
    others an advantage of 0: rl.skip_zero_advantage keeps these). rewards grouped by prompt, as zero_spread_fraction."""
    r = rewards.view(-1, k)
    return (r.max(1).values != r.min(1).values).repeat_interleave(k)


def spread_groups_first(scores: list[Tensor], k: int, groups: int) -> list[tuple[int, int]]:
    """DAPO's dynamic sampling, by counts: from several rollouts' rewards (each (n_prompts * k,), grouped by prompt,
    in the order they were drawn), the (rollout, sample) pairs of `groups` prompt groups: first every group whose k
    rewards differ, in draw order, then, if too few did, groups whose rewards are all equal, in draw order (the batch
    keeps its size)."""
    spread, flat = [], []
    for part, r in enumerate(scores):
        for g, row in enumerate(r.view(-1, k)):
            (spread if bool(row.max() != row.min()) else flat).append((part, g))
    chosen = (spread + flat)[:groups]
    return [(part, g * k + j) for part, g in chosen for j in range(k)]

