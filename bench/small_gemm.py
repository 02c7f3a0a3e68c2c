"""Why a decode step on this CPU is slow: the rate at which a matrix multiply with few rows reads its weights.
60 random (1536, 576) fp32 matrices (212 MB, SmolLM2's MLP shape, more than the caches hold) multiplied by an
(M, 576) input, as a decode step at M live rows does, against a plain streaming read of the same bytes (`sum`), and
MKL's packed GEMM (`torch.ops.mkl._mkl_linear`, the path inductor's CPU freezing takes) packed for 16 rows.

    python -m bench.small_gemm      # under a minute; prints, writes nothing
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from bench.common import machine


def fastest(fn, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    torch.manual_seed(0)
    weights = [torch.randn(1536, 576) for _ in range(60)]
    gb = sum(w.numel() for w in weights) * 4 / 1e9
    print(f"machine: {machine()}")
    print(f"streaming read (sum): {gb / fastest(lambda: [w.sum() for w in weights]):.1f} GB/s")
    packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, 16) for w in weights]
    print(f"MKL packed weight: {packed[0].numel() / weights[0].numel():.1f}x the bytes of the weight")
    for rows in (1, 4, 13, 16, 64, 256):
        x = torch.randn(rows, 576)
        s = fastest(lambda: [F.linear(x, w) for w in weights])
        p = fastest(lambda: [torch.ops.mkl._mkl_linear(x, q, w, None, 16) for q, w in zip(packed, weights)])
        print(f"{rows:4d} rows: F.linear reads {gb / s:5.1f} GB/s ({2 * rows * gb / 4 / s:6.1f} GFLOP/s); "
              f"MKL packed for 16 rows {gb / p:5.1f} GB/s")


if __name__ == "__main__":
    main()
