"""Where a GPU decode step's time goes, at SmolLM2-135M's shape (30 layers x 576, 9 heads / 3 KV heads, vocabulary
49152; random weights, bf16): transformers' forward and rlfuse's lean step (rlfuse/rollout/kv.py) through the engine,
against the same lean step at a fixed shape (a KV buffer of the whole capacity, the written column and the mask as
tensors) run eagerly and replayed as one CUDA graph, and against two floors: the weights' bytes over the measured
memory bandwidth, and the step's matmul FLOPs over the measured bf16 matmul rate.

The question it answers (issue 28): at 16 rows the d1 generation took ~50 ms a step on an H100, 100x the bandwidth
floor. If the graph replay is near the floor, the time is kernel launches and Python, and a graph-replayed decode step
is the engine's lever on a GPU; if the fixed-shape eager step is already fast, it is the engine's per-step work.

    python -m bench.decode_graph            # GPU only, ~1 min; writes docs/benchmarks/decode_step.md's GPU section
    python -m bench.decode_graph --check    # CPU too: the fixed-shape step's logits against transformers' forward
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from bench.common import machine, machine_short, md_table, write_headline, write_section
from rlfuse.rollout.kv import LlamaDecodeStep


def smollm2_shaped(n_layer: int, dtype: torch.dtype, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=n_layer,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                      max_position_embeddings=2048, rope_theta=100000.0)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


class FixedShapeStep:
    """The lean Llama step over a KV buffer of fixed capacity: every tensor it reads keeps its address and shape from
    step to step (the column to write and the mask are tensors), so one CUDA graph replays it."""

    def __init__(self, model, rows: int, capacity: int):
        self.lean = LlamaDecodeStep(model)
        p = next(model.parameters())
        L = len(self.lean.layers)
        self.kv = torch.zeros(L, 2, rows, self.lean.KVH, capacity, self.lean.D, dtype=p.dtype, device=p.device)
        self.last = torch.zeros(rows, dtype=torch.long, device=p.device)
        self.pos = torch.zeros(rows, dtype=torch.long, device=p.device)
        self.column = torch.zeros(1, dtype=torch.long, device=p.device)
        self.mask = torch.zeros(rows, capacity, dtype=torch.bool, device=p.device)
        self.logits: Tensor | None = None

    def forward(self) -> Tensor:
        s = self.lean
        H, D, R = s.H, s.D, self.last.shape[0]
        x = s.embed(self.last)[:, None]
        cos, sin = s.rotary(x, position_ids=self.pos[:, None])
        cos, sin = cos[:, None], sin[:, None]
        mask = self.mask[:, None, None, :]
        for i, layer in enumerate(s.layers):
            a = layer.self_attn
            q, k, v = s.rotated_qkv(a, layer.input_layernorm(x), cos, sin)
            self.kv[i, 0].index_copy_(2, self.column, k)
            self.kv[i, 1].index_copy_(2, self.column, v)
            # a key head's query heads as query positions of one head, as rlfuse/rollout/kv.py's step
            o = F.scaled_dot_product_attention(q.reshape(R, s.KVH, H // s.KVH, D), self.kv[i, 0], self.kv[i, 1],
                                               attn_mask=mask, scale=a.scaling)
            x = x + a.o_proj(o.reshape(R, 1, H * D))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        self.logits = s.lm_head(s.norm(x))[:, 0]
        return self.logits

    def advance(self, step, next_tokens: Tensor) -> None:
        """Inputs of the next step, written in place (outside the graph)."""
        self.last.copy_(next_tokens)
        self.pos.add_(1)
        self.column.add_(1)
        self.mask[:, step + 1] = True


def check(n_layer: int, device: str) -> float:
    """Feed a 6-token sequence one token at a time through the fixed-shape step (fp32); -> the largest difference
    of its last logits from transformers' forward over the whole sequence."""
    model = smollm2_shaped(n_layer, torch.float32, device)
    ids = torch.tensor([[1, 17, 300, 4000, 9, 42]], device=device)
    step = FixedShapeStep(model, rows=1, capacity=16)
    step.mask[:, 0] = True
    with torch.no_grad():
        for t in range(ids.shape[1]):
            step.last.copy_(ids[:, t])
            logits = step.forward()
            if t + 1 < ids.shape[1]:
                step.advance(t, ids[:, t + 1])
        want = model(input_ids=ids).logits[:, -1]
    return float((logits - want).abs().max())


