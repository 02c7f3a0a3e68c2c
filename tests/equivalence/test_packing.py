"""Packed micro-batches (rlfuse/models/prefix.py pack_sequences) change no number: samples of distinct prompts with
mixed lengths, laid end to end in one row under a block-diagonal causal mask, give the padded batch's log-probs,
critic values and loss gradients at assert_close's fp32 defaults, on tiny GPT-2 and Llama models with SDPA and eager
attention, with LoRA and gradient checkpointing; the packed path really ran (the padding it saved), and the comparison
fails when the mask lets one sequence see another."""

import pytest
import torch
from transformers import (GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          LlamaForSequenceClassification)

from rlfuse.config import load_config
from rlfuse.learn.losses import micro_policy_loss, micro_value_loss
from rlfuse.models import prefix
from rlfuse.models.build import disable_dropout
from rlfuse.models.forward import collate, forward_tokens, response_logprobs, response_values
from rlfuse.models.heads import ValueModel
from rlfuse.models.rewards import reward_model_fn
from rlfuse.rollout.engine import Sample
from rlfuse.rollout.fusion import Experience

from helpers import actor_and_critic

V, PAD = 48, 0
PROMPT_LENS, RESPONSE_LENS = (20, 3, 9, 14), (2, 11, 5, 1)
"""Sequences of 22, 14, 14 and 15 tokens: padded 4 x 22 = 88 positions, packed one row of 65."""


def tiny(arch: str, seed: int, attn: str = "sdpa", head: str = "lm"):
    torch.manual_seed(seed)
    if arch == "gpt2":
        cfg = GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=2, pad_token_id=PAD,
                         attn_implementation=attn, num_labels=1)
        model = (GPT2LMHeadModel if head == "lm" else GPT2ForSequenceClassification)(cfg)
    else:
        cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, attn_implementation=attn,
                          num_labels=1)
        model = (LlamaForCausalLM if head == "lm" else LlamaForSequenceClassification)(cfg)
    disable_dropout(model)
    return model.train()


def prompts_and_responses() -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(3)
    return ([torch.randint(1, V, (n,), generator=g).tolist() for n in PROMPT_LENS],
            [torch.randint(1, V, (n,), generator=g).tolist() for n in RESPONSE_LENS])


def test_pack_rows_by_hand():
    # decreasing length: 9 (seq 1) opens row 0, 7 (seq 3) row 1, 5 (seq 0) fits row 1 (12), 3 (seq 2) row 0 (12)
    assert prefix.pack_rows([5, 9, 3, 7], 12) == [[1, 2], [3, 0]]
    assert prefix.pack_rows([4, 4], 100) == [[0, 1]]
    assert prefix.pack_rows([7], 3) == [[0]]  # a sequence longer than the capacity still gets its row


def test_packed_layout_and_token_count():
    prompts, responses = prompts_and_responses()
    mb = collate(prompts, responses, PAD, "cpu", share_prompt=True)
    assert mb.prefix is None and mb.packed is not None  # no prompt repeats: packing, not sharing
    assert tuple(mb.packed.ids.shape) == (1, 65) and mb.packed.saved_tokens == 88 - 65
    assert forward_tokens(prompts, responses, True) == 65 and forward_tokens(prompts, responses, False) == 88
    # equal lengths have nothing to save: padded rows as before
    same = collate([[1] * 5, [2] * 5, [3] * 5], [[4] * 4] * 3, PAD, "cpu", share_prompt=True)
    assert same.packed is None and same.input_ids is not None
    # without share_prompt (a model the explicit-mask forward does not support): padded
    assert collate(prompts, responses, PAD, "cpu").packed is None


