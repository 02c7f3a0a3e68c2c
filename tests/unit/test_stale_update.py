"""The update of a stale batch (rl.max_staleness): the proximal log-probs (the scorer's actor pass) are the actor's
own log-probs of each sample, and with behaviour = proximal the decoupled loss is the plain clipped one (weight 1 on
every token), while a behaviour policy that gave a token half the probability doubles that token's weight."""

import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rlfuse.config import load_config
from rlfuse.learn.losses import micro_policy_loss
from rlfuse.models.forward import collate, response_logprobs
from rlfuse.rollout.fusion import Experience, build_experience
from rlfuse.rollout.score import Scorer
from rlfuse.rollout.state import Sample


def setup():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=2)).eval()
    prompts = [[1, 2, 3]] * 2 + [[4, 5]] * 2
    responses = [[6, 7, 8, 9], [6, 10], [11, 12, 13], [14]]
    T, n = 4, 4
    mask = torch.zeros(n, T)
    for i, r in enumerate(responses):
        mask[i, : len(r)] = 1
    with torch.no_grad():  # each sample alone: the reference the batched forward must equal
        own = torch.zeros(n, T)
        for i in range(n):
            own[i, : len(responses[i])] = response_logprobs(model, collate([prompts[i]], [responses[i]], 0, "cpu"))[0]
    exp = Experience(prompts, responses, torch.tensor([0, 0, 1, 1]), torch.tensor([1.0, 0.0, 1.0, 0.0]), own.clone(),
                     own.clone(), None, mask, ["eos"] * n)
    rl = load_config(None, ["rl.algo=grpo", "rl.k=2", "rl.prompts_per_iter=2", "rl.mini_batch_size=4",
                            "rl.micro_batch_size=2", "rl.max_staleness=1", "rl.kl_coef=0"]).rl
    return model, exp, rl


def test_proximal_logprobs_are_each_samples_own():
    # the scorer's proximal pass (micro-batches of 3: two uneven forwards) beside the sampling log-probs it keeps
    model, exp, rl = setup()
    drawn = [Sample(int(exp.prompt_index[i]), i % 2, exp.prompt_ids[i], exp.response_ids[i],
                    torch.full((len(exp.response_ids[i]),), -1.0), "eos") for i in range(len(exp))]
    scorer = Scorer(lambda chunk: torch.zeros(len(chunk)), 0, ref=model, actor=model, micro_batch_size=3)
    got = build_experience(scorer.score(drawn, proximal=True))
    torch.testing.assert_close(got.proximal_logprobs, exp.logprobs, atol=1e-5, rtol=0)
    assert bool((got.proximal_logprobs[exp.mask == 0] == 0).all())
    assert bool((got.logprobs[exp.mask == 1] == -1.0).all())  # the behaviour policy's, untouched
    assert build_experience(scorer.score(drawn)).proximal_logprobs is None  # not asked: no actor pass


def test_behaviour_equal_to_proximal_is_the_plain_objective():
    model, exp, rl = setup()
    adv, idx = torch.tensor([1.0, -1.0, 0.5, -0.5]), [0, 1, 2, 3]
    plain, _ = micro_policy_loss(model, exp, idx, adv, rl, 0.0, 0, 1.0)
    exp.proximal_logprobs = exp.logprobs.clone()
    decoupled, stats = micro_policy_loss(model, exp, idx, adv, rl, 0.0, 0, 1.0)
    torch.testing.assert_close(decoupled, plain)
    assert float(stats["train/behaviour_weight_mean"]) == 1.0 and float(stats["train/behaviour_beyond_cap"]) == 0.0


def test_a_token_the_sampler_found_half_as_likely_counts_twice():
    model, exp, rl = setup()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    exp.proximal_logprobs = exp.logprobs.clone()
    exp.logprobs[3, 0] -= math.log(2.0)  # the one-token sample 3: pi_prox / pi_behav = 2 (under the cap of 5)
    loss, stats = micro_policy_loss(model, exp, [3], adv, rl, 0.0, 0, 1.0)
    # at the proximal weights the ratio is 1: the per-token loss is -w * A = -2 * -0.5
    assert float(loss) == pytest.approx(1.0, abs=1e-5)
    assert float(stats["train/behaviour_weight_mean"]) == pytest.approx(2.0)


