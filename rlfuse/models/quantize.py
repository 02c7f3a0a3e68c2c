"""Quantised base weights through bitsandbytes (model.quantization): the from_pretrained arguments, the compute dtype
from run.precision, and the way back to full-precision weights (merged saves, a separate generator's copy).

bitsandbytes 0.50 runs NF4 and int8 layers on CPU as well as on GPU, so everything here is tested on CPU."""

from __future__ import annotations

import ctypes
from contextlib import contextmanager

import torch
from transformers import BitsAndBytesConfig

from rlfuse.errors import UserError
from rlfuse.models.device import native_bf16
from rlfuse.plan.cost import CPU_HEAP_THRESHOLDS, UPDATE_HEAP_THRESHOLDS  # the planner prices their faults

# Heads stay in full precision: the reward model's score head is trained (modules_to_save), and GPT-2's LM head is
# the (tied) embedding. transformers' own default skips only the output embedding.
SKIP_MODULES = ["lm_head", "score"]


def compute_dtype(precision: str, device) -> torch.dtype:
    """The dtype quantised layers compute in: run.precision, where auto is bf16 where the hardware multiplies it
    natively (device.native_bf16: a GPU with bf16, a CPU with AVX512-BF16 or AMX, as SFT's and RM's autocast), else
    fp32."""
    if precision == "auto":
        return torch.bfloat16 if native_bf16(torch.device(device)) else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def bnb_config(quantization: str, precision: str = "auto", device="cpu"):
    """transformers' BitsAndBytesConfig for model.quantization (none -> None): 4bit is QLoRA's NF4 with double
    quantisation (the quantisation constants quantised too: ~0.4 bit per weight saved)."""
    if quantization == "none":
        return None
    require_bitsandbytes(f"model.quantization={quantization}")

    if quantization == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute_dtype(precision, device),
                                  llm_int8_skip_modules=SKIP_MODULES)
    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=SKIP_MODULES)


def require_bitsandbytes(what: str) -> None:
    """A UserError naming the setting when bitsandbytes is not installed."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise UserError(f"{what} needs bitsandbytes, which is not installed; pip install -e .[qlora] (or pip install "
                        "bitsandbytes), or turn the setting off") from None


def quantized_load_kwargs(quantization: str, precision: str = "auto", device="cpu") -> dict:
    """Extra from_pretrained arguments: bitsandbytes quantises while loading, onto `device` (a quantised model is not
    moved afterwards: see place)."""
    q = bnb_config(quantization, precision, device)
    if q is None:
        return {}
    device = torch.device(device)
    where = device.index if device.type == "cuda" and device.index is not None else (0 if device.type == "cuda" else "cpu")
    # disable_mmap: read the checkpoint into memory rather than map it. Mapped, the quantised model kept the whole
    # full-precision file resident (RSS) for its lifetime: 173 MB beside 27 MB of 4-bit weights for a 6x768 GPT-2
    return {"quantization_config": q, "device_map": {"": where}, "disable_mmap": True}


FIX_CPU_HEAP = True
"""Whether a model load on the CPU fixes glibc's thresholds (python -m bench.memory --glibc-arm turns it off)."""
TRIM_CPU_HEAP = True
"""Whether trim_cpu_heap trims (a benchmark's arm without it sets it False)."""
_heap_policy = "lean"
_heap_threshold = None  # the mmap threshold fixed in this process; None: glibc's own
_libc = None


def choose_cpu_heap(policy: str) -> None:
    """run.cpu_heap for this process (lean | update | reuse, config/sections.py): the thresholds fix_cpu_heap sets at
    the next CPU model load, or now where an earlier load fixed another policy's. Trainers and training workers call
    it before they load a model."""
    global _heap_policy
    _heap_policy = policy
    if _heap_threshold is not None:
        fix_cpu_heap("cpu")


def fix_cpu_heap(device="cpu") -> bool:
    """Fix glibc's mmap and trim thresholds where run.cpu_heap (choose_cpu_heap) puts them, so that freed tensors'
    pages go back to the OS or stay for reuse as chosen rather than as glibc's moving threshold falls. glibc's mmap
    threshold grows to the size of the largest freed mapping (up to 32 MiB), after which such buffers come from the
    heap, whose freed pages stay resident and fragment: on the CPU every 4-bit matmul dequantises its layer's weight
    to fp32 (MBs) and frees it (RSS grew by GBs on a 0.5B model), and a full-precision update's activations and logit
    chunks are the same churn (SmolLM2 RLOO, workload d1 of bench/vs_trl.py: peak RSS 4600 MiB with the thresholds
    fixed against 5130 without, the same iteration time). lean (1 MiB, the default) keeps every allocation of 1 MiB
    or more an mmap of its own, unmapped when freed, and trims the heap top above twice that; reuse (32 MiB) serves
    a micro-batch's activations from the heap, whose pages the next one reuses instead of faulting them in afresh
    (plan/cost.py CPU_HEAP_THRESHOLDS). Linux/glibc on the CPU only (a GPU's tensors are CUDA allocations). Returns
    whether the thresholds are fixed in this process (by this call or an earlier one)."""
    global _heap_threshold, _libc
    threshold = CPU_HEAP_THRESHOLDS[_heap_policy]
    if _heap_threshold == threshold or not FIX_CPU_HEAP or torch.device(device).type != "cpu":
        return _heap_threshold is not None
    libc = None
    try:
        libc = ctypes.CDLL("libc.so.6")
        fixed = _set_thresholds(libc, threshold)
    except (OSError, AttributeError):  # not glibc (macOS, Windows, musl without mallopt)
        fixed = False
    _heap_threshold = threshold if fixed else None
    _libc = libc if fixed and hasattr(libc, "malloc_trim") else None
    return fixed


