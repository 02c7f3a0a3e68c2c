"""Which samples train together: SFT and RM batches grouped by length (batch_indices); an RL update's epochs x
mini-batches (a function of seed and iteration) and each mini-batch's micro-batches, by count or by a token budget,
with every data-parallel rank's share (minibatches, micro_batch_indices, micro_batches)."""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np
import torch

from rlfuse.algos.stats import in_spread_groups
from rlfuse.config import RLConfig
from rlfuse.config.algorithms import ALGORITHMS
from rlfuse.data.collate import pack_by_tokens, prompt_runs
from rlfuse.learn.advantages import sequence_rewards
from rlfuse.models.forward import forward_tokens, worth_sharing
from rlfuse.models.prefix import prompt_tokens_saved
from rlfuse.plan.spec import dp_micro_size
from rlfuse.rollout.fusion import Experience


def batch_indices(lengths: list[int], batch_size: int, steps: int, seed: int, group: int = 32):
    """Yield `steps` index lists of `batch_size` over seeded epoch permutations, grouped by length: each window of
    `group` batches is sorted by length before it is cut, so a batch pads to a similar length, not the corpus's
    long tail; the batch order within the window is shuffled again."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    n, queue = len(lengths), []
    for _ in range(steps):
        if not queue:
            order = rng.permutation(n)
            order = order[: n - n % batch_size] if n >= batch_size else np.resize(order, batch_size)
            window = batch_size * group
            for s in range(0, len(order), window):
                chunk = order[s: s + window]
                chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
                batches = [chunk[i: i + batch_size].tolist() for i in range(0, len(chunk), batch_size)]
                queue.extend(batches[i] for i in rng.permutation(len(batches)))
        yield queue.pop(0)


def minibatches(n: int, rl: RLConfig, seed: int, iteration: int) -> list[list[int]]:
    """Epochs x mini-batches of sample indices, a function of (seed, iteration); a prompt's k samples stay in one
    mini-batch (rloo, grpo; ppo too with rl.share_prompt, where rl.mini_batch_size is a multiple of rl.k, so that its
    micro-batches can share prompts). The actor and critic updates walk the same list."""
    gen = torch.Generator().manual_seed(seed * 7919 + iteration)
    group = rl.k if ALGORITHMS[rl.algo].groups_prompts or (rl.share_prompt and rl.mini_batch_size % rl.k == 0) else 1
    out = []
    for _ in range(rl.epochs):
        order = (torch.randperm(n // group, generator=gen)[:, None] * group + torch.arange(group)).view(-1).tolist()
        out += [order[s: s + rl.mini_batch_size] for s in range(0, n, rl.mini_batch_size)]
    return out


def micro_batch_indices(exp: Experience, mini: list[int], size: int, world: int = 1, tokens: int | None = None,
                        shared: bool = False) -> list[list[int]]:
    """A mini-batch's micro-batches, every rank's, in order: `size` samples each (in one process by_length_within_prompts:
    a prompt's samples in order of length, so each micro-batch pads its responses to a similar length), or with a token
    budget (`tokens`, rl.micro_batch_tokens) packed by collate.pack_by_tokens, a prompt's samples kept together,
    similar lengths together, each micro-batch's forward (models/forward.py forward_tokens; prompts once when
    `shared`) within the budget. A mini-batch too small to give each of `world` ranks a micro-batch is cut into
    `world` smaller ones (plan/spec.py dp_micro_size), so no rank only pads. Only the samples the update trains on
    (trained_only) are cut; a mini-batch without any has no micro-batch."""
    mini = trained_only(exp, mini)
    if not mini:
        return []
    units = prompt_runs(mini, exp.prompt_index.tolist())
    if tokens is not None:
        prompts, responses = exp.prompt_ids, exp.response_ids
        units.sort(key=lambda u: max(len(prompts[i]) + len(responses[i]) for i in u))
        cost = lambda idx: forward_tokens([prompts[i] for i in idx], [responses[i] for i in idx], shared)
        packed = pack_by_tokens(units, cost, tokens)
        if len(packed) >= world:
            return packed
    size = dp_micro_size(len(mini), size, world)
    # several ranks take micro-batches r, r + world, ...: by length, one rank would get every prompt's long replies
    # and the others would wait for it at each collective
    order = by_length_within_prompts(units, exp.response_ids) if world == 1 else mini
    return [order[s: s + size] for s in range(0, len(order), size)]


def trained_only(exp: Experience, mini: list[int]) -> list[int]:
    """The mini-batch's samples the update runs on (Experience.trained; all of them when it is None)."""
    if exp.trained is None:
        return mini
    keep = exp.trained.tolist()
    return [i for i in mini if keep[i]]


