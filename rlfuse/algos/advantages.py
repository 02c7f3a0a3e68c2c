"""Advantage estimators. Sequence-level ones (k samples per prompt, grouped contiguously) sit in ADVANTAGE_FNS."""

from __future__ import annotations

import torch
from torch import Tensor


def sampled_first(mask: Tensor) -> Tensor:
    """(B, T) long: per row, the positions where mask is 1 in order, then the others (a stable sort). Gathering by it
    closes the gaps a multi-turn episode's tool and observation tokens leave between the policy's turns; for a
    right-padded single-turn mask it is the identity."""
    return torch.sort((mask <= 0).to(torch.int8), dim=1, stable=True).indices


def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16), vectorised over time.

    rewards, values, mask: (B, T), mask 1 on the tokens the policy sampled: a right-padded response, or a
    multi-turn episode whose tool and observation tokens (mask 0) sit between its turns. Time runs over the sampled
    tokens alone: the value after a turn's last token is the next turn's first token's (the answer is the
    environment's move, not a step of the policy), and the value after the last sampled token is 0 (the episode
    ends). A_t = sum_{s>=t} (gamma*lam)^(s-t) delta_s, computed as one (T, T) matmul. Returns (advantages, returns
    = advantages + values), both (B, T) and 0 where mask is 0.
    """
    order = sampled_first(mask)
    if not bool((order == torch.arange(mask.shape[1], device=mask.device)).all()):  # gaps: close them, then reopen
        adv, ret = _gae(rewards.gather(1, order), values.gather(1, order), mask.gather(1, order), gamma, lam)
        return torch.zeros_like(adv).scatter(1, order, adv), torch.zeros_like(ret).scatter(1, order, ret)
    return _gae(rewards, values, mask, gamma, lam)


def _gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
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


def scaled(centred: Tensor, scale: str, eps: float = 1e-4) -> Tensor:
    """Group-centred advantages (n_prompts, k) divided by what `scale` names (TRL's scale_rewards): "group" each
    prompt's reward std (+ eps), "batch" the std of all of them (+ eps), "none" nothing (Dr. GRPO)."""
    if scale == "group":
        return centred / (centred.std(1, keepdim=True) + eps)
    if scale == "batch":
        return centred / (centred.std() + eps)
    if scale == "none":
        return centred
    raise ValueError(f"scale must be group, batch or none, got {scale!r}")


def rloo_advantages(rewards: Tensor, k: int, scale: str = "none") -> Tensor:
    """Leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024). rewards: (n_prompts*k,), the k samples of a
    prompt contiguous; each sample's baseline is the mean of the other k-1; then `scaled` (none by default).
    Returns the same shape."""
    r = rewards.view(-1, k)
    baseline = (r.sum(1, keepdim=True) - r) / (k - 1)
    return scaled(r - baseline, scale).view(-1)


def grpo_advantages(rewards: Tensor, k: int, scale: str = "group", eps: float = 1e-4) -> Tensor:
    """Group-relative advantages (Shao et al. 2024, DeepSeekMath eq. 3): (r - group mean), divided by the group's std
    + eps (scale="group", as the paper), the batch's (scale="batch") or nothing (scale="none", Dr. GRPO).
    rewards: (n_prompts*k,), grouped by prompt. Returns the same shape."""
    r = rewards.view(-1, k)
    centred = r - r.mean(1, keepdim=True)
    if scale == "group":  # the paper's expression, as it was computed before scale existed (bit for bit)
        return (centred / (r.std(1, keepdim=True) + eps)).view(-1)
    return scaled(centred, scale, eps).view(-1)


def overlong_penalty(lengths: Tensor, limit: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 for a response of at most limit - buffer tokens,
    falling linearly to -penalty at the limit. lengths: (N,) tokens each response sampled. Returns (N,)."""
    over = (lengths.to(torch.float32) - (limit - buffer)).clamp(min=0, max=buffer)
    return -penalty * over / buffer


def per_function_advantages(parts: Tensor, weights: list[float], k: int, estimator, scale: str) -> Tensor:
    """GDPO-style: each reward function's values (parts: (N, functions)) through the group estimator on its own
    (centred, and scaled by `scale`, within each prompt's group), then summed with the functions' weights, so that a
    function with a wide range does not drown the others' group differences. Returns (N,)."""
    return sum(w * estimator(parts[:, f].contiguous(), k, scale) for f, w in enumerate(weights))


ADVANTAGE_FNS = {"rloo": rloo_advantages, "grpo": grpo_advantages}
