"""KL to the reference policy: per-token estimators (Schulman 2020, "Approximating KL divergence") and the
controllers that set its coefficient."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """log p - log q: unbiased, high variance, can be negative per token."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """0.5 (log p - log q)^2: biased, low variance, >= 0."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


K3_MAX = 10.0
"""k3 per token is clipped here. Unclipped, one sampled token that the policy has made rare (p) and the reference
finds likely (q) weighs q/p: SmolLM2 on word problems (GRPO, 16 x 8 samples) had single iterations at a summed KL
of 25 from one token, against under 1.7 otherwise, and the KL penalty's gradient from it alone dominates the update.
veRL's low_var_kl clips the same way."""


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """(q/p - 1) - log(q/p): unbiased below K3_MAX, >= 0 (the GRPO paper's estimator), clipped at K3_MAX."""
    log_ratio = ref_logprobs - logprobs
    return (torch.expm1(log_ratio) - log_ratio).clamp(max=K3_MAX)


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token KL estimate. logprobs, ref_logprobs: (B, T) log-probs of the sampled tokens -> (B, T)."""
    return KL_ESTIMATORS[estimator](logprobs, ref_logprobs)


def sequence_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """log pi(y) / pi_ref(y) per reply (k1 summed over its tokens), averaged over the batch: an unbiased estimate of
    the KL to the reference, whatever estimator a penalty uses. (B, T) each -> scalar."""
    return (kl_k1(logprobs, ref_logprobs) * mask).sum(1).mean()


def kl_shaped_rewards(scores: Tensor, kl: Tensor, mask: Tensor, coef: float) -> Tensor:
    """Per-token rewards for PPO (Ziegler et al. 2019): -coef * KL on every response token, plus the sequence score
    on its last sampled token. scores: (B,); kl, mask: (B, T), mask 1 on sampled tokens (right-padded, with gaps in
    a multi-turn episode). Returns (B, T), 0 where mask is 0."""
    m = mask.to(kl.dtype)
    rewards = -coef * kl * m
    positions = torch.arange(1, m.shape[1] + 1, device=m.device, dtype=m.dtype)
    last = ((m > 0) * positions).argmax(1)  # the last sampled position (0 for an empty row)
    return rewards.scatter_add(1, last[:, None], scores[:, None].to(kl.dtype))


@dataclass
class FixedKLController:
    coef: float

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


@dataclass
class AdaptiveKLController:
    """Ziegler et al. 2019, sec. 2.2: move the coefficient towards a target KL, at most +-20% error per horizon."""
    coef: float
    target: float
    horizon: int

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.coef *= 1 + error * n_steps / self.horizon