@contextmanager
def update_heap():
    """An update's micro-batches under run.cpu_heap=update: glibc's mmap threshold raised to
    UPDATE_HEAP_THRESHOLDS' while they run, so a micro-batch's tensors under it come from the heap and reuse the
    pages the previous one freed, then lean's again and the heap's free pages handed back (malloc_trim) before the
    rollout. What it buys is the weight-sized tensors a full fine-tuning micro-batch makes afresh (SmolLM2 GRPO on a
    2-core AMD EPYC VM, `python -m bench.vs_trl --workloads d3 --rlfuse-update-heap`: iteration 10.8 s lean, 7.4 s
    so; peak RSS 3514 and 3710 MiB). Does nothing under the other policies or where the thresholds are not fixed."""
    if _libc is None or _heap_policy != "update":
        yield
        return
    inside = UPDATE_HEAP_THRESHOLDS["update"]
    _set_thresholds(_libc, inside)
    try:
        yield
    finally:
        _set_thresholds(_libc, CPU_HEAP_THRESHOLDS["update"])
        _libc.malloc_trim(0)


def _set_thresholds(libc, threshold: int) -> bool:
    """glibc's mmap threshold at `threshold` and its trim threshold at twice it."""
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 * threshold))


def trim_cpu_heap() -> bool:
    """Hand the pages of the C heap's free chunks back to the OS (glibc malloc_trim), where fix_cpu_heap fixed the
    thresholds (glibc, a model on the CPU). The fixed thresholds send only buffers of the mmap threshold or more to
    mmap; an update's many smaller tensors (per-head and per-row pieces, the LoRA paths' rank-wide ones) come from
    the heap's arenas, whose freed pages stay resident around the chunks still in use: on SmolLM2 LoRA RLOO (bench
    vs_trl d2) the floor between micro-batches rose from 1.6 to 2.4 GB after the first update, and the run's peak
    with it. Trimmed before each training micro-batch (learn/update.py), a micro-batch starts from the idle
    footprint (python -m bench.phase_memory --trim measured it: 2300-2400 -> 1590 MiB at each micro-batch). Not
    before the generation: its decode steps' small tensors would fault the pages back in, one step at a time.
    Only under run.cpu_heap=lean: reuse keeps those pages for the next micro-batch. Returns whether it ran."""
    if _libc is None or not TRIM_CPU_HEAP or _heap_policy != "lean":
        return False
    _libc.malloc_trim(0)
    return True


def keep_one_cpu_layout(model: torch.nn.Module) -> torch.nn.Module:
    """Stop bitsandbytes from repacking 4-bit weights for its CPU inference kernel (on CPUs with AVX512-BF16, on the
    first no-grad eval forward). That kernel computes in bf16 whatever the compute dtype, so the scorer's reference
    log-probs and rewards would come from other arithmetic than the update's (logits 2e-3 apart on a tiny Llama: the
    PPO ratio is no longer 1 on fresh samples), and the repacked layout does not dequantise back to the weights
    (0.14 off), which the generator sync and the saved model read. Returns the model."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def is_quantized(model: torch.nn.Module) -> bool:
    return any(quantized_layer(m) for m in model.modules())


def quantized_layer(module: torch.nn.Module) -> bool:
    try:
        import bitsandbytes as bnb  # an optional install (the qlora extra)
    except ImportError:
        return False
    return isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))


def place(model: torch.nn.Module, device) -> torch.nn.Module:
    """model.to(device), except for a quantised model, which bitsandbytes loaded onto its device already."""
    return model if is_quantized(model) else model.to(device)


@torch.no_grad()
def dequantized_weight(layer: torch.nn.Module, transpose: bool = False) -> torch.Tensor:
    """The full-precision (fp32) weight of a bitsandbytes Linear4bit / Linear8bitLt, (out, in); transpose gives
    (in, out), the layout of GPT-2's Conv1D, which transformers turns into a Linear when it quantises."""
    w = layer.weight
    if getattr(getattr(w, "quant_state", None), "packing_format_for_cpu", False):  # repacked before keep_one_cpu_layout
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse  # bitsandbytes: optional

        w.data, w.quant_state = _convert_weight_packed_for_cpu_inverse(w.data, w.quant_state)  # as its state_dict does
    from peft.utils.integrations import dequantize_bnb_weight  # deferred: see models/load.py apply_lora

    state = getattr(w, "quant_state", None) if state_is_4bit(layer) else layer.state
    out = dequantize_bnb_weight(w, state).float()
    return out.t().contiguous() if transpose else out


def state_is_4bit(layer) -> bool:
    import bitsandbytes as bnb  # an optional install: only called on a quantised layer

    return isinstance(layer, bnb.nn.Linear4bit)


def conv1d_layout(model) -> bool:
    """GPT-2 keeps its projections as Conv1D, (in, out); quantised they became Linear, (out, in)."""
    config = getattr(model, "config", None)
    return getattr(config, "model_type", "") == "gpt2"
