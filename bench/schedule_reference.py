"""The RLHFuse reference rows: serial 1F1B, lower bound and the fused search, with search time, bubble ratio and peak
memory against serial 1F1B.

    python -m bench.schedule_reference [--time-limit 120]            # the six rows (section schedule)
    python -m bench.schedule_reference --sweep [--time-limit 120]    # the grid (section schedule_sweep)

`--sweep` runs the grid of issue 19 instead: P in {2, 4, 8, 16} stages, M in {4, 16, 64} micro-batches of the big
model, forward-time ratios big:small in {1:1, 2:1, 5:4, 5:2}, K in {1, 2} small-model replicas of P/K stages with M/K
micro-batches each (as the RLHFuse rows), b = 2f; each search capped at --time-limit seconds and stopped at the lower
bound. Both write their section of docs/benchmarks/schedule_reference.md and their row of BENCHMARKS.md."""

from __future__ import annotations

import argparse
import os
import time

from bench.common import machine, machine_short, md_table, write_headline, write_section
from rlfuse.schedule.build import fused, serial
from rlfuse.schedule.model import Problem, check, lower_bound, simulate

REFERENCE = [  # pp, pp_small, m, m_small, f, f_small, serial, target
    (8, 4, 32, 16, 5, 4, 813, 708), (8, 4, 16, 8, 5, 4, 477, 372), (8, 4, 8, 4, 5, 4, 309, 225),
    (8, 8, 32, 32, 5, 2, 819, 702), (8, 8, 16, 16, 5, 2, 483, 366), (8, 8, 8, 8, 5, 2, 315, 225),
]
RATIOS = [(1, 1), (2, 1), (5, 4), (5, 2)]  # forward time big, small