def test_a_one_step_update_takes_the_proximal_log_probs_from_its_own_forward():
    # one epoch, one mini-batch: the update's forward runs on the weights it starts from (the proximal policy), so
    # the detached forward gives the scored proximal log-probs' loss and gradient without the scoring pass
    model, exp, rl = setup()
    adv, idx = torch.tensor([1.0, -1.0, 0.5, -0.5]), [0, 1, 2, 3]
    exp.logprobs[3, 0] -= math.log(2.0)  # a behaviour policy that differs from the proximal one
    results = []
    for from_update in (False, True):
        model.zero_grad()
        exp.proximal_logprobs = None if from_update else exp.ref_logprobs.clone()  # the model's own (setup)
        exp.proximal_from_update = from_update
        loss, stats = micro_policy_loss(model, exp, idx, adv, rl, 0.0, 0, 1.0)
        loss.backward()
        results.append((loss.detach(), stats, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (want, want_stats, want_grads), (got, got_stats, got_grads) = results
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert float(got_stats["train/behaviour_weight_max"]) == pytest.approx(2.0, rel=1e-4)
    assert float(got_stats["train/behaviour_weight_mean"]) == pytest.approx(float(want_stats["train/behaviour_weight_mean"]), rel=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_a_batch_without_proximal_log_probs_is_refused_in_several_steps():
    from rlfuse.learn.update import BadSteps, update

    _, exp, rl = setup()
    exp.proximal_from_update = True
    with pytest.raises(RuntimeError, match="2 optimiser steps"):
        update(None, None, exp, None, None, rl, 0.0, [[0, 1], [2, 3]], BadSteps())


def test_a_stale_batchs_kl_penalty_is_the_trained_policys_whatever_its_update_steps():
    # the synchronous loop's KL compares the policy as it is now with the reference; a stale batch (Ray async) or one
    # sampled in other arithmetic (bf16 autocast) is scored with those log-probs whenever a penalty needs them before
    # the update, one optimiser step or several, so one batch's KL does not depend on the mini-batch size
    from rlfuse.learn.advantages import compute_advantages
    from rlfuse.rollout.fusion import scores_proximal

    assert [scores_proximal(True, one_step, kl) for one_step, kl in ((False, 0.0), (True, 0.0), (True, 0.1))] == \
        [True, False, True]
    assert not scores_proximal(False, False, 0.1)  # on-policy: the sampler's log-probs are the policy's
    _, exp, rl = setup()
    rl = load_config(None, ["rl.algo=rloo", "rl.k=2", "rl.kl_coef=0.1"]).rl
    exp.proximal_logprobs = exp.ref_logprobs + 0.25 * exp.mask  # the trained policy: 0.25 nats a token off the ref
    exp.logprobs = exp.ref_logprobs - 0.5 * exp.mask  # the sampler, one update older
    _, _, kl = compute_advantages(exp, rl, 0.1)
    torch.testing.assert_close(kl, 0.25 * exp.mask)


def test_optimiser_steps_count_epochs_and_mini_batches():
    rl = load_config(None, ["rl.epochs=1", "rl.mini_batch_size=16"]).rl
    assert [rl.optimiser_steps(n) for n in (1, 16, 17, 32)] == [1, 1, 2, 2]
    assert load_config(None, ["rl.epochs=2", "rl.mini_batch_size=16"]).rl.optimiser_steps(16) == 2


def test_reference_log_probs_taken_where_decoded_are_what_the_scorer_takes():
    # asynchronous RL: a generation worker takes the reference's log-probs of what it decoded (micro-batches of 3);
    # the training worker's scorer then leaves its reference pass out and passes them on, equal to its own
    model, exp, rl = setup()
    drawn = lambda: [Sample(int(exp.prompt_index[i]), i % 2, exp.prompt_ids[i], exp.response_ids[i],
                            torch.full((len(exp.response_ids[i]),), -1.0), "eos") for i in range(len(exp))]
    scorer = Scorer(lambda chunk: torch.zeros(len(chunk)), 0, ref=model, micro_batch_size=2, temperature=0.7)
    want = build_experience(scorer.score(drawn()))
    assert scorer.times["reference"] > 0
    samples = drawn()
    on_decoder = Scorer(None, 0, ref=model, micro_batch_size=3)
    assert on_decoder.reference_logprobs(samples, 0.7) > 0
    assert all(s.ref_logprobs is not None and len(s.ref_logprobs) == len(s.token_ids) for s in samples)
    before = scorer.times["reference"]
    got = build_experience(scorer.score(samples))
    assert scorer.times["reference"] == before  # no reference pass on the training side
    torch.testing.assert_close(got.ref_logprobs, want.ref_logprobs, atol=1e-5, rtol=0)
