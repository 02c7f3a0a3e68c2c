"""Off-policy correction for asynchronous RL (issue 30), as pure tensor functions: the decoupled PPO objective and the
behaviour importance weights it needs, and the staleness of a batch.

Three policies meet in an asynchronous update (Hilton et al. 2022, "Batch size-invariance for policy optimization";
AReaL, Fu et al. 2025): the behaviour policy that sampled each token (a generator up to rl.max_staleness updates
old, its log-prob recorded per token), the proximal policy (the weights at the start of this update: the PPO trust
region is taken around it, not around the stale sampler), and the policy being optimised. The PPO ratio is
pi_theta / pi_prox; the sample is re-weighted by w = pi_prox / pi_behav (no gradient), which is bounded one of two
ways: "truncate" (min(w, cap): truncated importance sampling, Yao et al. 2025) or "mask" (a token with w > cap is
left out of the update: AReaL's behav_imp_weight_cap). With behaviour = proximal (a synchronous batch) w = 1 and the
objective is PPO's clipped surrogate exactly.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import Tensor

from rlfuse.algos.policy_losses import LossSettings, aggregate, ppo_loss
from rlfuse.config.algorithms import BEHAVIOUR_WEIGHT_MODES as WEIGHT_MODES


def behaviour_weights(proximal_logprobs: Tensor, behaviour_logprobs: Tensor, cap: float,
                      mode: str = "truncate") -> tuple[Tensor, Tensor]:
    """w = pi_prox / pi_behav per token, bounded by `cap` as `mode` says. (B, T) each -> (weights, beyond): the
    bounded weights (no gradient) and where the raw weight exceeded the cap (bool)."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"mode must be one of {WEIGHT_MODES}, got {mode!r}")
    with torch.no_grad():
        w = (proximal_logprobs - behaviour_logprobs).exp()
        beyond = w > cap
        bounded = w.clamp(max=cap) if mode == "truncate" else w.masked_fill(beyond, 0.0)
    return bounded, beyond


def decoupled_ppo_policy_loss(logprobs: Tensor, proximal_logprobs: Tensor, behaviour_logprobs: Tensor,
                              advantages: Tensor, mask: Tensor, clip_eps: float, cap: float, mode: str = "truncate",
                              level: str = "token") -> tuple[Tensor, dict]:
    """The decoupled clipped surrogate, negated for minimisation: per token w * max(-A r, -A clip(r, 1 - eps, 1 + eps))
    with r = pi_theta / pi_prox and w = behaviour_weights(...). Shapes as ppo_policy_loss; a masked-out token (mode
    "mask") contributes 0 but still counts in the mean, so it drops its own update without scaling up the others.
    Returns (loss, {clip_frac, approx_kl (against the proximal policy), weight_mean, weight_max, beyond_frac})."""
    per_token, stats = decoupled_loss(ppo_loss, logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask,
                                      LossSettings(clip_eps, clip_eps), cap, mode)
    return aggregate(per_token, mask, {"token": "token-mean", "sequence": "seq-mean-token-mean"}[level]), stats


def decoupled_loss(loss_fn, logprobs: Tensor, proximal_logprobs: Tensor, behaviour_logprobs: Tensor,
                   advantages: Tensor, mask: Tensor, settings, cap: float,
                   mode: str = "truncate") -> tuple[Tensor, dict]:
    """Any policy loss of the table (algos/policy_losses.py LOSSES, each linear in the advantages) around the proximal
    policy, each token's advantage weighted by behaviour_weights: the per-token loss and the stats of
    decoupled_ppo_policy_loss."""
    w, beyond = behaviour_weights(proximal_logprobs, behaviour_logprobs, cap, mode)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    loss, stats = loss_fn(logprobs, proximal_logprobs, w * advantages, mask, settings)
    with torch.no_grad():
        m = mask.to(w.dtype)
        n = m.sum().clamp(min=1)
        stats |= {"weight_mean": (w * m).sum() / n, "weight_max": (w * m).max(),
                  "beyond_frac": (beyond.to(m.dtype) * m).sum() / n}
    return loss, stats


def logprob_mismatch(behaviour_logprobs: Tensor, trainer_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the sampler's log-probs of the sampled tokens are from the trainer's own forward of the same tokens
    (the train-inference mismatch: another engine's kernels, another dtype; for a stale batch, the staleness too):
    the mean and max |difference| per token, and the k3 estimate of KL(sampler || trainer) per token,
    mean of r - 1 - log r with r = pi_trainer / pi_sampler (>= 0, unbiased under the sampler's tokens). (B, T) each;
    mask: 1 at the tokens counted."""
    with torch.no_grad():
        m = mask.to(torch.float32)
        n = m.sum().clamp(min=1)
        log_r = (trainer_logprobs - behaviour_logprobs).float() * m
        gap = log_r.abs()
        k3 = (log_r.exp() - 1 - log_r) * m
        return {"mismatch/logprob_abs_mean": float(gap.sum() / n), "mismatch/logprob_abs_max": float(gap.max()),
                "mismatch/kl_k3": float(k3.sum() / n)}


def staleness(versions: list[int], trained_version: int) -> dict[int, int]:
    """How many samples of a batch were generated how many updates before the policy that trains on them:
    {staleness: count}. versions: each sample's policy version (the weights that sampled it; for a partial rollout
    the oldest of its tokens)."""
    ages = [trained_version - v for v in versions]
    if any(a < 0 for a in ages):
        raise ValueError(f"a sample's policy version is newer than the trained policy {trained_version}: {versions}")
    return dict(sorted(Counter(ages).items()))
