"""Rollout benchmark (issue: inter-stage fusion). Same model, prompts, k and limits, one invocation, rows:

  (a) padded baseline: `model.generate` on the whole batch (k copies via num_return_sequences), then each scoring
      role (old log-probs, reference log-probs, critic values, reward) on the whole padded batch, as TRL's HF path;
  (b) rlfuse engine, fusion off: decode everything, then score in length-grouped micro-batches;
  (c) rlfuse engine, fusion on: score finished samples while the tail decodes;
  (d) transformers' continuous batching (`generate_batch`) as the generator, then the rlfuse scorer.

Workloads: the default task's SFT model with its natural long-tailed lengths; real IMDb prompts; a sweep where each
sample's length is drawn from a lognormal of given spread. Each measurement runs in its own process.

    python -m bench.rollout            # full matrix (about 15 minutes on 2 cores)
    python -m bench.rollout --quick    # small smoke run, prints only
    python -m bench.rollout --fusion   # fusion off vs on at k = 4 and 8 and what rollout.fusion=auto picks (~3 min)

Both write their section of docs/benchmarks/rollout.md and their row of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench.common import (SHARED_DATA, WORK, machine, machine_short, md_table, peak_rss_mb, reset_peak_rss, rss_mb,
                          run_child, write_headline, write_section)

ROWS = {"a": "padded generate + padded scoring", "b": "rlfuse engine, fusion off", "c": "rlfuse engine, fusion on",
        "d": "transformers generate_batch + rlfuse scorer"}


# ------------------------------------------------------------------------------------------- the models


def ensure_sft_model(log=print) -> Path:
    """The default task's SFT model (trained once with the default config, cached under bench/.work)."""
    out = WORK / "sft_run"
    if (out / "sft" / "model" / "config.json").exists():
        return out / "sft" / "model"
    from rlfuse.config import load_config
    from rlfuse.trainers.sft import train_sft

    log("[bench] training the default SFT model once (about 1-2 minutes)")
    cfg = load_config(None, [f"run.dir={out}", "run.quiet=true"])
    train_sft(cfg, out, log=lambda *_: None)
    return out / "sft" / "model"


def load_roles(model_dir: str, random_init: bool):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlfuse.models.heads import ValueModel
    from rlfuse.models.load import load_causal_lm, load_reward_model, load_tokenizer

    tok = load_tokenizer(model_dir)
    torch.manual_seed(0)
    if random_init:  # sweep: same shape, random weights (lengths are set by the benchmark, not the model)
        cfg = AutoConfig.from_pretrained(model_dir)
        actor, ref = AutoModelForCausalLM.from_config(cfg), AutoModelForCausalLM.from_config(cfg)
    else:
        actor, ref = load_causal_lm(model_dir), load_causal_lm(model_dir)
    rm = load_reward_model(model_dir, pad_token_id=tok.pad_token_id)
    critic = ValueModel.from_reward_model(load_reward_model(model_dir, pad_token_id=tok.pad_token_id))
    for m in (actor, ref, rm, critic):
        m.eval().requires_grad_(False)
    return tok, actor, ref, rm, critic


def workload_prompts(name: str, n: int, tok) -> list[list[int]]:
    from rlfuse.config import load_config
    from rlfuse.data.collate import encode

    if name == "imdb":
        cfg = load_config(None, ["data.kind=imdb", f"data.path={SHARED_DATA / 'imdb_reviews_2000.csv'}", "data.prompt_words=8"])
        from rlfuse.data.stages import rl_prompts

        _, held = rl_prompts(cfg, None, log=lambda *_: None)
        return [encode(tok, p) for p in held[:n]]
    from rlfuse.data.stages import rl_prompts
    from rlfuse.data.task import build_default_task

    cfg = load_config(None)
    task = build_default_task(cfg.data.num_reviews, 0, cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, log=lambda *_: None)
    train, held = rl_prompts(cfg, task)
    return [encode(tok, p) for p in (held + train)[:n]]


