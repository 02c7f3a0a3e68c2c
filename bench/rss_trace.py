"""Where each process of a command peaks in memory, and in which phase: runs the command with every Python process
it starts (the driver and its Ray workers alike) sampling its own RSS with its Python stack (bench/rss_site), then
prints each process's peak, split into anonymous, file-backed and shared pages, with the rlfuse frames running at
that moment, and the largest RSS seen in each phase. How the math config's two planner misses were found (a weight
sync's object-store pages, 513 MiB of RssShmem in both workers; FSDP's count, docs/benchmarks/plan.md).

    python -m bench.rss_trace -- rlfuse rl configs/smollm2_math.yaml rl.sft_path=... placement.strategy=separated \\
        placement.workers=2 rl.iterations=2
    python -m bench.rss_trace --out DIR --every-ms 5 --top 8 -- COMMAND ...

Each process's samples are in DIR/rss-<pid>.json (a timeline and the peak); a process killed with SIGKILL loses its
last second. Linux only; a sitecustomize already on the path is shadowed while it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT

SITE = Path(__file__).resolve().parent / "rss_site"


def summary(folder: Path, top: int = 6) -> str:
    """Each traced process that ran rlfuse code, largest peak first: its command, its peak and the phase then, and
    the largest RSS seen under each of its `top` largest phases."""
    procs = [json.loads(f.read_text()) for f in sorted(folder.glob("rss-*.json"))]
    procs = [p for p in procs if p.get("peak") and any(r["where"] for r in p["timeline"])]
    lines = []
    for p in sorted(procs, key=lambda p: -p["peak"]["rss"]):
        peak = p["peak"]
        lines.append(f"pid {p['pid']}: {' '.join(p['argv'])[:160]}")
        lines.append(f"  peak {peak['rss']:.0f} MiB at {peak['t']:.1f} s (anon {peak['anon']:.0f}, file "
                     f"{peak['file']:.0f}, shared {peak['shm']:.0f}): {' > '.join(peak['stack'][-6:]) or '(no rlfuse frame)'}")
        phases = {}
        for r in p["timeline"]:
            if r["where"] and r["rss"] > phases.get(r["where"], {"rss": 0})["rss"]:
                phases[r["where"]] = r
        for where, r in sorted(phases.items(), key=lambda kv: -kv[1]["rss"])[:top]:
            lines.append(f"    {r['rss']:7.0f} MiB (shared {r['shm']:.0f})  {where}")
    return "\n".join(lines) if lines else "no process ran rlfuse code"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: python -m bench.rss_trace [--out DIR] [--every-ms MS] [--top N] -- COMMAND ...")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="python -m bench.rss_trace", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="where the samples go (default bench/.work/rss_trace/<time>)")
    ap.add_argument("--every-ms", type=float, default=10.0, help="sampling interval (10 ms)")
    ap.add_argument("--top", type=int, default=6, help="phases listed per process")
    args, command = ap.parse_args(argv[:cut]), argv[cut + 1:]
    out = args.out or ROOT / "bench" / ".work" / "rss_trace" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"RLFUSE_RSS_TRACE": str(out), "RLFUSE_RSS_TRACE_MS": str(args.every_ms),
                        "PYTHONPATH": os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")]))}
    rc = subprocess.run(command, env=env).returncode
    print(f"[rss_trace] {' '.join(command)[:200]}: exit {rc}; samples in {out}", file=sys.stderr)
    print(summary(out, args.top))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
