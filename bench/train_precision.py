"""A training micro-batch of the real model in fp32 and under bf16 autocast (run.precision; the RL stage's update and
scoring passes: rlfuse/models/device.py), full fine-tuning and LoRA, alternated in one process: SmolLM2-135M-Instruct
prepared as the RL stage prepares it (lean MLPs and norms, rlfuse's LoRA linears, rank 8 on q/k/v/o/gate/up/down),
one prompt of 98 tokens with 4 replies of 60-128 tokens (workload d2's micro-batch, prefix-shared as collate lays it
out), log-probs forward and backward. Reports each way's median step, its peak above the step's start (gradients
included: 540 MB of them in full fine-tuning), and how far bf16's log-probs and gradients are from fp32's. The
speed is the machine's: on a CPU without AVX512-BF16 or AMX bf16 is emulated (the machine line says which).

    python -m bench.train_precision         # about 3 minutes; writes docs/benchmarks/vs_trl.md (train_precision)
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import machine, md_table, write_section


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.train_precision", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="alternations of fp32 and bf16 per model")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()

    import torch

    from rlfuse.config import load_config
    from rlfuse.metrics.memory import peak_rise
    from rlfuse.models.build import prepare_trainable
    from rlfuse.models.device import native_bf16
    from rlfuse.models.forward import collate, response_logprobs
    from rlfuse.models.gguf import local_model
    from rlfuse.models.load import apply_lora, load_causal_lm

    torch.manual_seed(0)
    prompt = torch.randint(100, 40000, (98,)).tolist()
    replies = [torch.randint(100, 40000, (n,)).tolist() for n in (60, 90, 110, 128)]
    mb = collate([prompt] * 4, replies, 0, "cpu", True)
    rows, notes = [], []
    for lora in (False, True):
        cfg = load_config(None, [f"model.lora={str(lora).lower()}"])
        model = load_causal_lm(local_model("smollm2-135m-instruct"))
        if lora:
            model = apply_lora(model, cfg.model)
            for n, p in model.named_parameters():
                if "lora_B" in n:  # away from zero, as after some training
                    torch.nn.init.normal_(p, std=0.02)
        model = prepare_trainable(model, cfg.rl, False, lean=True)
        out = {}

        def step(bf16: bool):
            model.zero_grad(set_to_none=True)
            t = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                lp = response_logprobs(model, mb)
            lp.sum().backward()
            out["s"], out["lp"] = time.perf_counter() - t, lp.detach()

        seconds = {False: [], True: []}
        peaks = {False: [], True: []}
        for bf16 in (False, True):  # warm-up
            step(bf16)
        for _ in range(a.rounds):
            for bf16 in (False, True):
                peaks[bf16].append(peak_rise(lambda: step(bf16)) / 2**20)
                seconds[bf16].append(out["s"])
                grads = torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])
                out[bf16] = (out["lp"], grads)
        (lp32, g32), (lp16, g16) = out[False], out[True]
        mask = mb.mask.bool()
        gap = float((lp16 - lp32).abs()[mask].mean())
        cos = float(torch.nn.functional.cosine_similarity(g16, g32, 0))
        name = "LoRA" if lora else "full fine-tuning"
        fp32_s = statistics.median(seconds[False])
        for bf16 in (False, True):
            rows.append([name, "bf16 autocast" if bf16 else "fp32", f"{statistics.median(seconds[bf16]):.2f}",
                         f"{fp32_s / statistics.median(seconds[bf16]):.2f}x", f"{statistics.median(peaks[bf16]):.0f}",
                         f"{gap:.4f}" if bf16 else "", f"{cos:.6f}" if bf16 else ""])
        del model
    text = (f"Command: `python -m bench.train_precision` (SmolLM2-135M-Instruct, {torch.get_num_threads()} threads, "
            f"lean MLPs and norms, LoRA rank 8 on q/k/v/o/gate/up/down through rlfuse's LoRA linears; one prompt of "
            f"{len(prompt)} tokens x 4 replies of 60-128 tokens, prefix-shared; log-probs forward + backward; "
            f"{a.rounds} alternated rounds after a warm-up; peak above the step's start, the gradients included). "
            f"bf16 native here: {native_bf16(torch.device('cpu'))} (False: emulated, its speed is not the method's). "
            f"Machine: {machine()}.\n\n"
            + md_table(["model", "precision", "median step s", "speed vs fp32", "peak above start MiB",
                        "mean abs log-prob gap to fp32 (nats)", "gradient cosine to fp32"], rows))
    print(text)
    if not a.no_write:
        write_section("train_precision", text, page="vs_trl")


if __name__ == "__main__":
    main()
