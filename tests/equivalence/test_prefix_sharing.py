"""Prefix sharing (rlfuse/models/prefix.py) changes no number: on tiny GPT-2 and Llama models, several prompts (of
different lengths) with k samples each (responses of different lengths), the scorer's rewards, reference log-probs and
critic values, and the gradients of the PPO loss and of the value loss w.r.t. every parameter, equal the unshared
computation at assert_close's fp32 defaults; also with LoRA adapters and with gradient checkpointing. Each test
checks the shared path really ran (the prompt tokens it saved), and one shows the comparison can fail."""

import pytest
import torch
from transformers import (GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM, LlamaForSequenceClassification)

from rlfuse.config import load_config
from rlfuse.models import prefix
from rlfuse.models.build import disable_dropout, enable_gradient_checkpointing
from rlfuse.models.heads import ValueModel
from rlfuse.rollout.engine import Sample
from rlfuse.rollout.fusion import Experience
from rlfuse.rollout.score import Scorer
from rlfuse.models import forward
from rlfuse.models.forward import collate, response_logprobs
from rlfuse.models.rewards import reward_model_fn
from rlfuse.learn.losses import micro_policy_loss, micro_value_loss
from rlfuse.learn.batches import minibatches, prompt_tokens_shared
from helpers import actor_and_critic

V, PAD, K = 48, 0, 3
PROMPT_LENS, RESPONSE_LENS = (7, 3, 5), (1, 4, 6, 2, 5, 3, 6, 1, 4)


def tiny(arch: str, seed: int, head: str = "lm", attn: str = "sdpa"):
    torch.manual_seed(seed)
    if arch == "gpt2":
        cfg = GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=2, pad_token_id=PAD,
                         attn_implementation=attn)
        model = (GPT2LMHeadModel if head == "lm" else GPT2ForSequenceClassification)(cfg)
    else:
        cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, attn_implementation=attn)
        model = (LlamaForCausalLM if head == "lm" else LlamaForSequenceClassification)(cfg)
    if head == "rm":
        cfg.num_labels = 1
        model = type(model)(cfg)
    disable_dropout(model)
    return model.train()


