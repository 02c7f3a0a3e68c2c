"""What a lower-precision generator could buy on this CPU (issue 28, workload d1): SmolLM2-135M's decode step is bound
by reading its fp32 weights (~540 MB a step, ~3.4 GB/s on the AMD VM), so fewer bytes per weight is the lever. This
times one decode step's matrix shapes (q/k/v/o and the MLP of a block, and the LM head) at 16 and 64 rows in fp32,
bf16 and int8 (torch's dynamic quantisation: fbgemm int8 weights, activations quantised per call), one thread, and
the int8 result's error against fp32.

    python -m bench.decode_precision        # about a minute
    python -m bench.decode_precision --real # the whole SmolLM2-135M (smollm2 extra) through the engine, ~3 minutes

--real: the real model's decode step through rlfuse's engine (2 chat prompts x k = 8, 64 new tokens, all
threads) in fp32, as a bf16 copy (what rollout.generator_dtype=bf16 decodes), and with torch's dynamic int8 three
ways (per-tensor weights, the default; per-channel weights; per-channel with the LM head kept fp32), and what each
sampler would do to RL: the sampled tokens' log-probs under it against the fp32 policy's (mean |difference| per
token, and the importance weight pi_fp32 / pi_sampler the decoupled objective applies), plus torch's weight-only
int8 kernel (_weight_int8pack_mm: int8 weights, fp32 activations) at the decode shapes.

rlfuse decodes in bf16 where the generator is a copy of its own and the hardware multiplies bf16 natively
(rollout.generator_dtype auto); never in int8. Written to docs/benchmarks/decode_step.md (sections decode_precision
and decode_precision_real, with the suffix _native_bf16 on a CPU with AVX512-BF16 or AMX).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import os

from bench.common import machine, machine_short, md_table, write_headline, write_section
from rlfuse.models.device import native_bf16

# SmolLM2-135M: hidden 576, 9 heads of 64 (3 KV heads: 192), MLP 1536, vocabulary 49152, 30 blocks
SHAPES = {"q/o projection 576x576": (576, 576), "k/v projection 576x192": (576, 192),
          "gate/up 576x1536": (576, 1536), "down 1536x576": (1536, 576), "LM head 576x49152": (576, 49152)}
PER_STEP = {"q/o projection 576x576": 2 * 30, "k/v projection 576x192": 2 * 30, "gate/up 576x1536": 2 * 30,
            "down 1536x576": 30, "LM head 576x49152": 1}
"""How many of each a decode step runs (30 blocks, one LM head)."""


NATIVE = "_native_bf16" if native_bf16(torch.device("cpu")) else ""
"""The sections' suffix on a CPU that multiplies bf16 natively (AVX512-BF16, AMX): its tables beside the AVX2 ones."""


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


QUESTIONS = ["How do I keep my houseplants alive through the winter when the apartment gets very dry?",
             "Can you explain how a bill becomes a law in the United States, step by step?"]
"""--real's prompts: two everyday chat questions in the model's own template."""


