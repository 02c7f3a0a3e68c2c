"""One iteration's RL objective with a KL penalty (kl_coef 0.2), by hand, for ppo, rloo and grpo and every KL estimator:
the advantages the trainer computes (rlfuse/learn/advantages.py compute_advantages, as trainers/rl.py calls it), where
the KL term goes (each token's reward, the sequence reward, or the loss: config/algorithms.py kl_in), and the loss the
update minimises (rlfuse/learn/losses.py micro_policy_loss, as learn/update.py update_actor calls it), against numbers
worked out below. The last tests run update_actor itself and check that its step is an SGD step on the loss written
out here, so a sign flipped anywhere on the path from the experience to the weights fails a test.

The comparisons elsewhere (one process against Ray, fused against serial, 1x8 against 8x1 micro-batches) run the same
KL code on both sides, so none of them could see a KL term with the wrong sign."""

import math

import pytest
import torch
from torch.testing import assert_close
from transformers import GPT2Config, GPT2LMHeadModel

import rlfuse.learn.losses as losses_mod
from rlfuse.config import load_config
from rlfuse.learn.advantages import compute_advantages
from rlfuse.learn.learners import Learner
from rlfuse.learn.losses import micro_policy_loss
from rlfuse.learn.update import BadSteps, update_actor
from rlfuse.models.build import disable_dropout
from rlfuse.models.forward import collate, response_logprobs
from rlfuse.rollout.fusion import Experience

COEF = 0.2  # rl.kl_coef's dataclass default (ppo's; rloo and grpo presets lower it)
ESTIMATORS = ("k1", "k2", "k3")

# Three samples of one prompt, responses of 2, 1 and 2 tokens (T = 2, the second row padded).
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
OLD = torch.tensor([[-1.0, -2.0], [-0.5, 0.0], [-1.0, -1.0]])     # the sampler's log-probs (the KL's policy side)
REF = torch.tensor([[-1.5, -1.75], [-1.5, 0.0], [-1.0, -1.5]])    # the reference's
# log pi - log ref per token:  [[0.5, -0.25], [1.0, pad], [0.0, 0.5]]
# the estimators of that d (Schulman 2020): k1 = d, k2 = d^2 / 2, k3 = e^-d - 1 + d
KL = {
    "k1": [[0.5, -0.25], [1.0, 0.0], [0.0, 0.5]],
    "k2": [[0.125, 0.03125], [0.5, 0.0], [0.0, 0.125]],
    "k3": [[math.exp(-0.5) - 0.5, math.exp(0.25) - 1.25], [math.exp(-1.0), 0.0], [0.0, math.exp(-0.5) - 0.5]],
}
SCORES = torch.tensor([1.0, 0.0, 0.5])

# The update's own forward: the new log-probs are the old ones moved by these (ratios e^0.1, e^-0.3, e^0.4, 1, e^0.2)
NEW = OLD + torch.tensor([[0.1, -0.3], [0.4, 0.0], [0.0, 0.2]])
# log new - log ref, the in-loss KL's d (grpo):  [[0.6, -0.55], [1.4, pad], [0.0, 0.7]]
KL_NEW = {
    "k1": [[0.6, -0.55], [1.4, 0.0], [0.0, 0.7]],
    "k2": [[0.18, 0.15125], [0.98, 0.0], [0.0, 0.245]],
    "k3": [[math.exp(-0.6) - 0.4, math.exp(0.55) - 1.55], [math.exp(-1.4) + 0.4, 0.0], [0.0, math.exp(-0.7) - 0.3]],
}


def rl_config(algo, estimator, k, *extra):
    return load_config(None, [f"rl.algo={algo}", f"rl.k={k}", f"rl.kl_estimator={estimator}", f"rl.kl_coef={COEF}",
                              "rl.whiten_advantages=false", "rl.share_prompt=false", "rl.prompts_per_iter=2",
                              f"rl.mini_batch_size={2 * k}", f"rl.micro_batch_size={2 * k}", *extra]).rl