def samples() -> list[Sample]:
    """3 prompts x K samples; responses end in EOS (= pad id) or at the limit."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, V, (n,), generator=g).tolist() for n in PROMPT_LENS]
    out = []
    for i, n in enumerate(RESPONSE_LENS):
        r = torch.randint(1, V, (n,), generator=g).tolist() + ([PAD] if i % 2 else [])
        out.append(Sample(i // K, i % K, prompts[i // K], r, torch.zeros(len(r)), "eos" if i % 2 else "length"))
    return out


def saved_by_hand(micro: list[list[int]]) -> int:
    return sum(PROMPT_LENS[p] * (len(m) - 1) for p, m in enumerate(micro))


@pytest.fixture(params=["packed", "padded"])
def layout(request, monkeypatch):
    """Each equivalence test twice: the continuations packed where that pays (collate's rule; these samples' lengths
    always pay) and one right-padded row each (packing never pays)."""
    if request.param == "padded":
        monkeypatch.setattr(forward, "PACK_BELOW", 0.0)
    return request.param


@pytest.mark.parametrize("arch,attn", [("gpt2", "sdpa"), ("llama", "sdpa"), ("gpt2", "eager"), ("llama", "eager")])
def test_scores_equal_unshared(arch, attn, layout):
    actor, ref, rm = tiny(arch, 0, attn=attn).eval(), tiny(arch, 1, attn=attn).eval(), tiny(arch, 2, "rm", attn).eval()
    critic = ValueModel.from_causal_lm(tiny(arch, 3, attn=attn)).eval()
    torch.nn.init.normal_(critic.head.weight, std=0.5)
    got = {}
    for share in (False, True):
        scorer = Scorer(reward_model_fn(rm, PAD, PAD), PAD, ref=ref, actor=actor, critic=critic,  # its switch rules
                        micro_batch_size=len(RESPONSE_LENS), recompute_old_logprobs=True, share_prompt=share)
        got[share] = scorer.score(samples())
        # 4 passes (reference, critic, old log-probs, reward) x each prompt's length x (K - 1)
        assert scorer.prompt_tokens_shared == (4 * saved_by_hand([[0] * K] * 3) if share else 0)
    key = lambda x: (x.sample.prompt_id, x.sample.sample_index)
    for a, b in zip(sorted(got[False], key=key), sorted(got[True], key=key)):
        torch.testing.assert_close(b.score, a.score)
        torch.testing.assert_close(b.ref_logprobs, a.ref_logprobs)
        torch.testing.assert_close(b.values, a.values)
        torch.testing.assert_close(b.old_logprobs, a.old_logprobs)


def test_deferred_passes_equal_the_fused_ones():
    """Scorer.deferred (FSDP ranks gather the reference and the critic only after decoding, one at a time): score()
    leaves their passes out, and deferred_pass over the samples, in another order and other micro-batches, gives each
    sample the fused passes' reference log-probs and values."""
    actor, ref = tiny("llama", 0).eval(), tiny("llama", 1).eval()
    critic = ValueModel.from_causal_lm(tiny("llama", 3)).eval()
    torch.nn.init.normal_(critic.head.weight, std=0.5)
    scorer = lambda: Scorer(lambda chunk: torch.zeros(len(chunk)), PAD, ref=ref, actor=actor, critic=critic,
                            temperature=0.7, micro_batch_size=4)
    fused = {(x.sample.prompt_id, x.sample.sample_index): x for x in scorer().score(samples())}
    deferred = scorer()
    deferred.deferred = ("reference", "critic")
    assert all(x.values is None and x.ref_logprobs is None for x in deferred.score(samples()))
    ss = samples()[::-1]
    prompts, responses = [s.prompt_ids for s in ss], [s.token_ids for s in ss]
    ref_lp, values = deferred.deferred_pass("reference", prompts, responses), deferred.deferred_pass("critic", prompts,
                                                                                                      responses)
    assert [len(v) for v in values] == [len(v) for v in ref_lp] == [len(s.token_ids) for s in ss]
    assert deferred.prompt_tokens_shared > 0  # a prompt's samples went together
    for s, lp, v in zip(ss, ref_lp, values):
        torch.testing.assert_close(lp, fused[(s.prompt_id, s.sample_index)].ref_logprobs)
        torch.testing.assert_close(v, fused[(s.prompt_id, s.sample_index)].values)


def test_wrong_prompt_fails(layout):
    """The comparison can fail: each sample continuing the next sample's prompt gives other log-probs."""
    model, ss = tiny("gpt2", 0).eval(), samples()
    prompts, responses = [s.prompt_ids for s in ss], [s.token_ids for s in ss]
    want = response_logprobs(model, collate(prompts, responses, PAD, "cpu"))
    mb = collate(prompts, responses, PAD, "cpu", share_prompt=True)
    assert mb.prefix is not None and mb.prefix.saved_tokens == saved_by_hand([[0] * K] * 3)
    assert (mb.prefix.packed is not None) == (layout == "packed")
    torch.testing.assert_close(response_logprobs(model, mb), want)
    mb.prefix.group = (mb.prefix.group + 1) % 3
    assert not torch.allclose(response_logprobs(model, mb), want, atol=1e-3)


def experience(actor) -> Experience:
    ss = samples()
    prompts, responses = [s.prompt_ids for s in ss], [s.token_ids for s in ss]
    mb = collate(prompts, responses, PAD, "cpu")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        lp = response_logprobs(actor, mb)
    noise = lambda s: s * torch.randn(*mb.mask.shape, generator=g) * mb.mask
    n = len(ss)
    return Experience(prompts, responses, torch.arange(n) // K, torch.randn(n, generator=g), lp + noise(0.2),
                      lp + noise(0.3), noise(1.0), mb.mask, ["eos"] * n)


def loss_gradients(model, loss_fn) -> dict:
    model.zero_grad(set_to_none=True)
    loss, _ = loss_fn()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    return grads