def real_model() -> tuple[str, list]:
    """--real (see the module's docstring): the real model's decode step and an int8 sampler's log-prob error."""
    import copy

    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfuse.models.build import with_dtype
    from rlfuse.models.gguf import local_model
    from rlfuse.rollout.engine import DecodeEngine, SamplingParams

    folder = local_model("smollm2-135m-instruct")
    fp32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for q in QUESTIONS]

    def decode(model):
        engine = DecodeEngine(model, eos_token_id=-1)
        t = time.perf_counter()
        out = list(engine.generate(prompts, 8, SamplingParams(64), seed=0))
        return out, 1000 * (time.perf_counter() - t) / engine.stats.decode_steps

    def sampled_logprobs(model, s) -> torch.Tensor:
        ids = torch.tensor([s.prompt_ids + list(s.token_ids)])
        lp = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
        return lp[-len(s.token_ids):]

    def int8(head: bool, per_channel: bool):
        model = copy.deepcopy(fp32)
        qconfig = per_channel_dynamic_qconfig if per_channel else torch.ao.quantization.default_dynamic_qconfig
        names = {n: qconfig for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and (head or n != "lm_head")}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return quantize_dynamic(model, names, dtype=torch.qint8, inplace=True)

    out = []
    with torch.no_grad():
        _, base_ms = decode(fp32)
        _, base_ms2 = decode(fp32)
        base_ms = min(base_ms, base_ms2)
        out.append(["fp32", f"{base_ms:.0f}", "1.00x", "0", "1", "1"])
        # bf16: the engine's own log-probs of its samples are what the update sees as the behaviour policy's
        model = with_dtype(copy.deepcopy(fp32), torch.bfloat16)  # as rlfuse builds it: parameters only
        samples, ms = decode(model)
        ms = min(ms, decode(model)[1])
        d = torch.cat([sampled_logprobs(fp32, s) - torch.as_tensor(s.logprobs) for s in samples])
        w = d.exp()
        out.append(["bf16 copy (rollout.generator_dtype=bf16)", f"{ms:.0f}", f"{base_ms / ms:.2f}x",
                    f"{float(d.abs().mean()):.3f}", f"{float(w.mean()):.2f}", f"{float(w.max()):.1f}"])
        del model
        for name, head, per_channel in (("int8 dynamic, per-tensor weights (torch's default)", True, False),
                                        ("int8 dynamic, per-channel weights", True, True),
                                        ("int8 dynamic, per-channel, LM head fp32", False, True)):
            model = int8(head, per_channel)
            samples, ms = decode(model)
            ms = min(ms, decode(model)[1])
            # the int8 sampler's own samples, scored by both: behaviour = int8, policy = fp32
            d = torch.cat([sampled_logprobs(fp32, s) - sampled_logprobs(model, s) for s in samples])
            w = d.exp()
            out.append([name, f"{ms:.0f}", f"{base_ms / ms:.2f}x", f"{float(d.abs().mean()):.3f}",
                        f"{float(w.mean()):.2f}", f"{float(w.max()):.1f}"])
        hidden = fp32(torch.tensor([prompts[0]]), output_hidden_states=True).hidden_states
        outliers = ", ".join(f"{float(h.abs().max()):.0f}" for h in hidden[::5])
    torch.manual_seed(0)
    packed = []
    for rows in (16,):
        for name, (k, n) in SHAPES.items():
            x, w = torch.randn(rows, k), torch.randn(n, k)
            scale = w.abs().amax(1) / 127
            wq = torch.round(w / scale[:, None]).to(torch.int8)
            packed.append([rows, name, f"{seconds(lambda: x @ w.t(), 5) * 1e3:.2f}",
                           f"{seconds(lambda: torch._weight_int8pack_mm(x, wq, scale), 2) * 1e3:.2f}"])
    text = "\n\n".join([
        f"Command: `python -m bench.decode_precision --real` (SmolLM2-135M-Instruct, {torch.get_num_threads()} threads; "
        f"{len(prompts)} chat prompts of {sum(map(len, prompts)) / len(prompts):.0f} tokens x k = 8, 64 new tokens "
        "(end of text ignored: every row decodes 64 steps), temperature 1, the best of 2 runs; every sample a lower-precision "
        "sampler draws is scored by the fp32 model too: the bf16 copy's against the engine's own log-probs, which the "
        f"update sees as the behaviour policy's; the int8 models' against their full forward). Machine: {machine()}.",
        md_table(["decoder", "ms per decode step (16 rows)", "speed-up", "mean |log pi_fp32 - log pi_sampler| "
                  "per sampled token", "importance weight pi_fp32 / pi_sampler: mean", "max"], out),
        f"The fp32 model's residual stream on the first prompt, max |x| after layers 0, 5, ..., 30: {outliers} (dynamic "
        "int8 gives each matrix's input one scale per call).",
        "Weight-only int8 (torch._weight_int8pack_mm) at the decode shapes, one step's matrices one at a time:",
        md_table(["rows", "matrix", "fp32 ms", "weight-only int8 ms"], packed)])
    return text, out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.decode_precision", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--real", action="store_true", help="the real model through the engine (see above)")
    args = ap.parse_args()
    if args.real:
        text, rows = real_model()
        print(text)
        if not args.no_write:
            write_section(f"decode_precision_real{NATIVE}", text, "decode_step")
            int8, bf16 = rows[2:], rows[1]
            if NATIVE:
                write_headline("decode_precision_real_native_bf16",
                               f"bf16 generator copy: decode step {bf16[2]} fp32's speed at 16 rows, its samples' "
                               f"log-probs {bf16[3]} nats off the fp32 policy's per token (importance weights mean "
                               f"{bf16[4]}, max {bf16[5]}); int8 dynamic {min(r[2] for r in int8)}-"
                               f"{max(r[2] for r in int8)} but {min(r[3] for r in int8)}-{max(r[3] for r in int8)} nats off",
                               "the fp32 model (decode speed, log-probs of the same samples)",
                               "python -m bench.decode_precision --real", machine_short(os.getloadavg()[0]),
                               page="decode_step", what="A bf16 or int8 generator for SmolLM2-135M on a CPU with "
                                                        "native bf16 (AMX)")
                return
            write_headline("decode_precision_real",
                           f"int8 dynamic decode step {min(r[2] for r in int8)}-{max(r[2] for r in int8)} fp32's speed "
                           f"at 16 rows, but the sampled tokens' log-probs {min(r[3] for r in int8)}-"
                           f"{max(r[3] for r in int8)} nats off the fp32 policy's per token (importance weights mean "
                           f"{min(float(r[4]) for r in int8):.0f}-{max(float(r[4]) for r in int8):.0f}): no int8 sampler",
                           "the fp32 model (decode speed, log-probs of the same samples)",
                           "python -m bench.decode_precision --real", machine_short(os.getloadavg()[0]),
                           page="decode_step", what="An int8 generator for SmolLM2-135M on a CPU without native bf16")
        return
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
        write_section(f"decode_precision{NATIVE}", text, "decode_step")


if __name__ == "__main__":
    main()
