"""Where and how a process computes: the device (run.device), the seeds, CPU threads and autocast (run.precision)."""

from __future__ import annotations

import contextlib
import random
from pathlib import Path

import numpy as np
import torch

from rlfuse.config import Config, RunConfig
from rlfuse.errors import ConfigError
from rlfuse.files import write_text_atomic
from rlfuse.models.cpu_share import measure_share, threads_for
from rlfuse.plan.resolve import NATIVE_BF16_ENV, cpu_multiplies_bf16, decoded_in, engine_choice, rl_autocasts


def pick_device(run: RunConfig) -> torch.device:
    if run.device == "cuda" or (run.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("run.device", "cuda requested but no GPU is visible", "set run.device=auto or cpu")
        return torch.device("cuda")
    return torch.device("cpu")


TORCH_THREADS = torch.get_num_threads()
"""torch's own thread count for this process, read before rlfuse sets any."""
_set_by_us: int | None = None


def setup_runtime(run: RunConfig, log=None, kept: Path | None = None) -> torch.device:
    """The stage's device, seeds and CPU threads: run.threads where set, else as many as the cores other work leaves
    free at the stage's start (models/cpu_share.py), said in one line when that is fewer than torch would take. The
    count is decided once and kept in `kept` (the stage folder's threads.txt), so a stage resumed from its checkpoint
    computes with the same count (a CPU's sums depend on it) as the run it continues."""
    global _set_by_us
    if run.threads:
        torch.set_num_threads(run.threads)
    else:
        # at most torch's own count, or what the caller set since (a count rlfuse set is not the caller's)
        most = TORCH_THREADS if torch.get_num_threads() == _set_by_us else torch.get_num_threads()
        threads, share = _kept_threads(kept), None
        if threads is None:
            share = measure_share()
            threads = threads_for(share, 0, most)
        torch.set_num_threads(threads)
        _set_by_us = threads
        if kept is not None:
            write_text_atomic(kept, f"{threads}\n")
        if share is not None and threads < most and log is not None:
            log(f"[run] other work keeps {share.busy:.1f} of {share.cores} cores busy: {threads} torch thread(s) "
                f"instead of {most} for this stage (run.threads fixes the count)")
    seed_everything(run.seed)
    return pick_device(run)


def _kept_threads(kept: Path | None) -> int | None:
    """The count a resumed stage computed with, where it left a checkpoint to continue from (the stage folder's
    checkpoint.pt): a stage stopped before its first starts over, and takes the cores free now."""
    if kept is None or not (kept.parent / "checkpoint.pt").exists():
        return None
    try:
        return max(1, int(kept.read_text().strip()))
    except (OSError, ValueError):
        return None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def autocast_dtype(device: torch.device, precision: str, rl: bool = False) -> torch.dtype | None:
    """The dtype run.precision computes in under autocast on `device`; None: fp32, no autocast. auto: bf16 where the
    hardware multiplies it natively (native_bf16: a GPU with bf16, a CPU with AVX512-BF16 or AMX), fp16 on an older GPU,
    else fp32. bf16 is taken where asked for even where it is emulated (slow). fp16 autocasts on a GPU only, and never
    in the RL stage (rl=True: a policy gradient in fp16 needs loss scaling, which the RL loop does not do; it runs
    fp32 there)."""
    if precision == "fp32":
        return None
    if precision == "bf16" or (precision == "auto" and native_bf16(device)):
        return torch.bfloat16
    if device.type == "cuda" and not rl:  # fp16, or auto on a GPU without bf16
        return torch.float16
    return None


def autocast(device: torch.device, precision: str):
    """SFT's and RM's mixed precision as autocast_dtype resolves run.precision here; a null context for fp32."""
    return autocast_to(device, autocast_dtype(device, precision))


def autocast_to(device, dtype: torch.dtype | None):
    """torch.autocast on the device's type to dtype; a null context for None (fp32)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def native_bf16(device: torch.device) -> bool:
    """Whether the device multiplies bf16 matrices natively: a GPU with bf16, or a CPU with AVX512-BF16 or AMX (torch
    converts bf16 to fp32 and back on any other CPU, 2-7x slower than fp32: docs/benchmarks/decode_step.md).
    RLFUSE_NATIVE_BF16=1 or 0 overrides the CPU's answer (NATIVE_BF16_ENV)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return cpu_multiplies_bf16()  # the same answer plan/resolve.py records in config.yaml


def rl_compute_dtype(cfg: Config, device: torch.device) -> torch.dtype | None:
    """The dtype the RL stage's update and scoring passes autocast to (run.precision, autocast_dtype with rl=True);
    None: fp32. The same in one process and on every Ray worker, which builds its models with it; none with
    model.quantization (its layers compute in their own dtype, bnb_4bit_compute_dtype from run.precision:
    models/quantize.py) or rl.train_parallel fsdp or pipeline_* (plan/resolve.py rl_autocasts)."""
    if not rl_autocasts(cfg):
        return None
    return autocast_dtype(torch.device(device), cfg.run.precision, rl=True)


def generator_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """The dtype the rollout engine of this process decodes in: its own copy's (generator_copy_dtype), or fp32 where
    it decodes the actor itself or a shared base."""
    return generator_copy_dtype(cfg, device) or torch.float32


def decode_dtype(choice: str, device: torch.device) -> torch.dtype:
    """rollout.generator_dtype as plan/resolve.py decoded_in gives it (bf16 | fp32), or auto where it could not be
    resolved before the run (a GPU, a cluster's CPU): bf16 where this device multiplies it natively."""
    return torch.bfloat16 if choice == "bf16" or (choice == "auto" and native_bf16(torch.device(device))) else \
        torch.float32


def generator_copy_dtype(cfg: Config, device: torch.device) -> torch.dtype | None:
    """The dtype of the generator's own copy of the policy in this process (rollout.generator_dtype, auto resolved on
    this device: plan/resolve.py decoded_in), or None where the engine has no copy (full fine-tuning decoding the
    fp32 actor itself; a shared base). model.lora: a merged copy, in one process in fp32 too; on a Ray worker only
    in bf16 (in fp32 it decodes the actor through its adapters). Full fine-tuning: a bf16 copy made at each weight
    sync and freed when the rollout ends (DecodeEngine's transient_weights), under auto where the device multiplies
    bf16 natively and the update computes in bf16 anyway, so that the samples' arithmetic is the update's own. A Ray
    worker that decodes makes the same copy as the single process, so that both sample alike."""
    device = torch.device(device)
    if cfg.model.shares_base or engine_choice(cfg, device.type == "cuda")[0] == "vllm":  # vLLM holds its own copy
        return None
    dtype = decode_dtype(decoded_in(cfg, native_bf16(device)), device)
    if cfg.model.lora:
        on_ray = cfg.placement.strategy not in ("single", "auto")
        return None if on_ray and dtype == torch.float32 else dtype
    return torch.bfloat16 if dtype == torch.bfloat16 else None


def dtype_name(dtype: torch.dtype) -> str:
    """bfloat16, float32...: a dtype as a log line names it."""
    return str(dtype).removeprefix("torch.")
