"""The real RL update functions (update_actor, update_critic): micro-batches 8x1 and 1x8 give the same updated weights
(plain SGD, one epoch, one mini-batch of 8, no clipping) for the actor and the critic, on responses of different
lengths, for ppo (token and sequence level, separate critic and a head on the actor's body), rloo and grpo."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rlfuse.config import load_config
from rlfuse.models.build import disable_dropout
from rlfuse.models.heads import ValueModel
from rlfuse.rollout.fusion import Experience
from rlfuse.models.forward import collate, response_logprobs
from rlfuse.learn.learners import Learner
from rlfuse.learn.advantages import compute_advantages
from rlfuse.learn.batches import minibatches
from rlfuse.learn.update import BadSteps, update_actor, update_critic

N, PAD = 8, 0


def tiny_lm(seed):
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=32, n_embd=32, n_layer=2, n_head=2)).train()
    disable_dropout(model)
    return model


def experience(actor, k):
    """Hand-made samples of lengths 1..6 (prompts of 2..5 tokens); old log-probs near the actor's own, so some ratios
    clip and some do not."""
    g = torch.Generator().manual_seed(1)
    n_prompts = N // k
    prompts = [torch.randint(1, 40, (2 + i % 4,), generator=g).tolist() for i in range(n_prompts)]
    prompt_ids = [prompts[i // k] for i in range(N)]
    response_ids = [torch.randint(1, 40, (1 + (3 * i) % 6,), generator=g).tolist() for i in range(N)]
    mb = collate(prompt_ids, response_ids, PAD, "cpu")
    with torch.no_grad():
        lp = response_logprobs(actor, mb)
    T = mb.mask.shape[1]
    noise = lambda s: s * torch.randn(N, T, generator=g) * mb.mask
    return Experience(prompt_ids, response_ids, torch.arange(N) // k, torch.randn(N, generator=g), lp + noise(0.2),
                      lp + noise(0.3), noise(1.0), mb.mask, ["eos"] * N)


def run_update(algo, level, shared, micro, *extra, clips=True):
    k = 1 if algo == "ppo" else 4
    rl = load_config(None, [f"rl.algo={algo}", f"rl.k={k}", "rl.epochs=1", f"rl.mini_batch_size={N}",
                            f"rl.micro_batch_size={micro}", "rl.grad_clip=0", f"rl.loss_level={level}",
                            "rl.prompts_per_iter=8", *extra]).rl
    actor = tiny_lm(0)
    exp = experience(actor, k)
    critic = None
    if algo == "ppo":
        critic = ValueModel.from_causal_lm(actor if shared else tiny_lm(1))
        torch.nn.init.normal_(critic.head.weight, std=0.1)

    def sgd(module):
        opt = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.5)
        return Learner(module, opt, torch.optim.lr_scheduler.ConstantLR(opt, 1.0, 0))

    adv, returns, _ = compute_advantages(exp, rl, 0.1)
    batches, bad = minibatches(N, rl, 0, 0), BadSteps()
    head = (critic, sgd(critic.head), returns) if shared else None
    stats = update_actor(sgd(actor), exp, adv, batches, rl, 0.1, PAD, bad, head)
    if critic is not None and not shared:
        stats |= update_critic(sgd(critic), exp, returns, batches, rl, PAD, bad)
    assert bad.skipped == 0 and (stats["train/clip_frac"] > 0 or not clips)
    models = {"actor": actor} | ({"critic": critic} if critic is not None else {})
    return {f"{r}.{n}": p.detach().clone() for r, m in models.items() for n, p in m.named_parameters()}


@pytest.mark.parametrize("algo,level,shared", [("ppo", "token", False), ("ppo", "sequence", False),
                                               ("ppo", "token", True), ("rloo", "token", False),
                                               ("grpo", "token", False), ("grpo", "sequence", False)])
def test_micro_batches_1x8_equal_8x1(algo, level, shared):
    start = {f"actor.{n}": p.detach().clone() for n, p in tiny_lm(0).named_parameters()}
    whole, split = run_update(algo, level, shared, N), run_update(algo, level, shared, 1)
    assert whole.keys() == split.keys()
    moved = [n for n in start if not torch.equal(start[n], whole[n])]
    assert len(moved) == len(start), "every actor parameter must change"
    for n in whole:
        torch.testing.assert_close(split[n], whole[n], msg=n)


@pytest.mark.parametrize("algo,level,shared,budget", [("ppo", "token", True, 14), ("grpo", "sequence", False, 8)])
def test_token_budget_micro_batches_equal_one_batch(algo, level, shared, budget):
    """rl.micro_batch_tokens: micro-batches of different sizes (here 3, 2, 1, 1, 1 and 4, 3, 1 of 8; a prompt's
    continuations packed count what they forward, so the GRPO case takes a smaller budget) still accumulate to the
    whole mini-batch's update."""
    from rlfuse.learn.batches import micro_batch_indices

    whole = run_update(algo, level, shared, N)
    split = run_update(algo, level, shared, N, f"rl.micro_batch_tokens={budget}")
    exp = experience(tiny_lm(0), 1 if algo == "ppo" else 4)
    sizes = [len(m) for m in micro_batch_indices(exp, list(range(N)), N, tokens=budget, shared=True)]
    assert len(sizes) > 1 and len(set(sizes)) > 1, sizes
    for n in whole:
        torch.testing.assert_close(split[n], whole[n], msg=n)


def test_wrong_weighting_fails():
    """The comparison above can fail: weighting micro-batches equally (not by their share of tokens) moves the
    weights differently on responses of different lengths."""
    import rlfuse.learn.update as rl_mod

    whole = run_update("ppo", "token", False, N)
    real = rl_mod.micro_batches

    def equal_shares(exp, mini, size, *rank_world):
        for idx, share in real(exp, mini, size, *rank_world):
            yield idx, {"token": len(idx) / len(mini), "sequence": len(idx) / len(mini)}

    rl_mod.micro_batches = equal_shares
    try:
        wrong = run_update("ppo", "token", False, 1)
    finally:
        rl_mod.micro_batches = real
    assert any(not torch.allclose(whole[n], wrong[n]) for n in whole)


@pytest.mark.parametrize("loss,agg", [("ppo", "seq-mean-token-sum"), ("ppo", "seq-mean-token-sum-norm"),
                                      ("gspo", "seq-mean-token-mean"), ("cispo", "token-mean"), ("gpg", "token-mean")])
def test_every_policy_loss_and_aggregation_accumulates(loss, agg):
    """rl.policy_loss and rl.loss_agg (algos/policy_losses.py) through the real update: micro-batches 8x1 and 1x8
    give the same weights, and the choice reaches the update (the weights differ from ppo with token-mean)."""
    extra = [f"rl.policy_loss={loss}", f"rl.loss_agg={agg}", "rl.clip_high=0.28", "rl.dual_clip=3"]
    whole = run_update("grpo", "token", False, N, *extra, clips=False)
    split = run_update("grpo", "token", False, 1, *extra, clips=False)
    for n in whole:
        torch.testing.assert_close(split[n], whole[n], msg=n)
    plain = run_update("grpo", "token", False, N)
    assert any(not torch.allclose(whole[n], plain[n]) for n in whole)

