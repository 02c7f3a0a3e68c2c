"""A LoRA training micro-batch of the real model through peft's LoRA linear and through rlfuse's fused one
(rlfuse/models/lora_linear.py), alternated in one process: SmolLM2-135M-Instruct with rlfuse's default adapters
(model.lora: rank 8, alpha 16 on q/k/v/o/gate/up/down), one prompt of 98 tokens with 4 replies of 60-128 tokens
(workload d2's micro-batch: 4 completions of one prompt, prefix-shared, laid out as collate lays it out: the two
runs recorded on 2026-11-28 padded each reply's row, collate packs them since), log-probs forward and backward. Reports each
way's fastest and median step, and the largest relative difference between the two ways' adapter gradients.

    python -m bench.lora_linear             # about 2 minutes; writes docs/benchmarks/vs_trl.md (lora_linear)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

from bench.common import machine, md_table, write_section


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.lora_linear", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="alternations of the two ways (A B A B ...)")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()

    import torch
    from peft import get_peft_model

    from rlfuse.config import ModelConfig
    from rlfuse.models.forward import collate, response_logprobs
    from rlfuse.models.gguf import local_model
    from rlfuse.models.lean import enable_lean_activations
    from rlfuse.models.load import fused_lora, load_causal_lm, lora_config

    cfg = ModelConfig(lora=True)
    base = load_causal_lm(local_model("smollm2-135m-instruct")).train()
    peft_way = get_peft_model(base, lora_config(base, cfg))  # peft's own LoRA linears
    torch.manual_seed(0)
    for n, p in peft_way.named_parameters():
        if "lora_B" in n:  # away from zero, as after some training: the product is part of the forward
            torch.nn.init.normal_(p, std=0.02)
    fused_way = fused_lora(copy.deepcopy(peft_way))
    for model in (peft_way, fused_way):  # as rlfuse's trainers prepare a model (models/build.py prepare_trainable);
        enable_lean_activations(model)  # after the copy: the lean forwards are closures over their own modules
    prompt = torch.randint(100, 40000, (98,)).tolist()
    replies = [torch.randint(100, 40000, (n,)).tolist() for n in (60, 90, 110, 128)]
    mb = collate([prompt] * 4, replies, 0, "cpu", True)

    def step(model) -> float:
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        response_logprobs(model, mb).sum().backward()
        return time.perf_counter() - t

    ways = {"peft's LoRA linear": peft_way, "rlfuse's fused LoRA linear": fused_way}
    for model in ways.values():
        step(model)  # warm-up
    grads = [{n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None} for m in ways.values()]
    rel = max(((grads[0][n] - grads[1][n]).abs().max() / grads[0][n].abs().max()).item() for n in grads[0])
    seconds = {name: [] for name in ways}
    for _ in range(a.rounds):
        for name, model in ways.items():
            seconds[name].append(step(model))
    peft_median = statistics.median(seconds["peft's LoRA linear"])
    rows = [[name, f"{min(s):.2f}", f"{statistics.median(s):.2f}", f"{peft_median / statistics.median(s):.2f}x"]
            for name, s in seconds.items()]
    text = (f"Command: `python -m bench.lora_linear` (SmolLM2-135M-Instruct, fp32, {torch.get_num_threads()} threads, "
            f"LoRA rank 8 on {len(grads[0]) // 2} linears, lean MLPs; one prompt of {len(prompt)} tokens x 4 replies "
            f"of 60-128 tokens, prefix-shared; log-probs forward + backward; {a.rounds} alternated rounds after a "
            f"warm-up). Adapter gradients of the two ways: largest difference {rel:.1e} of the largest gradient. "
            f"Machine: {machine()}.\n\n"
            + md_table(["LoRA linear", "fastest step s", "median step s", "speed-up (median)"], rows))
    print(text)
    if not a.no_write:
        write_section("lora_linear", text, page="vs_trl")


if __name__ == "__main__":
    main()