def ms_fixed(model, rows: int, steps: int, graph: bool) -> float:
    step = FixedShapeStep(model, rows, capacity=steps + 8)
    step.last.copy_(torch.arange(rows, device=step.last.device) + 5)
    step.mask[:, 0] = True
    with torch.no_grad():
        if graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    step.forward()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step.forward()
            run = g.replay
        else:
            run = step.forward
        best = float("inf")
        for _ in range(3):
            step.column.zero_(); step.pos.zero_(); step.mask.zero_(); step.mask[:, 0] = True
            torch.cuda.synchronize()
            t = time.perf_counter()
            for s in range(steps):
                run()
                # the engine's per-step host sync (which rows finished) is kept: argmax, then one .item()
                nxt = step.logits.argmax(-1)
                int(nxt[0])
                step.advance(s, nxt)
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t) / steps)
    return 1000 * best


def ms_engine(model, rows: int, steps: int, fast: bool) -> float:
    from bench.decode_step import decode_ms_per_step

    return min(decode_ms_per_step(model, rows, steps, fast, repeats=1) for _ in range(3))


def floors(model, rows: int) -> tuple[float, float]:
    """-> (ms to read every weight once at the measured copy bandwidth, ms for the step's matmuls at the measured
    bf16 matmul rate)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    buf = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    out = torch.empty_like(buf)
    out.copy_(buf); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        out.copy_(buf)
    torch.cuda.synchronize()
    bandwidth = 2 * buf.numel() * 10 / (time.perf_counter() - t)  # read + write
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    a @ a; torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    rate = 2 * 8192 ** 3 * 10 / (time.perf_counter() - t)
    matmul_params = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    matmul_params += model.lm_head.weight.numel()  # tied: the head multiplies by the embedding's matrix
    return 1000 * weights / bandwidth, 1000 * 2 * rows * matmul_params / rate


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.decode_graph", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-layer", type=int, default=30)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--check", action="store_true", help="only the correctness check (any device)")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    diff = check(min(a.n_layer, 4), device)
    print(f"fixed-shape step vs transformers' forward, fp32, 6 tokens one at a time: max |logit diff| {diff:.2e}")
    if a.check:
        return
    if device != "cuda":
        raise SystemExit("bench.decode_graph measures a GPU: no CUDA device here (--check runs on a CPU)")
    t0 = time.time()
    model = smollm2_shaped(a.n_layer, torch.bfloat16, "cuda")
    rows = []
    for r in a.rows:
        hf, lean = ms_engine(model, r, a.steps, False), ms_engine(model, r, a.steps, True)
        fixed, graph = ms_fixed(model, r, a.steps, False), ms_fixed(model, r, a.steps, True)
        bytes_ms, flops_ms = floors(model, r)
        for name, ms in (("engine, transformers' forward", hf), ("engine, lean step", lean),
                         ("fixed-shape lean step, eager", fixed), ("fixed-shape lean step, one CUDA graph", graph)):
            rows.append([r, name, ms, r * 1000 / ms, bytes_ms / ms, flops_ms / ms])
        print(md_table(["rows", "decode step", "ms per step", "tokens/s", "of the bandwidth floor",
                        "of the matmul limit"], rows[-4:]), flush=True)
    text = "\n".join([
        f"Machine: {machine()}", "",
        f"Command: `python -m bench.decode_graph` (SmolLM2-135M's shape, {a.n_layer} layers, random weights, bf16, "
        f"{a.steps} decode steps, best of 3; every row keeps one host sync per step, as the engine does; the fixed-shape "
        f"steps attend over the whole capacity of {a.steps + 8} columns). The fixed-shape step's fp32 logits match "
        f"transformers' forward to {diff:.1e}.", "",
        md_table(["rows", "decode step", "ms per step", "tokens/s", "fraction of the bandwidth floor (weights' bytes / "
                  "copy bandwidth)", "fraction of the bf16 matmul limit"], rows), "",
        f"Wall time: {time.time() - t0:.0f} s.",
    ])
    print(text)
    if a.no_write:
        return
    write_section("decode_graph_gpu", text, page="decode_step")
    by = {(row[0], row[1]): row[2] for row in rows}
    r = max(a.rows)
    write_headline("decode_graph_gpu",
                   f"SmolLM2-135M shape, {r} rows, bf16: {by[(r, 'engine, lean step')]:.1f} ms a step through the engine, "
                   f"{by[(r, 'fixed-shape lean step, one CUDA graph')]:.2f} ms replayed as one CUDA graph",
                   "transformers' forward through the same engine", "python -m bench.decode_graph",
                   machine_short(os.getloadavg()[0]), page="decode_step", what="Decode step on a GPU: CUDA graph")


if __name__ == "__main__":
    main()
