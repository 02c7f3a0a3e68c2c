"""Lean SwiGLU MLPs and RMSNorms for training (model.lean_activations). A Llama-family MLP computes down(silu(gate(x)) * up(x)), and
autograd keeps four ffn-wide tensors of it per token for the backward (gate, silu(gate), up and their product, the
down projection's input): at SmolLM2-135M (ffn 1536, 30 layers) that is 647 MiB of d1's 1178 MiB of saved
activations for one micro-batch of 4 x 230 tokens. The functions here keep gate and up only and recompute the other
two in the backward, elementwise (no matmul is recomputed, unlike rl.gradient_checkpointing): the gradients are the
same operations on the same values, so equal bit for bit (tests/equivalence/test_lean_mlp.py). An RMSNorm keeps
its input, its normalised input and (through the next layer) its output; the lean one keeps the input and one rsqrt
per token (121 MiB more at d1's micro-batch), its gradient equal to autograd's to rounding (the same formula summed in
another order).

No library does either on a CPU (Liger's fused SwiGLU and RMSNorm are Triton kernels for GPUs), hence this file."""

from __future__ import annotations

import torch
import torch.nn.functional as F

SILU_NAMES = ("silu", "swish")


class _SwiGLUDown(torch.autograd.Function):
    """down(silu(gate) * up) with a plain down weight (full fine-tuning), plus, where lora_a is given, one LoRA
    adapter on it (peft's Linear: base + B(A(x)) * scaling, no dropout): keeps gate and up, recomputes the product
    (which autograd, or peft's A, would keep). Under autocast gate and up arrive in its dtype and the products run in
    it, as autocast would run them; the weights are cast again in the backward, and their gradients come back in the
    weights' own dtype."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, lora_a=None, lora_b=None, scaling=1.0):
        dtype = up.dtype
        with torch.autocast(up.device.type, enabled=False):
            product = F.silu(gate) * up
            out = F.linear(product, weight.to(dtype), None if bias is None else bias.to(dtype))
            if lora_a is not None:
                out = out + F.linear(F.linear(product, lora_a.to(dtype)), lora_b.to(dtype)) * scaling
        ctx.save_for_backward(gate, up, weight, lora_a, lora_b)
        ctx.has_bias, ctx.scaling = bias is not None, scaling
        return out

    @staticmethod
    def backward(ctx, grad_out):
        gate, up, weight, lora_a, lora_b = ctx.saved_tensors
        dtype = up.dtype
        with torch.autocast(up.device.type, enabled=False):
            act = F.silu(gate)
            product = (act * up).reshape(-1, up.shape[-1])
            grad_2d = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype)
            grad_weight = grad_2d.t().mm(product).to(weight.dtype) if ctx.needs_input_grad[2] else None
            grad_bias = grad_2d.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[3] else None
            grad_product = grad_2d.mm(weight.to(dtype))
            grad_a = grad_b = None
            if lora_a is not None:
                a, b = lora_a.to(dtype), lora_b.to(dtype)
                grad_scaled = grad_2d * ctx.scaling
                grad_b = grad_scaled.t().mm(product.mm(a.t())).to(lora_b.dtype) if ctx.needs_input_grad[5] else None
                grad_low = grad_scaled.mm(b)  # (tokens, rank)
                grad_a = grad_low.t().mm(product).to(lora_a.dtype) if ctx.needs_input_grad[4] else None
                grad_product = grad_product + grad_low.mm(a)
            grad_product = grad_product.view_as(up)
            grad_gate = torch.ops.aten.silu_backward(grad_product * up, gate)
        return grad_gate, grad_product * act, grad_weight, grad_bias, grad_a, grad_b, None


def single_lora_adapter(layer: torch.nn.Module):
    """(A weight, B weight, scaling) of a peft LoRA Linear over a plain nn.Linear with exactly one active adapter,
    unmerged, its dropout off (none, p = 0, or eval mode), no DoRA or other variant, bias-free adapter layers, and
    nothing hooked on the layers a fused product skips (runs_stock); None otherwise (the layer then runs as itself)."""
    base = getattr(layer, "base_layer", None)
    if not hasattr(layer, "lora_A") or type(base) is not torch.nn.Linear:
        return None
    if getattr(layer, "disable_adapters", True) or getattr(layer, "merged", True):
        return None
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    a, b, dropout = layer.lora_A[name], layer.lora_B[name], layer.lora_dropout[name]
    if (not _dropout_off(dropout) or layer.use_dora.get(name, False)
            or name in getattr(layer, "lora_variant", {})
            or type(a) is not torch.nn.Linear or type(b) is not torch.nn.Linear or a.bias is not None
            or b.bias is not None or not all(map(runs_stock, (layer, base, a, b, dropout)))):
        return None
    return a.weight, b.weight, layer.scaling[name]


def _dropout_off(dropout: torch.nn.Module) -> bool:
    return type(dropout) is torch.nn.Identity or (type(dropout) is torch.nn.Dropout
                                                  and (not dropout.training or dropout.p == 0))


def runs_stock(module, decoding: bool = False) -> bool:
    """Whether calling `module` would run only its class's forward and autograd's backward: no forward or backward
    hooks (its own or global: what torch's Module.__call__ checks before its fast path) and no forward set on the
    instance (`decoding`: except one marked training_only, which then runs the stock forward). A fused or transposed
    product that reads a module's weights instead of calling it takes only such a module, so a hook on that module
    is never skipped."""
    hooks = torch.nn.modules.module
    own = module.__dict__.get("forward") if isinstance(module, torch.nn.Module) else None
    return isinstance(module, torch.nn.Module) and not (
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
        or (own is not None and not (decoding and getattr(own, "training_only", False)))
        or hooks._global_forward_hooks or hooks._global_forward_pre_hooks
        or hooks._global_backward_hooks or hooks._global_backward_pre_hooks)


def training_only(forward):
    """Mark a forward set on a module instance that acts only while the module trains with gradients on and calls
    the stock forward otherwise: a decode step that does the module's work itself may pass over it (runs_stock)."""
    forward.training_only = True
    return forward


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up alone (a down projection autograd already handles: LoRA, a quantised layer): keeps gate and up,
    recomputes silu(gate)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad_product):
        gate, up = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad_product * up, gate), grad_product * F.silu(gate)