def update_batches(exp: Experience, rl: RLConfig, kl: torch.Tensor, kl_coef: float,
                   batches: list[list[int]]) -> list[list[int]]:
    """The mini-batches the update walks: `batches`; with rl.skip_zero_advantage the samples of prompts whose k
    sequence rewards are all equal (advantage 0 before whitening, which shifts it by nothing and scales it alike)
    are marked left out (Experience.trained), and a mini-batch left without samples takes no step. kl, kl_coef:
    compute_advantages' per-token KL and the coefficient it used (rloo's sequence reward subtracts it)."""
    if not rl.skip_zero_advantage:
        return batches
    exp.trained = in_spread_groups(sequence_rewards(exp, rl, kl, kl_coef), rl.k)
    return [mini for mini in batches if trained_only(exp, mini)]


def by_length_within_prompts(units: list[list[int]], responses: list[list[int]]) -> list[int]:
    """The samples of each run of one prompt (collate.prompt_runs) shortest response first (ties: in the order
    given), the runs in their order. A prompt's k samples cut into micro-batches in this order pad to similar lengths:
    at k = 8 in micro-batches of 4, the four short replies no longer pad to the longest of the eight. The update is
    the same whichever samples share a micro-batch (micro_batches' shares make accumulation one big batch)."""
    return [i for unit in units for i in sorted(unit, key=lambda i: len(responses[i]))]


def rank_slots(every: list[list[int]], world: int) -> list[list[list[int]]]:
    """The micro-batches each rank runs at each slot, [slot][rank], from every rank's list in order (micro_batches:
    rank r runs r, r + world, ...). A rank with none left at a slot runs the first as zero-weight padding, so that
    every rank takes part in each collective."""
    return [[every[r + j * world] if r + j * world < len(every) else every[0] for r in range(world)]
            for j in range(-(-len(every) // world))]


def micro_batches(exp: Experience, mini: list[int], size: int, rank: int = 0, world: int = 1,
                  tokens: int | None = None, shared: bool = False) -> Iterator[tuple[list[int], dict]]:
    """(indices, share) per micro-batch (micro_batch_indices); share[level] is its part of the mini-batch's tokens
    ("token") or samples ("sequence"), so that micro-batch means scaled by it sum to the mini-batch mean
    (accumulation = one big batch). Data parallel (world > 1): rank r gets micro-batches r, r + world, ... of the same
    list (the single process's micro-batches, so the per-micro-batch stats agree too), shares still of the whole
    mini-batch, so the ranks' share-scaled gradients sum to the single-process one. Samples left out of the update
    (Experience.trained) still count in the mini-batch's total: the gradient is the whole mini-batch's without
    their terms (with rl.skip_zero_advantage, the KL penalty's alone), not a mean over fewer samples."""
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


def truncated_masked(exp: Experience) -> Experience:
    """rl.mask_truncated (TRL's mask_truncated_completions): the experience with the tokens of every sample that hit
    the length limit masked out, so the update's loss and KL leave them out; they still count in the mini-batch's
    sample total (a sequence-level average gives them 0), and their rewards shaped their group's advantages."""
    keep = torch.tensor([reason != "length" for reason in exp.finish_reasons], dtype=exp.mask.dtype)
    return dataclasses.replace(exp, mask=exp.mask * keep[:, None])
