"""Where and how a process computes: the device (run.device), the seeds, CPU threads and GPU autocast."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

from rlfuse.config import RunConfig
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
