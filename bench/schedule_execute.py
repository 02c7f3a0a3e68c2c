"""Execute a fused schedule on P gloo processes (CPU) and compare the measured bubble ratio with the simulator's,
the simulator given the measured mean forward/backward time of each model's stages.

    python bench/schedule_execute.py [--pp 4 --pp-small 2 --micro-batches 8 --micro-batches-small 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import WORK, machine, write_section  # noqa: E402
from rlfuse.schedule.build import fused, serial  # noqa: E402
from rlfuse.schedule.chart import gantt, simulated_spans  # noqa: E402
from rlfuse.schedule.execute import ExecSpec, execute, measured_bubble_ratio  # noqa: E402
from rlfuse.schedule.model import PipeModel, Problem, simulate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--pp-small", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--micro-batches-small", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    a = ap.parse_args()
    from rlfuse.data.task import build_default_task

    model_dir = build_default_task(6000, 0, 8, 256, 4, log=lambda *_: None).model_dir  # 8 layers: 2 per stage at P=4
    # plan with the big model twice as slow per stage as the small one (2x the layers per stage)
    plan = Problem.fused(a.pp, a.pp_small, a.micro_batches, a.micro_batches_small, 2, 1)
    spec = ExecSpec(str(model_dir), micro_batch_size=a.micro_batch_size, seq_len=a.seq_len)
    rows = []
    for name, sched in (("serial", serial(plan)), ("fused", fused(plan, seed=0, time_limit=20).schedule)):
        _, spans = execute(plan, sched, spec)
        makespan, bubble = measured_bubble_ratio(spans, plan.devices)
        dur = {(m, k): statistics.mean(e - s for _, t, s, e in spans if t.model == m and t.kind == k)
               for m in (0, 1) for k in ("F", "B")}
        measured = Problem(plan.devices, tuple(PipeModel(pm.stages, pm.replicas, pm.micro_batches, dur[(i, "F")],
                                                         dur[(i, "B")], pm.mem) for i, pm in enumerate(plan.models)))
        sim = simulate(measured, sched)
        rows.append((name, makespan, bubble, sim.makespan, sim.bubble_ratio, dur))
        gantt([(f"{name}, executed on {plan.devices} gloo processes: {makespan:.3f} s, bubble {bubble:.3f}", spans),
               (f"{name}, simulated with the measured task times: {sim.makespan:.3f} s, bubble {sim.bubble_ratio:.3f}",
                simulated_spans(measured, sim))], WORK / f"schedule_executed_{name}.png")
    lines = [f"Machine: {machine()['cpu']}, {machine()['cores']} cores; `python bench/schedule_execute.py` (P={a.pp}, "
             f"critic {a.pp_small} stages x {a.pp // a.pp_small} replicas, M {a.micro_batches}/{a.micro_batches_small}, "
             f"8-layer 256-dim GPT-2 actor and critic, micro-batch {a.micro_batch_size} x {a.seq_len} tokens, gloo).", "",
             "| schedule | measured makespan s | measured bubble | simulated makespan s | simulated bubble | mean F/B actor, critic (ms) |",
             "|---|---|---|---|---|---|"]
    for name, mk, bub, smk, sbub, dur in rows:
        lines.append(f"| {name} | {mk:.3f} | {bub:.3f} | {smk:.3f} | {sbub:.3f} | "
                     f"{dur[(0, 'F')] * 1e3:.1f}/{dur[(0, 'B')] * 1e3:.1f}, {dur[(1, 'F')] * 1e3:.1f}/{dur[(1, 'B')] * 1e3:.1f} |")
    lines += ["", "Charts: `bench/.work/schedule_executed_serial.png`, `bench/.work/schedule_executed_fused.png`."]
    write_section("schedule_execute", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
