"""The RL stage under bf16 autocast (run.precision: bf16, or auto where the hardware multiplies bf16 natively): rlfuse's
own autograd functions (the lean SwiGLU MLP, the in-place LoRA linear, the chunked log-prob head) compute as autocast
would run the layers they replace, so their gradients are as near the fp32 ones as transformers' and peft's own
forward under autocast; the LM head's bf16 products shift each token's logits by its target's; the gradients land in
the parameters' fp32; and a run resolves and logs it. bf16 is emulated on a CPU without AVX512-BF16 or AMX: slow there, the same numbers."""

import json

import pytest
import torch

from conftest import TINY
from helpers import lora_on, saved_bytes
from rlfuse.config import load_config
from rlfuse.models import device as device_module
from rlfuse.models.device import NATIVE_BF16_ENV, autocast_dtype, native_bf16, rl_compute_dtype
from rlfuse.models.forward import TokenLogprobs, collate, response_logprobs
from rlfuse.models.lean import enable_lean_activations
from rlfuse.models.lora_linear import fuse_lora_linears
from test_prefix_sharing import PAD, samples, tiny

CPU = torch.device("cpu")
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _grads(model, bf16: bool) -> dict:
    ss = samples()
    mb = collate([s.prompt_ids for s in ss], [s.token_ids for s in ss], PAD, "cpu", False)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = response_logprobs(model, mb, 0.7) * torch.linspace(0.5, 1.5, mb.mask.shape[1])
    out.sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _error(got: dict, want: dict) -> float:
    """The gradients' relative distance from want's, over all parameters."""
    num = sum(float((got[n].double() - want[n].double()).pow(2).sum()) for n in want)
    return (num / sum(float(want[n].double().pow(2).sum()) for n in want)) ** 0.5


@pytest.mark.parametrize("arch,lora", [("llama", False), ("llama", True), ("gpt2", True)])
def test_rlfuse_layers_under_autocast_are_as_near_fp32_as_the_stock_forward(arch, lora):
    """Stock (transformers, peft) and rlfuse's (lean MLP and norms, in-place LoRA) under bf16 autocast: both near the
    fp32 gradients, rlfuse's no farther than the stock forward's."""
    targets = LLAMA_TARGETS if arch == "llama" else None

    def build():
        model = tiny(arch, 0)
        return (lora_on(model, arch, targets) if lora else model).train()

    stock, ours = build(), build()
    if arch == "llama":
        assert enable_lean_activations(ours) > 0
    if lora:
        assert fuse_lora_linears(ours) > 0
    want = _grads(stock, False)
    assert _error(_grads(ours, False), want) < 1e-5  # fp32: the same function
    stock_bf16, ours_bf16 = _grads(stock, True), _grads(ours, True)
    stock_err, ours_err = _error(stock_bf16, want), _error(ours_bf16, want)
    assert 0 < ours_err < 0.05 and 0 < stock_err < 0.05  # bf16 rounding: near, not equal
    assert ours_err < 1.5 * stock_err + 1e-3, (ours_err, stock_err)


def test_fused_lora_runs_under_autocast_and_keeps_its_input_in_bf16():
    """Under autocast the in-place LoRA linear is taken (no fallback to peft's layer) and keeps its input once, in
    bf16, where peft's layer under autocast keeps a bf16 cast for the base and another for the adapter."""
    from rlfuse.models import lora_linear

    def kept_under_autocast(model) -> int:
        ss = samples()
        mb = collate([s.prompt_ids for s in ss], [s.token_ids for s in ss], PAD, "cpu", False)
        with torch.autocast("cpu", dtype=torch.bfloat16), saved_bytes(model) as kept:
            response_logprobs(model, mb).sum()
        return kept[0]

    stock, ours = lora_on(tiny("llama", 0), "llama").train(), lora_on(tiny("llama", 0), "llama").train()
    fuse_lora_linears(ours)
    calls = []
    apply = lora_linear.LoraLinearFunction.apply
    lora_linear.LoraLinearFunction.apply = lambda *a: calls.append(a[-1]) or apply(*a)
    try:
        ours_bytes = kept_under_autocast(ours)
    finally:
        lora_linear.LoraLinearFunction.apply = apply
    assert calls and set(calls) == {torch.bfloat16}
    assert ours_bytes < kept_under_autocast(stock)


