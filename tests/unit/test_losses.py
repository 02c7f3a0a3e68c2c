import math

import pytest
import torch
from torch.testing import assert_close

from rlfuse.algos.losses import pairwise_reward_loss, sft_loss


def test_pairwise_loss_hand_computed():
    rc, rr = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    # -log sigmoid(1) = log(1 + e^-1) = 0.31326; -log sigmoid(-1) = log(1 + e) = 1.31326
    expected = (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(1))) / 2
    assert_close(pairwise_reward_loss(rc, rr), torch.tensor(expected))
    assert_close(pairwise_reward_loss(rc, rr), -torch.nn.functional.logsigmoid(rc - rr).mean())


def check_pairwise_by_hand(loss_fn):
    """One pair, chosen 2 and rejected 1: log(1 + e^-1) = 0.31326 (with the two swapped, log(1 + e) = 1.31326: the
    three pairs below alone would hide a swap, their differences 1, -1 and 0 giving the same mean either way). Then
    three pairs, chosen minus rejected 1, -1 and 0: -log sigmoid of each is 0.31326, 1.31326 and log 2 = 0.69315, the
    loss their mean, 0.77322."""
    rc, rr = torch.tensor([2.0, 0.0, 3.0]), torch.tensor([1.0, 1.0, 3.0])
    want = (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(1)) + math.log(2)) / 3
    assert_close(loss_fn(rc[:1], rr[:1]), torch.tensor(math.log(1 + math.exp(-1))))
    assert_close(loss_fn(rc, rr), torch.tensor(want))


def test_pairwise_loss_by_hand_and_the_check_rejects_plausible_bugs():
    """check_pairwise_by_hand passes the real loss and fails each plausible bug: chosen and rejected swapped, a sum
    instead of a mean, sigmoid in place of log-sigmoid, the minus sign lost."""
    F = torch.nn.functional
    check_pairwise_by_hand(pairwise_reward_loss)
    for wrong in (lambda c, r: pairwise_reward_loss(r, c), lambda c, r: -F.logsigmoid(c - r).sum(),
                  lambda c, r: -torch.sigmoid(c - r).mean(), lambda c, r: F.logsigmoid(c - r).mean()):
        with pytest.raises(AssertionError):
            check_pairwise_by_hand(wrong)


def test_sft_loss_ignores_masked_tokens_and_shifts():
    # vocab 2; uniform logits everywhere -> loss log(2) per labelled token
    logits = torch.zeros(1, 3, 2)
    labels = torch.tensor([[-100, 1, -100]])
    assert_close(sft_loss(logits, labels), torch.tensor(math.log(2)))
    # a confident correct prediction at position 0 for label at position 1
    logits[0, 0] = torch.tensor([0.0, 10.0])
    assert sft_loss(logits, labels) < 1e-3


def test_sft_loss_normalizer_sums_micro_batches_to_batch_mean():
    torch.manual_seed(0)
    logits, labels = torch.randn(4, 5, 7), torch.randint(0, 7, (4, 5))
    labels[1, 3:] = -100
    n = int((labels[:, 1:] != -100).sum())
    parts = sft_loss(logits[:2], labels[:2], normalizer=n) + sft_loss(logits[2:], labels[2:], normalizer=n)
    assert_close(parts, sft_loss(logits, labels))
