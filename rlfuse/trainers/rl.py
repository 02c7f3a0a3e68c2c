"""Online RL: PPO with a critic, RLOO and GRPO, on the rollout engine and the pure functions in rlfuse/algos.
Build (rlfuse/models/build.py) -> loop (train_rl) -> update (update_actor, update_critic).

Departures from the papers, on purpose:
- the engine's sampling log-probs serve as the old log-probs (they equal a full forward to 1e-4, tested), so no
  extra actor pass is spent on them;
- RLOO folds the KL into the sequence reward (as Ahmadian et al.); GRPO keeps it in the loss (k3 by default, as
  DeepSeekMath); PPO folds it into per-token rewards (Ziegler et al.). One estimator (rl.kl_estimator_used) serves
  the penalty, the logged reward/kl and the adaptive controller;
- the actor and the critic are two updates over the same experience and the same mini-batch order, each clipping
  its own gradient norm and stepping its own optimiser; a value head on the actor's body (rl.critic_init=actor)
  joins the actor's update instead (see update_actor);
- the generator is its own model: it gets the actor's weights through DecodeEngine.load_weights before every
  rollout and evaluation, never by sharing the optimiser's tensors (with model.shared_base the engine decodes the
  shared base itself, with the actor's adapter: no copy, no sync);
- with rl.share_prompt (default) a prompt's k samples stay in one mini-batch for ppo too (as for rloo and grpo), so
  that their forwards share the prompt (rlfuse/models/prefix.py; equal numbers, fewer token-forwards);
- every random draw (prompt batch, sampling, mini-batch order) and the scheduled temperature are functions of
  (seed, iteration), so a resumed run repeats an uninterrupted one exactly;
- with a temperature schedule each iteration optimises softmax(logits / T_it): sampling, the reference log-probs
  and the update's log-probs all use T_it, while the before/after evaluation keeps one fixed temperature;
- step 1 (sync, generate, score) and step 4 (update, checkpoints) are a `rollout` and a `trainer` object
  (rlfuse/placement/rollout.py): this process, or Ray worker groups by placement.strategy (training data-parallel
  on the actor's group); the evaluation and the saved model stay in this process for every strategy.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from rlfuse.algos.advantages import ADVANTAGE_FNS, gae_advantages
from rlfuse.algos.kl import AdaptiveKLController, FixedKLController, kl_penalty, kl_shaped_rewards
from rlfuse.algos.losses import ppo_policy_loss, value_loss
from rlfuse.algos.schedules import scheduled_value
from rlfuse.algos.stats import explained_variance, level_mean, masked_mean, whiten
from rlfuse.config import Config, RLConfig, fusion_on
from rlfuse.data.collate import pack_by_tokens, prompt_runs
from rlfuse.data.curriculum import curriculum_indices, uniform_indices
from rlfuse.data.chat import set_chat_template
from rlfuse.data.prompts import encode_prompts, model_context, prompt_budget
from rlfuse.data.stages import rl_prompt_rows
from rlfuse.errors import UserError
from rlfuse.evaluation import evaluate, evaluate_before, iteration_gold, prompt_difficulty, sampling_params
from rlfuse.metrics.flops import compute_meter_for_run
from rlfuse.metrics.memory import MemoryMeter
from rlfuse.metrics.tracker import memory_metrics, stage_tracker
from rlfuse.models.build import Models, build_models, decode_engine
from rlfuse.models.load import save_trained_model
from rlfuse.models.prefix import prompt_tokens_saved
from rlfuse.placement.rollout import build_placement, local_scorer, sync_weights, uses_ray
from rlfuse.placement.planner import predicted_memory, resolve_auto
from rlfuse.placement.spec import dp_micro_size
from rlfuse.progress import Progress
from rlfuse.rollout.rewards import attach_rows, reward_metrics, reset_reward_metrics
from rlfuse.rollout.fusion import Experience, FusionPolicy
from rlfuse.rollout.score import (can_share, collate, forward_tokens, response_logprobs, response_values,
                                  worth_sharing)
from rlfuse.trainers.checkpoint import load_checkpoint, save_checkpoint
from rlfuse.trainers.common import build_constant_optimizer, setup_runtime
from rlfuse.trainers.observe import due, evaluate_during, group_metrics, learning_rates, sample_table
from rlfuse.trainers.sft import resolve_base_model

# ------------------------------------------------------------------------------------------- optimisers


@dataclass
class Learner:
    """A module that trains, with its optimiser and (constant) LR schedule."""
    module: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    params: list | None = None
    """What it trains when that is not every trainable parameter of `module`: a shared base holds the actor's and
    the critic's adapters in one model."""
    on_step: Callable | None = None
    """Called with the learner after each optimiser step, before the gradients are dropped (the memory meter)."""

    @classmethod
    def constant(cls, module: torch.nn.Module, lr: float, optimizer: str = "adamw",
                 params: list | None = None) -> "Learner":
        return cls(module, *build_constant_optimizer(module, lr, optimizer, params), params)

    def trained(self) -> list:
        return self.params if self.params is not None else [p for p in self.module.parameters() if p.requires_grad]

    def step(self, grad_clip: float) -> torch.Tensor:
        """Clip this learner's own gradient norm (0: no clipping), step, zero; returns the norm before clipping."""
        params = self.trained()
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        self.opt.step()
        self.sched.step()
        if self.on_step is not None:
            self.on_step(self)
        self.opt.zero_grad(set_to_none=True)
        return norm.detach()


