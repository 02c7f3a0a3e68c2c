"""peft's LoRA linear with the adapter's product added in place: y = x W^T + b, then y += scale (x A^T) B^T as one
addmm into y, and a backward written for a frozen base.

Why ours: peft computes `result + lora_B(lora_A(x)) * scaling`, two more (tokens, out) tensors per layer (the
product, its scaled copy) and an out-of-place add, in the forward and again in the backward (MulBackward, AddBackward,
each a full pass over a (tokens, out) gradient). On SmolLM2-135M (210 adapted linears) a LoRA forward + backward of
4 replies of 60-128 tokens after a 98-token prompt ran 1.13-1.20x faster this way than through peft on 2 CPU cores
(`python -m bench.lora_linear`), with the same gradients to 6e-6. Only the plain case is taken: one active adapter,
no dropout, no DoRA or other variant, no LoRA bias, an nn.Linear or GPT-2 Conv1D base with frozen weights, one dtype
or autocast (both products then in autocast's dtype, the input kept once in it, and the frozen weight cast again in
the backward where autocast would keep its cast copy from forward to backward); anything else (the reference pass's
adapters off, a merged adapter, a quantised base, mixed-batch adapter names) runs peft's own forward. Saved
adapters, merging and state dicts are peft's: only the class of each layer changes (to this subclass).
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from torch import Tensor, nn


class LoraLinearFunction(torch.autograd.Function):
    """y = x W^T + b + scale (x A^T) B^T for a frozen W (and b); gradients for x, A, B (and b if it trains).
    conv1d: W is stored (in, out) (GPT-2's Conv1D) instead of nn.Linear's (out, in). dtype: the dtype to compute in
    (autocast's, as autocast would run both products; None: x's): x is kept for the backward in it, the frozen W is
    cast again in the backward rather than kept cast (autocast would keep a cast copy of every W until then), and the
    gradients come back in their tensors' own dtypes."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, a: Tensor, b: Tensor, scale: float,
                conv1d: bool, dtype: torch.dtype | None = None) -> Tensor:
        dtype = dtype or x.dtype
        with torch.autocast(x.device.type, enabled=False):
            flat = x.reshape(-1, x.shape[-1]).to(dtype)
            w_t = weight.to(dtype) if conv1d else weight.to(dtype).T
            y = torch.addmm(bias.to(dtype), flat, w_t) if bias is not None else flat @ w_t
            xa = flat @ a.to(dtype).T  # (tokens, r)
            y.addmm_(xa, b.to(dtype).T, alpha=scale)
        ctx.save_for_backward(flat, xa, weight, a, b)
        ctx.scale, ctx.conv1d, ctx.x_shape, ctx.x_dtype = scale, conv1d, x.shape, x.dtype
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        flat, xa, weight, a, b = ctx.saved_tensors
        dtype = flat.dtype
        with torch.autocast(flat.device.type, enabled=False):
            g = grad_y.reshape(-1, grad_y.shape[-1]).to(dtype)
            a_, b_ = a.to(dtype), b.to(dtype)
            g_xa = (g @ b_).mul_(ctx.scale)  # the gradient at x A^T: (tokens, r)
            grad_x = grad_a = grad_b = grad_bias = None
            if ctx.needs_input_grad[0]:
                w = weight.to(dtype)
                grad_x = (g @ (w.T if ctx.conv1d else w)).addmm_(g_xa, a_).view(ctx.x_shape).to(ctx.x_dtype)
            if ctx.needs_input_grad[2]:
                grad_bias = g.sum(0).to(weight.dtype)
            if ctx.needs_input_grad[3]:
                grad_a = (g_xa.T @ flat).to(a.dtype)
            if ctx.needs_input_grad[4]:
                grad_b = (g.T @ xa).mul_(ctx.scale).to(b.dtype)
        return grad_x, None, grad_bias, grad_a, grad_b, None, None, None


def _conv1d(layer: nn.Module) -> bool:
    return type(layer).__name__ == "Conv1D"


class FusedLoraLinear(PeftLoraLinear):
    """A peft LoRA Linear whose plain case runs LoraLinearFunction (module docstring)."""

    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        adapter = self._plain_adapter(x, args, kwargs)
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        base = self.base_layer
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        return LoraLinearFunction.apply(x, base.weight, base.bias, self.lora_A[adapter].weight,
                                        self.lora_B[adapter].weight, self.scaling[adapter], _conv1d(base), dtype)

    def _plain_adapter(self, x: Tensor, args, kwargs) -> str | None:
        """The one active adapter when this call is the plain case, else None."""
        if args or kwargs or self.disable_adapters or self.merged or len(self.active_adapters) != 1:
            return None
        name = self.active_adapters[0]
        if name not in self.lora_A or name in self.lora_variant or not isinstance(self.lora_dropout[name], nn.Identity):
            return None
        base, a, b = self.base_layer, self.lora_A[name], self.lora_B[name]
        if base.weight.requires_grad or b.bias is not None:
            return None
        dtypes = {x.dtype, base.weight.dtype, a.weight.dtype, b.weight.dtype} | (
            {base.bias.dtype} if base.bias is not None else set())
        if len(dtypes) > 1 and not torch.is_autocast_enabled(x.device.type):  # autocast computes all in its dtype
            return None
        return name


def fuse_lora_linears(model: nn.Module) -> int:
    """Swap every peft LoRA Linear over an nn.Linear or Conv1D base for FusedLoraLinear (in place); the number swapped."""
    swapped = 0
    for module in model.modules():
        if type(module) is PeftLoraLinear and (type(module.base_layer) is nn.Linear or _conv1d(module.base_layer)):
            module.__class__ = FusedLoraLinear
            swapped += 1
    return swapped
