"""rl.skip_zero_advantage: the samples whose advantage is 0 everywhere (a prompt whose k samples scored alike) leave
the update, whose gradient is otherwise unchanged: without a KL penalty in the loss the weights after the update are
the full update's; the micro-batch shares stay fractions of the whole mini-batch."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rlfuse.algos.stats import in_spread_groups
from rlfuse.config import load_config
from rlfuse.errors import ConfigError
from rlfuse.learn.advantages import compute_advantages
from rlfuse.learn.batches import micro_batches, minibatches, update_batches
from rlfuse.learn.learners import Learner
from rlfuse.learn.losses import micro_policy_loss
from rlfuse.learn.update import BadSteps, optimise
from rlfuse.rollout.fusion import Experience


def test_in_spread_groups_by_hand():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    assert in_spread_groups(rewards, 2).tolist() == [False, False, True, True, False, False]
    assert in_spread_groups(rewards, 3).tolist() == [True, True, True, True, True, True]
    assert in_spread_groups(torch.tensor([0.3, 0.3, 0.3]), 3).tolist() == [False] * 3


def _rl(*more):
    return load_config(None, ["rl.algo=grpo", "rl.k=2", "rl.prompts_per_iter=3", "rl.mini_batch_size=2",
                              "rl.micro_batch_size=2", "rl.epochs=1", "rl.kl_coef=0", *more]).rl


def _experience(scores):
    torch.manual_seed(0)
    n = len(scores)
    prompts = [[1, 2, 3], [1, 2, 3], [4, 5], [4, 5], [6], [6]][:n]
    responses = [[6 + i % 5, 7, 8][: 1 + i % 3] for i in range(n)]
    mask = torch.zeros(n, 3)
    for i, r in enumerate(responses):
        mask[i, : len(r)] = 1
    lp = -torch.rand(n, 3) * mask
    return Experience(prompts, responses, torch.arange(n) // 2, torch.tensor(scores), lp, lp.clone(), None, mask,
                      ["eos"] * n)


def test_update_batches_drop_the_zero_advantage_groups_and_empty_mini_batches():
    exp = _experience([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])  # prompt 1's samples scored alike
    kl = torch.zeros_like(exp.mask)
    batches = [[0, 1], [2, 3], [4, 5]]
    assert update_batches(exp, _rl(), kl, 0.1, batches) == batches and exp.trained is None  # off: all of them
    kept = update_batches(exp, _rl("rl.skip_zero_advantage=true"), kl, 0.1, batches)
    assert exp.trained.tolist() == [True, True, False, False, True, True]
    assert kept == [[0, 1], [4, 5]]
    # within a mini-batch of two prompts the shares stay fractions of all its tokens
    shares = list(micro_batches(exp, [0, 1, 2, 3], 4))
    assert [idx for idx, _ in shares] == [[0, 1]] or sorted(shares[0][0]) == [0, 1]
    tokens = exp.mask.sum(1)
    assert shares[0][1]["token"] == pytest.approx(float(tokens[:2].sum() / tokens[:4].sum()))
    assert shares[0][1]["sequence"] == 0.5
    # rloo puts the KL in the sequence reward: equal scores, unequal KL is a spread, trained on
    rloo = _rl("rl.algo=rloo", "rl.skip_zero_advantage=true")
    kl[2, 0] = 1.0
    assert update_batches(exp, rloo, kl, 0.1, batches) == batches and bool(exp.trained.all())
    assert update_batches(exp, rloo, kl, 0.0, batches) == [[0, 1], [4, 5]]  # no penalty: not


def test_a_grpo_update_without_a_kl_penalty_is_the_full_one_whitened_advantages_and_all():
    """kl_coef 0: a sample of a zero-spread group adds nothing to the gradient (its whitened advantage is 0 but for
    rounding), so leaving it out changes no weight beyond rounding."""
    def updated(skip: bool):
        torch.manual_seed(1)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=20, n_positions=16, n_embd=16, n_layer=1, n_head=2))
        exp = _experience([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
        rl = _rl("rl.mini_batch_size=6", "rl.micro_batch_size=2", f"rl.skip_zero_advantage={str(skip).lower()}")
        adv, _, kl = compute_advantages(exp, rl, 0.0)
        assert abs(float(adv[2])) < 1e-6  # whitened: 0 up to rounding
        learner = Learner.constant(model, 1e-2)
        batches = update_batches(exp, rl, kl, 0.0, minibatches(len(exp), rl, 0, 0))
        seen = []

        def loss_of(idx, share):
            seen.append(list(idx))
            loss, stats = micro_policy_loss(model, exp, idx, adv, rl, 0.0, 0, 1.0)
            return loss * share["token"], stats

        optimise([learner], batches, exp, rl.micro_batch_size, loss_of, rl, BadSteps())
        return model, seen

    full, seen_full = updated(False)
    skipped, seen_skipped = updated(True)
    assert sorted(i for idx in seen_full for i in idx) == list(range(6))
    assert sorted(i for idx in seen_skipped for i in idx) == [0, 1, 4, 5]  # prompt 1's pair never ran
    for (name, a), b in zip(full.named_parameters(), skipped.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("more,why", [(["rl.algo=ppo", "rl.k=1"], "GAE"),
                                      (["rl.algo=grpo", "rl.k=4", "rl.train_parallel=pipeline"], "pipeline"),
                                      (["rl.algo=grpo", "rl.k=4", "placement.strategy=flattened",
                                        "placement.workers=2"], "one process")])
def test_only_group_advantages_in_one_process(more, why):
    with pytest.raises(ConfigError, match="rl.skip_zero_advantage") as e:
        load_config(None, ["rl.skip_zero_advantage=true", "rl.reward=rlfuse.data.gold:gold_reward", *more])
    assert why in str(e.value)
