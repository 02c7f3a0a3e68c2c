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


def test_pairwise_loss_wrong_value_fails():
    with pytest.raises(AssertionError):
        assert_close(pairwise_reward_loss(torch.tensor([2.0]), torch.tensor([1.0])), torch.tensor(0.3))


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