class _RMSNorm(torch.autograd.Function):
    """Llama's RMSNorm, weight * (x * rsqrt(mean(x^2) + eps)), keeping x and the per-token rsqrt (autograd keeps x,
    the normalised x and the output's consumer its own input: the normalised x is dropped here and recomputed)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        xf = x.float()
        normed = xf * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_out * normed.to(x.dtype)).reshape(-1, weight.shape[-1]).sum(0).to(weight.dtype)
        grad_normed = (grad_out * weight).float()
        # d/dx of x * rsqrt(mean(x^2) + eps): rstd * g - rstd^3 * x * mean(g * x)
        grad_x = rstd * grad_normed - rstd.pow(3) * xf * (grad_normed * xf).mean(-1, keepdim=True)
        return grad_x.to(x.dtype), grad_weight, None


def is_llama_rms_norm(module: torch.nn.Module) -> bool:
    """transformers' Llama-family RMSNorm (LlamaRMSNorm, Qwen2RMSNorm, MistralRMSNorm...): weight * normalised x with
    `variance_epsilon` (Gemma's, weight (1 + w) and `eps`, is not one)."""
    return (type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)
            and isinstance(getattr(module, "variance_epsilon", None), float))


def lean_rms_norm_forward(module: torch.nn.Module):
    """module's forward as _RMSNorm while it trains with gradients on; the stock forward otherwise."""
    stock = module.forward

    def forward(x):
        if not (module.training and torch.is_grad_enabled()):
            return stock(x)
        return _RMSNorm.apply(x, module.weight, module.variance_epsilon)

    return training_only(forward)


def is_swiglu_mlp(module: torch.nn.Module) -> bool:
    """A transformers MLP of the Llama family (Llama, Mistral, Qwen2/3, SmolLM2...): gate_proj, up_proj, down_proj
    and a SiLU activation."""
    config = getattr(module, "config", None)
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    return (all(isinstance(getattr(module, n, None), torch.nn.Module) for n in ("gate_proj", "up_proj", "down_proj"))
            and act in SILU_NAMES)


def lean_swiglu_forward(module: torch.nn.Module):
    """module's forward as a lean SwiGLU while it trains with gradients on; the stock forward otherwise (decoding,
    scoring: nothing is kept there anyway). The down projection joins the fused function when it is a plain
    nn.Linear (full fine-tuning) or peft's LoRA over one (single_lora_adapter); otherwise (a bitsandbytes base,
    several active adapters, dropout) it runs as itself on the fused product, which it keeps once."""
    stock = module.forward
    down = module.down_proj
    plain_down = type(down) is torch.nn.Linear

    def forward(x):
        if not (module.training and torch.is_grad_enabled()):
            return stock(x)
        gate, up = module.gate_proj(x), module.up_proj(x)
        if plain_down and runs_stock(down):
            return _SwiGLUDown.apply(gate, up, down.weight, down.bias)
        adapter = single_lora_adapter(down)  # read at each call: the active adapter can change (shared base)
        if adapter is not None:
            base = down.base_layer
            return _SwiGLUDown.apply(gate, up, base.weight, base.bias, *adapter)
        return down(_SwiGLU.apply(gate, up))

    return training_only(forward)


def enable_lean_activations(model: torch.nn.Module, norms: bool = True) -> int:
    """Every SwiGLU MLP of `model` trains lean (lean_swiglu_forward), and with `norms` every Llama-family RMSNorm
    (lean_rms_norm_forward); returns how many modules changed. Idempotent."""
    count = 0
    for module in model.modules():
        if getattr(module, "_rlfuse_lean", False):
            continue
        if is_swiglu_mlp(module):
            module.forward = lean_swiglu_forward(module)
        elif norms and is_llama_rms_norm(module):
            module.forward = lean_rms_norm_forward(module)
        else:
            continue
        module._rlfuse_lean = True
        count += 1
    return count