def experience(k, values=None):
    """The three samples above as an iteration's Experience (k samples per prompt); values (ppo's critic) or 0."""
    n = len(SCORES)
    responses = [[11, 12][: int(m.sum())] for m in MASK]
    return Experience([[5, 6, 7]] * n, responses, torch.arange(n) // k, SCORES, OLD, REF,
                      torch.zeros_like(OLD) if values is None else values, MASK, ["eos"] * n)


def kl_table(estimator):
    return torch.tensor(KL[estimator])


def test_the_kl_tables_are_the_estimators_of_d():
    """The numbers above, entry by entry, are the three estimators of the written-out d (a typo there would make
    every test below check the wrong thing)."""
    d = [[0.5, -0.25], [1.0, 0.0], [0.0, 0.5]]
    for row, d_row in zip(KL["k2"], d):
        assert row == pytest.approx([x * x / 2 for x in d_row])
    for row, d_row in zip(KL["k3"], d):
        assert row == pytest.approx([math.exp(-x) - 1 + x for x in d_row])
    d_new = [[0.6, -0.55], [1.4, 0.0], [0.0, 0.7]]
    for row, d_row in zip(KL_NEW["k2"], d_new):
        assert row == pytest.approx([x * x / 2 for x in d_row])
    for row, d_row in zip(KL_NEW["k3"], d_new):
        assert row == pytest.approx([math.exp(-x) - 1 + x for x in d_row])
    assert_close((OLD - REF) * MASK, torch.tensor(d) * MASK)
    assert_close((NEW - REF) * MASK, torch.tensor(d_new) * MASK)


# ----------------------------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_ppo_puts_the_kl_in_each_tokens_reward_then_gae(estimator):
    """PPO (Ziegler et al.): reward_t = -0.2 KL_t on every response token, + the score on the last; GAE with gamma 1,
    lambda 0.5 over values V. A KL added instead of subtracted, a KL left out, or lambda ignored fails."""
    kl = KL[estimator]
    values = torch.tensor([[0.5, 0.2], [0.3, 0.0], [0.1, 0.4]])
    rl = rl_config("ppo", estimator, 1, "rl.gamma=1.0", "rl.lam=0.5")
    adv, returns, got_kl = compute_advantages(experience(1, values=values), rl, COEF)
    # rewards: row 0 [-0.2 kl00, 1 - 0.2 kl01]; row 1 [0 - 0.2 kl10]; row 2 [-0.2 kl20, 0.5 - 0.2 kl21]
    r = [[-COEF * kl[0][0], 1.0 - COEF * kl[0][1]], [0.0 - COEF * kl[1][0]], [-COEF * kl[2][0], 0.5 - COEF * kl[2][1]]]
    # two-token rows: delta_1 = r_1 - V_1 (the episode ends), delta_0 = r_0 + V_1 - V_0, A_0 = delta_0 + 0.5 delta_1
    want = []
    for row, v in zip(r, values.tolist()):
        if len(row) == 1:
            want.append([row[0] - v[0], 0.0])
            continue
        d1, d0 = row[1] - v[1], row[0] + v[1] - v[0]
        want.append([d0 + 0.5 * d1, d1])
    want = torch.tensor(want)
    if estimator == "k1":  # the same, as numbers: r = [[-0.1, 1.05], [-0.2], [0, 0.4]]
        assert_close(want, torch.tensor([[-0.4 + 0.5 * 0.85, 0.85], [-0.5, 0.0], [0.3 + 0.5 * 0.0, 0.0]]))
    assert_close(got_kl, kl_table(estimator))
    assert_close(adv, want)
    assert_close(returns, (want + values) * MASK)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_rloo_puts_the_summed_kl_in_the_sequence_reward(estimator):
    """RLOO (Ahmadian et al.): R_i = score_i - 0.2 sum_t KL_it, advantage R_i - mean of the other k - 1 = 2 rewards.
    A KL added instead of subtracted, a KL left out, or a baseline over k fails."""
    kl = KL[estimator]
    rl = rl_config("rloo", estimator, 3)
    adv, returns, got_kl = compute_advantages(experience(3), rl, COEF)
    R = [1.0 - COEF * sum(kl[0]), 0.0 - COEF * sum(kl[1]), 0.5 - COEF * sum(kl[2])]
    want = torch.tensor([R[0] - (R[1] + R[2]) / 2, R[1] - (R[0] + R[2]) / 2, R[2] - (R[0] + R[1]) / 2])
    if estimator == "k1":  # KL sums [0.25, 1, 0.5]: R = [0.95, -0.2, 0.4], baselines [0.1, 0.675, 0.375]
        assert_close(want, torch.tensor([0.85, -0.875, 0.025]))
    assert returns is None
    assert_close(got_kl, kl_table(estimator))
    assert_close(adv, want)


