"""What a lower-precision generator could buy on this CPU (issue 28, workload d1): SmolLM2-135M's decode step is bound
by reading its fp32 weights (~540 MB a step, ~3.4 GB/s on the AMD VM), so fewer bytes per weight is the lever. This
times one decode step's matrix shapes (q/k/v/o and the MLP of a block, and the LM head) at 16 and 64 rows in fp32,
bf16 and int8 (torch's dynamic quantisation: fbgemm int8 weights, activations quantised per call), one thread, and
the int8 result's error against fp32.

    python -m bench.decode_precision        # about a minute

Nothing in rlfuse decodes in bf16 or int8 yet: this is the measurement that decides whether it should, on which
hardware. Written to docs/benchmarks/decode_step.md (section decode_precision).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from bench.common import machine, md_table, write_section

# SmolLM2-135M: hidden 576, 9 heads of 64 (3 KV heads: 192), MLP 1536, vocabulary 49152, 30 blocks
SHAPES = {"q/o projection 576x576": (576, 576), "k/v projection 576x192": (576, 192),
          "gate/up 576x1536": (576, 1536), "down 1536x576": (1536, 576), "LM head 576x49152": (576, 49152)}
PER_STEP = {"q/o projection 576x576": 2 * 30, "k/v projection 576x192": 2 * 30, "gate/up 576x1536": 2 * 30,
            "down 1536x576": 30, "LM head 576x49152": 1}
"""How many of each a decode step runs (30 blocks, one LM head)."""


def seconds(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        runs.append((time.perf_counter() - t) / reps)
    return statistics.median(runs)


def measure(rows: int, k: int, n: int) -> dict:
    torch.manual_seed(0)
    x, linear = torch.randn(rows, k), torch.nn.Linear(k, n, bias=False)
    with warnings.catch_warnings():  # torch.ao's deprecation notice (its successor, torchao, is not a dependency)
        warnings.simplefilter("ignore")
        int8 = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear},
                                                      dtype=torch.qint8)
    x16, w16 = x.bfloat16(), linear.weight.detach().bfloat16()
    reps = max(3, int(2e7 // (k * n)))
    with torch.no_grad():
        want = linear(x)
        err = float((int8(x) - want).abs().max() / want.abs().max())
        return {"fp32": seconds(lambda: linear(x), reps),
                "bf16": seconds(lambda: torch.nn.functional.linear(x16, w16), reps),
                "int8": seconds(lambda: int8(x), reps), "int8_error": err}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.decode_precision", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows_out, steps = [], {}
    for rows in (16, 64):
        for name, (k, n) in SHAPES.items():
            m = measure(rows, k, n)
            for dtype in ("fp32", "bf16", "int8"):
                steps[rows, dtype] = steps.get((rows, dtype), 0.0) + PER_STEP[name] * m[dtype]
            rows_out.append([rows, name, f"{m['fp32'] * 1e3:.2f}", f"{k * n * 4 / m['fp32'] / 1e9:.1f}",
                             f"{m['bf16'] * 1e3:.2f}", f"{m['fp32'] / m['bf16']:.2f}x", f"{m['int8'] * 1e3:.2f}",
                             f"{m['fp32'] / m['int8']:.2f}x", f"{m['int8_error']:.3f}"])
    table = md_table(["rows", "matrix", "fp32 ms", "fp32 weight GB/s", "bf16 ms", "bf16 speed-up", "int8 ms",
                      "int8 speed-up", "int8 max error / max |output|"], rows_out)
    sums = "; ".join(f"{rows} rows: fp32 {steps[rows, 'fp32'] * 1e3:.0f} ms, bf16 {steps[rows, 'bf16'] * 1e3:.0f} ms, "
                     f"int8 {steps[rows, 'int8'] * 1e3:.0f} ms" for rows in (16, 64))
    text = (f"Command: `python -m bench.decode_precision` (one thread; median of 5 timings). Machine: {machine()}.\n\n"
            f"{table}\n\nA decode step's matrix multiplies summed (30 blocks and the LM head, attention and the rest "
            f"left out): {sums}.")
    print(text)
    if not args.no_write:
        write_section("decode_precision", text, "decode_step")


if __name__ == "__main__":
    main()
