"""What one LoRA training micro-batch of the real model holds resident on a CPU, and what glibc's mmap threshold
changes in it (issue 28: smollm2_hh's memory): SmolLM2-135M-Instruct with LoRA (rank 16, every linear) and lean
activations, the policy loss's own path (`response_logprobs` and its backward) over micro-batches of 1, 2, 4 and 8
chat-length sequences (prompts of 160 tokens and 7 fewer for each next row, answers of 48, padded to the longest as
a run pads them), under rlfuse's fixed threshold (1 MiB, models/quantize.fix_cpu_heap), a lower one (128 KiB) and
glibc's own ceiling (32 MiB). Each threshold in a process of its own; per size the peak's rise above its start
(freed heap handed back first, the kernel's high-water mark reset: metrics.memory.peak_rise) against the activations
the memory model counts (plan/memory.train_activation_bytes), and the seconds of the fastest of the repeats run back
to back before (a run's micro-batches follow each other untrimmed: the heap reuses its pages, where a mapping faults
its pages in afresh each time).

    python -m bench.heap        # about 12 minutes on 2 cores; writes docs/benchmarks/plan.md (heap)
    python -m bench.heap --faults   # ~6 minutes: the page faults the planner prices (section heap_faults)

`--faults`: the same forward + backward as a run's update takes it (the heap trimmed before each micro-batch, LoRA or
full fine-tuning, lean activations), at 208 to 832 tokens, timed, its minor page faults counted (ru_minflt), beside
the bytes of fresh mappings the cost model prices for it (plan/cost.py mapped_train_bytes): the step where the
hidden width's tensors reach the 1 MiB threshold (456 tokens on SmolLM2) is what made micro-batches of 4 train
slower per token than micro-batches of 2 in smollm2_hh's runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from bench.common import ROOT, machine, md_table, write_section

THRESHOLDS = {1 << 20: "1 MiB (rlfuse's, fix_cpu_heap)", 128 << 10: "128 KiB",
              32 << 20: "32 MiB (where glibc's own threshold ends up)"}
"""Each threshold's trade at a micro-batch: below rlfuse's, more of the heap is handed back (less resident, more page
faults); above it (glibc's default moves its threshold up to the largest freed mapping, at most 32 MiB: TRL's
process, whose heap is never fixed), the activations come from the heap, reused without faulting but fragmented."""
PROMPT, ANSWER = 160, 48


def child(threshold: int, rows_list: list[int], repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    import rlfuse.models.quantize as quantize
    from rlfuse.config import ModelConfig
    from rlfuse.metrics.memory import peak_rise
    from rlfuse.models.forward import collate, response_logprobs
    from rlfuse.models.gguf import local_model
    from rlfuse.models.lean import enable_lean_activations
    from rlfuse.models.load import apply_lora
    from rlfuse.plan.cost import KNOWN_SHAPES
    from rlfuse.plan.memory import train_activation_bytes

    torch.set_num_threads(1)
    quantize.CPU_HEAP_THRESHOLDS = {**quantize.CPU_HEAP_THRESHOLDS, "lean": threshold}  # this arm's, as run.cpu_heap
    quantize.fix_cpu_heap("cpu")  # as every rlfuse model load on a CPU, at this threshold
    shape = KNOWN_SHAPES["smollm2-135m-instruct"]
    model = AutoModelForCausalLM.from_pretrained(local_model("smollm2-135m-instruct"), dtype=torch.float32)
    model = apply_lora(model, ModelConfig(lora=True, lora_r=16, lora_alpha=32)).train()
    enable_lean_activations(model)
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for rows in [rows_list[0], *rows_list]:  # the first size twice: the first pass pages the weights in
        prompts = [torch.randint(1, shape.vocab, (PROMPT - 7 * i,), generator=gen).tolist() for i in range(rows)]
        answers = torch.randint(1, shape.vocab, (rows, ANSWER), generator=gen).tolist()
        mb = collate(prompts, answers, 0, "cpu")
        step = lambda: response_logprobs(model, mb).sum().backward()
        seconds = []
        for _ in range(repeats + 1):  # timed back to back as a run's micro-batches follow each other: the heap reuses
            model.zero_grad(set_to_none=True)  # its pages (a trim before each would fault them in again every time)
            t = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - t)
        rises = []
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            rises.append(peak_rise(step) - grads)
        out[rows] = {"tokens": rows * (PROMPT + ANSWER), "rise_mb": min(rises) / 2**20, "seconds": min(seconds[1:]),
                     "counted_mb": train_activation_bytes(shape, rows * (PROMPT + ANSWER), 4.0, False, True,
                                                          lean=True) / 2**20}
    return out


FAULT_SIZES = ((1, 208), (2, 208), (4, 100), (4, 208), (8, 100), (2, 400))
"""(rows, tokens a row) of the --faults micro-batches: 208 to 832 tokens, either side of the hidden width's threshold;
each row's last FAULT_ANSWER tokens scored."""
FAULT_ANSWER = 40