@pytest.mark.parametrize("arch,attn", [("gpt2", "sdpa"), ("llama", "sdpa"), ("gpt2", "eager"), ("llama", "eager")])
def test_packed_logprobs_and_values_equal_padded(arch, attn):
    prompts, responses = prompts_and_responses()
    model, critic = tiny(arch, 0, attn).eval(), ValueModel.from_causal_lm(tiny(arch, 1, attn)).eval()
    torch.nn.init.normal_(critic.head.weight, std=0.5)
    padded, packed = (collate(prompts, responses, PAD, "cpu", share) for share in (False, True))
    assert packed.packed is not None
    with torch.no_grad():
        torch.testing.assert_close(response_logprobs(model, packed), response_logprobs(model, padded))
        torch.testing.assert_close(response_values(critic, packed), response_values(critic, padded))


@pytest.mark.parametrize("arch,attn", [("gpt2", "sdpa"), ("llama", "eager")])
def test_packed_rewards_equal_padded(arch, attn, monkeypatch):
    packed = []
    monkeypatch.setattr(prefix, "pack_sequences", lambda *a, f=prefix.pack_sequences: packed.append(1) or f(*a))
    prompts, responses = prompts_and_responses()
    rm = tiny(arch, 2, attn, head="rm").eval()
    # responses ending in EOS (= the pad id here) and not: the pooling skips the trailing EOS either way
    samples = [Sample(i, 0, p, r + ([PAD] if i % 2 else []), torch.zeros(len(r)), "eos" if i % 2 else "length")
               for i, (p, r) in enumerate(zip(prompts, responses))]
    score = reward_model_fn(rm, PAD, PAD)
    with torch.no_grad():
        want, got = score(samples, share_prompt=False), score(samples, share_prompt=True)
    assert packed == [1] and not torch.equal(want, torch.zeros_like(want))  # the packed path ran, once
    torch.testing.assert_close(got, want)


def test_a_mask_that_lets_sequences_see_each_other_fails():
    prompts, responses = prompts_and_responses()
    model = tiny("llama", 0).eval()
    mb = collate(prompts, responses, PAD, "cpu", share_prompt=True)
    want = response_logprobs(model, collate(prompts, responses, PAD, "cpu"))
    mb.packed.segment[:] = 0  # one causal sequence: the later ones attend to the earlier ones
    assert not torch.allclose(response_logprobs(model, mb), want, atol=1e-3)


@pytest.mark.parametrize("arch,lora,checkpointing", [("gpt2", False, False), ("llama", False, False),
                                                     ("llama", True, True)])
def test_packed_training_gradients_equal_padded(arch, lora, checkpointing):
    prompts, responses = prompts_and_responses()
    actor, critic = actor_and_critic(tiny, arch, lora, checkpointing)
    mask = collate(prompts, responses, PAD, "cpu").mask
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        lp = response_logprobs(actor, collate(prompts, responses, PAD, "cpu"))
    noise = lambda s: s * torch.randn(*mask.shape, generator=g) * mask
    n = len(prompts)
    exp = Experience(prompts, responses, torch.arange(n), torch.randn(n, generator=g), lp + noise(0.2),
                     lp + noise(0.3), noise(1.0), mask, ["eos"] * n)
    adv, returns, idx = noise(1.0), noise(1.0), list(range(n))
    grads = {}
    for share in (False, True):
        rl = load_config(None, ["rl.algo=ppo", f"rl.share_prompt={str(share).lower()}", "rl.prompts_per_iter=4",
                                "rl.mini_batch_size=4", "rl.micro_batch_size=4"]).rl
        got = []
        for model, loss in ((actor, lambda: micro_policy_loss(actor, exp, idx, adv, rl, 0.1, PAD, 0.7)),
                            (critic, lambda: micro_value_loss(critic, exp, idx, returns, rl, PAD))):
            model.zero_grad(set_to_none=True)
            loss()[0].backward()
            got.append({name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad})
            assert all(v.abs().sum() > 0 for v in got[-1].values())
        grads[share] = got
    for want, got in zip(grads[False], grads[True]):
        assert want.keys() == got.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=lambda m, name=name: f"{name}: {m}")
