"""The table of policy losses and their aggregation (algos/policy_losses.py) against hand-computed numbers, and the
table's grpo and token-mean recipes equal to the loss the update runs today, bit for bit."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlfuse.algos.losses import ppo_policy_loss
from rlfuse.algos.policy_losses import AGGREGATIONS, LOSSES, LossSettings, aggregate
from rlfuse.config.algorithms import RECIPES


def logs(*ratios):
    """(logprobs, old_logprobs) of one sequence whose tokens have these ratios (old log-probs -1)."""
    old = torch.full((1, len(ratios)), -1.0)
    return old + torch.log(torch.tensor([ratios])), old


def test_ppo_with_clip_higher_and_dual_clip_by_hand():
    lp, old = logs(1.5, 0.5, 1.1, 5.0)
    adv = torch.tensor([[1.0, -1.0, 2.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, st = LOSSES["ppo"](lp, old, adv, mask, LossSettings(0.2, 0.28))
    # 1.5 clipped to 1.28 (A > 0: the smaller gain), 0.5 to 0.8 (A < 0), 1.1 inside, 5 unclipped for A < 0
    assert_close(loss, torch.tensor([[-1.28, 0.8, -2.2, 5.0]]))
    assert float(st["clip_frac"]) == 0.5
    dual, _ = LOSSES["ppo"](lp, old, adv, mask, LossSettings(0.2, 0.28, clip_c=3.0))
    assert_close(dual, torch.tensor([[-1.28, 0.8, -2.2, 3.0]]))  # a negative advantage's loss at most 3 |A|


def test_gspo_is_one_clipped_ratio_per_sequence_by_hand():
    lp, old = logs(2.0, 1.0)
    lp.requires_grad_(True)
    mask = torch.ones(1, 2)
    loss, _ = LOSSES["gspo"](lp, old, torch.tensor([1.0]), mask, LossSettings(0.2, 0.2))
    assert_close(loss, torch.tensor([[-1.2, -1.2]]))  # sqrt(2) = 1.414 clipped to 1.2 on both tokens
    loss, _ = LOSSES["gspo"](lp, old, torch.tensor([-1.0]), mask, LossSettings(0.2, 0.2))
    assert_close(loss.detach(), torch.full((1, 2), math.sqrt(2)))  # A < 0: the unclipped ratio
    loss.sum().backward()
    assert_close(lp.grad, torch.full((1, 2), math.sqrt(2)))  # each token's gradient carries the sequence ratio


def test_cispo_and_gpg_by_hand():
    lp, old = logs(1.5, 0.9)
    lp.requires_grad_(True)
    adv, mask = torch.tensor([[2.0, -1.0]]), torch.ones(1, 2)
    loss, st = LOSSES["cispo"](lp, old, adv, mask, LossSettings(0.2, 0.28))
    loss.sum().backward()
    assert_close(lp.grad, torch.tensor([[-1.28 * 2.0, 0.9]]))  # -sg(clipped weight) * A: 1.5 -> 1.28, 0.9 kept
    assert float(st["clip_frac"]) == 0.5
    lp.grad = None
    loss, _ = LOSSES["gpg"](lp, old, adv, mask, LossSettings())
    assert_close(loss, -adv * lp)
    loss.sum().backward()
    assert_close(lp.grad, -adv)


def test_aggregations_by_hand():
    loss = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    got = {mode: float(aggregate(loss, mask, mode, max_tokens=4)) for mode in AGGREGATIONS}
    assert got == {"token-mean": 2.0, "seq-mean-token-mean": 2.25, "seq-mean-token-sum": 3.0,
                   "seq-mean-token-sum-norm": 0.75}
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(loss, mask, "mean")


@pytest.mark.parametrize("mode,level", [("seq-mean-token-mean", "sequence"), ("token-mean", "token")])
def test_the_tables_grpo_is_todays_loss_bit_for_bit(mode, level):
    g = torch.Generator().manual_seed(0)
    lp, old = -torch.rand(6, 9, generator=g) * 3, -torch.rand(6, 9, generator=g) * 3
    mask = (torch.rand(6, 9, generator=g) > 0.3).float()
    adv = torch.randn(6, generator=g)
    want, want_st = ppo_policy_loss(lp, old, adv, mask, 0.2, level)
    per_token, st = LOSSES["ppo"](lp, old, adv, mask, LossSettings(0.2, 0.2))
    assert torch.equal(aggregate(per_token, mask, mode), want)
    assert torch.equal(st["clip_frac"], want_st["clip_frac"]) and torch.equal(st["approx_kl"], want_st["approx_kl"])
    if mode == "seq-mean-token-mean":
        assert RECIPES["grpo"]["policy_loss"] == "ppo" and RECIPES["grpo"]["loss_agg"] == mode


def test_scale_rewards_by_hand():
    from rlfuse.algos.advantages import grpo_advantages, rloo_advantages

    rewards = torch.tensor([1.0, 3.0, 0.0, 0.0, 2.0, 6.0])  # three groups of 2
    centred = torch.tensor([-1.0, 1.0, 0.0, 0.0, -2.0, 2.0])
    assert_close(grpo_advantages(rewards, 2, "none"), centred)
    group_std = torch.tensor([math.sqrt(2), math.sqrt(2), 0.0, 0.0, 2 * math.sqrt(2), 2 * math.sqrt(2)])
    assert_close(grpo_advantages(rewards, 2, "group"), centred / (group_std + 1e-4))
    assert_close(grpo_advantages(rewards, 2, "batch"), centred / (centred.std() + 1e-4))
    # rloo: the leave-one-out baseline is the other sample, so the advantage is twice the centred reward
    assert_close(rloo_advantages(rewards, 2), 2 * centred)
    assert_close(rloo_advantages(rewards, 2, "batch"), 2 * centred / ((2 * centred).std() + 1e-4))


def test_scale_rewards_defaults_per_algorithm():
    from rlfuse.config import load_config

    assert load_config(None, ["rl.algo=grpo"]).rl.scale_rewards == "group"
    assert load_config(None, ["rl.algo=rloo"]).rl.scale_rewards == "none"
    assert load_config(None, ["rl.algo=grpo", "rl.scale_rewards=none"]).rl.scale_rewards == "none"


def test_recipes_set_what_the_config_leaves_out():
    from rlfuse.config import load_config
    from rlfuse.errors import ConfigError

    dapo = load_config(None, ["rl.algo=grpo", "rl.recipe=dapo"]).rl
    assert (dapo.policy_loss, dapo.loss_agg, dapo.clip, dapo.clip_high) == ("ppo", "token-mean", 0.2, 0.28)
    gspo = load_config(None, ["rl.algo=grpo", "rl.recipe=gspo", "rl.clip_high=0.001"]).rl
    assert (gspo.policy_loss, gspo.clip, gspo.clip_high) == ("gspo", 3e-4, 0.001)  # what is given wins
    dr = load_config(None, ["rl.algo=grpo", "rl.recipe=dr_grpo"]).rl
    assert (dr.loss_agg, dr.scale_rewards) == ("seq-mean-token-sum-norm", "none")
    with pytest.raises(ConfigError, match="rl.recipe: dapo is a recipe for group-relative algorithms, not ppo"):
        load_config(None, ["rl.recipe=dapo"])
    with pytest.raises(ConfigError, match="rl.recipe"):
        load_config(None, ["rl.algo=grpo", "rl.recipe=bnpo"])



def test_dapos_overlong_penalty_by_hand():
    from rlfuse.algos.advantages import overlong_penalty

    lengths = torch.tensor([10, 16, 18, 20])
    # limit 20, buffer 4: free up to 16, then -0.5 per token of the buffer's 4, -penalty at the limit
    assert_close(overlong_penalty(lengths, 20, 4, 2.0), torch.tensor([0.0, 0.0, -1.0, -2.0]))


def test_the_overlong_penalty_reaches_the_advantages():
    from helpers import hand_experience
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlfuse.config import load_config
    from rlfuse.learn.advantages import compute_advantages

    actor = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=32, n_embd=16, n_layer=1, n_head=2)).eval()
    exp = hand_experience(actor, n=8, k=4, longest=6)
    plain = load_config(None, ["rl.algo=grpo", "rl.k=4", "rl.max_new_tokens=6"]).rl
    shaped = load_config(None, ["rl.algo=grpo", "rl.k=4", "rl.max_new_tokens=6", "rl.overlong_buffer=3"]).rl
    a, _, _ = compute_advantages(exp, plain, 0.1)
    b, _, _ = compute_advantages(exp, shaped, 0.1)
    assert not torch.allclose(a, b)
    lengths = exp.mask.sum(1)
    # the longest responses of a group lose the most: their advantage drops against the plain one
    longest = int(lengths.argmax())
    assert b[longest] < a[longest]


def test_dynamic_sampling_picks_groups_with_a_spread_first():
    from rlfuse.algos.stats import spread_groups_first

    first = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0])  # k=2: groups flat, spread, flat
    refill = torch.tensor([0.0, 0.0, 3.0, 1.0, 5.0, 4.0])  # flat, spread, spread
    assert spread_groups_first([first, refill], 2, 3) == [(0, 2), (0, 3), (1, 2), (1, 3), (1, 4), (1, 5)]
    # too few with a spread: the flat ones fill the batch, in draw order
    assert spread_groups_first([first], 2, 3) == [(0, 2), (0, 3), (0, 0), (0, 1), (0, 4), (0, 5)]


def test_take_samples_merges_rollouts():
    from rlfuse.rollout.fusion import Experience, take_samples

    def exp(n, width, base):
        return Experience([[1]] * n, [[base + i] * (1 + i % width) for i in range(n)], torch.arange(n) // 2,
                          torch.arange(n, dtype=torch.float32) + base, torch.full((n, width), float(base)),
                          torch.zeros(n, width), None, torch.ones(n, width), ["eos"] * n, timing={"rollout": 1.0})

    a, b = exp(4, 2, 0), exp(4, 3, 10)
    kept = take_samples([a, b], [(1, 2), (1, 3), (0, 0), (0, 1)])
    assert kept.response_ids == [b.response_ids[2], b.response_ids[3], a.response_ids[0], a.response_ids[1]]
    assert kept.scores.tolist() == [12.0, 13.0, 0.0, 1.0] and kept.logprobs.shape == (4, 3)
    assert kept.logprobs[2].tolist() == [0.0, 0.0, 0.0] and kept.logprobs[0].tolist() == [10.0] * 3
    assert kept.prompt_index.tolist() == [0, 0, 1, 1]  # both had prompt index 1 / 0: renumbered apart
    assert kept.timing == {"rollout": 2.0} and kept.values is None


def test_truncated_samples_leave_the_loss():
    from helpers import hand_experience
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlfuse.config import load_config
    from rlfuse.learn.batches import truncated_masked
    from rlfuse.learn.losses import micro_policy_loss

    torch.manual_seed(0)
    actor = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=32, n_embd=16, n_layer=1, n_head=2))
    exp = hand_experience(actor, n=4, k=2, longest=6)
    exp.finish_reasons = ["length", "eos", "length", "eos"]
    masked = truncated_masked(exp)
    assert masked.mask[[0, 2]].sum() == 0 and torch.equal(masked.mask[[1, 3]], exp.mask[[1, 3]])
    rl = load_config(None, ["rl.algo=grpo", "rl.k=2", "rl.mask_truncated=true"]).rl
    adv = torch.randn(4)

    def grads(e, idx):
        actor.zero_grad()
        loss, _ = micro_policy_loss(actor, e, idx, adv, rl, 0.5, 0, 1.0)
        loss.backward()
        return [p.grad.clone() for p in actor.parameters() if p.grad is not None]

    assert all(float(g.abs().sum()) == 0 for g in grads(masked, [0, 2]))  # only truncated ones: nothing to learn
    assert any(float(g.abs().sum()) > 0 for g in grads(exp, [0, 2]))


def test_an_entropy_bonus_raises_the_entropy():
    """rl.entropy_coef: one SGD step on the loss less the bonus leaves the policy's entropy at the sampled positions
    higher than the same step without it."""
    from helpers import hand_experience
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlfuse.config import load_config
    from rlfuse.learn.losses import micro_policy_loss
    from rlfuse.models.forward import collate, response_logprobs

    def entropy_after(coef):
        torch.manual_seed(0)
        actor = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=32, n_embd=16, n_layer=1, n_head=2))
        exp = hand_experience(actor, n=4, k=2, longest=6)
        rl = load_config(None, ["rl.algo=grpo", "rl.k=2", f"rl.entropy_coef={coef}"]).rl
        loss, _ = micro_policy_loss(actor, exp, [0, 1, 2, 3], torch.zeros(4), rl, 0.0, 0, 1.0)
        loss.backward()
        with torch.no_grad():
            for p in actor.parameters():
                p -= 0.5 * p.grad
            mb = collate(exp.prompt_ids, exp.response_ids, 0, "cpu")
            _, ent = response_logprobs(actor, mb, 1.0, with_entropy=True)
        return float((ent * mb.mask).sum() / mb.mask.sum())

    assert entropy_after(1.0) > entropy_after(0.0) + 1e-4


def test_per_function_normalisation_by_hand():
    """GDPO-style: two functions that disagree on a group, one on a 100x wider range: normalised on their own they
    cancel, summed first the wide one decides."""
    from rlfuse.algos.advantages import grpo_advantages, per_function_advantages

    parts = torch.tensor([[0.0, 100.0], [1.0, 0.0]])  # one group of k=2: f1 prefers sample 1, f2 sample 0
    assert_close(per_function_advantages(parts, [1.0, 1.0], 2, grpo_advantages, "group"), torch.zeros(2),
                 atol=1e-3, rtol=0)
    summed = grpo_advantages(parts @ torch.tensor([1.0, 1.0]), 2, "group")
    assert_close(summed, torch.tensor([0.7071, -0.7071]), atol=1e-3, rtol=0)


def test_reward_parts_travel_from_the_scorer_to_the_advantages():
    from rlfuse.config import load_config
    from rlfuse.learn.advantages import compute_advantages
    from rlfuse.models.rewards import FunctionReward
    from rlfuse.rollout.fusion import build_experience
    from rlfuse.rollout.score import ScoredSample
    from rlfuse.rollout.state import Sample

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    def short(completions, **_):
        return [float(len(c) < 4) for c in completions]

    def loud(completions, **_):
        return [100.0 * ("9" in c) for c in completions]

    fn = FunctionReward([short, loud], [1.0, 1.0], Tok())
    samples = [Sample(0, j, [1], toks, torch.zeros(len(toks)), "eos") for j, toks in enumerate([[1], [9, 9, 9]])]
    total = fn(samples)
    assert fn.last_parts.tolist() == [[1.0, 0.0], [0.0, 100.0]] and total.tolist() == [1.0, 100.0]
    scored = [ScoredSample(s, float(t), torch.zeros(len(s.token_ids)), None, s.logprobs, None, p)
              for s, t, p in zip(samples, total, fn.last_parts)]
    exp = build_experience(scored)
    assert exp.reward_parts.tolist() == [[1.0, 0.0], [0.0, 100.0]]
    rl = lambda norm: load_config(None, ["rl.algo=grpo", "rl.k=2", f"rl.reward_normalization={norm}",
                                         "rl.whiten_advantages=false"]).rl
    per_fn, _, _ = compute_advantages(exp, rl("per_function"), 0.0)
    summed, _, _ = compute_advantages(exp, rl("sum"), 0.0)
    assert abs(float(per_fn[0])) < 1e-3 and float(summed[0]) < -0.5  # the loud function no longer decides


def test_merged_timing_adds_seconds_not_ratios():
    from rlfuse.rollout.fusion import merged_timing

    a = {"rollout": 2.0, "busy": {0: 1.0, 1: 2.0}, "decode_rss_mb": [10, 20], "mean_length_generated": 7.0}
    b = {"rollout": 3.0, "busy": {1: 5.0}, "decode_rss_mb": [30, 40], "mean_length_generated": 9.0}
    assert merged_timing([a, b]) == {"rollout": 5.0, "busy": {0: 1.0, 1: 7.0}, "decode_rss_mb": [10, 20],
                                     "mean_length_generated": 7.0}
    assert a["busy"] == {0: 1.0, 1: 2.0}  # the parts are not changed
