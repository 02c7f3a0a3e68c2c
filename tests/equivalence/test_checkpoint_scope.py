"""rl.checkpoint_scope=mlp (models/build.py enable_gradient_checkpointing): each decoder layer's MLP is recomputed in
the backward (its forward runs twice in training, once in no-grad scoring), and the gradients of every parameter
equal those with nothing recomputed, on tiny GPT-2 and Llama models, with and without LoRA adapters."""

import pytest
import torch

from helpers import actor_and_critic
from rlfuse.config import load_config
from rlfuse.models.build import enable_gradient_checkpointing, prepare_trainable
from rlfuse.models.forward import collate, response_logprobs
from test_prefix_sharing import PAD, samples, tiny


def gradients(model) -> dict:
    ss = samples()
    mb = collate([s.prompt_ids for s in ss], [s.token_ids for s in ss], PAD, "cpu", False)
    model.zero_grad(set_to_none=True)
    (response_logprobs(model, mb, 0.7) * torch.linspace(0.5, 1.5, mb.mask.shape[1])).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def count_mlp_calls(model) -> list[int]:
    calls = [0]
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "mlp":
            inner = module.forward

            def counted(*a, inner=inner, **k):
                calls[0] += 1
                return inner(*a, **k)
            module.forward = counted
    return calls


@pytest.mark.parametrize("arch,lora", [("gpt2", False), ("llama", False), ("llama", True)])
def test_mlp_recompute_gives_the_same_gradients(arch, lora):
    plain, _ = actor_and_critic(tiny, arch, lora, False)
    want = gradients(plain)
    model, _ = actor_and_critic(tiny, arch, lora, False)
    calls = count_mlp_calls(model)
    enable_gradient_checkpointing(model, scope="mlp")
    got = gradients(model)
    assert calls[0] == 2 * 2  # 2 layers, each MLP forward run again in the backward
    assert want.keys() == got.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    calls[0] = 0
    with torch.no_grad():  # scoring: no recompute
        ss = samples()
        response_logprobs(model, collate([s.prompt_ids for s in ss], [s.token_ids for s in ss], PAD, "cpu", False))
    assert calls[0] == 2


def test_the_scope_is_a_checked_setting():
    rl = load_config(None, ["rl.gradient_checkpointing=true", "rl.checkpoint_scope=mlp"]).rl
    model = prepare_trainable(tiny("llama", 0), rl)
    mlps = [m for name, m in model.named_modules() if name.endswith(".mlp")]
    assert len(mlps) == 2 and all("forward" in m.__dict__ for m in mlps)  # each wrapped for recompute
    with pytest.raises(Exception, match="rl.checkpoint_scope"):
        load_config(None, ["rl.checkpoint_scope=attention"])
