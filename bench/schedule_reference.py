"""The RLHFuse reference rows: serial 1F1B, lower bound and the fused search, with search time, bubble ratio and peak
memory against serial 1F1B. `python bench/schedule_reference.py [--time-limit 120]` writes BENCHMARKS.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, md_table, write_section  # noqa: E402
from rlfuse.schedule.build import fused, serial  # noqa: E402
from rlfuse.schedule.model import Problem, check, lower_bound, simulate  # noqa: E402

REFERENCE = [  # pp, pp_small, m, m_small, f, f_small, serial, target
    (8, 4, 32, 16, 5, 4, 813, 708), (8, 4, 16, 8, 5, 4, 477, 372), (8, 4, 8, 4, 5, 4, 309, 225),
    (8, 8, 32, 32, 5, 2, 819, 702), (8, 8, 16, 16, 5, 2, 483, 366), (8, 8, 8, 8, 5, 2, 315, 225),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = []
    for pp, pps, m, ms, f, fs, ser_ref, target in REFERENCE:
        prob = Problem.fused(pp, pps, m, ms, f, fs)
        ser = simulate(prob, serial(prob))
        res = fused(prob, seed=args.seed, time_limit=args.time_limit)
        check(prob, res.schedule)
        r = res.result
        rows.append([f"{pp}/{pps} ({pp // pps})", f"{m}/{ms}", f"{f}/{fs}", f"{ser.makespan:g} ({ser_ref})",
                     f"{lower_bound(prob):g} ({target})", f"{r.makespan:g}", "yes" if r.makespan <= target else
                     f"{100 * (r.makespan / target - 1):.1f}% over", f"{res.seconds:.1f}", f"{ser.bubble_ratio:.3f}",
                     f"{r.bubble_ratio:.3f}", f"{max(ser.peak_memory):g}", f"{max(r.peak_memory):g}"])
        print(rows[-1], flush=True)
    text = "\n".join([
        f"Machine: {machine()['cpu']}, {machine()['cores']} cores. Command: `python bench/schedule_reference.py "
        f"--time-limit {args.time_limit:g}` (seed {args.seed}; b = 2f; memory in micro-batch activations).", "",
        md_table(["PP big/small (K)", "M big/small", "f big/small", "serial 1F1B (paper)", "lower bound (paper target)",
                  "fused found", "target reached", "search s", "bubble serial", "bubble fused", "peak mem serial",
                  "peak mem fused"], rows)])
    write_section("schedule", text)
    print(text)


if __name__ == "__main__":
    main()
