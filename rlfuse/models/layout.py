"""The memory layout of the generator copy's weight matrices (rollout.weight_layout). A decode step multiplies a few
rows (the live samples) by every weight matrix; on some CPUs the BLAS reads a matrix stored as nn.Linear keeps it,
(out, in) row-major, far slower at such row counts than the same matrix stored (in, out): on an AVX512 Xeon VM
(2026-11-28), 16 rows by SmolLM2's MLP matrices read 3.7 GB/s row-major and 7.1 GB/s column-major, and the engine
decoded 16 rows x 64 tokens in 7.8-8.6 against 13.0-14.2 s; at 4 rows and at 64 and more the row-major layout was
as fast or faster (`python -m bench.small_gemm --real`). Which layout wins is the BLAS's and the CPU's, so `auto`
measures it once, on matrices of the model's own shapes, at the row counts the engine will decode. The weights keep
their shape and values (a column-major matrix is the transposed view of a contiguous (in, out) tensor): modules, state
dicts and weight syncs (copy_ into the parameter) see no difference.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from rlfuse.config import Config
from rlfuse.models.lean import is_swiglu_mlp, runs_stock, single_lora_adapter

PROBE_BYTES = 96 * 2**20
"""Bytes of matrices the probe multiplies per pass: more than a CPU's last-level cache holds, as the model's do."""


def column_major(model: torch.nn.Module) -> int:
    """Store every nn.Linear weight of `model` column-major (the transpose of a contiguous (in, out) tensor), in
    place; tied weights are one parameter, converted once. Returns how many were converted."""
    done = set()
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and w is not None and id(w) not in done and w.dim() == 2:
            w.data = w.data.t().contiguous().t()
            done.add(id(w))
    return len(done)


def layout_of(model: torch.nn.Module) -> str:
    """"column" where the model's nn.Linear weights are stored column-major (column_major), else "row"."""
    w = next((m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)), None)
    return "column" if w is not None and w.dim() == 2 and w.stride(0) == 1 and w.shape[1] > 1 else "row"


TRANSPOSED_MAX_ROWS = 48
"""The most rows a decode step multiplies as W @ h^T (multiplies_transposed): on the AVX512 Xeon VM, 16 rows by
SmolLM2's MLP matrices read 11.6-11.8 GB/s that way against 4.0 through F.linear, 32 rows 8.5 against 3.6, 48 rows 6.8
against 3.0, and from 64 rows on the two are even (3.3-3.5 GB/s, where the multiply is no longer bound by reading)."""


def multiplies_transposed(module, rows: int) -> bool:
    """Whether a decode step over `rows` rows multiplies `module` as W @ h^T (transposed_product) rather than
    h @ W^T (F.linear): a plain nn.Linear with its fp32 weight on the CPU, stored as nn.Linear keeps it ((out, in),
    row-major), at up to TRANSPOSED_MAX_ROWS rows; or peft's LoRA layer over one, unmerged, with one active adapter
    of the base's dtype and device whose dropout is off (eval mode, or p = 0), or with the adapters switched off (a
    shared base decoding as the actor, or as the reference); no forward hooks and no forward of its own on any of
    them (what they would do is not ours to skip). At a decode step's few rows MKL reads such a weight 2-3x faster
    in the first form than in the second, and faster than the same weight stored column-major
    (rollout.weight_layout=column) in the second: on an AVX512 Xeon VM (2026-11-28), 16 rows by SmolLM2's matrices
    at 8-12 GB/s against 2.7-4.0 and 6.8-8.9; the engine decoded 16 rows x 64 tokens in 6.6-7.8 s against 11.6-12.8
    through F.linear and 7.1-7.7 column-major (`python -m bench.small_gemm --real`). A column-major, bf16 (not
    measured on hardware that multiplies it natively) or quantised weight, or one on a GPU, keeps its module's own
    forward."""
    return transposed_product(module, rows) is not None


LORA_LAYERS = ("peft.tuners.lora.layer.Linear", "rlfuse.models.lora_linear.FusedLoraLinear")
"""peft's LoRA linear and ours (the same layer with a fused training forward), by name: importing peft here would
cost every process that decodes 2.5 s (models/load.py apply_lora)."""


