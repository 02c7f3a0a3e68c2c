"""Pieces every trainer uses: device and precision, seeding, optimiser with warm-up + cosine, batches."""

from __future__ import annotations

import contextlib
import math
import random

import numpy as np
import torch

from rlfuse.config import RunConfig


def pick_device(run: RunConfig) -> torch.device:
    if run.device == "cuda" or (run.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from rlfuse.errors import ConfigError

            raise ConfigError("run.device", "cuda requested but no GPU is visible", "set run.device=auto or cpu")
        return torch.device("cuda")
    return torch.device("cpu")


def setup_runtime(run: RunConfig) -> torch.device:
    if run.threads:
        torch.set_num_threads(run.threads)
    seed_everything(run.seed)
    return pick_device(run)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def autocast(device: torch.device, precision: str):
    """Mixed precision where the device supports it: bf16 autocast on a capable GPU; fp32 on CPU (CPU autocast is
    slower than fp32 for models this small)."""
    if device.type != "cuda" or precision == "fp32":
        return contextlib.nullcontext()
    if precision == "auto":
        precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return torch.autocast("cuda", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


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
        from rlfuse.models.quantize import require_bitsandbytes

        require_bitsandbytes(f"rl.optimizer={name}")
        import bitsandbytes as bnb

        return getattr(bnb.optim, name)(groups, lr=lr, betas=(0.9, 0.95))

    return build


OPTIMIZERS = {
    "adamw": lambda groups, lr: torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95)),
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


def batch_indices(lengths: list[int], batch_size: int, steps: int, seed: int, group: int = 32):
    """Yield `steps` index lists of `batch_size` over seeded epoch permutations, grouped by length: each window of
    `group` batches is sorted by length before it is cut, so a batch pads to a similar length, not the corpus's
    long tail; the batch order within the window is shuffled again."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    n, queue = len(lengths), []
    for _ in range(steps):
        if not queue:
            order = rng.permutation(n)
            order = order[: n - n % batch_size] if n >= batch_size else np.resize(order, batch_size)
            window = batch_size * group
            for s in range(0, len(order), window):
                chunk = order[s: s + window]
                chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
                batches = [chunk[i: i + batch_size].tolist() for i in range(0, len(chunk), batch_size)]
                queue.extend(batches[i] for i in rng.permutation(len(batches)))
        yield queue.pop(0)


def clip_and_step(model, opt, sched, grad_clip: float) -> float:
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return float(norm)