@pytest.mark.parametrize("arch,lora,checkpointing,algo", [
    ("gpt2", False, False, "ppo"), ("llama", False, False, "ppo"), ("gpt2", True, False, "ppo"),
    ("llama", True, True, "grpo"), ("gpt2", False, True, "ppo")])
def test_training_gradients_equal_unshared(arch, lora, checkpointing, algo, layout):
    actor, critic = actor_and_critic(tiny, arch, lora, checkpointing)
    exp, idx = experience(actor), list(range(len(RESPONSE_LENS)))
    adv, returns = torch.randn(exp.mask.shape) * exp.mask, torch.randn(exp.mask.shape) * exp.mask
    grads = {}
    for share in (False, True):
        rl = load_config(None, [f"rl.algo={algo}", f"rl.k={K}", f"rl.share_prompt={str(share).lower()}",
                                "rl.prompts_per_iter=3", "rl.mini_batch_size=9", "rl.micro_batch_size=9"]).rl
        a = adv if algo == "ppo" else adv[:, 0]
        grads[share] = (loss_gradients(actor, lambda: micro_policy_loss(actor, exp, idx, a, rl, 0.1, PAD, 0.7)),
                        loss_gradients(critic, lambda: micro_value_loss(critic, exp, idx, returns, rl, PAD)))
    for want, got in zip(grads[False], grads[True]):
        assert want.keys() == got.keys()
        for n in want:
            torch.testing.assert_close(got[n], want[n], msg=lambda m, n=n: f"{n}: {m}")


