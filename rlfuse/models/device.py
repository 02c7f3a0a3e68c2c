"""Where and how a process computes: the device (run.device), the seeds, CPU threads and GPU autocast."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

from rlfuse.config import Config, RunConfig
from rlfuse.errors import ConfigError


def pick_device(run: RunConfig) -> torch.device:
    if run.device == "cuda" or (run.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
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


def native_bf16(device: torch.device) -> bool:
    """Whether the device multiplies bf16 matrices natively: a GPU with bf16, or a CPU with AVX512-BF16 or AMX (torch
    converts bf16 to fp32 and back on any other CPU, 2-7x slower than fp32: docs/benchmarks/decode_step.md)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    cpu = torch.cpu
    return any(getattr(cpu, probe, lambda: False)() for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def generator_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """The dtype of the generator's own copy of the policy (rollout.generator_dtype, auto resolved on this device):
    bf16 only for a copy of its own in this process (model.lora without a shared base, placement.strategy=single)."""
    choice = cfg.rollout.generator_dtype
    own_copy = cfg.model.lora and not cfg.model.shares_base and cfg.placement.strategy == "single"
    if choice == "auto":
        choice = "bf16" if own_copy and native_bf16(torch.device(device)) else "fp32"
    return torch.bfloat16 if choice == "bf16" else torch.float32
