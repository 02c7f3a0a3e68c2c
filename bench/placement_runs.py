"""The whole RL run per placement strategy on the default task: `rlfuse run placement.strategy=separated
placement.workers=2` (SFT, reward model, PPO), then RL from its SFT and reward model for single, flattened and
interleaved; one markdown table row per run from its metrics.jsonl, eval.json and rl/summary.json, printed and written
to the `placement_runs` section of docs/benchmarks/placement.md (and the seconds per iteration to its row of
BENCHMARKS.md).

    python -m bench.placement_runs                         # the runs (about 6 minutes on 2 cores), then the table
    python -m bench.placement_runs --summarize DIR [DIR..]  # the table of run folders that exist already
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from bench.common import ROOT, WORK, machine_short, write_headline, write_section

HEADER = ("| run | strategy | RL s | s/iteration (median) | rollout s | training s | weight sync s | sync MB | "
          "worker rollout busy s (median, per worker) | worker training s | worker peak RSS MiB | driver peak RSS MiB | gold positive before -> after |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def run_all(work: Path) -> list[Path]:
    rlfuse = [sys.executable, "-m", "rlfuse"]
    first = work / "driver_sep"
    subprocess.run([*rlfuse, "run", "placement.strategy=separated", "placement.workers=2", f"run.dir={first}",
                    "run.quiet=true"], check=True, cwd=ROOT)
    dirs = [first]
    for strategy in ("single", "flattened", "interleaved"):
        d = work / f"driver_rl_{strategy}"
        extra = [] if strategy == "single" else [f"placement.strategy={strategy}", "placement.workers=2"]
        subprocess.run([*rlfuse, "rl", f"rl.sft_path={first / 'sft' / 'model'}", f"rl.rm_path={first / 'rm' / 'model'}",
                        f"run.dir={d}", "run.quiet=true", *extra], check=True, cwd=ROOT)
        dirs.append(d)
    return dirs


def table_row(d: Path) -> tuple[str, str, float]:
    """(the run's markdown row, its strategy, its median seconds per iteration)."""
    rows = [json.loads(line) for line in (d / "rl" / "metrics.jsonl").read_text().splitlines()]
    med = lambda k: statistics.median(r[k] for r in rows if k in r) if any(k in r for r in rows) else float("nan")
    ev = json.loads((d / "eval.json").read_text())
    seconds = json.loads((d / "rl" / "summary.json").read_text())["seconds"]
    strategy = (yaml.safe_load((d / "config.yaml").read_text()).get("placement") or {}).get("strategy", "single")
    ranks = sorted({k.split("/")[1] for r in rows for k in r if k.startswith("worker/")})
    busy = ", ".join(f"{med(f'worker/{w}/busy_s'):.2f}" for w in ranks) or "-"
    train = ", ".join(f"{med(f'worker/{w}/train_s'):.2f}" for w in ranks if any(f"worker/{w}/train_s" in r for r in rows)) or "-"
    peak = lambda w: max(r.get(f"worker/{w}/rss_peak_mb", r.get(f"worker/{w}/rss_mb", 0)) for r in rows)
    rss = ", ".join(f"{peak(w):.0f}" for w in ranks) or "-"
    return (f"| {d.name} | {strategy} | {seconds:.0f} | {med('time/iteration'):.2f} | {med('time/rollout'):.2f} | "
            f"{med('time/training'):.2f} | {med('time/weight_sync'):.3f} | {med('sync/bytes') / 2**20:.1f} | {busy} | {train} | "
            f"{rss} | {max(r.get('mem/rss_peak_mb', r['mem/rss_mb']) for r in rows):.0f} | "
            f"{ev['before']['gold_positive_rate']:.3f} -> {ev['after']['gold_positive_rate']:.3f} |",
            strategy, med("time/iteration"))


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.placement_runs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=WORK / "placement_runs")
    ap.add_argument("--summarize", type=Path, nargs="+", metavar="RUN_DIR")
    ap.add_argument("--no-write", action="store_true", help="print only; write neither the page nor BENCHMARKS.md")
    args = ap.parse_args()
    dirs = args.summarize or run_all(args.work)
    rows = [table_row(d) for d in dirs]
    shown = lambda d: d.resolve().relative_to(ROOT) if d.resolve().is_relative_to(ROOT) else d
    command = "python -m bench.placement_runs" + (" --summarize " + " ".join(str(shown(d)) for d in dirs)
                                                  if args.summarize else "")
    text = "\n".join([f"Command: `{command}`.", "", HEADER, *(row for row, _, _ in rows)])
    print(text)
    if args.no_write:
        return
    write_section("placement_runs", text, page="placement")
    write_headline("placement_runs", "seconds per iteration (median): " + ", ".join(
        f"{strategy} {s:.2f}" for _, strategy, s in rows),
        "one another: the same PPO run in one process (single) and on 2 Ray workers", "python -m bench.placement_runs",
        machine_short(os.getloadavg()[0]), page="placement")


if __name__ == "__main__":
    main()
