"""FusedLoraLinear (rlfuse/models/lora_linear.py): the adapter's product added in place gives peft's log-probs and
every adapter's gradient to rounding, on GPT-2 (Conv1D base) and Llama, through the prefix-shared forward and with
checkpointing; every case it does not cover (adapters off, a merged adapter, dropout, a training base) runs peft's
own forward; a saved adapter reloads onto the fused class."""

import copy

import pytest
import torch

from helpers import lora_on
from rlfuse.config import ModelConfig
from rlfuse.models import lora_linear
from rlfuse.models.build import enable_gradient_checkpointing
from rlfuse.models.forward import collate, response_logprobs
from rlfuse.models.load import fused_lora, load_causal_lm
from rlfuse.models.shared import adapters_off
from test_prefix_sharing import PAD, samples, tiny


def batch(share: bool):
    ss = samples()
    return collate([s.prompt_ids for s in ss], [s.token_ids for s in ss], PAD, "cpu", share)


def logprobs_and_grads(model, share: bool):
    model.zero_grad(set_to_none=True)
    mb = batch(share)
    out = response_logprobs(model, mb, 0.7)
    (out * torch.linspace(0.5, 1.5, mb.mask.shape[1])).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def calls(monkeypatch) -> list:
    seen = []
    apply = lora_linear.LoraLinearFunction.apply
    monkeypatch.setattr(lora_linear.LoraLinearFunction, "apply", lambda *a: seen.append(1) or apply(*a))
    return seen


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_fused_lora_gives_peft_logprobs_and_gradients(arch, share, checkpointing, monkeypatch):
    peft_model = lora_on(tiny(arch, 0), arch).train()
    fused = copy.deepcopy(peft_model)
    n = fused_lora(fused) and sum(type(m) is lora_linear.FusedLoraLinear for m in fused.modules())
    assert n == (8 if arch == "gpt2" else 10)  # 2 layers x the adapted linears (c_proj: attention and MLP)
    if checkpointing:
        enable_gradient_checkpointing(peft_model)
        enable_gradient_checkpointing(fused)
    want_lp, want = logprobs_and_grads(peft_model, share)
    seen = calls(monkeypatch)
    got_lp, got = logprobs_and_grads(fused, share)
    assert seen, "the fused function was not used"
    torch.testing.assert_close(got_lp, want_lp, rtol=1e-5, atol=1e-5)
    assert got.keys() == want.keys() and any("lora_A" in k for k in got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=k)


def test_cases_it_does_not_cover_run_peft(monkeypatch):
    model = fused_lora(lora_on(tiny("llama", 0), "llama")).eval()
    mb = batch(False)
    seen = calls(monkeypatch)
    with torch.no_grad(), adapters_off(model):  # the reference: the base alone
        off = response_logprobs(model, mb)
    assert not seen
    layer = next(m for m in model.modules() if type(m) is lora_linear.FusedLoraLinear)
    x = torch.randn(3, layer.in_features)
    assert layer._plain_adapter(x, (), {}) == "default"
    layer.base_layer.weight.requires_grad_(True)  # a base that trains: its gradient is peft's to give
    assert layer._plain_adapter(x, (), {}) is None
    layer.base_layer.weight.requires_grad_(False)
    assert layer._plain_adapter(x.double(), (), {}) is None
    layer.lora_dropout["default"] = torch.nn.Dropout(0.1)
    assert layer._plain_adapter(x, (), {}) is None
    with torch.no_grad():  # the base with its LoRA layers unwrapped: what adapters off must compute
        torch.testing.assert_close(off, response_logprobs(copy.deepcopy(model).unload(), mb))


def test_merged_adapter_runs_the_merged_weight(monkeypatch):
    model = fused_lora(lora_on(tiny("llama", 0), "llama")).eval()
    mb = batch(False)
    with torch.no_grad():
        want = response_logprobs(model, mb)
        model.merge_adapter()
        seen = calls(monkeypatch)
        got = response_logprobs(model, mb)
    assert not seen
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_saved_adapter_reloads_fused_and_equal(tmp_path):
    folder = tmp_path / "base"
    tiny("llama", 0).save_pretrained(folder)
    cfg = ModelConfig(name=str(folder), lora=True, lora_r=4)
    model = load_causal_lm(str(folder), cfg)
    assert any(type(m) is lora_linear.FusedLoraLinear for m in model.modules())
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.3)
    model.save_pretrained(tmp_path / "adapter")
    again = load_causal_lm(str(tmp_path / "adapter"))
    assert any(type(m) is lora_linear.FusedLoraLinear for m in again.modules())
    mb = batch(False)
    with torch.no_grad():
        torch.testing.assert_close(response_logprobs(again, mb), response_logprobs(model.eval(), mb))
