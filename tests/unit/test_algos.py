"""RL math against numbers a person can check by hand, and vectorised functions against slow reference loops."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlfuse.algos.advantages import ADVANTAGE_FNS, gae_advantages, grpo_advantages, rloo_advantages
from rlfuse.algos.kl import (K3_MAX, KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_penalty,
                             kl_shaped_rewards, sequence_kl)
from rlfuse.algos.losses import ppo_policy_loss, value_loss
from rlfuse.algos.stats import explained_variance, masked_mean, masked_var, whiten


def gae_reference(rewards, values, mask, gamma, lam):
    """cleanRL-style loop, one sequence at a time over its own length."""
    adv = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        n = int(mask[b].sum())
        last = 0.0
        for t in reversed(range(n)):
            next_v = values[b, t + 1] if t + 1 < n else 0.0
            delta = rewards[b, t] + gamma * next_v - values[b, t]
            last = delta + gamma * lam * last
            adv[b, t] = last
    return adv, (adv + values) * mask


def test_gae_hand_computed():
    # one sequence of 2 tokens: r = [0, 1], V = [0.5, 0.2], gamma = 1, lam = 0.5
    # delta_1 = 1 + 0 - 0.2 = 0.8 ; delta_0 = 0 + 0.2 - 0.5 = -0.3 ; A_0 = -0.3 + 0.5 * 0.8 = 0.1
    adv, ret = gae_advantages(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.2]]), torch.ones(1, 2), 1.0, 0.5)
    assert_close(adv, torch.tensor([[0.1, 0.8]]))
    assert_close(ret, torch.tensor([[0.6, 1.0]]))


def test_gae_matches_reference_loop_with_variable_lengths():
    torch.manual_seed(0)
    B, T = 5, 9
    mask = torch.zeros(B, T)
    for b, n in enumerate([9, 1, 4, 7, 2]):
        mask[b, :n] = 1
    rewards, values = torch.randn(B, T) * mask, torch.randn(B, T) * mask
    adv, ret = gae_advantages(rewards, values, mask, 0.97, 0.9)
    ref_adv, ref_ret = gae_reference(rewards, values, mask, 0.97, 0.9)
    assert_close(adv, ref_adv)
    assert_close(ret, ref_ret)


def test_gae_lambda1_gamma1_is_reward_to_go_minus_value():
    torch.manual_seed(1)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    rewards, values = torch.randn(2, 4) * mask, torch.randn(2, 4) * mask
    adv, _ = gae_advantages(rewards, values, mask, 1.0, 1.0)
    reward_to_go = torch.flip(torch.cumsum(torch.flip(rewards, [1]), 1), [1])
    assert_close(adv, (reward_to_go - values) * mask)


WRONG_GAE = {  # plausible bugs, each given the real function
    "lambda-ignored": lambda gae, r, v, m, gamma, lam: gae(r, v, m, gamma, 1.0),  # A_0 = 0.5
    "values-ignored": lambda gae, r, v, m, gamma, lam: gae(r, v * 0, m, gamma, lam),  # A = [0.5, 1]
    "sign-flipped": lambda gae, r, v, m, gamma, lam: tuple(-x for x in gae(r, v, m, gamma, lam)),
    "time-reversed": lambda gae, r, v, m, gamma, lam: tuple(x.flip(1) for x in gae(r.flip(1), v.flip(1), m, gamma,
                                                                                   lam)),  # A = [-0.5, 1.05]
}


@pytest.mark.parametrize("bug", list(WRONG_GAE))
def test_the_gae_hand_check_rejects_plausible_bugs(monkeypatch, bug):
    """test_gae_hand_computed fails on GAE with a plausible bug planted (its numbers tell them apart): it runs
    against the bug in place of gae_advantages."""
    real = gae_advantages
    monkeypatch.setitem(globals(), "gae_advantages", lambda *args: WRONG_GAE[bug](real, *args))
    with pytest.raises(AssertionError):
        test_gae_hand_computed()


def test_rloo_hand_computed():
    # rewards [1, 2, 3], k = 3: baselines [2.5, 2, 1.5], advantages [-1.5, 0, 1.5]
    assert_close(rloo_advantages(torch.tensor([1.0, 2.0, 3.0]), 3), torch.tensor([-1.5, 0.0, 1.5]))


def test_rloo_k2_is_half_the_pairwise_difference_times_two():
    # with k = 2 the leave-one-out baseline is the other sample: A = r_i - r_j = 2 * (r_i - r_j) / 2
    r = torch.tensor([1.0, 4.0, -2.0, 0.5])
    adv = rloo_advantages(r, 2)
    pair = r.view(-1, 2)
    expected = torch.stack([pair[:, 0] - pair[:, 1], pair[:, 1] - pair[:, 0]], 1).view(-1)
    assert_close(adv, expected)
    # the k=2 form equals (r - mean) * k/(k-1) = (r_i - r_j)/2 * 2
    assert_close(adv, ((pair - pair.mean(1, keepdim=True)) * 2).view(-1))


def test_rloo_matches_reference_loop():
    torch.manual_seed(2)
    r, k = torch.randn(12), 4
    ref = torch.stack([r[i] - (r[(i // k) * k:(i // k + 1) * k].sum() - r[i]) / (k - 1) for i in range(12)])
    assert_close(rloo_advantages(r, k), ref)


def test_grpo_hand_computed():
    # group [1, 2, 3]: mean 2, sample std 1 -> [-1, 0, 1] (up to eps)
    assert_close(grpo_advantages(torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0]), 3, eps=0.0)[:3], torch.tensor([-1.0, 0.0, 1.0]))
    # a group with equal rewards has zero advantage, not NaN
    assert_close(grpo_advantages(torch.tensor([5.0, 5.0, 5.0]), 3), torch.zeros(3))


def test_advantage_table():
    assert ADVANTAGE_FNS["rloo"] is rloo_advantages and ADVANTAGE_FNS["grpo"] is grpo_advantages


def test_masked_stats_and_whiten():
    x, m = torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert_close(masked_mean(x, m), torch.tensor(2.0))
    assert_close(masked_var(x, m), torch.tensor(1.0))  # unbiased: ((1)+(0)+(1))/2
    assert_close(masked_var(x, m, unbiased=False), torch.tensor(2 / 3))
    assert_close(whiten(x, m, eps=0.0), torch.tensor([-1.0, 0.0, 1.0, 0.0]))
    assert_close(masked_mean(torch.tensor([[1.0, 3.0], [2.0, 9.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]), dim=1),
                 torch.tensor([2.0, 2.0]))


def test_explained_variance():
    m = torch.ones(4)
    r = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert_close(explained_variance(r, r, m), torch.tensor(1.0))
    assert_close(explained_variance(torch.zeros(4), r, m), torch.tensor(0.0))


def test_kl_estimators_hand_computed():
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # k1 = log 2; k2 = 0.5 (log 2)^2; k3 = (0.5 - 1) - log 0.5 = -0.5 + log 2
    assert_close(kl_penalty(lp, ref, "k1"), torch.tensor([math.log(2)]))
    assert_close(kl_penalty(lp, ref, "k2"), torch.tensor([0.5 * math.log(2) ** 2]))
    assert_close(kl_penalty(lp, ref, "k3"), torch.tensor([-0.5 + math.log(2)]))
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}


def test_k3_is_clipped_at_ten_per_token():
    # the policy gave the sampled token 1e-4, the reference 0.9: q/p = 9000, k3 = 8999 - log 9000 = 8989.9 -> 10
    lp, ref = torch.tensor([math.log(1e-4), math.log(0.5)]), torch.tensor([math.log(0.9), math.log(0.25)])
    assert_close(kl_penalty(lp, ref, "k3"), torch.tensor([K3_MAX, -0.5 + math.log(2)]))
    assert K3_MAX == 10.0


def test_kl_estimators_agree_in_expectation():
    # sample from p, estimate KL(p || q) with each estimator; k1 and k3 are unbiased
    torch.manual_seed(0)
    p, q = torch.tensor([0.6, 0.3, 0.1]), torch.tensor([0.3, 0.4, 0.3])
    true_kl = float((p * (p / q).log()).sum())
    x = torch.multinomial(p, 200_000, replacement=True)
    lp, lq = p.log()[x], q.log()[x]
    assert abs(float(kl_penalty(lp, lq, "k1").mean()) - true_kl) < 0.01
    assert abs(float(kl_penalty(lp, lq, "k3").mean()) - true_kl) < 0.01


def test_kl_shaped_rewards_put_score_on_last_token():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    r = kl_shaped_rewards(torch.tensor([1.0, -1.0]), kl, mask, coef=0.5)
    assert_close(r, torch.tensor([[-0.05, -0.1, -0.15 + 1.0], [-0.25 - 1.0, 0.0, 0.0]]))


def test_adaptive_kl_controller():
    # Ziegler et al.: error clipped to +-0.2, coef *= 1 + error * n_steps / horizon
    ctl = AdaptiveKLController(coef=0.1, target=6.0, horizon=100)
    ctl.update(current_kl=12.0, n_steps=10)  # error clipped to 0.2
    assert ctl.coef == pytest.approx(0.1 * 1.02)
    ctl.update(current_kl=5.4, n_steps=50)  # error -0.1
    assert ctl.coef == pytest.approx(0.1 * 1.02 * 0.95)
    fixed = FixedKLController(0.3)
    fixed.update(100.0, 10)
    assert fixed.coef == 0.3


def test_ppo_policy_loss_hand_computed():
    lp = torch.log(torch.tensor([[1.5, 0.5]]))  # ratios 1.5, 0.5 against old log-probs 0
    old, adv, m = torch.zeros(1, 2), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2)
    loss, st = ppo_policy_loss(lp, old, adv, m, clip_eps=0.2)
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(-0.5, -0.8) = -0.5 (unclipped)
    assert_close(loss, torch.tensor(-0.85))
    assert_close(st["clip_frac"], torch.tensor(0.5))
    assert_close(st["approx_kl"], 0.5 * (lp ** 2).mean())


def test_ppo_token_vs_sequence_level():
    lp = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    tok, _ = ppo_policy_loss(lp, lp, adv, m, 0.2, level="token")
    seq, _ = ppo_policy_loss(lp, lp, adv, m, 0.2, level="sequence")
    assert_close(tok, torch.tensor(-(1 + 1 + 1 + 4) / 4))
    assert_close(seq, torch.tensor(-(1 + 4) / 2))
    # one advantage per sequence broadcasts over its tokens
    s1, _ = ppo_policy_loss(lp, lp, torch.tensor([1.0, 4.0]), m, 0.2, level="token")
    assert_close(s1, tok)


def test_value_loss_hand_computed():
    v, old, ret, m = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[2.0, 1.0]]), torch.ones(1, 2)
    loss, st = value_loss(v, old, ret, m, clip_eps=0.5)
    # token 0: unclipped (1-2)^2 = 1, clipped (0.5-2)^2 = 2.25 -> 2.25 ; token 1: 1 and 1 -> 1
    assert_close(loss, torch.tensor(0.5 * (2.25 + 1) / 2))
    assert_close(st["clip_frac"], torch.tensor(0.5))


def _exp(scores, logprobs, ref_logprobs):
    from rlfuse.rollout.fusion import Experience

    n, t = logprobs.shape
    return Experience([[1]] * n, [[2] * t] * n, torch.arange(n), scores, logprobs, ref_logprobs, torch.zeros(n, t),
                      torch.ones(n, t), ["eos"] * n)


@pytest.mark.parametrize("algo", ["rloo", "grpo"])
def test_whiten_advantages_applies_to_every_sequence_algorithm(algo):
    from rlfuse.config import load_config
    from rlfuse.learn.advantages import compute_advantages

    exp = _exp(torch.tensor([1.0, 2.0, 4.0, 0.0, 3.0, 9.0]), torch.zeros(6, 2), torch.zeros(6, 2))
    cfg = lambda w: load_config(None, [f"rl.algo={algo}", "rl.k=2", f"rl.whiten_advantages={w}"]).rl
    raw, _, _ = compute_advantages(exp, cfg("false"), 0.0)
    white, _, _ = compute_advantages(exp, cfg("true"), 0.0)
    assert_close(raw, ADVANTAGE_FNS[algo](exp.scores, 2))
    assert_close(white, (raw - raw.mean()) / raw.std())
    assert not torch.allclose(white, raw)


def test_kl_estimator_default_and_grpo_loss_use_the_configured_one():
    from rlfuse.config import load_config
    from rlfuse.learn.advantages import compute_advantages

    assert load_config(None, ["rl.algo=grpo", "rl.k=2"]).rl.kl_estimator_used == "k3"
    assert load_config(None, ["rl.algo=rloo", "rl.k=2"]).rl.kl_estimator_used == "k1"
    assert load_config(None, ["rl.algo=grpo", "rl.k=2", "rl.kl_estimator=k2"]).rl.kl_estimator_used == "k2"
    lp, ref = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]]), torch.tensor([[-1.5, -1.0], [-0.5, -2.5]])
    exp = _exp(torch.tensor([1.0, 0.0]), lp, ref)
    for est in ("k1", "k2", "k3"):  # the KL the controller measures is the configured estimator's
        rl = load_config(None, ["rl.algo=grpo", "rl.k=2", f"rl.kl_estimator={est}"]).rl
        _, _, kl = compute_advantages(exp, rl, 0.1)
        assert_close(kl, kl_penalty(lp, ref, est))


def test_the_algorithm_table_is_consistent():
    """config/algorithms.py: each row names an estimator that exists, and the properties that go together do (GAE
    reads per-token rewards and needs the critic's values; a group baseline needs a prompt's samples together)."""
    from rlfuse.algos.advantages import ADVANTAGE_FNS
    from rlfuse.config.algorithms import ALGORITHMS

    assert set(ALGORITHMS) == {"ppo", "rloo", "grpo"}
    for name, a in ALGORITHMS.items():
        assert a.name == name and a.kl_estimator in KL_ESTIMATORS
        assert a.advantage == "gae" or a.advantage in ADVANTAGE_FNS
        assert (a.advantage == "gae") == (a.kl_in == "token_reward") == a.critic, name
        assert (a.kl_in in ("token_reward", "sequence_reward", "loss")) and a.groups_prompts == (a.min_k >= 2), name


def test_sequence_kl_sums_k1_over_each_reply_then_averages():
    lp = torch.tensor([[math.log(0.5), math.log(0.5)], [math.log(0.25), 0.0]])
    ref = torch.tensor([[math.log(0.25), math.log(0.5)], [math.log(0.5), 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # reply 0: log 2 + 0; reply 1: -log 2 (its padding does not count) -> mean 0
    assert_close(sequence_kl(lp, ref, mask), torch.tensor(0.0))
    assert_close(sequence_kl(lp[:1], ref[:1], mask[:1]), torch.tensor(math.log(2)))