def test_rloo_advantages_whitened_as_the_trainer_runs_by_default():
    """rl.whiten_advantages (on by default) divides the k1 advantages above, [0.85, -0.875, 0.025] (mean 0: a
    leave-one-out group's advantages sum to 0), by their Bessel-corrected std, sqrt((0.7225 + 0.765625 + 0.000625) /
    2) = 0.862772: the KL's sign still shows after it."""
    adv, _, _ = compute_advantages(experience(3), rl_config("rloo", "k1", 3, "rl.whiten_advantages=true"), COEF)
    std = math.sqrt((0.85 ** 2 + 0.875 ** 2 + 0.025 ** 2) / 2)
    assert std == pytest.approx(0.862772, abs=1e-6)
    assert_close(adv, torch.tensor([0.85, -0.875, 0.025]) / std)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_grpo_keeps_the_kl_out_of_the_advantages(estimator):
    """GRPO (DeepSeekMath): the KL goes in the loss, so the advantages are the scores' alone, group-normalised:
    scores [1, 0, 0.5] have mean 0.5 and std 0.5, so A = [0.5, -0.5, 0] / (0.5 + 1e-4). A KL folded into the
    rewards as well fails."""
    rl = rl_config("grpo", estimator, 3)
    adv, returns, got_kl = compute_advantages(experience(3), rl, COEF)
    assert returns is None
    assert_close(got_kl, kl_table(estimator))
    assert_close(adv, torch.tensor([0.5, -0.5, 0.0]) / 0.5001)


# --------------------------------------------------------------------------------------------------- the loss

A_GRPO = 0.5 / 0.5001


def surrogate_terms(adv):
    """-min(A r, A clip(r, 0.8, 1.2)) per token for the NEW ratios [[e^0.1, e^-0.3], [e^0.4], [1, e^0.2]], with one
    advantage per sample: a positive A takes the smaller of r and its clip, a negative one the larger."""
    r = [[math.exp(0.1), math.exp(-0.3)], [math.exp(0.4)], [1.0, math.exp(0.2)]]
    clip = lambda x: min(max(x, 0.8), 1.2)
    return [[max(-a * x, -a * clip(x)) for x in row] for a, row in zip(adv, r)]


def level_mean(rows, level):
    """token: over all 5 response tokens; sequence: within each response, then over the 3."""
    if level == "token":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    return sum(sum(r) / len(r) for r in rows) / len(rows)


def test_surrogate_terms_by_hand():
    """The helper above for A = [a, -a, 0] (grpo's): e^0.1 is inside the clip (-a e^0.1), e^-0.3 under it with A > 0
    (the unclipped -a e^-0.3 is the larger), e^0.4 over it with A < 0 (the unclipped a e^0.4 is the larger)."""
    a = A_GRPO
    terms = surrogate_terms([a, -a, 0.0])
    assert terms == [pytest.approx([-a * math.exp(0.1), -a * math.exp(-0.3)]), pytest.approx([a * math.exp(0.4)]),
                     pytest.approx([0.0, 0.0])]
    assert level_mean(terms, "token") == pytest.approx(a * (math.exp(0.4) - math.exp(0.1) - math.exp(-0.3)) / 5)


