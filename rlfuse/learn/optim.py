"""Optimisers every trainer uses: AdamW without decay on biases and norms (or bitsandbytes' 8-bit AdamW), with a
warm-up + cosine schedule (SFT, RM) or an explicit constant one (RL), and one clipped step."""

from __future__ import annotations

import math

import torch

from rlfuse.models.quantize import require_bitsandbytes


def build_adamw(model: torch.nn.Module, lr: float, weight_decay: float, kind: str = "adamw",
                params: list | None = None) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (or `params`, when several roles' adapters live in one model), no decay on
    biases and norms. kind (rl.optimizer): adamw (torch) | adamw_8bit | paged_adamw_8bit (bitsandbytes: 8-bit
    states; paged ones spill to host memory under GPU pressure)."""
    decay, no_decay = [], []
    for p in (params if params is not None else [p for p in model.parameters() if p.requires_grad]):
        (no_decay if p.ndim < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return OPTIMIZERS[kind](groups, lr)


def _bnb_optimizer(name: str):
    def build(groups, lr):
        require_bitsandbytes(f"rl.optimizer={name}")
        import bitsandbytes as bnb  # an optional install (the qlora extra): only for 8-bit optimisers

        return getattr(bnb.optim, name)(groups, lr=lr, betas=(0.9, 0.95))

    return build


def fusable(params) -> bool:
    """Whether torch's fused AdamW takes these parameters: plain floating tensors on CPU or CUDA, all on one device
    type. Sharded DTensors (FSDP2) and anything else keep torch's default implementation."""
    params = list(params)
    kinds = {p.device.type for p in params}
    return (bool(params) and len(kinds) == 1 and kinds <= {"cpu", "cuda"}
            and all(type(p) is torch.nn.Parameter or type(p) is torch.Tensor for p in params)
            and all(p.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64) for p in params))


def _adamw(groups, lr):
    """torch's AdamW, fused where it can be: one kernel over all parameters rather than passes of small ops (a step
    over SmolLM2's 135 M parameters on the 2-core CPU: fused 55 ms, foreach 315, loop 360, the same weights to
    2e-7 after 5 steps; `python -m bench.cpu_kernels`, docs/benchmarks/cpu_kernels.md)."""
    fused = fusable(p for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=fused or None)


OPTIMIZERS = {
    "adamw": _adamw,
    "adamw_8bit": _bnb_optimizer("AdamW8bit"),
    "paged_adamw_8bit": _bnb_optimizer("PagedAdamW8bit"),
}


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, warmup: int, total: int):
    """AdamW (build_adamw) and a warm-up + cosine-to-10% schedule."""
    opt = build_adamw(model, lr, weight_decay)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def build_constant_optimizer(model: torch.nn.Module, lr: float, kind: str = "adamw", params: list | None = None):
    """AdamW (build_adamw, no weight decay; kind and params as there) at a constant learning rate: an explicit constant
    schedule, so the scheduler state saved in a checkpoint says what it is."""
    opt = build_adamw(model, lr, 0.0, kind, params)
    return opt, torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=0)


def clip_and_step(model, opt, sched, grad_clip: float) -> float:
    """Clip the gradient norm, step the optimiser and the schedule; returns the norm before clipping. A non-finite
    norm (a NaN/inf loss or gradient) skips the optimiser step, so the weights stay finite; the caller counts it."""
    params = [p for p in model.parameters() if p.requires_grad]
    norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf")))
    if math.isfinite(norm):
        opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return norm