class TransposedProduct:
    """module(h)^T from h^T (in, R), as (out, R): W @ h^T plus the bias, and a LoRA adapter's term as
    (B @ (A @ h^T)) x scaling, added as peft adds it. The tensors are read once, when the step builds it."""

    __slots__ = ("module", "weight", "bias", "adapter")

    def __init__(self, module, weight: Tensor, bias: Tensor | None, adapter):
        self.module, self.weight, self.bias, self.adapter = module, weight, bias, adapter

    def __call__(self, ht: Tensor) -> Tensor:
        w = self.weight
        out = torch.mm(w, ht) if self.bias is None else torch.addmm(self.bias[:, None], w, ht)
        if self.adapter is not None:
            a, b, scaling = self.adapter
            out = out + torch.mm(b, torch.mm(a, ht)) * scaling
        return out


def transposed_product(module, rows: int) -> TransposedProduct | None:
    """The product a decode step over `rows` rows computes for `module` as W @ h^T, where multiplies_transposed
    allows it; None where the module runs its own forward."""
    if rows > TRANSPOSED_MAX_ROWS or not runs_stock(module):
        return None
    base, adapter = module, None
    if hasattr(module, "lora_A"):
        base = getattr(module, "base_layer", None)
        if _class_name(module) not in LORA_LAYERS or module.merged or not runs_stock(base):
            return None
        if not module.disable_adapters:
            adapter = single_lora_adapter(module)
            if adapter is None or not all(map(_plain_fp32_cpu, adapter[:2])):
                return None
    w = getattr(base, "weight", None)
    if not (type(base) is torch.nn.Linear and _plain_fp32_cpu(w) and w.is_contiguous()):
        return None
    return TransposedProduct(module, w, base.bias, adapter)


