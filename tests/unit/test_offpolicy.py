"""Off-policy correction (rlfuse/algos/offpolicy.py) on values a person can check."""

import math

import pytest
import torch
from torch.testing import assert_close

from rlfuse.algos.losses import ppo_policy_loss
from rlfuse.algos.offpolicy import behaviour_weights, decoupled_ppo_policy_loss, staleness

log = math.log


def test_behaviour_weights_truncated_or_masked_by_hand():
    prox = torch.tensor([[log(0.5), log(0.5), log(0.3)]])
    behav = torch.tensor([[log(0.25), log(0.5), log(0.6)]])
    w, beyond = behaviour_weights(prox, behav, cap=1.5, mode="truncate")  # raw 2, 1, 0.5
    assert_close(w, torch.tensor([[1.5, 1.0, 0.5]]))
    assert beyond.tolist() == [[True, False, False]]
    w, _ = behaviour_weights(prox, behav, cap=1.5, mode="mask")
    assert_close(w, torch.tensor([[0.0, 1.0, 0.5]]))
    with pytest.raises(ValueError, match="mode"):
        behaviour_weights(prox, behav, cap=1.5, mode="clip")


def test_decoupled_loss_by_hand():
    # one token: pi_theta 0.6, pi_prox 0.5, pi_behav 0.25 -> r = 1.2, w = 2; A = +1, eps = 0.2: the surrogate
    # max(-1.2, -clip(1.2) = -1.2) = -1.2, times w
    lp, prox, behav = (torch.tensor([[log(p)]]) for p in (0.6, 0.5, 0.25))
    adv, mask = torch.tensor([1.0]), torch.ones(1, 1)
    loss, st = decoupled_ppo_policy_loss(lp, prox, behav, adv, mask, clip_eps=0.2, cap=3.0)
    assert_close(loss, torch.tensor(-2.4))
    assert_close(st["weight_mean"], torch.tensor(2.0))
    assert st["beyond_frac"] == 0
    loss, st = decoupled_ppo_policy_loss(lp, prox, behav, adv, mask, clip_eps=0.2, cap=1.5)  # w truncated to 1.5
    assert_close(loss, torch.tensor(-1.8))
    assert st["beyond_frac"] == 1
    loss, _ = decoupled_ppo_policy_loss(lp, prox, behav, adv, mask, clip_eps=0.2, cap=1.5, mode="mask")
    assert loss == 0
    # r = 0.6 / 0.4 = 1.5 is clipped at 1.2 for A > 0: -1.2 x w (w = 0.4 / 0.25 = 1.6)
    prox = torch.tensor([[log(0.4)]])
    loss, st = decoupled_ppo_policy_loss(lp, prox, behav, adv, mask, clip_eps=0.2, cap=3.0)
    assert_close(loss, torch.tensor(-1.2 * 1.6))
    assert st["clip_frac"] == 1


def test_a_masked_token_drops_its_update_without_scaling_the_others():
    # two tokens, the first beyond the cap: the mean still divides by 2
    lp = torch.tensor([[log(0.5), log(0.5)]])
    behav = torch.tensor([[log(0.1), log(0.5)]])
    loss, st = decoupled_ppo_policy_loss(lp, lp, behav, torch.tensor([1.0]), torch.ones(1, 2), 0.2, cap=2.0,
                                         mode="mask")
    assert_close(loss, torch.tensor(-0.5))  # (0 + -1 x 1) / 2
    assert st["beyond_frac"] == 0.5


def test_on_policy_batch_is_ppo_exactly():
    # behaviour = proximal (a synchronous batch): w = 1, the loss and its gradient are ppo_policy_loss's
    torch.manual_seed(0)
    old = torch.randn(3, 5).clamp(max=-0.1)
    lp = (old + 0.3 * torch.randn(3, 5)).requires_grad_()
    adv, mask = torch.randn(3, 5), (torch.rand(3, 5) > 0.2).float()
    want, _ = ppo_policy_loss(lp, old, adv, mask, 0.2, "sequence")
    (g_want,) = torch.autograd.grad(want, lp)
    got, st = decoupled_ppo_policy_loss(lp, old, old, adv, mask, 0.2, cap=2.0, level="sequence")
    (g_got,) = torch.autograd.grad(got, lp)
    assert torch.equal(got, want) and torch.equal(g_got, g_want)
    assert st["weight_mean"] == 1 and st["beyond_frac"] == 0


def test_staleness_histogram():
    assert staleness([5, 4, 4, 3, 5], trained_version=5) == {0: 2, 1: 2, 2: 1}
    with pytest.raises(ValueError, match="newer"):
        staleness([6], trained_version=5)
