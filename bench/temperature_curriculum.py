"""Does a sampling-temperature schedule or a prompt curriculum help RL on the default task?

One SFT model and one reward model (the default config's, built once into bench/.work/base, or --base DIR), then
`rlfuse rl` per (variant, seed) with everything else at the default config; each run's held-out evaluation is at one
fixed temperature (rl.eval_temperature=0.7, the default sampling temperature) so the variants compare.

    python -m bench.temperature_curriculum                    # 4 variants x 3 seeds, writes its page and row
    python -m bench.temperature_curriculum --seeds 0 --variants constant annealed --no-write
    python -m bench.temperature_curriculum --seeds 0 1 2 3 4 --jobs 2 --threads 1    # as measured

run.seed also picks the held-out prompts and the train prompt order, so variants are compared within a seed (the
same prompts) and the spread is over seeds. RL seconds are wall time of the whole `rlfuse rl` stage (for
curriculum=reward it includes scoring every train prompt once) on a machine shared with other work: noisy. The table
goes to docs/benchmarks/temperature_curriculum.md, each variant's gain over constant to BENCHMARKS.md's row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import ROOT, WORK, machine, machine_short, md_table, write_headline, write_section

EVAL = ["rl.eval_temperature=0.7"]
VARIANTS = {
    "constant": [],  # rl.temperature=0.7 throughout, uniform prompts: today's default
    "annealed": ["rl.temperature=1.0", "rl.temperature_schedule=linear", "rl.temperature_final=0.7"],
    "curriculum-reward": ["rl.curriculum=reward"],
    "curriculum-length": ["rl.curriculum=length"],
    "annealed+curriculum": ["rl.temperature=1.0", "rl.temperature_schedule=linear", "rl.temperature_final=0.7",
                            "rl.curriculum=reward"],
}
DEFAULT_VARIANTS = ["constant", "annealed", "curriculum-reward", "curriculum-length"]
METRICS = ["gold_positive_rate", "grammatical_rate", "kl", "reward_mean"]


def rlfuse(*args: str, log: Path) -> None:
    with open(log, "a") as f:
        subprocess.run([sys.executable, "-m", "rlfuse", *args, "run.quiet=true"], check=True, stdout=f, stderr=f,
                       cwd=ROOT)


def ensure_base(base: Path) -> Path:
    """SFT and reward model of the default config (about 3 minutes on 2 quiet cores), built once."""
    if not (base / "sft" / "model").exists():
        rlfuse("sft", f"run.dir={base}", log=base.parent / "base.log")
    if not (base / "rm" / "model").exists():
        rlfuse("rm", f"run.dir={base}", log=base.parent / "base.log")
    return base


def run_one(base: Path, variant: str, seed: int, threads: int) -> dict:
    run_dir = WORK / "temperature_curriculum" / f"{variant}-s{seed}"
    if not (run_dir / "eval.json").exists():
        if run_dir.exists():
            subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        t = time.perf_counter()
        rlfuse("rl", f"run.dir={run_dir}", f"run.seed={seed}", f"run.threads={threads}",
               f"rl.sft_path={base / 'sft' / 'model'}", f"rl.rm_path={base / 'rm' / 'model'}", *EVAL,
               *VARIANTS[variant], log=WORK / "temperature_curriculum.log")
        wall = time.perf_counter() - t
        (run_dir / "wall.json").write_text(json.dumps({"wall_s": wall}))
    after = json.loads((run_dir / "eval.json").read_text())["after"]
    difficulty = run_dir / "rl" / "difficulty.json"
    return {"variant": variant, "seed": seed, **{k: after[k] for k in METRICS},
            "rl_s": json.loads((run_dir / "rl" / "summary.json").read_text())["seconds"],
            "difficulty_s": json.loads(difficulty.read_text())["seconds"] if difficulty.exists() else 0.0,
            "before_gold_positive_rate": json.loads((run_dir / "eval.json").read_text())["before"]["gold_positive_rate"]}


def mean_sd(values: list[float], digits: int = 3) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def table(results: list[dict], variants: list[str]) -> str:
    rows = []
    for v in variants:
        rs = [r for r in results if r["variant"] == v]
        if not rs:
            continue
        base = {r["seed"]: r["gold_positive_rate"] for r in results if r["variant"] == "constant"}
        deltas = [r["gold_positive_rate"] - base[r["seed"]] for r in rs if r["seed"] in base]
        rows.append([v, " ".join(VARIANTS[v]) or "(default)", len(rs), mean_sd([r["gold_positive_rate"] for r in rs]),
                     mean_sd(deltas) if v != "constant" and deltas else "",
                     mean_sd([r["grammatical_rate"] for r in rs]), mean_sd([r["kl"] for r in rs], 2),
                     mean_sd([r["rl_s"] for r in rs], 0),
                     mean_sd([r["difficulty_s"] for r in rs], 0) if "curriculum" in v else ""])
    return md_table(["variant", "overrides", "seeds", "gold positive rate (after)", "vs constant, same seed",
                     "grammatical rate", "KL (nats)", "RL s", "of which difficulty s"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.temperature_curriculum", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    ap.add_argument("--base", type=Path, default=WORK / "base", help="run folder with sft/model and rm/model")
    ap.add_argument("--threads", type=int, default=0, help="run.threads of each RL run (0: torch's default)")
    ap.add_argument("--jobs", type=int, default=1, help="RL runs at once (e.g. 2 with --threads 1 on 2 cores)")
    ap.add_argument("--no-write", action="store_true", help="print the table; write neither the page nor BENCHMARKS.md")
    args = ap.parse_args()
    base = ensure_base(args.base.resolve())
    # seed-major: every variant of a seed before the next seed, so partial measurements still pair up
    todo = [(v, seed) for seed in args.seeds for v in args.variants]
    with ThreadPoolExecutor(args.jobs) as pool:  # each job is a child process; threads only wait on it
        results = []
        for r in pool.map(lambda vs: run_one(base, vs[0], vs[1], args.threads), todo):
            results.append(r)
            print(json.dumps(r), flush=True)
    (WORK / "temperature_curriculum.json").write_text(json.dumps(results, indent=2))
    m = machine()
    command = (f"python -m bench.temperature_curriculum --seeds {' '.join(map(str, args.seeds))} --variants "
               f"{' '.join(args.variants)} --jobs {args.jobs} --threads {args.threads}")
    text = (f"Machine: {m['cpu']}, {m['cores']} cores (shared with other work while measured: RL seconds are noisy). "
            f"Command: `{command}`. Default config otherwise (PPO, 40 iterations x 32 prompts); one SFT + reward "
            f"model for all runs; held-out evaluation on 128 prompts at temperature 0.7 for every variant; "
            f"mean ± standard deviation over seeds.\n\n" + table(results, args.variants))
    print(text)
    if not args.no_write:
        write_section("temperature_curriculum", text, page="temperature_curriculum")
        write_headline("temperature_curriculum", "held-out gold positive rate against constant, same seed: "
                       + ", ".join(f"{v} {gain}" for v, gain in gains(results, args.variants).items())
                       + f" ({len(args.seeds)} seeds)", "constant temperature 0.7, uniform prompts (the default)",
                       command, machine_short())


def gains(results: list[dict], variants: list[str]) -> dict[str, str]:
    """variant -> its gold positive rate minus constant's of the same seed, mean ± standard deviation over seeds."""
    base = {r["seed"]: r["gold_positive_rate"] for r in results if r["variant"] == "constant"}
    out = {}
    for v in variants:
        deltas = [r["gold_positive_rate"] - base[r["seed"]] for r in results if r["variant"] == v and r["seed"] in base]
        if v != "constant" and deltas:
            sd = statistics.stdev(deltas) if len(deltas) > 1 else 0.0
            out[v] = f"{statistics.mean(deltas):+.3f} ± {sd:.3f}"
    return out


if __name__ == "__main__":
    main()
