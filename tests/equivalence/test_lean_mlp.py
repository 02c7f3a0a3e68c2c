"""model.lean_activations (rlfuse/models/lean.py): a SwiGLU MLP keeps gate and up for the backward and recomputes
silu(gate) and the product elementwise; the gradients of every parameter equal transformers' forward bit for bit
(full fine-tuning, LoRA, a reward model's body, with MLP-scope checkpointing on top). An RMSNorm keeps its input and
rsqrt; gradients equal to rounding. Fewer bytes are kept (counted exactly), decoding and scoring run the stock forward,
and GPT-2 (no SwiGLU, LayerNorm) is left alone."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from helpers import actor_and_critic, saved_bytes
from rlfuse.config import load_config
from rlfuse.models.build import enable_gradient_checkpointing, prepare_trainable
from rlfuse.models.forward import collate, response_logprobs
from rlfuse.models.lean import enable_lean_activations
from test_prefix_sharing import PAD, V, samples, tiny


def batch():
    ss = samples()
    return collate([s.prompt_ids for s in ss], [s.token_ids for s in ss], PAD, "cpu", False)


def gradients_and_saved_bytes(model) -> tuple[dict, int]:
    """Every trainable parameter's gradient of a weighted log-prob sum, and the bytes autograd kept for it besides
    the parameters themselves."""
    mb = batch()
    model.zero_grad(set_to_none=True)
    with saved_bytes(model) as kept:
        out = response_logprobs(model, mb, 0.7) * torch.linspace(0.5, 1.5, mb.mask.shape[1])
    out.sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}, kept[0]


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("scope", [None, "mlp"])
def test_lean_mlp_gives_the_same_gradients_bit_for_bit(lora, scope):
    stock, _ = actor_and_critic(tiny, "llama", lora, False)
    lean, _ = actor_and_critic(tiny, "llama", lora, False)
    assert enable_lean_activations(lean, norms=False) == 2
    if scope is not None:  # checkpointing wraps the lean forward (prepare_trainable's order)
        enable_gradient_checkpointing(stock, scope=scope)
        enable_gradient_checkpointing(lean, scope=scope)
    want, stock_bytes = gradients_and_saved_bytes(stock)
    got, lean_bytes = gradients_and_saved_bytes(lean)
    assert want.keys() == got.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n
    if scope is None:
        # 2 layers x rows x tokens x ffn 64 x 4 bytes: 2 of the 4 ffn-wide tensors (full fine-tuning), 1 with LoRA,
        # whose down projection keeps its input itself
        mb = batch()
        ffn_tensor = mb.input_ids.numel() * 64 * 4
        assert stock_bytes - lean_bytes == 2 * (1 if lora else 2) * ffn_tensor


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_lora_down_projection_folds_into_the_lean_mlp(dropout):
    """With an adapter on down_proj (d2's targets) the lean function runs base + B(A(product)) itself and keeps gate
    and up alone; with LoRA dropout (random masks) the adapter layer runs as itself: gradients equal either way."""
    targets = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]
    models = []
    for _ in range(2):
        model = get_peft_model(tiny("llama", 0), LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                            lora_dropout=dropout))
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(len(n)))
        models.append(model.train())
    stock, lean = models
    enable_lean_activations(lean, norms=False)
    torch.manual_seed(5)
    want, stock_bytes = gradients_and_saved_bytes(stock)
    torch.manual_seed(5)
    got, lean_bytes = gradients_and_saved_bytes(lean)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
    if dropout == 0.0:  # stock keeps gate, silu(gate), up, the product (A's input) and A's output (B's input):
        tokens = batch().input_ids.numel()  # 2 layers x (2 ffn-wide + the rank-4 one) dropped
        assert stock_bytes - lean_bytes == 2 * (2 * 64 + 4) * tokens * 4


def test_a_reward_models_body_trains_lean_with_the_same_gradients():
    stock, lean = tiny("llama", 0, head="rm"), tiny("llama", 0, head="rm")
    assert enable_lean_activations(lean, norms=False) == 2
    ids = torch.randint(1, V, (3, 9), generator=torch.Generator().manual_seed(0))
    for model in (stock, lean):
        model(input_ids=ids).logits.pow(2).sum().backward()
    for (n, a), (_, b) in zip(stock.named_parameters(), lean.named_parameters()):
        assert torch.equal(a.grad, b.grad), n


def test_decoding_runs_the_stock_forward_and_gpt2_is_left_alone():
    model = tiny("llama", 0)
    assert enable_lean_activations(model) == 2 + 5  # 2 MLPs, 2 x 2 + 1 norms
    assert enable_lean_activations(model) == 0  # idempotent
    ids = torch.randint(1, V, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            model.eval()(input_ids=ids)
        assert kept == []
    assert torch.equal(model(input_ids=ids).logits, tiny("llama", 0).eval()(input_ids=ids).logits)
    assert enable_lean_activations(tiny("gpt2", 0)) == 0


@pytest.mark.parametrize("lora", [False, True])
def test_lean_norms_give_the_same_gradients_to_rounding_and_keep_less(lora):
    stock, _ = actor_and_critic(tiny, "llama", lora, False)
    lean, _ = actor_and_critic(tiny, "llama", lora, False)
    assert enable_lean_activations(lean) == 2 + 5
    want, stock_bytes = gradients_and_saved_bytes(stock)
    got, lean_bytes = gradients_and_saved_bytes(lean)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    tokens = batch().input_ids.numel()
    mlp_saving = 2 * (1 if lora else 2) * tokens * 64 * 4
    # each norm's normalised input, kept by autograd for the norm's weight gradient: none with LoRA (frozen norms)
    norm_saving = 0 if lora else 5 * tokens * 32 * 4
    assert stock_bytes - lean_bytes == mlp_saving + norm_saving


@pytest.mark.parametrize("on", [True, False])
def test_the_setting_reaches_the_trained_model(on):
    cfg = load_config(None, [f"model.lean_activations={str(on).lower()}"])
    model = prepare_trainable(tiny("llama", 0), cfg.rl, lean=cfg.model.lean_activations)
    mlps = [m for name, m in model.named_modules() if name.endswith(".mlp")]
    norms = [m for name, m in model.named_modules() if name.endswith("norm")]
    assert len(mlps) == 2 and all(("forward" in m.__dict__) is on for m in mlps)
    assert len(norms) == 5 and all(("forward" in m.__dict__) is on for m in norms)
