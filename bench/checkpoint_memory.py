"""What activation checkpointing costs and saves in one training micro-batch of the real model (issue 28, workload d1's
memory): SmolLM2-135M-Instruct's body, forward and backward over 4 sequences of 230 tokens (d1's micro-batch of 4
completions with their prompt), four ways: nothing recomputed through transformers' forward, nothing recomputed with
lean SwiGLU MLPs and RMSNorms (model.lean_activations, rlfuse's default: a MLP keeps 2 of its 4 ffn-wide tensors), each
layer's MLP recomputed (its activations are most of a layer's: ffn 1536 against 576-wide attention values), and whole
layers recomputed (transformers' gradient checkpointing, what rl.gradient_checkpointing=true and TRL's default run). Each way in a
process of its own; the figures are the peak RSS above the steps' start (gradients already allocated) and the
fastest of three timed steps after a first.

    python -m bench.checkpoint_memory       # about 3 minutes; writes docs/benchmarks/vs_trl.md (checkpoint_memory)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from bench.common import ROOT, machine, md_table, peak_rss_mb, reset_peak_rss, rss_mb, write_section

MODES = {"none": "nothing recomputed, transformers' forward (model.lean_activations=false)",
         "lean": "nothing recomputed, lean MLPs and norms (model.lean_activations, rlfuse's default)",
         "mlp": "each layer's MLP recomputed (with lean norms)",
         "full": "whole layers recomputed (gradient checkpointing; lean inside)"}


def child(mode: str, rows: int, tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from rlfuse.models.build import enable_gradient_checkpointing
    from rlfuse.models.gguf import local_model
    from rlfuse.models.lean import enable_lean_activations
    from rlfuse.models.quantize import fix_cpu_heap

    fix_cpu_heap("cpu")  # as every rlfuse model load on a CPU
    model = AutoModelForCausalLM.from_pretrained(local_model("smollm2-135m-instruct"), dtype=torch.float32).train()
    if mode != "none":  # rlfuse's default since model.lean_activations; prepare_trainable's order
        enable_lean_activations(model)
    if mode in ("mlp", "full"):  # what rl.gradient_checkpointing=true with rl.checkpoint_scope=layer|mlp runs
        enable_gradient_checkpointing(model, scope="mlp" if mode == "mlp" else "layer")
    torch.manual_seed(0)
    ids = torch.randint(100, 40000, (rows, tokens))

    def step():  # the body alone: rlfuse's LM-head pass is chunked and the same in every mode
        model.model(input_ids=ids).last_hidden_state.pow(2).mean().backward()
        model.zero_grad(set_to_none=False)

    step()
    start = rss_mb()
    reset_peak_rss()
    seconds = []
    for _ in range(3):
        t = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - t)
    return {"seconds": min(seconds), "peak_above_start_mb": peak_rss_mb() - start}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.checkpoint_memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=230)
    ap.add_argument("--child", choices=sorted(MODES))
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.rows, a.tokens)))
        return
    out = {}
    for mode in MODES:
        run = subprocess.run([sys.executable, "-m", "bench.checkpoint_memory", "--child", mode, "--rows", str(a.rows),
                              "--tokens", str(a.tokens)], cwd=ROOT, capture_output=True, text=True, check=True)
        out[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    none = out["none"]
    rows = [[MODES[m], f"{r['peak_above_start_mb']:.0f}", f"{r['peak_above_start_mb'] / none['peak_above_start_mb']:.2f}",
             f"{r['seconds']:.2f}", f"{r['seconds'] / none['seconds']:.2f}"] for m, r in out.items()]
    text = (f"Command: `python -m bench.checkpoint_memory` (SmolLM2-135M-Instruct's body, {a.rows} x {a.tokens} tokens, "
            f"forward + backward, fp32; each mode in its own process; the fastest of 3 steps). Machine: {machine()}.\n\n"
            + md_table(["what is recomputed", "peak RSS above the step's start (MiB)", "vs none", "step s", "vs none"],
                       rows))
    print(text)
    if not a.no_write:
        write_section("checkpoint_memory", text, page="vs_trl")


if __name__ == "__main__":
    main()