def fault_child(kind: str, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    import rlfuse.models.quantize as quantize
    from rlfuse.config import ModelConfig
    from rlfuse.metrics.memory import minor_faults
    from rlfuse.models.forward import collate, response_logprobs
    from rlfuse.models.gguf import local_model
    from rlfuse.models.lean import enable_lean_activations
    from rlfuse.models.load import apply_lora
    from rlfuse.plan.cost import KNOWN_SHAPES, PAGE_BYTES, mapped_train_bytes

    torch.set_num_threads(1)
    quantize.fix_cpu_heap("cpu")
    shape = KNOWN_SHAPES["smollm2-135m-instruct"]
    model = AutoModelForCausalLM.from_pretrained(local_model("smollm2-135m-instruct"), dtype=torch.float32)
    if kind == "lora":
        model = apply_lora(model, ModelConfig(lora=True, lora_r=16, lora_alpha=32))
    model.train()
    enable_lean_activations(model)
    out = {}
    for rows, length in FAULT_SIZES:
        prompts = [[1 + (i * 7 + j) % 400 for j in range(length - FAULT_ANSWER)] for i in range(rows)]
        answers = [[5 + j % 300 for j in range(FAULT_ANSWER)] for _ in range(rows)]
        mb = collate(prompts, answers, 0, "cpu")

        def step():  # as learn/update.py runs a micro-batch
            model.zero_grad(set_to_none=True)
            quantize.trim_cpu_heap()
            response_logprobs(model, mb, 0.7, with_entropy=True)[0].sum().backward()

        step()
        seconds, faults = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            faults.append(minor_faults(step))
            seconds.append(time.perf_counter() - t)
        tokens = rows * length
        out[f"{rows} x {length}"] = {
            "tokens": tokens, "seconds": min(seconds), "faulted_gib": min(faults) * PAGE_BYTES / 2**30,
            "priced_gib": mapped_train_bytes(shape, tokens, rows * FAULT_ANSWER, kind == "lora") / 2**30}
    return out


def faults_report(repeats: int, write: bool) -> None:
    rows = []
    for kind in ("lora", "full"):
        run = subprocess.run([sys.executable, "-m", "bench.heap", "--fault-child", kind, "--repeats", str(repeats)],
                             cwd=ROOT, capture_output=True, text=True, check=True)
        for size, m in json.loads(run.stdout.strip().splitlines()[-1]).items():
            rows.append([kind, size, m["tokens"], f"{m['seconds']:.2f}", f"{m['faulted_gib']:.2f}",
                         f"{m['priced_gib']:.2f}", f"{m['faulted_gib'] / max(m['priced_gib'], 1e-9):.2f}"])
    text = (f"Command: `python -m bench.heap --faults` (SmolLM2-135M-Instruct fp32, LoRA r 16 on every linear or full "
            f"fine-tuning, lean activations, glibc's threshold fixed at 1 MiB and the heap trimmed before each "
            f"micro-batch, as a run's update; the policy loss's forward + backward with entropy, the last "
            f"{FAULT_ANSWER} tokens of each row scored; the least of {repeats} repeats). Faulted: minor page faults "
            f"x 4 KiB; priced: plan/cost.py mapped_train_bytes (a fully trained model's weight gradients, about 0.5 "
            f"GiB fresh each step, not in it). Machine: {machine()}.\n\n"
            + md_table(["training", "micro-batch", "tokens", "seconds", "faulted GiB", "priced GiB",
                        "faulted / priced"], rows))
    print(text)
    if write:
        write_section("heap_faults", text, page="plan")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.heap", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--child", type=int, metavar="THRESHOLD")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--faults", action="store_true", help="the page faults of training micro-batches (heap_faults)")
    ap.add_argument("--fault-child", choices=["lora", "full"])
    a = ap.parse_args()
    if a.fault_child:
        print(json.dumps(fault_child(a.fault_child, a.repeats)))
        return
    if a.faults:
        faults_report(max(a.repeats, 3), not a.no_write)
        return
    sizes = [str(r) for r in a.rows]
    if a.child:
        print(json.dumps(child(a.child, a.rows, a.repeats)))
        return
    out = {}
    for threshold in THRESHOLDS:
        run = subprocess.run([sys.executable, "-m", "bench.heap", "--child", str(threshold), "--rows", *sizes,
                              "--repeats", str(a.repeats)], cwd=ROOT, capture_output=True, text=True, check=True)
        out[threshold] = {int(k): v for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items()}
    fixed = out[1 << 20]
    rows = [[THRESHOLDS[t], r, m["tokens"], f"{m['counted_mb']:.0f}", f"{m['rise_mb']:.0f}",
             f"{m['rise_mb'] / m['counted_mb']:.2f}", f"{m['seconds']:.2f}",
             f"{m['seconds'] / fixed[r]['seconds']:.2f}"]
            for t, sizes_of in out.items() for r, m in sizes_of.items()]
    text = (f"Command: `python -m bench.heap` (SmolLM2-135M-Instruct, LoRA r 16 on every linear, lean activations; "
            f"the policy loss's forward + backward over rows of {PROMPT} - 7 i prompt + {ANSWER} answer tokens, "
            f"padded; each threshold in its own process; the least of {a.repeats} repeats, seconds from {a.repeats} "
            f"run back to back after a first). Machine: {machine()}.\n\n"
            + md_table(["glibc mmap threshold", "rows", "padded tokens", "counted MiB", "resident MiB (peak rise)",
                        "resident / counted", "seconds", "vs 1 MiB"], rows))
    print(text)
    if not a.no_write:
        write_section("heap", text, page="plan")


if __name__ == "__main__":
    main()