def test_ppo_keeps_a_prompts_samples_together_when_sharing():
    overrides = ["rl.algo=ppo", "rl.k=4", "rl.prompts_per_iter=4", "rl.mini_batch_size=8", "rl.micro_batch_size=4"]
    for share, grouped in (("true", True), ("false", False)):
        rl = load_config(None, overrides + [f"rl.share_prompt={share}"]).rl
        batches = minibatches(16, rl, 0, 0)
        together = all(len({i // 4 for i in b[s: s + 4]}) == 1 for b in batches for s in range(0, 8, 4))
        assert together == grouped


def test_packed_continuations_by_hand():
    """Continuations of 3, 1, 0 and 2 tokens after prompts of 2, 2, 3 and 3 tokens (two distinct prompts): each
    prompt's pack into a row of their own (longest first, pack_rows), the rows padded to 4, each continuation at its
    positions after its own prompt."""
    pb = prefix.group_by_prompt([[5, 6], [5, 6], [7, 8, 9], [7, 8, 9]], [[1, 2, 3], [4], [], [10, 11]], PAD, "cpu",
                                pack=True)
    assert pb.group.tolist() == [0, 0, 1, 1] and pb.packed is not None
    assert pb.packed.ids.tolist() == [[1, 2, 3, 4], [10, 11, PAD, PAD]]
    assert pb.packed.position_ids.tolist() == [[2, 3, 4, 2], [3, 4, 0, 0]]
    assert pb.packed.segment.tolist() == [[0, 0, 0, 1], [3, 3, -3, -4]]
    assert pb.packed.row_prompt.tolist() == [0, 1]
    assert pb.packed.starts == [(0, 0), (0, 3), (1, 2), (1, 0)]


def test_packed_layouts_run(monkeypatch):
    """The packed case of the equivalence tests above really packs: these samples' continuations (0-5 tokens) pay."""
    calls = []
    run = prefix._packed_continuations
    monkeypatch.setattr(prefix, "_packed_continuations", lambda *a: calls.append(1) or run(*a))
    model, ss = tiny("llama", 0).eval(), samples()
    response_logprobs(model, collate([s.prompt_ids for s in ss], [s.token_ids for s in ss], PAD, "cpu", True))
    assert calls


def test_prompt_tokens_shared_counts_by_hand():
    """Micro-batches of 4 over prompts of 7, 3, 5 tokens with K=3 samples each, in order: [p0 p0 p0 p1] [p1 p1 p2 p2]
    [p2] share 7 x 2 + 3 x 1 + 5 x 1 = 22 prompt tokens per pass."""
    ss = samples()
    exp = Experience([s.prompt_ids for s in ss], [s.token_ids for s in ss], torch.arange(9) // K, torch.zeros(9),
                     torch.zeros(9, 7), torch.zeros(9, 7), None, torch.ones(9, 7), ["eos"] * 9)
    rl = load_config(None, ["rl.algo=grpo", f"rl.k={K}", "rl.prompts_per_iter=3", "rl.mini_batch_size=9",
                            "rl.micro_batch_size=1"]).rl
    rl.micro_batch_size = 4  # a size that cuts groups (config validation wants a divisor of the mini-batch)
    assert prompt_tokens_shared(exp, [list(range(9))], rl) == 22
    assert prefix.prompt_tokens_saved([[1, 2], [1, 2], [3]]) == 2


def test_shared_base_roles_equal_unshared():
    """model.shared_base: the critic (AdapterValueModel) and the reward model (AdapterRewardModel) are adapters on the
    actor's base, run prefix-shared under their own adapter: scores, values and the critic's gradients (through the
    checkpointed base, its recompute under the critic's adapter) equal the unshared ones."""
    from peft import LoraConfig, get_peft_model

    from rlfuse.models.shared import CRITIC, REWARD, AdapterRewardModel, AdapterValueModel, recompute_with_same_adapter
    from rlfuse.models.forward import response_values

    lora = lambda: LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    base = get_peft_model(tiny("llama", 0), lora())
    base.add_adapter(CRITIC, lora())
    base.add_adapter(REWARD, lora())
    torch.manual_seed(4)
    for n, p in base.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.3)
            p.requires_grad_(f".{CRITIC}." in n)
    enable_gradient_checkpointing(base, context_fn=recompute_with_same_adapter(base))
    critic = AdapterValueModel(base, torch.nn.Linear(32, 1, bias=False))
    torch.nn.init.normal_(critic.head.weight, std=0.5)
    rm = AdapterRewardModel(base, torch.nn.Linear(32, 1, bias=False), PAD)
    ss = samples()
    got = {}
    for share in (False, True):
        mb = collate([s.prompt_ids for s in ss], [s.token_ids for s in ss], PAD, "cpu", share)
        assert (mb.prefix is not None) == share
        base.zero_grad(set_to_none=True)
        values = response_values(critic, mb)
        values.pow(2).mean().backward()  # a mean, as the real losses: O(1) gradients
        with torch.no_grad():
            scores = reward_model_fn(rm, PAD, PAD, share)(ss)
        got[share] = (values.detach(), scores, {n: p.grad.clone() for n, p in base.named_parameters()
                                                if p.grad is not None})
        assert got[share][2] and all(f".{CRITIC}." in n for n in got[share][2])
    for want, have in zip(got[False][:2], got[True][:2]):
        torch.testing.assert_close(have, want)
    assert got[True][2].keys() == got[False][2].keys()
    for n in got[False][2]:
        torch.testing.assert_close(got[True][2][n], got[False][2][n], msg=n)


def test_rl_run_logs_prompt_tokens_shared(tiny_task, tmp_path):
    """rloo with k=4 on the tiny default task through the CLI: the loop runs prefix-shared and logs what it saved."""
    import json

    from conftest import TINY
    from rlfuse.cli import main

    args = [f"rl.sft_path={tiny_task.model_dir}", "rl.reward=rlfuse.data.gold:gold_reward", "rl.algo=rloo", "rl.k=4",
            "rl.iterations=1", "rl.prompts_per_iter=2", "rl.mini_batch_size=8", "rl.micro_batch_size=8",
            "rl.max_new_tokens=8", "rl.epochs=1", "rl.eval_prompts=0", "rollout.score_every=8", f"run.dir={tmp_path}",
            *TINY]
    assert main(["rl", *args]) == 0
    row = json.loads((tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["perf/prompt_tokens_shared"] > row["perf/prompt_tokens_shared_train"] > 0
