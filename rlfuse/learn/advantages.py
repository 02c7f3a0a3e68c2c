"""An iteration's advantages and returns from its experience: the KL penalty where rl.algo puts it (its Algorithm's
kl_in), then the algorithm's estimator, through the pure functions of rlfuse/algos."""

from __future__ import annotations

import torch

from rlfuse.algos.advantages import ADVANTAGE_FNS, gae_advantages, overlong_penalty, per_function_advantages
from rlfuse.algos.kl import kl_penalty, kl_shaped_rewards
from rlfuse.algos.stats import whiten
from rlfuse.config import RLConfig
from rlfuse.config.algorithms import ALGORITHMS
from rlfuse.rollout.fusion import Experience


def compute_advantages(exp: Experience, rl: RLConfig, kl_coef: float):
    """-> (advantages (N, T) for a per-token estimator or (N,), returns (N, T) or None, per-token KL (N, T)); calls
    only pure functions. rl.whiten_advantages whitens over response tokens (gae) or over samples (rloo, grpo)."""
    algo = ALGORITHMS[rl.algo]
    # the trained policy's log-probs in the reference's arithmetic where the sampler computed in another (a bf16
    # update against an fp32 or bf16-copy sampler): the sampler's would put the rounding into the KL (0.073 nats
    # over SmolLM2's hh replies before any update)
    policy = exp.logprobs if exp.proximal_logprobs is None else exp.proximal_logprobs
    kl = kl_penalty(policy, exp.ref_logprobs, rl.kl_estimator_used) * exp.mask
    if algo.kl_in == "token_reward":  # the KL in each token's reward (Ziegler et al.), advantages by GAE
        rewards = kl_shaped_rewards(shaped_scores(exp, rl), kl, exp.mask, kl_coef)
        adv, returns = gae_advantages(rewards, exp.values, exp.mask, rl.gamma, rl.lam)
        mask = exp.mask
    else:  # the KL in the sequence reward (rloo) or in the loss (grpo: learn/losses.py micro_policy_loss)
        estimator = ADVANTAGE_FNS[algo.advantage]
        if rl.reward_normalization == "per_function" and exp.reward_parts is not None:
            # each function normalised in its group on its own (GDPO), the rest of the reward (a KL in the sequence
            # reward, an overlong penalty, an environment's reward) as one more part
            weights = rl.reward_weights or [1.0] * exp.reward_parts.shape[1]
            rest = sequence_rewards(exp, rl, kl, kl_coef) - exp.reward_parts @ torch.tensor(weights)
            parts = torch.cat([exp.reward_parts, rest[:, None]], 1)
            adv = per_function_advantages(parts, [*weights, 1.0], rl.k, estimator, rl.scale_rewards)
        else:
            adv = estimator(sequence_rewards(exp, rl, kl, kl_coef), rl.k, rl.scale_rewards)
        returns = None
        mask = torch.ones_like(adv)
    return (whiten(adv, mask) if rl.whiten_advantages else adv), returns, kl


def sequence_rewards(exp: Experience, rl: RLConfig, kl, kl_coef: float):
    """rloo, grpo: each sample's reward, less its summed KL where the algorithm puts the KL in the sequence reward
    (rloo; grpo's is in the loss). kl: compute_advantages' per-token KL (N, T)."""
    return shaped_scores(exp, rl) - (kl_coef * kl.sum(1) if ALGORITHMS[rl.algo].kl_in == "sequence_reward" else 0.0)


def shaped_scores(exp: Experience, rl: RLConfig):
    """The scores the advantages read: the reward, plus DAPO's soft overlong penalty where rl.overlong_buffer is set
    (on the tokens each sample sampled, against the response limit)."""
    if not rl.overlong_buffer:
        return exp.scores
    return exp.scores + overlong_penalty(exp.mask.sum(1), rl.response_limit, rl.overlong_buffer, rl.overlong_penalty)
