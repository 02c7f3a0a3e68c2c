"""One micro-batch's losses, unscaled: the actor's policy loss from the table (algos/policy_losses.py, with GRPO's KL
in the loss, where its Algorithm puts it) and the critic's clipped value loss, each on the model's own forward of
the micro-batch."""

from __future__ import annotations

from rlfuse.algos.kl import kl_penalty
from rlfuse.algos.losses import value_loss
from rlfuse.algos.offpolicy import decoupled_loss
from rlfuse.algos.policy_losses import LOSSES, LossSettings, aggregate
from rlfuse.algos.stats import masked_mean
from rlfuse.config import RLConfig
from rlfuse.config.algorithms import ALGORITHMS
from rlfuse.models.forward import can_share, collate, response_logprobs, response_values
from rlfuse.rollout.fusion import Experience


def _micro(exp: Experience, idx: list[int], pad_id: int, model, share_prompt: bool):
    """The micro-batch's inputs on model's device (prefix-shared where rl.share_prompt, the model supports it and a
    prompt repeats), a function taking its rows of an (N,) or (N, T) experience tensor, and the mask of the tokens
    the policy sampled (Experience.mask), the only ones the losses read."""
    device = next(model.parameters()).device
    mb = collate([exp.prompt_ids[i] for i in idx], [exp.response_ids[i] for i in idx], pad_id, device,
                 share_prompt and can_share(model))
    T = mb.mask.shape[1]
    take = lambda t: (t[idx] if t.dim() == 1 else t[idx][:, :T]).to(device)
    return mb, take, mb.mask * take(exp.mask).to(mb.mask.dtype)


def loss_settings(rl: RLConfig) -> LossSettings:
    """rl.clip (low), rl.clip_high and rl.dual_clip as the policy-loss table takes them."""
    return LossSettings(rl.clip, rl.clip if rl.clip_high is None else rl.clip_high, rl.dual_clip)


def micro_policy_loss(actor, exp: Experience, idx: list[int], adv, rl: RLConfig, kl_coef: float, pad_id: int,
                      temperature: float, share_prompt: bool | None = None):
    """rl.policy_loss (plus grpo's in-loss KL) of one micro-batch, aggregated by rl.loss_agg over the micro-batch,
    unscaled (the caller weighs it by the micro-batch's share, rl.loss_share). temperature: the one the samples were
    drawn and the reference scored at (the iteration's). share_prompt: this micro-batch's prefix sharing where the
    caller decides it (FSDP: the same on every rank); None: rl.share_prompt."""
    mb, take, mask = _micro(exp, idx, pad_id, actor, rl.share_prompt if share_prompt is None else share_prompt)
    new_lp, entropy = response_logprobs(actor, mb, temperature, with_entropy=True)
    stale = exp.proximal_logprobs is not None or exp.proximal_from_update
    loss_fn, settings, agg = LOSSES[rl.policy_loss], loss_settings(rl), rl.loss_agg_used
    if not stale:
        per_token, st = loss_fn(new_lp, take(exp.logprobs), take(adv), mask, settings)
    else:  # a stale batch (rl.max_staleness): the loss around the proximal policy, re-weighted from the behaviour one
        proximal = new_lp.detach() if exp.proximal_from_update else take(exp.proximal_logprobs)
        per_token, st = decoupled_loss(loss_fn, new_lp, proximal, take(exp.logprobs), take(adv), mask, settings,
                                       rl.behaviour_weight_cap, rl.behaviour_weight_mode)
    loss = aggregate(per_token, mask, agg, rl.response_limit)
    if rl.entropy_coef:  # an entropy bonus, averaged as the loss is (the entropy is differentiable for it)
        loss = loss - rl.entropy_coef * aggregate(entropy, mask, agg, rl.response_limit)
    stats = {"train/policy_loss": loss.detach(), "train/clip_frac": st["clip_frac"], "train/approx_kl": st["approx_kl"],
             "train/entropy": masked_mean(entropy.detach(), mask)}
    if stale:
        stats |= {"train/behaviour_weight_mean": st["weight_mean"], "train/behaviour_weight_max": st["weight_max"],
                  "train/behaviour_beyond_cap": st["beyond_frac"]}
    if ALGORITHMS[rl.algo].kl_in == "loss":  # KL to the reference inside the loss (grpo)
        kl = kl_penalty(new_lp, take(exp.ref_logprobs), rl.kl_estimator_used)
        loss = loss + kl_coef * aggregate(kl, mask, agg, rl.response_limit)
    return loss, stats


def micro_value_loss(critic, exp: Experience, idx: list[int], returns, rl: RLConfig, pad_id: int,
                     share_prompt: bool | None = None):
    """Clipped value loss of one micro-batch (a token mean), unscaled; share_prompt as micro_policy_loss's."""
    mb, take, mask = _micro(exp, idx, pad_id, critic, rl.share_prompt if share_prompt is None else share_prompt)
    loss, st = value_loss(response_values(critic, mb), take(exp.values), take(returns), mask, rl.vf_clip)
    return loss, {"train/value_loss": loss.detach(), "train/value_clip_frac": st["clip_frac"]}
