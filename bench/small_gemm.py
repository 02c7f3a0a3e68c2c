"""Why a decode step on this CPU is slow: the rate at which a matrix multiply with few rows reads its weights.
60 random (1536, 576) fp32 matrices (212 MB, SmolLM2's MLP shape, more than the caches hold) multiplied by an
(M, 576) input, as a decode step at M live rows does, against a plain streaming read of the same bytes (`sum`),
the same matrices stored column-major (the transposed view of a contiguous (576, 1536) tensor: what
rollout.weight_layout=column does to the generator copy, rlfuse/models/layout.py), the row-major matrices multiplied
as W @ x^T (what the Llama decode step does with them, rlfuse/models/layout.py transposed_product), and MKL's
packed GEMM (`torch.ops.mkl._mkl_linear`, the path inductor's CPU freezing takes) packed for 16 rows.

    python -m bench.small_gemm          # under a minute; prints, writes nothing
    python -m bench.small_gemm --real   # also SmolLM2-135M-Instruct's engine decoding 2 prompts x 8 samples x 64
                                        # tokens: row-major weights through F.linear and as W @ x^T, and
                                        # column-major ones, alternated (~3 min)
    python -m bench.small_gemm --lora   # also the same engine decoding through peft's LoRA layers (rank 16 on
                                        # every projection, unmerged: a shared base as the actor), F.linear
                                        # against W @ x^T (~2 min)
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from bench.common import machine
from rlfuse.models.layout import fastest_seconds as fastest


def engine_layouts(rounds: int = 2, new_tokens: int = 64, lora: bool = False) -> None:
    """The real model's engine (rlfuse.rollout.engine.DecodeEngine, its lean Llama decode step) decoding 2 prompts
    of 98 tokens x k = 8 samples x new_tokens (no EOS: every row runs to the limit), its weights row-major (nn.Linear's
    own) through F.linear and as W @ x^T (the step's default for them), and column-major
    (rlfuse.models.layout.column_major) through F.linear, alternated."""
    from rlfuse.models.gguf import local_model
    from rlfuse.models.layout import column_major
    from rlfuse.models.load import load_causal_lm
    from rlfuse.rollout import kv
    from rlfuse.rollout.engine import DecodeEngine
    from rlfuse.rollout.state import SamplingParams

    model = load_causal_lm(str(local_model("smollm2-135m-instruct"))).eval().requires_grad_(False)
    if lora:  # a shared base decoding as the actor: peft's LoRA layers (rank 16 on every projection), unmerged
        from rlfuse.config import load_config
        from rlfuse.models.load import apply_lora

        peft_model = apply_lora(model, load_config(None, ["model.lora=true", "model.lora_r=16"]).model)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.01)
        model = peft_model.get_base_model().eval().requires_grad_(False)
    prompts = [torch.randint(100, 40000, (98,)).tolist() for _ in range(2)]
    engine = DecodeEngine(model, eos_token_id=-1, max_rows=64)
    transposed = kv.transposed_product
    try:
        for _ in range(rounds):
            names = ("row-major through F.linear", "row-major as W @ x^T", "column-major through F.linear")
            for name in names[:2] if lora else names:
                for module in model.modules():
                    if isinstance(module, torch.nn.Linear):
                        module.weight.data = module.weight.data.contiguous()
                if name.startswith("column"):
                    column_major(model)
                kv.transposed_product = transposed if "W @ x^T" in name else (lambda module, rows: None)
                start = time.perf_counter()
                samples = list(engine.generate(prompts, 8, SamplingParams(new_tokens), 7))
                print(f"engine, {'LoRA adapters on ' if lora else ''}weights {name}: "
                      f"{time.perf_counter() - start:.2f} s for {len(samples)} rows x {new_tokens} tokens")
    finally:
        kv.transposed_product = transposed


def main() -> None:
    import sys

    torch.manual_seed(0)
    weights = [torch.randn(1536, 576) for _ in range(60)]
    gb = sum(w.numel() for w in weights) * 4 / 1e9
    print(f"machine: {machine()}")
    print(f"streaming read (sum): {gb / fastest(lambda: [w.sum() for w in weights]):.1f} GB/s")
    columns = [w.t().contiguous().t() for w in weights]
    packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, 16) for w in weights]
    print(f"MKL packed weight: {packed[0].numel() / weights[0].numel():.1f}x the bytes of the weight")
    for rows in (1, 4, 13, 16, 32, 48, 64, 256):
        x = torch.randn(rows, 576)
        s = fastest(lambda: [F.linear(x, w) for w in weights])
        c = fastest(lambda: [F.linear(x, w) for w in columns])
        xt = x.t().contiguous()
        t = fastest(lambda: [torch.mm(w, xt) for w in weights])
        p = fastest(lambda: [torch.ops.mkl._mkl_linear(x, q, w, None, 16) for q, w in zip(packed, weights)])
        print(f"{rows:4d} rows: F.linear reads {gb / s:5.1f} GB/s ({2 * rows * gb / 4 / s:6.1f} GFLOP/s); "
              f"column-major {gb / c:5.1f} GB/s ({s / c:.2f}x); W @ x^T {gb / t:5.1f} GB/s ({s / t:.2f}x); "
              f"MKL packed for 16 rows {gb / p:5.1f} GB/s")
    if "--real" in sys.argv[1:]:
        engine_layouts()
    if "--lora" in sys.argv[1:]:
        engine_layouts(lora=True)


if __name__ == "__main__":
    main()