def policy_loss_with_new_logprobs(monkeypatch, exp, adv, rl):
    """micro_policy_loss (the update's loss of one micro-batch) with the model's forward replaced by NEW."""
    new = NEW.clone().requires_grad_()
    monkeypatch.setattr(losses_mod, "response_logprobs",
                        lambda model, mb, temperature, with_entropy: (new * mb.mask, torch.zeros_like(mb.mask)))
    loss, _ = micro_policy_loss(torch.nn.Linear(1, 1), exp, [0, 1, 2], adv, rl, COEF, 0, 1.0)
    return loss


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_grpo_loss_is_the_surrogate_plus_the_kl_to_the_reference(monkeypatch, estimator, level):
    """GRPO's loss = clipped surrogate + 0.2 x the new policy's KL to the reference (same estimator, averaged at the
    same level): loss - 0.2 KL, or no KL at all, fails."""
    rl = rl_config("grpo", estimator, 3, f"rl.loss_level={level}")
    exp = experience(3)
    adv, _, _ = compute_advantages(exp, rl, COEF)
    loss = policy_loss_with_new_logprobs(monkeypatch, exp, adv, rl)
    kl = [row[: int(m.sum())] for row, m in zip(KL_NEW[estimator], MASK)]
    want = level_mean(surrogate_terms([A_GRPO, -A_GRPO, 0.0]), level) + COEF * level_mean(kl, level)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    if estimator == "k1" and level == "token":  # KL mean (0.6 - 0.55 + 1.4 + 0 + 0.7) / 5 = 0.43
        assert loss.item() == pytest.approx(A_GRPO * (math.exp(0.4) - math.exp(0.1) - math.exp(-0.3)) / 5
                                            + 0.2 * 0.43, rel=1e-5)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_rloo_loss_is_the_surrogate_alone(monkeypatch, estimator):
    """RLOO's KL is in its advantages: the loss is the clipped surrogate of those advantages and nothing else."""
    rl = rl_config("rloo", estimator, 3)
    exp = experience(3)
    adv, _, _ = compute_advantages(exp, rl, COEF)
    loss = policy_loss_with_new_logprobs(monkeypatch, exp, adv, rl)
    kl = KL[estimator]
    R = [1.0 - COEF * sum(kl[0]), 0.0 - COEF * sum(kl[1]), 0.5 - COEF * sum(kl[2])]
    a = [R[0] - (R[1] + R[2]) / 2, R[1] - (R[0] + R[2]) / 2, R[2] - (R[0] + R[1]) / 2]
    assert loss.item() == pytest.approx(level_mean(surrogate_terms(a), "token"), rel=1e-5)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_ppo_loss_is_the_surrogate_of_per_token_advantages(monkeypatch, estimator):
    """PPO's KL is in its per-token advantages (GAE over KL-shaped rewards): the loss is their clipped surrogate
    alone. With zero values, gamma 1 and lambda 1 each token's advantage is its reward-to-go."""
    rl = rl_config("ppo", estimator, 1, "rl.gamma=1.0", "rl.lam=1.0")
    exp = experience(1)
    adv, _, _ = compute_advantages(exp, rl, COEF)
    loss = policy_loss_with_new_logprobs(monkeypatch, exp, adv, rl)
    kl = KL[estimator]
    r = [[-COEF * kl[0][0], 1.0 - COEF * kl[0][1]], [0.0 - COEF * kl[1][0]], [-COEF * kl[2][0], 0.5 - COEF * kl[2][1]]]
    to_go = [[row[0] + row[1], row[1]] if len(row) == 2 else row for row in r]
    ratios = [[math.exp(0.1), math.exp(-0.3)], [math.exp(0.4)], [1.0, math.exp(0.2)]]
    clip = lambda x: min(max(x, 0.8), 1.2)
    terms = [[max(-a * x, -a * clip(x)) for a, x in zip(arow, xrow)] for arow, xrow in zip(to_go, ratios)]
    assert loss.item() == pytest.approx(level_mean(terms, "token"), rel=1e-5)


