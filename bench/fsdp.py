"""FSDP2 against DDP on 2 Ray workers, SmolLM2-135M-Instruct (issue 31): peak memory per worker, iteration time,
checkpoint size and save time per rank.

Both runs: `rlfuse rl` PPO with a critic (rl.critic_init=sft: a second 135M model trained whole), full fine-tuning,
placement.strategy=flattened on 2 workers (each decodes, scores and trains), from the converted instruct model on
configs/smollm2_hh.yaml's hh-rlhf prompts and chat template, reward bench.vs_trl:reply_reward (a function: no reward
model), a checkpoint every iteration; rl.train_parallel=data (DDP, full replicas) against fsdp (FSDP2 shards,
rlfuse/runtime/fsdp.py), alternated A B (A B ...) in one command; each pair as configured and again with
rl.gradient_checkpointing=true on both sides (VARIANTS). rl.share_prompt=false on both (as measured: FSDP's training
forwards were not prefix-shared then, so DDP's would have done less work).

    python -m bench.fsdp                 # one round of both variants (about 25 min on 2 cores; the smollm2 extra)
    python -m bench.fsdp --variants plain
    python -m bench.fsdp --rounds 2
    python -m bench.fsdp --summarize     # the table of the run folders that exist already

Per mode: each worker's peak RSS (the largest worker/<rank>/rss_peak_mb of the run: loading, rollouts, updates and
checkpoints), the larger worker's peak after the first iteration (before any checkpoint, and before AdamW's states
exist during a rollout), the planner's prediction for the same config (rlfuse/plan/planner.py memory_of_config: the memory model's
peak of one worker, FSDP's at the larger of its rollout and update phases), the median iteration and per-rank
training seconds, and each rank's checkpoint bytes and seconds (rl/checkpoints.jsonl, median over the run's
checkpoints). Written to docs/benchmarks/fsdp.md and BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from bench.common import ROOT, WORK, machine_short, md_table, today, write_headline, write_section

MODES = ("data", "fsdp")
VARIANTS = {"plain": [], "checkpointed": ["rl.gradient_checkpointing=true"]}
"""Each pair of runs as configured, and again with activation checkpointing on both sides: a micro-batch's
activations (4 x ~250 tokens through 30 layers, ~0.8 GiB) are whole on every rank whatever shards the weights, and
FSDP users run it with checkpointing (veRL's FSDP configs set enable_gradient_checkpointing: True)."""
RUN = ["configs/smollm2_hh.yaml", "model.lora=false", "model.shared_base=false", "rl.algo=ppo", "rl.critic_init=sft",
       "rl.k=4", "rl.prompts_per_iter=2", "rl.max_new_tokens=64", "rl.reward=bench.vs_trl:reply_reward",
       "rl.mini_batch_size=8", "rl.micro_batch_size=4", "rl.epochs=1", "rl.iterations=3", "rl.eval_prompts=0",
       "rl.kl_target=null", "rl.ckpt_every=1", "rl.share_prompt=false", "placement.strategy=flattened",
       "placement.workers=2"]


def run_dir(work: Path, mode: str, round_: int, variant: str = "plain") -> Path:
    return work / (f"{mode}-{round_}" if variant == "plain" else f"{mode}-{variant}-{round_}")


def run(work: Path, mode: str, round_: int, variant: str = "plain") -> Path:
    from rlfuse.models.gguf import local_model  # transformers and gguf: only for this workload

    d = run_dir(work, mode, round_, variant)
    if not (d / "eval.json").exists():
        subprocess.run([sys.executable, "-m", "rlfuse", "rl", *RUN, *VARIANTS[variant],
                        f"rl.sft_path={local_model('smollm2-135m-instruct')}", f"run.dir={d}", "run.quiet=true",
                        f"rl.train_parallel={mode}", "--overwrite"], check=True,
                       cwd=ROOT, env=os.environ | {"CI": "true"})
        for f in (d / "rl").glob("checkpoint.pt*"):  # 3 GB a run: measured already (rl/checkpoints.jsonl)
            shutil.rmtree(f) if f.is_dir() else f.unlink()
    return d


def predicted_mb(mode: str, variant: str = "plain") -> float:
    """The planner's predicted peak per worker of the run's config (both workers run the same roles)."""
    from rlfuse.config import load_config
    from rlfuse.plan.planner import memory_of_config
    from rlfuse.plan.strategies import spec_from_config

    cfg = load_config(str(ROOT / RUN[0]), [*RUN[1:], *VARIANTS[variant], f"rl.train_parallel={mode}"])
    spec = spec_from_config(cfg)
    return memory_of_config(cfg)(spec.groups[0], spec) / 2**20


def measured(d: Path) -> dict:
    rows = [json.loads(line) for line in (d / "rl" / "metrics.jsonl").read_text().splitlines()]
    ckpts = [json.loads(line) for line in (d / "rl" / "checkpoints.jsonl").read_text().splitlines()]
    med = lambda values: statistics.median(values)
    return {"peak_mb": [max(r[f"worker/{w}/rss_peak_mb"] for r in rows) for w in (0, 1)],
            "first_mb": max(rows[0][f"worker/{w}/rss_peak_mb"] for w in (0, 1)),
            "iteration_s": med([r["time/iteration"] for r in rows]),
            "train_s": [med([r[f"worker/{w}/train_s"] for r in rows]) for w in (0, 1)],
            "rollout_s": med([r["time/rollout"] for r in rows]),
            "ckpt_mb": [med([c["bytes"][w] for c in ckpts]) / 2**20 for w in (0, 1)],
            "ckpt_s": [med([c["seconds"][w] for c in ckpts]) for w in (0, 1)]}


def table(work: Path, rounds: int, variants: list[str]) -> tuple[str, dict]:
    rows, by_mode = [], {(v, m): [] for v in variants for m in MODES}
    for variant, r, mode in itertools.product(variants, range(rounds), MODES):
        d = run_dir(work, mode, r, variant)
        if not (d / "eval.json").exists():
            continue
        m = measured(d)
        by_mode[variant, mode].append(m)
        pred = predicted_mb(mode, variant)
        error = 100 * (pred - max(m["peak_mb"])) / max(m["peak_mb"])
        rows.append([" ".join(VARIANTS[variant]) or "as configured", r, mode, *(f"{x:.0f}" for x in m["peak_mb"]),
                     f"{m['first_mb']:.0f}", f"{pred:.0f} ({error:+.0f}%)", f"{m['iteration_s']:.1f}",
                     f"{m['rollout_s']:.1f}", *(f"{x:.1f}" for x in m["train_s"]),
                     *(f"{x:.0f}" for x in m["ckpt_mb"]), *(f"{x:.1f}" for x in m["ckpt_s"])])
    return md_table(["variant", "round", "rl.train_parallel", "worker 0 peak RSS MiB", "worker 1 peak RSS MiB",
                     "peak after iteration 1 MiB", "planner's prediction MiB (error against the run's peak)",
                     "s / iteration (median)", "rollout s", "rank 0 train s", "rank 1 train s",
                     "rank 0 checkpoint MiB", "rank 1 checkpoint MiB", "rank 0 checkpoint s", "rank 1 checkpoint s"],
                    rows), by_mode


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.fsdp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=WORK / "fsdp")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--summarize", action="store_true", help="only the table of the runs already in --work")
    ap.add_argument("--no-write", action="store_true", help="print only; write neither the page nor BENCHMARKS.md")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = ap.parse_args()
    if not args.summarize:
        for variant, r, mode in itertools.product(args.variants, range(args.rounds), MODES):
            run(args.work, mode, r, variant)
    text, by_mode = table(args.work, args.rounds, args.variants)
    if not all(by_mode.values()):
        print(text)
        return
    figures = []
    for variant in args.variants:
        runs = {mode: by_mode[variant, mode] for mode in MODES}
        peak = {m: statistics.median(max(x["peak_mb"]) for x in v) for m, v in runs.items()}
        it = {m: statistics.median(x["iteration_s"] for x in v) for m, v in runs.items()}
        ckpt = {m: statistics.median(max(x["ckpt_mb"]) for x in v) for m, v in runs.items()}
        ratio = peak["fsdp"] / peak["data"]
        figures.append(f"{' '.join(VARIANTS[variant]) or 'as configured'}: peak RSS per worker {ratio:.2f}x DDP's "
                       f"({peak['fsdp']:.0f} vs {peak['data']:.0f} MiB), "
                       f"iteration {it['fsdp'] / it['data']:.2f}x DDP's time, "
                       f"checkpoint per rank {ckpt['fsdp']:.0f} vs {ckpt['data']:.0f} MiB")
    figure = "; ".join(figures)
    load = os.getloadavg()[0]
    flags = (f"{' --rounds ' + str(args.rounds) if args.rounds != 1 else ''}"
             f"{' --variants ' + ' '.join(args.variants) if args.variants != list(VARIANTS) else ''}")
    body = (f"Command: `python -m bench.fsdp{flags}`; machine: {machine_short(load)} (load average at the end). Every "
            f"run: `rlfuse rl {' '.join(RUN)} rl.sft_path=<the converted SmolLM2-135M-Instruct> "
            f"rl.train_parallel=data|fsdp` (variant checkpointed: and rl.gradient_checkpointing=true).\n\n{text}\n\n"
            f"Headline: {figure}.")
    print(body)
    if not args.no_write:
        write_section("fsdp", body, "fsdp")
        write_headline("fsdp", figure, "DDP (rl.train_parallel=data), the same run on the same 2 workers",
                       f"python -m bench.fsdp{flags}", machine_short(load), what="FSDP2 against DDP: SmolLM2-135M PPO "
                       "with a critic, flattened on 2 Ray workers", page="fsdp")


if __name__ == "__main__":
    main()