@dataclass
class Learners:
    actor: Learner
    critic: Learner | None
    """With a value head on the actor (critic_init=actor) this owns only the head; the body is the actor's."""
    shared_body: bool


def build_learners(models: Models, rl: RLConfig) -> Learners:
    """The actor's and the critic's optimisers (rl.optimizer). On a shared base each owns its adapter's tensors."""
    from rlfuse.models.shared import ACTOR, role_parameters

    on_actor = models.critic is not None and models.roles["critic"].source == "actor"  # a value head on its body
    critic = None
    if models.critic is not None:
        if on_actor:
            critic = Learner.constant(models.critic.head, rl.critic_lr, rl.optimizer)
        else:
            own = models.critic.trainable_parameters() if models.shared_base is not None else None
            critic = Learner.constant(models.critic, rl.critic_lr, rl.optimizer, own)
    own = role_parameters(models.actor, ACTOR) if models.shared_base is not None else None
    return Learners(Learner.constant(models.actor, rl.lr, rl.optimizer, own), critic, on_actor)


def learner_sets(learners: Learners) -> list[list[Learner]]:
    """The learners each optimise() call of `update` steps together, in update's order: the actor (with the value
    head when it sits on the actor's body), then a separate critic."""
    sets = [[learners.actor] + ([learners.critic] if learners.shared_body else [])]
    return sets + ([[learners.critic]] if learners.critic is not None and not learners.shared_body else [])


# ------------------------------------------------------------------------------------------- the math


def prompt_batch(prompts: list[list[int]], iteration: int, n: int, seed: int, difficulty: list[float] | None = None,
                 iterations: int = 1, start_fraction: float = 1.0) -> list[list[int]]:
    """The iteration's prompts: a function of (seed, iteration), so no data position needs restoring. Uniform, or
    with difficulty scores (one per prompt) a curriculum over the run's iterations (rlfuse/data/curriculum.py)."""
    idx = (uniform_indices(len(prompts), iteration, n, seed) if difficulty is None else
           curriculum_indices(difficulty, iteration, iterations, n, seed, start_fraction))
    return [prompts[i] for i in idx]


def iteration_temperature(rl: RLConfig, iteration: int) -> float:
    """Sampling temperature of 0-based `iteration`: rl.temperature -> rl.temperature_final by rl.temperature_schedule."""
    final = rl.temperature if rl.temperature_final is None else rl.temperature_final
    return scheduled_value(rl.temperature_schedule, rl.temperature, final, iteration, rl.iterations)


def sampling_note(rl: RLConfig) -> str:
    """'temperature 1 -> 0.7 (linear), curriculum by reward' for the run's first log line."""
    note = f"temperature {rl.temperature:g}"
    if rl.temperature_schedule != "constant":
        note += f" -> {rl.temperature_final:g} ({rl.temperature_schedule})"
    return note + (f", curriculum by {rl.curriculum}" if rl.curriculum != "none" else "")


def compute_advantages(exp: Experience, rl: RLConfig, kl_coef: float):
    """-> (advantages (N, T) for ppo or (N,), returns (N, T) or None, per-token KL (N, T)); calls only pure functions.
    rl.whiten_advantages whitens over response tokens (ppo) or over samples (rloo, grpo)."""
    kl = kl_penalty(exp.logprobs, exp.ref_logprobs, rl.kl_estimator_used) * exp.mask
    if rl.algo == "ppo":
        rewards = kl_shaped_rewards(exp.scores, kl, exp.mask, kl_coef)
        adv, returns = gae_advantages(rewards, exp.values, exp.mask, rl.gamma, rl.lam)
        mask = exp.mask
    else:  # rloo: KL in the sequence reward; grpo: KL in the loss (micro_policy_loss)
        seq_reward = exp.scores - (kl_coef * kl.sum(1) if rl.algo == "rloo" else 0.0)
        adv, returns = ADVANTAGE_FNS[rl.algo](seq_reward, rl.k), None
        mask = torch.ones_like(adv)
    return (whiten(adv, mask) if rl.whiten_advantages else adv), returns, kl


