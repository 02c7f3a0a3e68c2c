"""The update: the accumulation loop every RL update shares (optimise: per mini-batch one backward per micro-batch,
then each learner's clipped step; on a data-parallel group each rank its share), the actor's and the critic's
updates over one iteration's experience, and the count of updates skipped for non-finite losses or rewards."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from rlfuse.config import RLConfig
from rlfuse.errors import UserError
from rlfuse.learn.batches import micro_batch_indices, micro_batches, prompt_tokens_shared, rank_slots
from rlfuse.learn.divergence import rl_blowup, rl_blowup_line
from rlfuse.learn.learners import Learner, Learners
from rlfuse.learn.losses import micro_policy_loss, micro_value_loss
from rlfuse.learn.optim import clip_and_step
from rlfuse.models.build import Models
from rlfuse.models.forward import can_share, worth_sharing
from rlfuse.models.mapped import release_mapped
from rlfuse.models.quantize import trim_cpu_heap, update_heap
from rlfuse.rollout.fusion import Experience


@dataclass
class BadSteps:
    """Updates skipped for a NaN/inf loss or reward: in all, in a row, and why the last one was. rl.max_bad_steps in
    a row end the run; the checkpoint keeps them (as a dict), so a resumed run counts on."""
    skipped: int = 0
    consecutive: int = 0
    why: str | None = None
    abstained: int = 0
    """Iterations in a row on which every reward function abstained (returned None) on every sample."""

    def count(self, why: str, max_bad_steps: int, stop: bool = True, fix: str | None = None) -> None:
        """A skipped update: counted; max_bad_steps in a row end the run (at once, or at stop_if_diverged)."""
        self.skipped += 1
        self.consecutive += 1
        self.why = why
        if stop:
            self.stop_if_diverged(max_bad_steps, fix)

    def stop_if_diverged(self, max_bad_steps: int, fix: str | None = None) -> None:
        """fix: what to change and what is kept (default: the RL stage's)."""
        if self.consecutive >= max_bad_steps:
            raise UserError(f"training diverged: {self.consecutive} consecutive updates skipped, the last for "
                            f"{self.why} ({fix or 'lower rl.lr, raise rl.kl_coef, or check rl.reward; last checkpoint kept'})")


def count_abstained(share: float | None, bad: BadSteps, max_iterations: int, log) -> None:
    """An iteration whose every sample every reward function abstained on (share 1.0: reward 0 throughout) is
    warned about; max_iterations of them in a row stop the run."""
    if share is None or share < 1.0:
        bad.abstained = 0
        return
    bad.abstained += 1
    if bad.abstained >= max_iterations:
        raise UserError(f"reward error: rl.reward: every function abstained (returned None) on every sample for "
                        f"{bad.abstained} iterations in a row, so nothing is learnt; make at least one function score "
                        "these completions (check what it matches against: print a few completions)")
    log(f"[rl] warning: every reward function abstained on every sample of this iteration (reward 0 throughout); "
        f"{max_iterations} such iterations in a row stop the run")


def stage_step(model: torch.nn.Module, opt, sched, section, stage: str, loss: float, bad: BadSteps) -> float:
    """SFT's and RM's optimiser step (clip_and_step): one with a NaN/inf loss or gradient is skipped and counted in
    `bad`, and section.max_bad_steps of them in a row stop the stage. Returns the gradient norm before clipping."""
    grad_norm = clip_and_step(model, opt, sched, section.grad_clip)
    if math.isfinite(grad_norm):
        bad.consecutive = 0
    else:
        bad.count("a NaN/inf loss" if not math.isfinite(loss) else "a NaN/inf gradient", section.max_bad_steps,
                  fix=f"lower {stage}.lr or raise {stage}.warmup_steps; no model saved")
    return grad_norm


def require_finite_weights(model: torch.nn.Module, stage: str) -> None:
    """Refuse to save a model holding NaN/inf weights, which every later stage would load without a word."""
    bad = [n for n, p in model.named_parameters() if p.requires_grad and not bool(torch.isfinite(p).all())]
    if bad:
        raise UserError(f"training diverged: {len(bad)} trained weight tensors hold NaN/inf (first {bad[0]}); no model "
                        f"saved; lower {stage}.lr or raise {stage}.warmup_steps")


def optimise(learners: list[Learner], batches: list[list[int]], exp: Experience, micro_size: int,
             loss_of: Callable, rl: RLConfig, bad: BadSteps, group=None) -> tuple[dict, list[float]]:
    """The accumulation loop both updates share: per mini-batch, one backward per micro-batch of loss_of(idx, share)
    (already scaled by its share), then each learner clips its own gradient norm and steps. A non-finite loss skips
    the mini-batch (BadSteps.count). Returns (mean stats over micro-batches, mean grad norm per learner).

    group: data parallelism (rlfuse/runtime/data_parallel.py DataParallelGroup, DDP underneath, or fsdp.py ShardedGroup): this rank runs its
    micro-batches of each mini-batch (micro_batches), padded with zero-weight ones to the same count on every rank,
    the losses computed inside DDP's forward; the last micro-batch's backward all-reduces, so every rank steps on the
    gradient one process would get from the whole mini-batch. Runs inside update_heap (run.cpu_heap=update)."""
    with update_heap():
        if group is not None:
            return _optimise_data_parallel(learners, batches, exp, micro_size, loss_of, rl, bad, group)
        return _optimise_one(learners, batches, exp, micro_size, loss_of, rl, bad)


def _optimise_one(learners, batches, exp, micro_size, loss_of, rl, bad):
    """optimise in one process."""
    sums: dict = {}
    count, steps, norms = 0, 0, [0.0] * len(learners)
    for mini in batches:
        finite = torch.ones((), dtype=torch.bool)
        # the finite flag stays a tensor: one host sync per mini-batch (at the step), none per micro-batch; a NaN
        # micro-batch's backward makes NaN gradients, which the skipped step drops
        for idx, share in micro_batches(exp, mini, micro_size, 0, 1, rl.micro_batch_tokens, rl.share_prompt):
            trim_cpu_heap()  # the previous micro-batch's freed small tensors: pages back before the next forward
            loss, stats = loss_of(idx, share)
            finite = finite.to(loss.device) & torch.isfinite(loss.detach())
            loss.backward()
            count = add_stats(sums, stats, count, finite)
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
        by_slot = rank_slots(every, group.world)  # as many slots as the most any rank has: every rank takes part in
        slots = len(by_slot)                      # each all-reduce
        finite = torch.ones((), dtype=torch.bool)
        for j in range(slots):
            idx, share = mine[j] if j < len(mine) else (every[0], zero)  # a padding slot adds nothing
            if shared and group.same_forwards:  # FSDP: every rank's slot j runs prefix-shared, or none does
                share = share | {"prefix": all(worth_sharing([exp.prompt_ids[i] for i in slot],
                                                             [exp.response_ids[i] for i in slot])
                                               for slot in by_slot[j])}
            trim_cpu_heap()  # as in optimise
            with group.micro_batch(modules, sync=j == slots - 1) as run:
                loss, stats = run(loss_of, idx, share)
                finite = finite.to(loss.device) & torch.isfinite(loss.detach())
                loss.backward()
            if j < len(mine):  # as one process: no stats from a NaN micro-batch on
                count = add_stats(sums, stats, count, finite)
        if n == 0:
            group.check_all_used(modules)
        steps, norms = _step_or_skip(learners, group.all_finite(bool(finite)), rl, bad, steps, norms)
    sums, count = group.sum_stats(sums, int(count))
    return {k: float(v) / max(1, count) for k, v in sums.items()}, [float(n) / max(1, steps) for n in norms]


def add_stats(sums: dict, stats: dict, count, finite: torch.Tensor):
    """Adds a micro-batch's stats where `finite` (all losses of its mini-batch so far were): tensors throughout, no
    host sync per micro-batch. count: a tensor once added to."""
    for key, v in stats.items():
        sums[key] = sums.get(key, 0.0) + torch.where(finite, v.detach(), 0.0)
    return count + finite.long()


def _step_or_skip(learners, finite: bool, rl: RLConfig, bad: BadSteps, steps: int, norms: list) -> tuple[int, list]:
    """After a mini-batch's backwards: step every learner, or with a non-finite loss zero their gradients and count
    the skip."""
    if not finite:
        for learner in learners:
            learner.opt.zero_grad(set_to_none=True)
        bad.count("a NaN/inf loss", rl.max_bad_steps)
        return steps, norms
    bad.consecutive = 0
    return steps + 1, [n + learner.step(rl.grad_clip) for n, learner in zip(norms, learners)]


def update_actor(actor: Learner, exp: Experience, adv, batches: list[list[int]], rl: RLConfig, kl_coef: float,
                 pad_id: int, bad: BadSteps, value_head: tuple | None = None, temperature: float | None = None,
                 group=None, autocast=contextlib.nullcontext) -> dict:
    """The actor's update: the clipped objective over epochs x mini-batches x micro-batches.

    value_head=(critic, head learner, returns) when the critic is a head on the actor's body (critic_init=actor):
    the value loss joins the actor's graph (one forward of the body, one backward) and the head's optimiser steps
    after the actor's, each clipping its own norm. Two separate updates would run the body twice per micro-batch,
    and the second would differentiate through a body the first had already moved.
    temperature: the iteration's sampling temperature (None: rl.temperature, a constant schedule).
    autocast: the forwards' mixed-precision context (Models.autocast); the backward runs outside it, as torch advises."""
    learners = [actor] + ([value_head[1]] if value_head else [])
    temperature = rl.temperature if temperature is None else temperature

    def loss_of(idx, share):
        with autocast():
            loss, stats = micro_policy_loss(actor.module, exp, idx, adv, rl, kl_coef, pad_id, temperature,
                                            share.get("prefix"))
            loss = loss * share[rl.loss_share]
            if value_head:
                vloss, vstats = micro_value_loss(value_head[0], exp, idx, value_head[2], rl, pad_id,
                                                 share.get("prefix"))
                loss, stats = loss + vloss * share["token"], stats | vstats
        return loss, stats

    stats, norms = optimise(learners, batches, exp, rl.micro_batch_size, loss_of, rl, bad, group)
    return stats | {"train/grad_norm": norms[0]} | ({"train/critic_grad_norm": norms[1]} if value_head else {})


def update_critic(critic: Learner, exp: Experience, returns, batches: list[list[int]], rl: RLConfig, pad_id: int,
                  bad: BadSteps, group=None, autocast=contextlib.nullcontext) -> dict:
    """The separate critic's update: the clipped value loss (a token mean) over the same mini-batches."""
    def loss_of(idx, share):
        with autocast():
            loss, stats = micro_value_loss(critic.module, exp, idx, returns, rl, pad_id, share.get("prefix"))
        return loss * share["token"], stats

    stats, norms = optimise([critic], batches, exp, rl.micro_batch_size, loss_of, rl, bad, group)
    return stats | {"train/critic_grad_norm": norms[0]}


def update(models: Models, learners: Learners, exp: Experience, adv, returns, rl: RLConfig, kl_coef: float,
           batches: list[list[int]], bad: BadSteps, temperature: float | None = None, group=None) -> dict:
    """Actor then critic over the same experience (sampled at `temperature`); returns their stats and times. group:
    see optimise."""
    if exp.proximal_from_update and len(batches) > 1:  # the proximal policy would move after the first step
        raise RuntimeError(f"a batch scored without proximal log-probs is trained in {len(batches)} optimiser steps")
    pad, t0 = models.tokenizer.pad_token_id, time.perf_counter()
    release_mapped(models.ref)  # rl.release_reference: the update's peak without the reference's pages
    head = (models.critic, learners.critic, returns) if learners.shared_body else None
    stats = update_actor(learners.actor, exp, adv, batches, rl, kl_coef, pad, bad, head, temperature, group,
                         models.autocast)
    t1 = time.perf_counter()
    if learners.critic is not None and not learners.shared_body:
        stats |= update_critic(learners.critic, exp, returns, batches, rl, pad, bad, group, models.autocast)
    passes = rl.share_prompt * (can_share(models.actor) + can_share(models.critic))  # a value head runs the body again
    shared = passes * prompt_tokens_shared(exp, batches, rl, group.world if group else 1) if passes else 0
    return stats | {"time/train_actor": t1 - t0, "time/train_critic": time.perf_counter() - t1,
                    "perf/prompt_tokens_shared_train": shared}


def count_nonfinite_rewards(exp: Experience, rl: RLConfig, bad: BadSteps) -> int:
    """Non-finite rewards of the iteration; any skips its update, counted like a non-finite loss (the loop logs the
    iteration's row before BadSteps.stop_if_diverged ends the run)."""
    n = int((~torch.isfinite(exp.scores)).sum())
    if n:
        bad.count(f"non-finite rewards ({n} of {len(exp)} samples)", rl.max_bad_steps, stop=False)
    return n


def stop_if_blown(stats: dict, iteration: int, rl: RLConfig, ckpt: Path, start: int) -> None:
    """An update that blew the policy apart (learn/divergence.py rl_blowup) ends the run at its iteration (1-based),
    before that iteration's checkpoint: the one on disk is from before it (the last multiple of rl.ckpt_every this
    process reached, or the one it resumed from at `start`), and no policy is saved."""
    kl = stats.get("train/approx_kl")
    if not rl_blowup(kl):
        return
    saved = max(start, (iteration - 1) // rl.ckpt_every * rl.ckpt_every)
    kept = (f"the policy of iteration {saved} (the last checkpoint before it) is kept in {ckpt}, for --resume" if saved
            else f"no policy saved and no checkpoint from before it (one comes every rl.ckpt_every={rl.ckpt_every} "
                 "iterations)")
    fix = "lower rl.lr" + (" or set rl.grad_clip (1.0 is the default)" if rl.grad_clip <= 0 else "")
    raise UserError(rl_blowup_line(iteration, kl, kept, fix))