def test_the_lm_head_runs_bf16_under_autocast_with_logits_shifted_by_the_targets():
    """Under bf16 autocast TokenLogprobs' head products run in bf16, each token's logits less its target's: on sampled
    targets its log-probs stay within 2^-8 of their size (plus 1e-3) of the exact log-softmax of the bf16-rounded h and
    W, many times nearer than bf16 logits are (rounded by up to 0.06 at a logit of 30), and so do the gradients;
    without autocast the head is fp32, as the plain log-softmax."""
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(4, 8, 16, generator=g) * 3).requires_grad_()  # logits up to about 50
    w = torch.randn(40, 16, generator=g).requires_grad_()
    temperature = 0.7
    probs = torch.softmax(h.detach() @ w.detach().T / temperature, -1).view(-1, 40)
    targets = torch.multinomial(probs, 1, generator=g).view(4, 8)
    h64, w64 = (t.detach().bfloat16().double().requires_grad_() for t in (h, w))
    exact = torch.log_softmax(h64 @ w64.T / temperature, -1).gather(-1, targets[..., None]).squeeze(-1)
    exact_grads = torch.autograd.grad(exact.sum(), (h64, w64))
    bf16_logits = (h.detach().bfloat16() @ w.detach().bfloat16().T).float() / temperature
    plain = torch.log_softmax(bf16_logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the backward too, as a user's might
        lp, _ = TokenLogprobs.apply(h, w, targets, temperature, 4, False)
        grads = torch.autograd.grad(lp.sum(), (h, w))
    assert lp.dtype == torch.float32
    err, plain_err = (lp.double() - exact).abs(), (plain.double() - exact).abs()
    assert (err <= 2 ** -8 * exact.abs() + 1e-3).all()
    assert err.mean() * 5 < plain_err.mean() and plain_err.max() > 0.02
    for got, want in zip(grads, exact_grads):
        assert (got.double() - want).abs().max() <= 1e-2 * want.abs().max()
    lp32, _ = TokenLogprobs.apply(h, w, targets, temperature, 4, False)
    torch.testing.assert_close(lp32, torch.log_softmax(h @ w.T / temperature, -1).gather(-1, targets[..., None])
                               .squeeze(-1))


def test_run_precision_resolves_per_device_and_stage(monkeypatch, tiny_task):
    monkeypatch.setenv(NATIVE_BF16_ENV, "1")
    assert native_bf16(CPU)
    assert autocast_dtype(CPU, "auto") == torch.bfloat16 and autocast_dtype(CPU, "auto", rl=True) == torch.bfloat16
    monkeypatch.setenv(NATIVE_BF16_ENV, "0")
    assert not native_bf16(CPU)
    assert autocast_dtype(CPU, "auto") is None and autocast_dtype(CPU, "auto", rl=True) is None
    assert autocast_dtype(CPU, "bf16", rl=True) == torch.bfloat16  # asked for: taken, emulated or not
    assert autocast_dtype(CPU, "fp16") is None and autocast_dtype(CPU, "fp32") is None
    gpu = torch.device("cuda")
    monkeypatch.setattr(device_module, "native_bf16", lambda device: False)  # an older GPU
    assert autocast_dtype(gpu, "auto") == torch.float16 and autocast_dtype(gpu, "auto", rl=True) is None
    assert autocast_dtype(gpu, "fp16", rl=True) is None  # no loss scaling in RL: fp32 there
    monkeypatch.setattr(device_module, "native_bf16", lambda device: True)
    base = [f"rl.sft_path={tiny_task.model_dir}", "rl.reward=rlfuse.data.gold:gold_reward"]
    assert rl_compute_dtype(load_config(None, base), CPU) == torch.bfloat16
    assert rl_compute_dtype(load_config(None, [*base, "run.precision=fp32"]), CPU) is None
    ray = load_config(None, [*base, "placement.strategy=flattened", "placement.workers=1"])
    assert rl_compute_dtype(ray, CPU) == torch.bfloat16  # the Ray placements autocast as the single process does
    fsdp = load_config(None, [*base, "placement.strategy=flattened", "placement.workers=2", "rl.train_parallel=fsdp"])
    assert rl_compute_dtype(fsdp, CPU) is None  # FSDP2 shards train in fp32 for now


@pytest.mark.parametrize("lora,mini_batch,decode", [(False, 8, "auto"), (True, 8, "auto"), (False, 4, "auto"),
                                                    (False, 8, "fp32")])
def test_a_run_under_bf16_autocast_corrects_for_its_fp32_or_bf16_sampler(tiny_task, tmp_path, monkeypatch, capsys,
                                                                         lora, mini_batch, decode):
    """auto on (what rlfuse takes for) native-bf16 hardware: the update's forwards and the scoring passes autocast
    (a multi-step update's proximal pass included), the engine decodes a bf16 copy (full fine-tuning: one made at
    each sync and freed after the rollout; LoRA: the merged copy), and the decoupled objective's behaviour weights
    are logged near 1, not all 1; rollout.generator_dtype=fp32: full fine-tuning decodes the fp32 actor itself."""
    from rlfuse.cli import main
    from rlfuse.learn import losses, update
    from rlfuse.rollout import score

    seen = {"update": set(), "scoring": set()}

    def spy(where, fn):
        return lambda *a, **k: seen[where].add(torch.is_autocast_enabled("cpu")) or fn(*a, **k)

    monkeypatch.setattr(update, "micro_policy_loss", spy("update", losses.micro_policy_loss))
    monkeypatch.setattr(score, "response_logprobs", spy("scoring", score.response_logprobs))
    monkeypatch.setenv(NATIVE_BF16_ENV, "1")
    assert main(["rl", f"rl.sft_path={tiny_task.model_dir}", "rl.reward=rlfuse.data.gold:gold_reward", "rl.algo=grpo",
                 "rl.k=2", f"model.lora={str(lora).lower()}", f"run.dir={tmp_path}", *TINY, "rl.iterations=2",
                 "rl.prompts_per_iter=4", f"rl.mini_batch_size={mini_batch}", "rl.micro_batch_size=4", "rl.epochs=1",
                 "rl.max_new_tokens=8", "rl.eval_prompts=0", f"rollout.generator_dtype={decode}"]) == 0
    assert seen == {"update": {True}, "scoring": {True}}
    rows = [json.loads(l) for l in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:  # bf16 rounding against an fp32 or bf16 sampler: more than an fp32 forward's ~1e-5 apart
        assert 0.8 < r["train/behaviour_weight_mean"] < 1.2 and r["train/behaviour_weight_max"] > 1.0002
    said = capsys.readouterr()
    said = said.out + said.err
    assert "bfloat16 autocast" in said  # the run's first line says what it computes in
    assert ("decoding in float32" if decode == "fp32" else "decoding in bfloat16") in said


def test_the_held_out_kl_compares_policy_and_reference_in_one_arithmetic(tiny_task, tmp_path, monkeypatch):
    """Before any update the policy is the reference, so the held-out KL is 0 under bf16 autocast too: the
    evaluation scores the actor's own log-probs beside the reference's, in the same autocast, rather than set the
    fp32 sampler's against a bf16 reference (0.073 over SmolLM2's hh replies, docs/benchmarks/real_model.md)."""
    from rlfuse.cli import main

    monkeypatch.setenv(NATIVE_BF16_ENV, "1")
    assert main(["rl", f"rl.sft_path={tiny_task.model_dir}", "rl.reward=rlfuse.data.gold:gold_reward", "rl.algo=grpo",
                 "rl.k=2", f"run.dir={tmp_path}", *TINY, "rl.iterations=1", "rl.prompts_per_iter=2",
                 "rl.mini_batch_size=4", "rl.micro_batch_size=4", "rl.max_new_tokens=16", "rl.eval_prompts=8",
                 "rl.temperature=1.0"]) == 0
    before = json.loads((tmp_path / "rl" / "eval_before.json").read_text())
    assert before["kl"] == 0.0 and before["mean_length"] > 1, before


@pytest.mark.parametrize("algo,lora", [("rloo", False), ("grpo", True)])
def test_the_training_kl_compares_policy_and_reference_in_one_arithmetic(tiny_task, tmp_path, monkeypatch, algo, lora):
    """The KL penalty of the first iteration, before any update, is 0 under bf16 autocast too: the scoring pass
    computes the actor's own log-probs beside the reference's, in the same autocast, and the penalty takes those
    rather than the fp32 (or bf16-copy) sampler's, even where the update is one optimiser step."""
    from rlfuse.cli import main

    monkeypatch.setenv(NATIVE_BF16_ENV, "1")
    assert main(["rl", f"rl.sft_path={tiny_task.model_dir}", "rl.reward=rlfuse.data.gold:gold_reward", f"rl.algo={algo}",
                 "rl.k=2", f"model.lora={str(lora).lower()}", f"run.dir={tmp_path}", *TINY, "rl.iterations=1",
                 "rl.prompts_per_iter=4", "rl.mini_batch_size=8", "rl.micro_batch_size=4", "rl.max_new_tokens=16",
                 "rl.eval_prompts=0", "rl.temperature=1.0", "rl.kl_coef=0.1"]) == 0
    row = json.loads((tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["reward/kl"] == 0.0 and row["train/behaviour_weight_max"] > 1.0002, row