def target_lengths(n_prompts: int, k: int, sigma: float, median: int, cap: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    L = np.clip(np.round(median * np.exp(sigma * rng.standard_normal(n_prompts * k))), 1, cap).astype(int)
    return L.reshape(n_prompts, k)


# ------------------------------------------------------------------------------------------- the rows


def score_padded(tok, actor, ref, rm, critic, seqs, prompt_len: int, eos: int):
    """Baseline scoring: every role on the whole padded batch, full (B, T, V) logits."""
    import torch

    resp = seqs[:, prompt_len:]
    is_eos = resp == eos
    # response tokens up to and including the first EOS
    after = (is_eos.cumsum(1) - is_eos.long()) > 0
    resp_mask = (~after).long()
    attn = torch.cat([(seqs[:, :prompt_len] != tok.pad_token_id).long(), resp_mask], 1)
    out = {}
    for name, model in (("old_logprobs", actor), ("ref_logprobs", ref)):
        logits = model(input_ids=seqs, attention_mask=attn).logits[:, prompt_len - 1:-1].float()
        out[name] = torch.log_softmax(logits, -1).gather(-1, resp[..., None]).squeeze(-1) * resp_mask
    out["values"] = critic(input_ids=seqs, attention_mask=attn)[:, prompt_len - 1:-1] * resp_mask
    out["reward"] = rm(input_ids=seqs, attention_mask=attn).logits.squeeze(-1)
    return resp_mask.sum(1)


def row_padded(tok, actor, ref, rm, critic, prompts, k, max_new, lengths):
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    eos = tok.eos_token_id
    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), tok.pad_token_id)
    attn = torch.zeros(len(prompts), P, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as batched generate needs
        ids[i, P - len(p):], attn[i, P - len(p):] = torch.tensor(p), 1

    class ForceLengths(LogitsProcessor):  # sweep: EOS exactly at each row's target length, never before
        def __call__(self, input_ids, scores):
            step = input_ids.shape[1] - P
            target = torch.as_tensor(lengths).reshape(-1)
            scores[:, eos] = float("-inf")
            hit = target == step + 1
            scores[hit] = float("-inf")
            scores[hit, eos] = 0.0
            return scores

    t0 = time.perf_counter()
    with torch.no_grad():
        seqs = actor.generate(input_ids=ids, attention_mask=attn, do_sample=True, num_return_sequences=k,
                              max_new_tokens=max_new, eos_token_id=eos, pad_token_id=tok.pad_token_id,
                              logits_processor=LogitsProcessorList([ForceLengths()]) if lengths is not None else None)
        t1 = time.perf_counter()
        n_tokens = score_padded(tok, actor, ref, rm, critic, seqs, P, eos)
    t2 = time.perf_counter()
    return {"generation_s": t1 - t0, "scoring_s": t2 - t1, "total_s": t2 - t0, "tokens": int(n_tokens.sum()),
            "completions": int(seqs.shape[0]), "hidden_scoring_frac": 0.0}


def row_engine(tok, actor, ref, rm, critic, prompts, k, max_new, lengths, fused: bool):
    from rlfuse.rollout.engine import DecodeEngine, SamplingParams
    from rlfuse.rollout.fusion import FusionPolicy, generate_rollouts
    from rlfuse.rollout.score import Scorer
    from rlfuse.models.rewards import reward_model_fn

    eos = tok.eos_token_id if lengths is None else -1  # sweep: lengths are set, EOS never ends a row
    scorer = Scorer(reward_model_fn(rm, tok.eos_token_id, tok.pad_token_id), tok.pad_token_id, ref=ref, actor=actor,
                    critic=critic, micro_batch_size=16)
    engine = DecodeEngine(actor, eos, max_rows=256)
    fn = (lambda p, j: int(lengths[p][j])) if lengths is not None else None
    t0 = time.perf_counter()
    exp = generate_rollouts(engine, scorer, prompts, k, SamplingParams(max_new_tokens=max_new), 0,
                            FusionPolicy(fused, score_every=16, live_below=8), lengths=fn)
    total = time.perf_counter() - t0
    t = exp.timing
    return {"generation_s": t["generation"], "scoring_s": t["scoring"], "total_s": total, "tokens": int(exp.mask.sum()),
            "completions": len(exp), "scored_while_decoding_frac": t["scoring_during_decode"] / max(t["scoring"], 1e-9),
            "hidden_scoring_frac": 0.0, "decode_rows": t["decode_rows"], "decode_steps": t["decode_steps"]}


def row_generate_batch(tok, actor, ref, rm, critic, prompts, k, max_new, lengths):
    import torch
    from transformers import GenerationConfig

    from rlfuse.rollout.engine import Sample
    from rlfuse.rollout.score import Scorer
    from rlfuse.models.rewards import reward_model_fn

    gc = GenerationConfig(max_new_tokens=max_new, do_sample=True, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
    t0 = time.perf_counter()
    out = actor.generate_batch([p for p in prompts for _ in range(k)], generation_config=gc)
    t1 = time.perf_counter()
    inputs = [p for p in prompts for _ in range(k)]
    samples = [Sample(i // k, i % k, inputs[i], list(o.generated_tokens), torch.zeros(len(o.generated_tokens)), "eos")
               for i, o in enumerate(out.values()) if len(o.generated_tokens)]
    scorer = Scorer(reward_model_fn(rm, tok.eos_token_id, tok.pad_token_id), tok.pad_token_id, ref=ref, actor=actor,
                    critic=critic, micro_batch_size=16)
    scorer.score(samples)
    t2 = time.perf_counter()
    return {"generation_s": t1 - t0, "scoring_s": t2 - t1, "total_s": t2 - t0,
            "tokens": sum(len(s.token_ids) for s in samples), "completions": len(samples), "hidden_scoring_frac": 0.0}


def child(args) -> None:
    import torch

    torch.manual_seed(0)
    tok, actor, ref, rm, critic = load_roles(args.model, random_init=args.workload == "sweep")
    prompts = workload_prompts("default" if args.workload == "sweep" else args.workload, args.prompts, tok)
    lengths = target_lengths(len(prompts), args.k, args.sigma, args.median, args.max_new) if args.workload == "sweep" else None
    idle = rss_mb()
    reset_peak_rss()  # loading four models has a transient peak that is not the rollout's
    fn = {"a": row_padded, "b": lambda *a: row_engine(*a, fused=False), "c": lambda *a: row_engine(*a, fused=True),
          "d": row_generate_batch}[args.child]
    res = fn(tok, actor, ref, rm, critic, prompts, args.k, args.max_new, lengths)
    peak = peak_rss_mb()
    res |= {"peak_rss_mb": peak, "idle_rss_mb": idle, "peak_above_idle_mb": peak - idle,
            "tokens_per_s": res["tokens"] / res["total_s"], "samples_per_s": res["completions"] / res["total_s"]}
    if torch.cuda.is_available():
        res |= {"cuda_peak_allocated_mb": torch.cuda.max_memory_allocated() / 2**20}
    print(json.dumps(res))


# ------------------------------------------------------------------------------------------- the matrix


def measure(model: Path, workload: str, rows: str, k: int, prompts: int, max_new: int, repeats: int,
            sigma: float = 0.0, median: int = 32) -> dict:
    """Run rows alternately (a b c a b c ...), `repeats` times each; report the median time, the max peak."""
    runs: dict[str, list[dict]] = {r: [] for r in rows}
    for _ in range(repeats):
        for r in rows:
            runs[r].append(run_child("bench.rollout", ["--child", r, "--model", str(model), "--workload", workload,
                                                      "--k", str(k), "--prompts", str(prompts), "--max-new", str(max_new),
                                                      "--sigma", str(sigma), "--median", str(median)]))
    out = {}
    for r, rs in runs.items():
        best = sorted(rs, key=lambda x: x["total_s"])[len(rs) // 2]
        out[r] = best | {"peak_rss_mb": max(x["peak_rss_mb"] for x in rs),
                         "peak_above_idle_mb": max(x["peak_above_idle_mb"] for x in rs)}
    return out


def auto_row() -> str:
    """The row rollout.fusion=auto (the default) runs in one process on this machine: "c" (fusion on) or "b"."""
    from rlfuse.config import fusion_on, load_config

    return "c" if fusion_on(load_config(None)) else "b"


def auto_note(results: dict) -> str:
    """Which row rollout.fusion=auto (the default) runs here, and fusion on's speed against off."""
    on = auto_row() == "c"
    ratio = results["b"]["total_s"] / results["c"]["total_s"]
    return (f"rollout.fusion=auto (the default) runs row {'(c)' if on else '(b)'} here (one process on "
            f"{'CUDA' if __import__('torch').cuda.is_available() else 'CPU'}); fusion on runs at {ratio:.2f}x the speed "
            "of fusion off.")


def table(results: dict, base: str = "a") -> str:
    rows = []
    for r, m in results.items():
        rows.append([f"({r}) {ROWS[r]}", m["total_s"], m["generation_s"], m["scoring_s"], m["tokens_per_s"],
                     m["completions"], m["tokens"] / m["completions"], m["peak_rss_mb"], m["peak_above_idle_mb"],
                     results[base]["total_s"] / m["total_s"], m["peak_above_idle_mb"] / results[base]["peak_above_idle_mb"]])
    return md_table(["row", "gen+score s", "generation s", "scoring s", "tokens/s", "completions", "mean length",
                     "peak RSS MB", "peak above idle MB", f"speedup vs ({base})", f"memory above idle vs ({base})"], rows)


def fusion_matrix(model: Path, repeats: int, prompts: int, max_new: int) -> None:
    """Fusion off (b) against on (c) on the default task's SFT model, k = 4 and 8, alternated b c b c; the section
    says which one rollout.fusion=auto runs on this device."""
    t0, sections = time.time(), [f"Machine: {json.dumps(machine())}; load average before: "
                                 f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", ""]
    ratios = {}
    for k in (4, 8):
        r = measure(model, "default", "bc", k, prompts, max_new, repeats)
        ratios[k] = r["b"]["total_s"] / r["c"]["total_s"]
        sections += [f"### Fusion off and on: default task SFT model, {prompts} prompts x k={k}, up to {max_new} new "
                     f"tokens (median of {repeats} alternated runs)", "", table(r, base="b"), "", auto_note(r), ""]
    command = f"python -m bench.rollout --fusion --repeats {repeats}"
    sections += [f"Command: `{command}`; wall time {time.time() - t0:.0f} s, "
                 f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}.", ""]
    print("\n".join(sections))
    write_section("rollout_fusion", "\n".join(sections), page="rollout")
    write_headline("rollout_fusion", "scoring fused into decoding runs at " + ", ".join(
                       f"{x:.2f}x the speed of scoring after it at k={k}" for k, x in ratios.items())
                   + f"; so rollout.fusion=auto leaves it {'on' if auto_row() == 'c' else 'off'} in one process",
                   "fusion off (score after decoding), one process", command, machine_short(os.getloadavg()[0]),
                   page="rollout")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.rollout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=list(ROWS))
    ap.add_argument("--model")
    ap.add_argument("--workload", default="default", choices=["default", "imdb", "sweep"])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--sigma", type=float, default=0.0)
    ap.add_argument("--median", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="16 prompts, 64 new tokens; prints, writes nothing")
    ap.add_argument("--fusion", action="store_true",
                    help="only rows (b) and (c), k = 4 and 8, --repeats alternations (default 2); writes its own section")
    args = ap.parse_args()
    if args.child:
        return child(args)
    import torch

    torch.set_num_threads(torch.get_num_threads())
    model = ensure_sft_model()
    t0 = time.time()
    if args.quick:
        print(table(measure(model, "default", "abc", 4, 16, 64, 1)))
        return
    if args.fusion:
        return fusion_matrix(model, max(2, args.repeats), args.prompts, args.max_new)
    sections = [f"Machine: {json.dumps(machine())}", "", "Command: `python -m bench.rollout` (one invocation, rows "
                "alternated a b c ..., each measurement in its own process; median of repeats).", ""]
    res = {}
    res["default_k4"] = measure(model, "default", "abcd", 4, 64, 256, args.repeats)
    sections += ["### Default task SFT model, natural lengths: 64 prompts x k=4, up to 256 new tokens", "",
                 table(res["default_k4"]), "", auto_note(res["default_k4"]), ""]
    res["default_k8"] = measure(model, "default", "abc", 8, 64, 256, 1)
    sections += ["### Same, k=8 (memory)", "", table(res["default_k8"]), "", auto_note(res["default_k8"]), ""]
    if (SHARED_DATA / "imdb_reviews_2000.csv").exists():
        res["imdb_k4"] = measure(model, "imdb", "abc", 4, 64, 128, 1)
        sections += ["### Real IMDb prompts (first 8 words of held-out reviews), k=4, up to 128 new tokens", "",
                     table(res["imdb_k4"]), "", auto_note(res["imdb_k4"]), ""]
    sweep_rows = []
    for sigma in (0.0, 0.5, 1.0, 1.5):
        r = measure(model, "sweep", "abc", 4, 32, 256, 1, sigma=sigma, median=32)
        res[f"sweep_{sigma}"] = r
        sweep_rows.append([sigma, r["a"]["tokens"] / r["a"]["completions"], r["a"]["total_s"], r["b"]["total_s"],
                           r["c"]["total_s"], r["a"]["total_s"] / r["c"]["total_s"]])
    sections += ["### Tail sweep: lengths lognormal(median 32, sigma), cap 256, 32 prompts x k=4, random-weight model", "",
                 md_table(["sigma", "mean length", "(a) s", "(b) s", "(c) s", "speedup (c) vs (a)"], sweep_rows), ""]
    sections += [f"Wall time of the whole benchmark: {time.time() - t0:.0f} s.", ""]
    (WORK / "rollout.json").write_text(json.dumps(res, indent=2))
    print("\n".join(sections))
    write_section("rollout", "\n".join(sections), page="rollout")
    row, k4, k8 = auto_row(), res["default_k4"], res["default_k8"]
    speed = k4["a"]["total_s"] / k4[row]["total_s"]
    memory = k8[row]["peak_above_idle_mb"] / k8["a"]["peak_above_idle_mb"]
    write_headline("rollout", f"rlfuse's engine {speed:.1f}x the speed of generate + padded scoring at k=4, at "
                   f"{memory:.2g}x its memory above idle at k=8 (the default task's long-tailed lengths)",
                   "model.generate + padded scoring (TRL's HF path)", "python -m bench.rollout",
                   machine_short(os.getloadavg()[0]), page="rollout")


if __name__ == "__main__":
    main()