def sweep_grid(stages=(2, 4, 8, 16), micro_batches=(4, 16, 64), replicas=(1, 2)) -> list[tuple]:
    """Problem.fused arguments (pp, pp_small, m, m_small, f, f_small) of every sweep configuration."""
    return [(p, p // k, m, m // k, f, fs) for p in stages for m in micro_batches for f, fs in RATIOS for k in replicas
            if p % k == 0 and m % k == 0]


def memory_note(ratios: list[float]) -> str:
    ratios = sorted(ratios)
    return (f"Peak activation memory (fused / serial 1F1B, max over devices): above serial's in "
            f"{sum(r > 1 for r in ratios)} of {len(ratios)} configurations, median {ratios[len(ratios) // 2]:.2f}x, "
            f"max {ratios[-1]:.2f}x. A schedule at the bound keeps both pipelines in flight on every device; the memory "
            f"pass lowers the peak at the same makespan (a per-device cap, bisected) but does not reach serial's. "
            f"Where the bound is missed it may be unattainable: for P 8, K 1, M 4, 5:4 the search run exhaustively "
            f"(no node limit; its pruning only drops partial schedules that cannot end by the target) rules out 165 in "
            f"about 20 s, so 166 is optimal there.")


def sweep(args) -> None:
    rows, gaps, secs, mems, t_all, load0 = [], [], [], [], time.perf_counter(), os.getloadavg()[0]
    for pp, pps, m, ms, f, fs in sweep_grid():
        prob = Problem.fused(pp, pps, m, ms, f, fs)
        ser = simulate(prob, serial(prob))
        res = fused(prob, seed=args.seed, time_limit=args.time_limit)
        check(prob, res.schedule)
        found, lb = res.result.makespan, res.lower_bound
        gaps.append(found / lb - 1)
        secs.append(res.seconds)
        mems.append(max(res.result.peak_memory) / max(ser.peak_memory))
        rows.append([pp, pp // pps, m, f"{f}:{fs}", f"{ser.makespan:g}", f"{lb:g}", f"{found:g}", f"{100 * gaps[-1]:.2f}",
                     f"{res.seconds:.1f}", f"{max(ser.peak_memory):g} / {max(res.result.peak_memory):g}"])
        print(rows[-1], flush=True)
    wall, load1 = time.perf_counter() - t_all, os.getloadavg()[0]
    at_bound, within = sum(g <= 1e-9 for g in gaps), sum(g <= 0.01 + 1e-9 for g in gaps)
    text = "\n".join([
        f"Machine: {machine()['cpu']}, {machine()['cores']} cores, load average {load0:.2f} at the start and "
        f"{load1:.2f} at the end (other work shared the cores). Command: `{command(args)}` (seed {args.seed}; b = 2f; "
        "the small model has P/K stages and M/K micro-batches per "
        f"replica; memory in micro-batch activations, max over devices; seconds include the memory pass).", "",
        f"**{at_bound} of {len(gaps)} reach the lower bound, {within} are within 1% of it; worst gap "
        f"{100 * max(gaps):.2f}%, longest search {max(secs):.1f} s; whole sweep {wall / 60:.1f} min.**", "",
        memory_note(mems), "",
        md_table(["P", "K", "M", "f big:small", "serial 1F1B", "lower bound", "fused found", "gap %", "search s",
                  "peak mem serial / fused"], rows)])
    print(text)
    if not args.no_write:
        write_section("schedule_sweep", text, page="schedule_reference")
        write_headline("schedule_sweep", f"{at_bound} of {len(gaps)} configurations at the lower bound, "
                       f"{within} within 1%; worst {100 * max(gaps):.2f}% over ({args.time_limit:g} s per search at "
                       "most)",
                       "the lower bound of each configuration", command(args), machine_short(load1),
                       page="schedule_reference")


def command(args) -> str:
    return f"python -m bench.schedule_reference{' --sweep' if args.sweep else ''} --time-limit {args.time_limit:g}"


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.schedule_reference", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep", action="store_true", help="the P x M x ratio x K grid instead of the six paper rows")
    ap.add_argument("--no-write", action="store_true", help="print only; write neither the page nor BENCHMARKS.md")
    args = ap.parse_args()
    if args.sweep:
        return sweep(args)
    rows, reached, seconds = [], 0, []
    for pp, pps, m, ms, f, fs, ser_ref, target in REFERENCE:
        prob = Problem.fused(pp, pps, m, ms, f, fs)
        ser = simulate(prob, serial(prob))
        res = fused(prob, seed=args.seed, time_limit=args.time_limit)
        check(prob, res.schedule)
        r = res.result
        reached += r.makespan <= target
        seconds.append(res.seconds)
        rows.append([f"{pp}/{pps} ({pp // pps})", f"{m}/{ms}", f"{f}/{fs}", f"{ser.makespan:g} ({ser_ref})",
                     f"{lower_bound(prob):g} ({target})", f"{r.makespan:g}", "yes" if r.makespan <= target else
                     f"{100 * (r.makespan / target - 1):.1f}% over", f"{res.seconds:.1f}", f"{ser.bubble_ratio:.3f}",
                     f"{r.bubble_ratio:.3f}", f"{max(ser.peak_memory):g}", f"{max(r.peak_memory):g}"])
        print(rows[-1], flush=True)
    load1 = os.getloadavg()[0]
    text = "\n".join([
        f"Machine: {machine()['cpu']}, {machine()['cores']} cores, load average {load1:.2f} at the end. "
        f"Command: `{command(args)}` (seed {args.seed}; b = 2f; memory in micro-batch activations).", "",
        md_table(["PP big/small (K)", "M big/small", "f big/small", "serial 1F1B (paper)", "lower bound (paper target)",
                  "fused found", "target reached", "search s", "bubble serial", "bubble fused", "peak mem serial",
                  "peak mem fused"], rows)])
    print(text)
    if not args.no_write:
        write_section("schedule", text, page="schedule_reference")
        write_headline("schedule", f"the published optimum reached in {reached} of {len(REFERENCE)} rows (search "
                       f"{min(seconds):.1f}-{max(seconds):.1f} s each)",
                       "the RLHFuse paper's serial 1F1B and lower bound per row", command(args), machine_short(load1),
                       page="schedule_reference")


if __name__ == "__main__":
    main()
