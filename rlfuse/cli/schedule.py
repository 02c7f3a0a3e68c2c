"""`rlfuse schedule`: serial vs one 1F1B per model vs fused, for a pipeline shape; prints or emits JSON; draws the chart."""

from __future__ import annotations

import argparse
import json
import sys

from rlfuse.schedule.build import fused, one_f_one_b, serial
from rlfuse.schedule.model import Problem, check, lower_bound, simulate


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pp", type=int, default=8, help="pipeline stages of the big model (= devices)")
    p.add_argument("--pp-small", type=int, default=4, help="stages of the small model per replica (divides --pp)")
    p.add_argument("--micro-batches", type=int, default=32, help="micro-batches of the big model")
    p.add_argument("--micro-batches-small", type=int, default=16, help="micro-batches of the small model per replica")
    p.add_argument("--fwd", type=float, default=5, help="forward time of one big-model stage")
    p.add_argument("--fwd-small", type=float, default=4, help="forward time of one small-model stage")
    p.add_argument("--bwd-ratio", type=float, default=2.0, help="backward time = ratio x forward")
    p.add_argument("--comm", type=float, default=0.0, help="time to pass a micro-batch between devices")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds for the fused search")
    p.add_argument("--out", default=None, help="Gantt chart PNG (default: none)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(ns) -> int:
    if ns.pp < 1 or ns.pp_small < 1 or ns.pp % ns.pp_small:
        print(f"rlfuse schedule: --pp-small {ns.pp_small} must be >= 1 and divide --pp {ns.pp}", file=sys.stderr)
        return 2
    if min(ns.micro_batches, ns.micro_batches_small) < 1 or min(ns.fwd, ns.fwd_small, ns.bwd_ratio) <= 0:
        print("rlfuse schedule: micro-batches must be >= 1 and times > 0", file=sys.stderr)
        return 2
    prob = Problem.fused(ns.pp, ns.pp_small, ns.micro_batches, ns.micro_batches_small, ns.fwd, ns.fwd_small,
                         ns.bwd_ratio, comm=ns.comm)
    ser = serial(prob)
    check(prob, ser)
    r_ser = simulate(prob, ser)
    singles = [simulate(prob, one_f_one_b(prob, m)) for m in (0, 1)]
    found = fused(prob, seed=ns.seed, time_limit=ns.time_limit)
    check(prob, found.schedule)
    r_fused = found.result
    lb = lower_bound(prob)
    row = lambda r: {"makespan": r.makespan, "bubble_ratio": r.bubble_ratio, "peak_memory": max(r.peak_memory)}
    out = {"serial": row(r_ser), "fused": row(r_fused) | {"search_seconds": found.seconds, "evaluations": found.evaluations},
           "lower_bound": {"makespan": lb, "bubble_ratio": 1 - prob.work / (prob.devices * lb), "peak_memory": None},
           "one_f_one_b": {"big": row(singles[0]), "small": row(singles[1])}}
    if ns.out:
        from rlfuse.metrics.schedule_chart import gantt, simulated_spans  # matplotlib: only when a chart is asked for

        gantt([("serial (1F1B, then 1F1B)", simulated_spans(prob, r_ser)), ("fused", simulated_spans(prob, r_fused))],
              ns.out, title=f"PP {ns.pp}/{ns.pp_small}, M {ns.micro_batches}/{ns.micro_batches_small}, "
                            f"f {ns.fwd:g}/{ns.fwd_small:g}, b = {ns.bwd_ratio:g}f")
    if ns.json:
        print(json.dumps(out))
        return 0
    print(f"{'schedule':<22}{'makespan':>10}{'bubble':>9}{'peak mem':>10}")
    for name, r in (("serial", out["serial"]), ("1F1B big alone", out["one_f_one_b"]["big"]),
                    ("1F1B small alone", out["one_f_one_b"]["small"]), ("fused", out["fused"])):
        print(f"{name:<22}{r['makespan']:>10g}{r['bubble_ratio']:>9.3f}{r['peak_memory']:>10g}")
    print(f"{'lower bound':<22}{lb:>10g}{out['lower_bound']['bubble_ratio']:>9.3f}")
    print(f"fused vs serial: {r_ser.makespan / r_fused.makespan:.3f}x; search {found.seconds:.1f}s, "
          f"{found.evaluations} schedules evaluated" + (f"; chart: {ns.out}" if ns.out else ""))
    return 0