# ------------------------------------------------------------------------------------- through update_actor

VOCAB = 40


def tiny_lm(seed=0):
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2)).train()
    disable_dropout(model)
    return model


def kl_by_hand(d, estimator):
    """d = log pi - log ref per token."""
    return {"k1": d, "k2": 0.5 * d ** 2, "k3": torch.exp(-d) - 1 + d}[estimator]


def hand_objective(new, exp, adv, rl, algo, estimator):
    """The loss written out: -min(A r, A clip(r)) averaged over response tokens, + grpo's 0.2 KL(new || ref)."""
    m = exp.mask
    a = adv if adv.dim() == 2 else adv[:, None].expand_as(new)
    ratio = torch.exp(new - exp.logprobs)
    surrogate = torch.maximum(-a * ratio, -a * ratio.clamp(1 - rl.clip, 1 + rl.clip))
    loss = (surrogate * m).sum() / m.sum()
    if algo == "grpo":
        loss = loss + COEF * (kl_by_hand(new - exp.ref_logprobs, estimator) * m).sum() / m.sum()
    return loss


@pytest.mark.parametrize("algo,estimator", [(a, e) for a in ("ppo", "rloo", "grpo") for e in ESTIMATORS])
def test_update_actor_steps_on_the_hand_written_objective(algo, estimator):
    """update_actor (the trainer's update) with plain SGD, one mini-batch, one micro-batch, no clipping moves the
    weights by exactly -lr x the gradient of hand_objective on the advantages compute_advantages gave (checked by
    hand above). 6 samples of 2 prompts, responses of 1-3 tokens, reference log-probs 0.3-0.6 nats from the
    sampler's so the KL terms are large."""
    k = 3
    actor = tiny_lm()
    g = torch.Generator().manual_seed(3)
    prompts = [[1, 2, 3]] * 3 + [[4, 5]] * 3
    responses = [[7, 8, 9], [10], [11, 12], [13, 14, 15], [16, 17], [18]]
    mb = collate(prompts, responses, 0, "cpu")
    with torch.no_grad():
        lp = response_logprobs(actor, mb)
    old = (lp + 0.2 * torch.randn(lp.shape, generator=g)) * mb.mask  # some ratios clip
    ref = (old - 0.3 - 0.3 * torch.rand(lp.shape, generator=g)) * mb.mask
    values = torch.randn(lp.shape, generator=g) * mb.mask
    exp = Experience(prompts, responses, torch.arange(6) // k, torch.tensor([1.0, -0.5, 0.2, 0.8, -1.0, 0.3]), old,
                     ref, values, mb.mask, ["eos"] * 6)
    rl = rl_config(algo, estimator, k, "rl.epochs=1", "rl.grad_clip=0", "rl.loss_level=token")
    adv, _, _ = compute_advantages(exp, rl, COEF)

    # the expected step, by hand
    lr = 0.5
    hand = tiny_lm()
    # (at rl.temperature, 0.7, which update_actor samples were drawn at when the trainer names none)
    hand_objective(response_logprobs(hand, mb, rl.temperature), exp, adv, rl, algo, estimator).backward()
    want = {n: p.detach() - lr * p.grad for n, p in hand.named_parameters()}

    opt = torch.optim.SGD(actor.parameters(), lr=lr)
    learner = Learner(actor, opt, torch.optim.lr_scheduler.ConstantLR(opt, 1.0, 0))
    bad = BadSteps()
    stats = update_actor(learner, exp, adv, [list(range(6))], rl, COEF, 0, bad)
    assert bad.skipped == 0 and stats["train/clip_frac"] > 0
    moved = 0
    for n, p in actor.named_parameters():
        assert_close(p.detach(), want[n], msg=lambda m, n=n: f"{n}: {m}")
        moved += not torch.equal(p.detach(), hand.get_parameter(n).detach())
    assert moved > 0
