"""The RL update: micro-batches 1x8 and 8x1 give the same gradients (actor and critic)."""

import pytest
import torch

from rlfuse.config import load_config
from rlfuse.data.collate import encode
from rlfuse.data.gold import gold_reward
from rlfuse.models.heads import ValueModel
from rlfuse.models.load import load_causal_lm, load_tokenizer
from rlfuse.rollout.engine import DecodeEngine, SamplingParams
from rlfuse.rollout.fusion import FusionPolicy, generate_rollouts
from rlfuse.rollout.score import Scorer, function_reward_fn
from rlfuse.trainers.rl import Models, compute_advantages, micro_batch_loss


def make(tiny_task, algo):
    tok = load_tokenizer(str(tiny_task.model_dir))
    torch.manual_seed(0)
    actor = load_causal_lm(str(tiny_task.model_dir))
    ref = load_causal_lm(str(tiny_task.model_dir)).requires_grad_(False)
    critic = ValueModel.from_causal_lm(load_causal_lm(str(tiny_task.model_dir))) if algo == "ppo" else None
    if critic is not None:
        torch.nn.init.normal_(critic.head.weight, std=0.1)
    models = Models(tok, actor, ref, critic, function_reward_fn(gold_reward, tok))
    k = 1 if algo == "ppo" else 4
    cfg = load_config(None, [f"rl.algo={algo}", f"rl.k={k}", "rl.mini_batch_size=8", "rl.micro_batch_size=8",
                             "rl.prompts_per_iter=8", "rl.kl_coef=0.1"])
    prompts = [encode(tok, p) for p in ["the acting", "the old", "i really", "this film", "the plot", "it is",
                                        "the villain", "later, the"]][: 8 // k]
    scorer = Scorer(models.reward_fn, tok.pad_token_id, ref=ref, actor=actor, critic=critic)
    exp = generate_rollouts(DecodeEngine(actor, tok.eos_token_id), scorer, prompts, k, SamplingParams(10), 3,
                            FusionPolicy(True, 4))
    return models, exp, cfg.rl


@pytest.mark.parametrize("algo,level", [("ppo", "token"), ("ppo", "sequence"), ("grpo", "token")])
def test_micro_batches_1x8_equal_8x1(tiny_task, algo, level):
    models, exp, rl = make(tiny_task, algo)
    rl.loss_level = level
    adv, returns, _ = compute_advantages(exp, rl, 0.1)
    # perturb the old log-probs so ratios differ from 1 and clipping is exercised
    exp.logprobs = exp.logprobs + 0.3 * torch.randn_like(exp.logprobs) * exp.mask
    grads = []
    for micro in (8, 1):
        for m in (models.actor, models.critic):
            if m is not None:
                m.zero_grad(set_to_none=True)
        mini = list(range(8))
        total = float(exp.mask[mini].sum()) if level == "token" else 8.0
        for s in range(0, 8, micro):
            idx = mini[s: s + micro]
            share = (float(exp.mask[idx].sum()) if level == "token" else len(idx)) / total
            loss, critic_loss, _ = micro_batch_loss(models, exp, idx, adv, returns, rl, 0.1, share)
            (loss + (critic_loss if critic_loss is not None else 0)).backward()
        grads.append({n: p.grad.clone() for m in (models.actor, models.critic) if m is not None
                      for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], msg=n)