class PackedProduct:
    """h @ W^T (+ bias) for h (..., in) in bf16 on the CPU, from W reordered once into oneDNN's blocked layout
    (torch.ops.mkldnn._reorder_linear_weight, the packing inductor's CPU freezing gives a bf16 Linear). F.linear hands
    oneDNN the plain row-major matrix, which it reorders at every call: a decode step, whose weights come from memory
    rather than cache, reads each twice. On a 2-core Xeon with AMX (2026-12-02), SmolLM2's 211 matrices multiplied by
    16 rows took 17.0-18.9 ms a pass packed against 23.1-25.6 through F.linear (64 rows: 20.9-22.5 against 32.3), with
    the same values to the bit (`/work`-style sweep in docs/systems.md)."""

    __slots__ = ("packed", "bias")

    def __init__(self, weight: Tensor, bias: Tensor | None):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size=16)  # a hint only
        self.bias = None if bias is None else bias.detach()

    def __call__(self, h: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(h, self.packed, self.bias, "none", [], "")


def packs_bf16() -> bool:
    """Whether this torch build's oneDNN multiplies bf16 on this CPU natively, with the packing ops PackedProduct
    calls."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise") and bool(mkldnn._is_mkldnn_bf16_supported()))


def packed_product(module) -> PackedProduct | None:
    """A decode step's product for `module` from a packed weight (PackedProduct): a plain nn.Linear whose weight and
    bias are contiguous bf16 CPU tensors, with no hook (runs_stock), where oneDNN packs bf16 (packs_bf16); None
    otherwise (the module's forward, or its transposed product, runs)."""
    w, b = getattr(module, "weight", None), getattr(module, "bias", None)
    if type(module) is not torch.nn.Linear or not runs_stock(module):
        return None
    if not all(t is None or (type(t) in (torch.nn.Parameter, Tensor) and t.device.type == "cpu"
                             and t.dtype == torch.bfloat16 and t.is_contiguous()) for t in (w, b)):
        return None
    return PackedProduct(w, b) if packs_bf16() else None


def _plain_fp32_cpu(t) -> bool:
    """An fp32 CPU tensor or parameter, not a tensor subclass (a DTensor, a quantised weight dressed as fp32), whose
    own mm would differ from its module's forward."""
    return type(t) in (torch.nn.Parameter, Tensor) and t.device.type == "cpu" and t.dtype == torch.float32


def _class_name(module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


LLAMA_STYLE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def has_llama_decode_step(model) -> bool:
    """Whether the engine decodes `model` with its Llama-family step (rollout/kv.py LlamaDecodeStep), the one that
    multiplies as multiplies_transposed says: Llama, Qwen2 or Mistral without a sliding window. Any other
    architecture decodes through F.linear (GPT-2's step, transformers' forward)."""
    cfg = getattr(model, "config", None)
    if type(model).__name__ not in LLAMA_STYLE_ARCHITECTURES or cfg is None:
        return False
    sliding = getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True)
    return not sliding and getattr(cfg, "pretraining_tp", 1) == 1


def multiplies_mlp_transposed(model) -> bool:
    """Whether the engine's decode step multiplies `model`'s MLP matrices (the shape the probe times, mlp_shape) as
    W @ h^T: the Llama-family step over a SwiGLU MLP (the step runs any other MLP through its own forward)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return has_llama_decode_step(model) and bool(layers) and is_swiglu_mlp(layers[0].mlp)


def fastest_seconds(fn, reps: int = 3) -> float:
    """The fastest of `reps` calls of fn, in seconds."""
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def faster_layout(out_features: int, in_features: int, rows: list[int], dtype: torch.dtype,
                  transposed_step: bool) -> str:
    """"row" or "column": the layout in which the decode step multiplies `rows` rows by (out, in) matrices of
    `dtype` in less time, summed over the row counts given, on this CPU with its torch threads (0.6-0.8 s for
    SmolLM2). Column-major goes through F.linear; row-major as W @ h^T where a `transposed_step` (the Llama-family
    step over a SwiGLU MLP, multiplies_mlp_transposed) would take it (multiplies_transposed), else through F.linear
    too."""
    row_bytes = in_features * torch.finfo(dtype).bits // 8
    out_features = min(out_features, PROBE_BYTES // row_bytes)  # a matrix larger than the probe: a slab of it
    n = max(1, PROBE_BYTES // (out_features * row_bytes))
    gen = torch.Generator().manual_seed(0)
    row = [torch.randn(out_features, in_features, generator=gen).to(dtype) for _ in range(n)]
    col = [w.t().contiguous().t() for w in row]
    total = {"row": 0.0, "column": 0.0}
    for r in rows:
        x = torch.randn(r, in_features, generator=gen).to(dtype)
        xt = x.t().contiguous()
        transposed = transposed_step and multiplies_transposed(torch.nn.Linear(1, 1, bias=False, dtype=dtype), r)
        products = {"row": (lambda w: torch.mm(w, xt)) if transposed else (lambda w: F.linear(x, w)),
                    "column": lambda w: F.linear(x, w)}
        for name, ws in (("row", row), ("column", col)):
            products[name](ws[0])  # warm-up
            total[name] += fastest_seconds(lambda: [products[name](w) for w in ws])
    return "column" if total["column"] < 0.95 * total["row"] else "row"  # a clear win only


def decode_rows(batch: int) -> list[int]:
    """The row counts a decode of `batch` samples spends its steps at, for the probe: the batch, then halves as
    samples finish (at most 4 counts)."""
    rows = [batch]
    while rows[-1] > 1 and len(rows) < 4:
        rows.append((rows[-1] + 1) // 2)
    return rows


def mlp_shape(model: torch.nn.Module) -> tuple[int, int]:
    """(out, in) of the model's most common nn.Linear weight shape by bytes: the matrices a decode step mostly reads."""
    by_shape: dict[tuple[int, int], int] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dim() == 2:
            shape = tuple(module.weight.shape)
            by_shape[shape] = by_shape.get(shape, 0) + module.weight.numel()
    return max(by_shape, key=by_shape.get)


def generator_layout(cfg: Config, device, generator: torch.nn.Module) -> str:
    """rollout.weight_layout resolved for this generator copy: "row" or "column". auto measures (faster_layout) on a
    CPU, for a copy whose weights outgrow a cache (PROBE_BYTES), at the rows the
    engine starts an iteration with (rl.prompts_per_iter x rl.k, at most rollout.max_rows) and as they halve."""
    choice = cfg.rollout.weight_layout
    if choice != "auto":
        return choice
    weights = sum(p.numel() * p.element_size() for p in generator.parameters())
    if torch.device(device).type != "cpu" or weights < PROBE_BYTES:
        return "row"
    batch = min(cfg.rl.prompts_per_iter * cfg.rl.k, cfg.rollout.max_rows)
    dtype = next(generator.parameters()).dtype
    return faster_layout(*mlp_shape(generator), decode_rows(batch), dtype, multiplies_mlp_transposed(generator))


def kept_layout(path: Path, cfg: Config) -> str | None:
    """A resumed run's layout as its start kept it (keep_layout) where rollout.weight_layout is auto: the layouts'
    matmuls differ in the last bits, and the samples with them, so the run decodes on as it began. An explicit layout
    given on resume is taken as given (None)."""
    if cfg.rollout.weight_layout != "auto" or not path.exists():
        return None
    return path.read_text().strip()


def keep_layout(path: Path, generator: torch.nn.Module | None) -> None:
    """Write the generator copy's layout (layout_of) to `path`, for a resumed run (kept_layout)."""
    if generator is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(layout_of(generator) + "\n")