def minibatches(n: int, rl: RLConfig, seed: int, iteration: int) -> list[list[int]]:
    """Epochs x mini-batches of sample indices, a function of (seed, iteration); a prompt's k samples stay in one
    mini-batch (rloo, grpo; ppo too with rl.share_prompt, where rl.mini_batch_size is a multiple of rl.k, so that its
    micro-batches can share prompts). The actor and critic updates walk the same list."""
    gen = torch.Generator().manual_seed(seed * 7919 + iteration)
    group = rl.k if rl.algo != "ppo" or (rl.share_prompt and rl.mini_batch_size % rl.k == 0) else 1
    out = []
    for _ in range(rl.epochs):
        order = (torch.randperm(n // group, generator=gen)[:, None] * group + torch.arange(group)).view(-1).tolist()
        out += [order[s: s + rl.mini_batch_size] for s in range(0, n, rl.mini_batch_size)]
    return out


def micro_batch_indices(exp: Experience, mini: list[int], size: int, world: int = 1, tokens: int | None = None,
                        shared: bool = False) -> list[list[int]]:
    """A mini-batch's micro-batches, every rank's, in order: `size` samples each, or with a token budget (`tokens`,
    rl.micro_batch_tokens) packed by collate.pack_by_tokens, a prompt's samples kept together, similar lengths
    together, each micro-batch's forward (score.forward_tokens; prompts once when `shared`) within the budget. A
    mini-batch too small to give each of `world` ranks a micro-batch is cut into `world` smaller ones
    (placement/spec.py dp_micro_size), so no rank only pads."""
    if tokens is not None:
        prompts, responses = exp.prompt_ids, exp.response_ids
        units = prompt_runs(mini, exp.prompt_index.tolist())
        units.sort(key=lambda u: max(len(prompts[i]) + len(responses[i]) for i in u))
        cost = lambda idx: forward_tokens([prompts[i] for i in idx], [responses[i] for i in idx], shared)
        packed = pack_by_tokens(units, cost, tokens)
        if len(packed) >= world:
            return packed
    size = dp_micro_size(len(mini), size, world)
    return [mini[s: s + size] for s in range(0, len(mini), size)]


def micro_batches(exp: Experience, mini: list[int], size: int, rank: int = 0, world: int = 1,
                  tokens: int | None = None, shared: bool = False) -> Iterator[tuple[list[int], dict]]:
    """(indices, share) per micro-batch (micro_batch_indices); share[level] is its part of the mini-batch's tokens
    ("token") or samples ("sequence"), so that micro-batch means scaled by it sum to the mini-batch mean
    (accumulation = one big batch). Data parallel (world > 1): rank r gets micro-batches r, r + world, ... of the same
    list (the single process's micro-batches, so the per-micro-batch stats agree too), shares still of the whole
    mini-batch, so the ranks' share-scaled gradients sum to the single-process one."""
    lengths = exp.mask.sum(1).tolist()  # one host read per mini-batch (exp lives on the host anyway)
    total = sum(lengths[i] for i in mini)
    for idx in micro_batch_indices(exp, mini, size, world, tokens, shared)[rank::world]:
        yield idx, {"token": sum(lengths[i] for i in idx) / total, "sequence": len(idx) / len(mini)}


def prompt_tokens_shared(exp: Experience, batches: list[list[int]], rl: RLConfig, world: int = 1) -> int:
    """Prompt token-forwards that one prefix-shared pass over these mini-batches' micro-batches (every rank's)
    does not compute: per micro-batch that shares (worth_sharing), each repeated prompt's length x (its samples - 1)."""
    total = 0
    for mini in batches:
        for idx in micro_batch_indices(exp, mini, rl.micro_batch_size, world, rl.micro_batch_tokens, rl.share_prompt):
            prompts, responses = [exp.prompt_ids[i] for i in idx], [exp.response_ids[i] for i in idx]
            total += prompt_tokens_saved(prompts) if worth_sharing(prompts, responses) else 0
    return total


def _micro(exp: Experience, idx: list[int], pad_id: int, model, share_prompt: bool):
    """The micro-batch's inputs on model's device (prefix-shared where rl.share_prompt, the model supports it and a
    prompt repeats), and a function taking its rows of an (N,) or (N, T) experience tensor."""
    device = next(model.parameters()).device
    mb = collate([exp.prompt_ids[i] for i in idx], [exp.response_ids[i] for i in idx], pad_id, device,
                 share_prompt and can_share(model))
    T = mb.mask.shape[1]
    return mb, lambda t: (t[idx] if t.dim() == 1 else t[idx][:, :T]).to(device)


def micro_policy_loss(actor, exp: Experience, idx: list[int], adv, rl: RLConfig, kl_coef: float, pad_id: int,
                      temperature: float):
    """Clipped surrogate (plus grpo's in-loss KL, same estimator and averaging level) of one micro-batch, unscaled.
    temperature: the one the samples were drawn and the reference scored at (the iteration's)."""
    mb, take = _micro(exp, idx, pad_id, actor, rl.share_prompt)
    new_lp, entropy = response_logprobs(actor, mb, temperature, with_entropy=True)
    loss, st = ppo_policy_loss(new_lp, take(exp.logprobs), take(adv), mb.mask, rl.clip, rl.loss_level)
    stats = {"train/policy_loss": loss.detach(), "train/clip_frac": st["clip_frac"], "train/approx_kl": st["approx_kl"],
             "train/entropy": masked_mean(entropy.detach(), mb.mask)}
    if rl.algo == "grpo":  # KL to the reference inside the loss
        kl = kl_penalty(new_lp, take(exp.ref_logprobs), rl.kl_estimator_used)
        loss = loss + kl_coef * level_mean(kl, mb.mask, rl.loss_level)
    return loss, stats


def micro_value_loss(critic, exp: Experience, idx: list[int], returns, rl: RLConfig, pad_id: int):
    """Clipped value loss of one micro-batch (a token mean), unscaled."""
    mb, take = _micro(exp, idx, pad_id, critic, rl.share_prompt)
    loss, st = value_loss(response_values(critic, mb), take(exp.values), take(returns), mb.mask, rl.vf_clip)
    return loss, {"train/value_loss": loss.detach(), "train/value_clip_frac": st["clip_frac"]}


def count_bad_step(bad: dict, rl: RLConfig, why: str, stop: bool = True) -> None:
    """A skipped update: counted; rl.max_bad_steps in a row end the run (at once, or at stop_if_diverged)."""
    bad["skipped"] += 1
    bad["consecutive"] += 1
    bad["why"] = why
    if stop:
        stop_if_diverged(bad, rl)


def stop_if_diverged(bad: dict, rl: RLConfig) -> None:
    if bad["consecutive"] >= rl.max_bad_steps:
        raise UserError(f"training diverged: {bad['consecutive']} consecutive updates skipped, the last for "
                        f"{bad.get('why')} (lower rl.lr, raise rl.kl_coef, or check rl.reward); last checkpoint kept")


def optimise(learners: list[Learner], batches: list[list[int]], exp: Experience, micro_size: int,
             loss_of: Callable, rl: RLConfig, bad: dict, group=None) -> tuple[dict, list[float]]:
    """The accumulation loop both updates share: per mini-batch, one backward per micro-batch of loss_of(idx, share)
    (already scaled by its share), then each learner clips its own gradient norm and steps. A non-finite loss skips
    the mini-batch (count_bad_step). Returns (mean stats over micro-batches, mean grad norm per learner).

    group: data parallelism (rlfuse/placement/ray_train.py DataParallelGroup, DDP underneath): this rank runs its
    micro-batches of each mini-batch (micro_batches), padded with zero-weight ones to the same count on every rank,
    the losses computed inside DDP's forward; the last micro-batch's backward all-reduces, so every rank steps on the
    gradient one process would get from the whole mini-batch."""
    if group is not None:
        return _optimise_data_parallel(learners, batches, exp, micro_size, loss_of, rl, bad, group)
    sums: dict = {}
    count, steps, norms = 0, 0, [0.0] * len(learners)
    for mini in batches:
        finite = torch.ones((), dtype=torch.bool)
        # the finite flag stays a tensor: one host sync per mini-batch (at the step), none per micro-batch; a NaN
        # micro-batch's backward makes NaN gradients, which the skipped step drops
        for idx, share in micro_batches(exp, mini, micro_size, 0, 1, rl.micro_batch_tokens, rl.share_prompt):
            loss, stats = loss_of(idx, share)
            finite = finite.to(loss.device) & torch.isfinite(loss.detach())
            loss.backward()
            count = _add_stats(sums, stats, count, finite)
        steps, norms = _step_or_skip(learners, bool(finite), rl, bad, steps, norms)
    return {k: float(v) / max(1, int(count)) for k, v in sums.items()}, [float(n) / max(1, steps) for n in norms]


def _optimise_data_parallel(learners, batches, exp, micro_size, loss_of, rl, bad, group):
    """optimise on one rank of a data-parallel group. Every rank runs every slot (a NaN loss too: it makes the
    all-reduced gradient NaN on every rank, and the ranks skip the step together)."""
    sums: dict = {}
    count, steps, norms = 0, 0, [0.0] * len(learners)
    modules = [learner.module for learner in learners]
    zero = {"token": 0.0, "sequence": 0.0}
    tokens, shared = rl.micro_batch_tokens, rl.share_prompt
    for n, mini in enumerate(batches):
        every = micro_batch_indices(exp, mini, micro_size, group.world, tokens, shared)
        mine = list(micro_batches(exp, mini, micro_size, group.rank, group.world, tokens, shared))
        slots = -(-len(every) // group.world)  # the most any rank has: every rank takes part in each all-reduce
        finite = torch.ones((), dtype=torch.bool)
        for j in range(slots):
            idx, share = mine[j] if j < len(mine) else (every[0], zero)  # a padding slot adds nothing
            with group.micro_batch(modules, sync=j == slots - 1) as run:
                loss, stats = run(loss_of, idx, share)
                finite = finite.to(loss.device) & torch.isfinite(loss.detach())
                loss.backward()
            if j < len(mine):  # as one process: no stats from a NaN micro-batch on
                count = _add_stats(sums, stats, count, finite)
        if n == 0:
            group.check_all_used(modules)
        steps, norms = _step_or_skip(learners, group.all_finite(bool(finite)), rl, bad, steps, norms)
    sums, count = group.sum_stats(sums, int(count))
    return {k: float(v) / max(1, count) for k, v in sums.items()}, [float(n) / max(1, steps) for n in norms]


def _add_stats(sums: dict, stats: dict, count, finite: torch.Tensor):
    """Adds a micro-batch's stats where `finite` (all losses of its mini-batch so far were): tensors throughout, no
    host sync per micro-batch. count: a tensor once added to."""
    for key, v in stats.items():
        sums[key] = sums.get(key, 0.0) + torch.where(finite, v.detach(), 0.0)
    return count + finite.long()


def _step_or_skip(learners, finite: bool, rl: RLConfig, bad: dict, steps: int, norms: list) -> tuple[int, list]:
    """After a mini-batch's backwards: step every learner, or with a non-finite loss zero their gradients and count
    the skip."""
    if not finite:
        for learner in learners:
            learner.opt.zero_grad(set_to_none=True)
        count_bad_step(bad, rl, "a NaN/inf loss")
        return steps, norms
    bad["consecutive"] = 0
    return steps + 1, [n + learner.step(rl.grad_clip) for n, learner in zip(norms, learners)]


def update_actor(actor: Learner, exp: Experience, adv, batches: list[list[int]], rl: RLConfig, kl_coef: float,
                 pad_id: int, bad: dict, value_head: tuple | None = None, temperature: float | None = None,
                 group=None) -> dict:
    """The actor's update: the clipped objective over epochs x mini-batches x micro-batches.

    value_head=(critic, head learner, returns) when the critic is a head on the actor's body (critic_init=actor):
    the value loss joins the actor's graph (one forward of the body, one backward) and the head's optimiser steps
    after the actor's, each clipping its own norm. Two separate updates would run the body twice per micro-batch,
    and the second would differentiate through a body the first had already moved.
    temperature: the iteration's sampling temperature (None: rl.temperature, a constant schedule)."""
    learners = [actor] + ([value_head[1]] if value_head else [])
    temperature = rl.temperature if temperature is None else temperature

    def loss_of(idx, share):
        loss, stats = micro_policy_loss(actor.module, exp, idx, adv, rl, kl_coef, pad_id, temperature)
        loss = loss * share[rl.loss_level]
        if value_head:
            vloss, vstats = micro_value_loss(value_head[0], exp, idx, value_head[2], rl, pad_id)
            loss, stats = loss + vloss * share["token"], stats | vstats
        return loss, stats

    stats, norms = optimise(learners, batches, exp, rl.micro_batch_size, loss_of, rl, bad, group)
    return stats | {"train/grad_norm": norms[0]} | ({"train/critic_grad_norm": norms[1]} if value_head else {})


def update_critic(critic: Learner, exp: Experience, returns, batches: list[list[int]], rl: RLConfig, pad_id: int,
                  bad: dict, group=None) -> dict:
    """The separate critic's update: the clipped value loss (a token mean) over the same mini-batches."""
    loss_of = lambda idx, share: (lambda l, s: (l * share["token"], s))(
        *micro_value_loss(critic.module, exp, idx, returns, rl, pad_id))
    stats, norms = optimise([critic], batches, exp, rl.micro_batch_size, loss_of, rl, bad, group)
    return stats | {"train/critic_grad_norm": norms[0]}


def update(models: Models, learners: Learners, exp: Experience, adv, returns, rl: RLConfig, kl_coef: float,
           batches: list[list[int]], bad: dict, temperature: float | None = None, group=None) -> dict:
    """Actor then critic over the same experience (sampled at `temperature`); returns their stats and times. group:
    see optimise."""
    pad, t0 = models.tokenizer.pad_token_id, time.perf_counter()
    head = (models.critic, learners.critic, returns) if learners.shared_body else None
    stats = update_actor(learners.actor, exp, adv, batches, rl, kl_coef, pad, bad, head, temperature, group)
    t1 = time.perf_counter()
    if learners.critic is not None and not learners.shared_body:
        stats |= update_critic(learners.critic, exp, returns, batches, rl, pad, bad, group)
    passes = rl.share_prompt * (can_share(models.actor) + can_share(models.critic))  # a value head runs the body again
    shared = passes * prompt_tokens_shared(exp, batches, rl, group.world if group else 1) if passes else 0
    return stats | {"time/train_actor": t1 - t0, "time/train_critic": time.perf_counter() - t1,
                    "perf/prompt_tokens_shared_train": shared}


def count_nonfinite_rewards(exp: Experience, rl: RLConfig, bad: dict) -> int:
    """Non-finite rewards of the iteration; any skips its update, counted like a non-finite loss (the loop logs the
    iteration's row before stop_if_diverged ends the run)."""
    n = int((~torch.isfinite(exp.scores)).sum())
    if n:
        count_bad_step(bad, rl, f"non-finite rewards ({n} of {len(exp)} samples)", stop=False)
    return n


def rollout_metrics(exp: Experience, kl, returns, kl_coef: float, max_new: int) -> dict:
    lengths, finite = exp.mask.sum(1), exp.scores[torch.isfinite(exp.scores)]
    m = {
        "reward/mean": float(finite.mean()) if len(finite) else float("nan"),
        "reward/std": float(finite.std()) if len(finite) > 1 else 0.0,
        "reward/nonfinite": len(exp) - len(finite),
        "reward/kl": float(kl.sum(1).mean()), "reward/kl_coef": kl_coef,
        "rollout/length_mean": float(lengths.mean()), "rollout/length_p50": float(lengths.median()),
        "rollout/length_p95": float(torch.quantile(lengths, 0.95)), "rollout/length_max": float(lengths.max()),
        "rollout/hit_limit": float((lengths >= max_new).float().mean()), "rollout/samples": len(exp),
    }
    if returns is not None and not m["reward/nonfinite"]:
        m["train/explained_variance"] = float(explained_variance(exp.values, returns, exp.mask))
    return m


# ------------------------------------------------------------------------------------------- the loop


def train_rl(cfg: Config, run_dir: Path, log=print, resume: bool = False, on_ready=None) -> dict:
    """The RL stage: build -> loop -> save the policy. Returns {"before", "after", "samples_after", "seconds"}; the
    CLI writes eval.json and the report. on_ready(models), if given, is called once the models are loaded, before
    the first iteration (benchmarks read the idle memory footprint there)."""
    cfg = resolve_auto(cfg, log)  # a Config built in code with placement.strategy=auto (load_config did it already)
    rl, t_start, seed = cfg.rl, time.perf_counter(), cfg.run.seed
    if not (run_dir / "config.yaml").exists():  # called as a library rather than through the CLI
        from rlfuse.config import save_config

        save_config(cfg, run_dir)
    device = setup_runtime(cfg.run)
    _, task = resolve_base_model(cfg, log) if cfg.data.kind == "synthetic" else (None, None)
    models = build_models(cfg, run_dir, device)
    tok, gold = models.tokenizer, cfg.data.kind == "synthetic"
    set_chat_template(tok, cfg.data.chat_template)
    train_rows, held_rows = rl_prompt_rows(cfg, task, log)
    held_rows = held_rows[: rl.eval_prompts]
    budget = prompt_budget(rl, model_context(models.actor.config))
    train_prompts, cut = encode_prompts(tok, [r.prompt for r in train_rows], budget)
    held_prompts, cut_held = encode_prompts(tok, [r.prompt for r in held_rows], budget)
    attach_rows(models.reward_fn, train_prompts + held_prompts, train_rows + held_rows)
    if cut or cut_held:  # left-truncated: the end of a prompt is what the response continues
        log(f"[rl] prompts cut to their last {budget} tokens: {cut} of {len(train_prompts)} train, "
            f"{cut_held} of {len(held_prompts)} held out")
    engine = decode_engine(models, cfg.rollout.max_rows)
    scorer = local_scorer(models, cfg)
    fusion = FusionPolicy(fusion_on(cfg), cfg.rollout.score_every, cfg.rollout.live_below)
    params = sampling_params(models, rl, rl.temperature)
    trainer = LocalTrainer(models, build_learners(models, rl), rl)
    kl_ctl = (AdaptiveKLController(rl.kl_coef, rl.kl_target, rl.kl_horizon) if rl.kl_target is not None
              else FixedKLController(rl.kl_coef))
    out = run_dir / "rl"
    out.mkdir(parents=True, exist_ok=True)
    # memory per component of this process's roles (run.memory_table); on Ray the roles live in the workers
    # (worker/<rank>/rss_*)
    meter = (MemoryMeter(models, trainer.learners, device, out / "memory.json", cfg.model.quantization)
             if cfg.run.measures_memory(cfg.model) and not uses_ray(cfg) else None)
    if meter is not None:  # the planner's prediction, shown beside the measurement (rlfuse/placement/memory.py)
        (out / "memory_predicted.json").write_text(json.dumps({"bytes": predicted_memory(cfg)}))
    ckpt, start, bad = out / "checkpoint.pt", 0, {"skipped": 0, "consecutive": 0}
    if resume and ckpt.exists():  # on Ray the trainers restore it (below); this process needs only the counters
        state = torch.load(ckpt, weights_only=False, map_location="cpu") if uses_ray(cfg) else trainer.load_checkpoint(ckpt)
        start, kl_ctl.coef, bad = state["iteration"], state["kl_coef"], state["counters"]
        log(f"[rl] resumed from {ckpt} at iteration {start}")
    sync_weights(engine, models.actor)
    before = evaluate_before(out / "eval_before.json", models, engine, held_prompts, rl, seed + 12345, gold)
    difficulty = prompt_difficulty(models, engine, train_prompts, rl, seed + 23456, out / "difficulty.json", log)
    reset_reward_metrics(models.reward_fn)  # the evaluations' calls are not the first iteration's
    tracker = stage_tracker(cfg, out, from_step=start)
    flops = compute_meter_for_run(cfg, models, device)  # perf/: FLOPs done over the bare matmul rate (< 1 s)
    if on_ready is not None:
        on_ready(models)
    log(f"[rl] {rl.algo}: {rl.iterations} iterations x {rl.prompts_per_iter} prompts x k={rl.k}, fusion "
        f"{'on' if fusion.enabled else 'off'}, KL {rl.kl_estimator_used}{'' if rl.kl_estimator else ' (default)'}, "
        f"{sampling_note(rl)}")
    with build_placement(cfg, run_dir, engine, scorer, fusion, trainer, log) as (rollout, trainer), \
            Progress(rl.iterations, f"rl/{rl.algo}", cfg.run.quiet, unit="iter") as bar:
        if start and not isinstance(trainer, LocalTrainer):
            trainer.load_checkpoint(ckpt)
        bar.update(start)
        rollout = meter.watch(rollout) if meter is not None else rollout
        for it in range(start, rl.iterations):
            t0 = time.perf_counter()
            # 1. the actor's weights into the generator(s): an explicit copy, never the optimiser's own tensors
            sync = rollout.sync_weights(models)
            # 2. generate and score at the iteration's temperature (sampling and reference log-probs alike); scoring
            # runs on finished samples while the tail decodes (fusion on; on Ray workers, per rlfuse/placement)
            temperature = iteration_temperature(rl, it)
            prompts = prompt_batch(train_prompts, it, rl.prompts_per_iter, seed, difficulty, rl.iterations,
                                   rl.curriculum_start)
            shared_before = scorer.prompt_tokens_shared  # this process's scorer (Ray workers score on their own)
            exp = rollout.generate(prompts, rl.k, dataclasses.replace(params, temperature=temperature),
                                   seed * 1_000_003 + it)
            shared_scoring = scorer.prompt_tokens_shared - shared_before
            # 3. KL-shaped rewards and advantages (pure functions in rlfuse/algos)
            adv, returns, kl = compute_advantages(exp, rl, kl_ctl.coef)
            # 4. update actor and critic (skipped, and counted, when a reward is not finite)
            t1, stats = time.perf_counter(), {}
            if not count_nonfinite_rewards(exp, rl, bad):
                stats = trainer.update(exp, adv, returns, kl_ctl.coef, minibatches(len(exp), rl, seed, it), bad,
                                       temperature)
                kl_ctl.update(float(kl.sum(1).mean()), len(exp))
            t2 = time.perf_counter()
            # 5. record (every iteration, skipped or not) and checkpoint
            row = rollout_metrics(exp, kl, returns, kl_ctl.coef, rl.max_new_tokens) | stats | sync
            row |= rollout.metrics(exp)
            row |= memory_metrics(device) | iteration_gold(exp, tok, gold) | reward_metrics(models.reward_fn)
            row |= flops.metrics([len(p) for p in exp.prompt_ids], [len(r) for r in exp.response_ids], t2 - t0,
                                 trained=bool(stats))
            row |= learning_rates(trainer, rl) | group_metrics(exp, rl.k)
            if due(rl.eval_every, it + 1) and it + 1 < rl.iterations:  # the last one is the "after" evaluation
                row |= evaluate_during(trainer, models, engine, held_prompts, rl, seed + 12345, gold)
                reset_reward_metrics(models.reward_fn)  # the evaluation's calls are not the next iteration's
            if due(rl.log_samples_every, it + 1):
                tracker.log_table(it + 1, "samples", sample_table(exp, tok, gold))
            row |= {"perf/prompt_tokens_shared": shared_scoring + stats.get("perf/prompt_tokens_shared_train", 0),
                    "rollout/temperature": temperature, "time/training": t2 - t1, "time/iteration": t2 - t0,
                    "train/skipped_steps": bad["skipped"],
                    "rollout/samples_per_s": len(exp) / (t2 - t0), "rollout/tokens_per_s": float(exp.mask.sum()) / (t2 - t0)}
            tracker.log(it + 1, **row)
            stop_if_diverged(bad, rl)
            if (it + 1) % rl.ckpt_every == 0 or it + 1 == rl.iterations:
                trainer.save_checkpoint(ckpt, iteration=it + 1, kl_coef=kl_ctl.coef, counters=bad)
            (out / "last_rewards.json").write_text(json.dumps(exp.scores.tolist()))
            bar.update(reward=row["reward/mean"], kl=row["reward/kl"], sps=row["rollout/samples_per_s"])
        trainer.pull_into(models)
    tracker.close()
    sync_weights(engine, models.actor)
    after, after_texts = evaluate(models, engine, held_prompts, rl, seed + 12345, gold)
    save_trained_model(models.actor, tok, out, base=models.policy_source)
    prompts_info = {"prompt_budget": budget, "prompts_truncated": cut, "prompts": len(train_prompts),
                    "eval_prompts_truncated": cut_held}
    return {"before": before, "after": after, "samples_after": after_texts, "prompts": prompts_info,
            "seconds": time.perf_counter() - t_start}


@dataclass
class LocalTrainer:
    """Step 4 of the loop and its checkpoints in this process (placement.strategy=single); on Ray,
    rlfuse/placement/ray_driver.py's RayTrainer has the same methods."""
    models: Models
    learners: Learners
    rl: RLConfig

    def update(self, exp: Experience, adv, returns, kl_coef: float, batches: list[list[int]], bad: dict,
               temperature: float | None = None) -> dict:
        return update(self.models, self.learners, exp, adv, returns, self.rl, kl_coef, batches, bad, temperature)

    def save_checkpoint(self, path: Path, iteration: int, kl_coef: float, counters: dict) -> None:
        save_checkpoint(path, **dict(zip(CHECKPOINT_KEYS, checkpoint_parts(self.models, self.learners))),
                        iteration=iteration, kl_coef=kl_coef, counters=counters)

    def load_checkpoint(self, path: Path) -> dict:
        return load_checkpoint(path, *checkpoint_parts(self.models, self.learners))

    def pull_into(self, models: Models) -> None:
        """The trained modules are `models`' own: nothing to copy."""


CHECKPOINT_KEYS = ("actor", "critic", "opt_actor", "opt_critic", "sched_actor", "sched_critic")


def checkpoint_parts(models: Models, learners: Learners) -> tuple:
    """What a checkpoint holds besides counters, in CHECKPOINT_KEYS order."""
    c = learners.critic
    return (models.actor, models.critic, learners.actor.opt, c.opt if c else None, learners.actor.sched,
            c.sched if c else None)
