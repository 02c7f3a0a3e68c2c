"""The shipped real-model configs, run as a user runs them, and their figures (issue 28).

    python -m bench.real_model                      # both configs: math over seeds 0 1 2, then hh (about 70 min idle)
    python -m bench.real_model --configs math       # configs/smollm2_math.yaml over 3 seeds (about 32 min)
    python -m bench.real_model --configs hh         # configs/smollm2_hh.yaml (SFT -> RM -> PPO, seed 0)
    python -m bench.real_model --no-write           # print the tables only
    python -m bench.real_model --engines rlfuse vllm  # the math config on both rollout engines, seeds alternated
                                                      # (a Python with vLLM: docs/engines.md; about 70 min)

Each run is `rlfuse run configs/<config>.yaml run.seed=S run.dir=bench/.work/real_model/<config>-s<S>` with
run.threads set to the machine's cores (auto would take fewer when other work runs as the run starts); a finished
run's readings (its eval, summaries, metrics and samples, not its weights) are copied to bench/readings/<folder>/
with the commit it ran at, and a run with readings there is read, not run again (so an interrupted bench goes on
where it stopped, on this machine or a later one; delete both folders to measure afresh). Needs the model:
`bash scripts/install.sh smollm2`; the hh config also the hh-rlhf file in ../shared/data.

Math: held-out exact-match accuracy (200 problems never trained on, sampled at temperature 1) of the SFT model
(before RL) and after GRPO, per seed; targets (issue 28): at least +25 points on average, each seed's gain larger
than the seed-to-seed spread (max - min) of the accuracy after RL, the KL to the reference under the bound the
table states, at most 30 minutes per seed. hh: the reward model's held-out pairwise accuracy (target >= 0.60), the
held-out reward and KL before and after PPO (KL against the controller's target), the time (target <= 40 minutes).
The tables go to docs/benchmarks/real_model.md, the headline figures to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.common import ROOT, SHARED_DATA, WORK, machine, machine_short, md_table, write_headline, write_section

CONFIGS = {"math": "smollm2_math", "hh": "smollm2_hh"}
MATH_KL_BOUND = 2.0  # the bound the math runs are held to: KL to the reference, summed over a reply, every iteration
MATH_MINUTES, HH_MINUTES = 30, 40
CORES = os.cpu_count() or 1


def run_folder(config: str, seed: int, engine: str | None = None, tag: str = "") -> Path:
    """Where run() keeps the run of `config` at `seed` (named by its engine or, failing that, its tag)."""
    name = f"{config}-{engine}-s{seed}" if engine else f"{config}{'-' + tag if tag else ''}-s{seed}"
    return WORK / "real_model" / name


READINGS = ROOT / "bench" / "readings"
"""What the pages read of each finished run (not its weights), kept in the repository under the run folder's name:
a table over seeds outlives the machine that ran its first seed. Delete both folders to measure a run afresh."""
KEPT = ("eval.json", "config.yaml", "sft/summary.json", "rm/summary.json", "rl/summary.json", "rl/threads.txt",
        "rl/metrics.jsonl", "rl/eval_before.json", "rl/samples_after.json")


def finished(run_dir: Path) -> bool:
    """Whether the run in `run_dir` (bench/.work) finished here or its readings were kept before."""
    return (run_dir / "eval.json").exists() or (READINGS / run_dir.name / "eval.json").exists()


def source_commit() -> str:
    """The commit the code was at, marked where rlfuse/ or configs/ had changes not committed."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") or "?"
    return commit + ("+changes" if git("status", "--porcelain", "--", "rlfuse", "configs") else "")


def keep_readings(run_dir: Path, commit: str) -> Path:
    """Copy the KEPT files of a finished run to READINGS, with the commit it ran at; the copy's folder."""
    kept = READINGS / run_dir.name
    for rel in KEPT:
        if (run_dir / rel).exists():
            (kept / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(run_dir / rel, kept / rel)
    ended = time.gmtime((run_dir / "eval.json").stat().st_mtime)
    ran = {"commit": commit, "machine": describe_machine(), "finished": time.strftime("%Y-%m-%d %H:%M UTC", ended)}
    (kept / "ran.json").write_text(json.dumps(ran, indent=1) + "\n")
    return kept


def ran_on(readings: Path) -> dict:
    """The commit, machine and finishing time of the run whose readings these are ("?" where not known)."""
    return {"commit": "?", "machine": "?", "finished": "?"} | read_json(readings / "ran.json")


def machines(readings: list[Path]) -> str:
    """The machine(s) the runs of a table ran on, for its header."""
    return "; ".join(sorted({ran_on(d)["machine"] for d in readings})) or describe_machine()


def run(config: str, seed: int, engine: str | None = None, extra: tuple[str, ...] = (), tag: str = "") -> Path:
    """The readings (READINGS) of `rlfuse run configs/<config>.yaml run.seed=seed` (rollout.engine=engine where
    given, and the overrides `extra`, named by `tag` in the folder), run unless it already finished."""
    run_dir = run_folder(config, seed, engine, tag)
    name = run_dir.name
    if (READINGS / name / "eval.json").exists():
        return READINGS / name
    commit = "?"  # a run that finished in bench/.work before readings were kept: its commit is not known
    if not finished(run_dir):
        commit = source_commit()
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        resume = (run_dir / "config.yaml").exists()
        # a fresh run takes every core whatever the load at its start (auto would take fewer beside other work):
        # minutes compare between runs; a resumed run keeps the count it started with (run.threads in its config)
        threads = [] if resume or any(e.startswith("run.threads=") for e in extra) else [f"run.threads={CORES}"]
        cmd = [sys.executable, "-m", "rlfuse", "run", f"configs/{config}.yaml", f"run.seed={seed}",
               f"run.dir={run_dir}", *([f"rollout.engine={engine}"] if engine else []), *threads, *extra,
               *(["--resume", str(run_dir)] if resume else [])]
        print(f"[bench] {' '.join(cmd[2:])}", flush=True)
        with open(run_dir.parent / f"{name}.log", "a") as log:
            subprocess.run(cmd, check=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        # a finished run's RL checkpoint (weights and optimiser, 3x the saved model) is only for going on longer, which
        # a bench never does: at 1.6 GB each, a dozen filled the disk
        for kept in ("checkpoint.pt", "checkpoint.pt.prev"):
            (run_dir / "rl" / kept).unlink(missing_ok=True)
    return keep_readings(run_dir, commit)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def stage_seconds(run_dir: Path) -> dict:
    return {s: read_json(run_dir / s / "summary.json").get("seconds", 0.0) for s in ("sft", "rm", "rl")}


def rl_threads(run_dir: Path) -> str:
    """The torch threads the RL stage ran with (run.threads, or what auto chose on a busy machine): its minutes
    compare only with runs on as many."""
    path = run_dir / "rl" / "threads.txt"  # what auto chose; run.threads set: the saved config's
    if path.exists():
        return path.read_text().strip()
    config = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").exists() else {}
    return str((config.get("run") or {}).get("threads") or "?")


def rl_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rl" / "metrics.jsonl").read_text().splitlines() if line.strip()]


def math_section(seeds: list[int]) -> tuple[str, str]:
    rows, before, after, gains, worst_kl, worst_k1, minutes, above, iterations = [], [], [], [], [], [], [], 0, 0
    for seed in seeds:
        d = run(CONFIGS["math"], seed)
        ev, secs = read_json(d / "eval.json"), stage_seconds(d)
        b, a = ev["before"]["reward_mean"], ev["after"]["reward_mean"]
        kls = [r["reward/kl"] for r in rl_rows(d)]
        kl_max, over = max(kls), sum(kl > MATH_KL_BOUND for kl in kls)
        k1 = [r["reward/kl_k1"] for r in rl_rows(d) if "reward/kl_k1" in r]  # runs before it was logged: none
        above, iterations = above + over, iterations + len(kls)
        total = sum(secs.values()) / 60
        before.append(b), after.append(a), gains.append(a - b), worst_kl.append(kl_max), minutes.append(total)
        worst_k1.append(max(k1) if k1 else float("nan"))
        rows.append([seed, f"{b:.3f}", f"{a:.3f}", f"{a - b:+.3f}", f"{kl_max:.2f}", f"{worst_k1[-1]:.2f}",
                     f"{over} of {len(kls)}",
                     f"{ev['after']['kl']:.2f}", f"{secs['sft']:.0f}", f"{secs['rl']:.0f}", f"{total:.1f}"])
    spread = max(after) - min(after)
    mean_gain = statistics.mean(gains)
    verdicts = [
        f"mean gain {mean_gain * 100:+.1f} points (target >= +25): {'met' if mean_gain >= 0.25 else 'missed'}",
        f"every seed's gain above the seed-to-seed spread of the accuracy after RL ({spread * 100:.1f} points): "
        f"{'met' if min(gains) > spread else 'missed'}",
        f"KL to the reference (summed over a reply) at most {max(worst_kl):.2f} in any iteration of any seed, above "
        f"the bound in {above} of {iterations} iterations (bound {MATH_KL_BOUND}): "
        f"{'met' if max(worst_kl) <= MATH_KL_BOUND else 'missed'}; by the estimator the penalty uses (k3, clipped at "
        f"10 per token), and by k1 (log pi(y) / pi_ref(y), unbiased) at most {max(worst_k1):.2f}",
        f"at most {max(minutes):.1f} minutes per seed (target <= {MATH_MINUTES}): "
        f"{'met' if max(minutes) <= MATH_MINUTES else 'missed'}"]
    table = md_table(["seed", "exact match, SFT model", "after GRPO", "gain", "max KL in training", "max k1 KL",
                      f"iterations with KL > {MATH_KL_BOUND}", "held-out KL after", "SFT s", "RL s", "total min"], rows)
    text = (f"### configs/smollm2_math.yaml: GRPO on word problems, full fine-tuning, seeds {seeds}\n\n"
            f"Command: `python -m bench.real_model --configs math` (each seed `rlfuse run configs/smollm2_math.yaml "
            f"run.seed=S`). Machine: {describe_machine()}.\n\n{table}\n\nMean: {statistics.mean(before):.3f} -> "
            f"{statistics.mean(after):.3f}.\n\n" + "\n".join(f"- {v}" for v in verdicts))
    figure = (f"held-out exact match {statistics.mean(before):.3f} -> {statistics.mean(after):.3f} "
              f"({mean_gain * 100:+.1f} points, mean of {len(seeds)} seeds; seed-to-seed spread {spread * 100:.1f}), "
              f"KL <= "
              f"{max(worst_kl):.2f} ({above} of {iterations} iterations above {MATH_KL_BOUND}), "
              f"{min(minutes):.0f}-{max(minutes):.0f} min per seed")
    return text, figure


def engines_section(seeds: list[int], engines: list[str]) -> tuple[str, str]:
    """The math config on each rollout engine, the seeds alternated between them (A B A B): held-out exact match
    before and after, per seed and engine; the target: each other engine's mean gain within the seed-to-seed spread
    (max - min) of the first engine's gains."""
    gains, rows = {e: [] for e in engines}, []
    for seed in seeds:
        for engine in engines:
            d = run(CONFIGS["math"], seed, engine)
            ev = read_json(d / "eval.json")
            b, a = ev["before"]["reward_mean"], ev["after"]["reward_mean"]
            metrics = rl_rows(d)
            gap = [r["mismatch/logprob_abs_mean"] for r in metrics if "mismatch/logprob_abs_mean" in r]
            gains[engine].append(a - b)
            rows.append([engine, seed, f"{b:.3f}", f"{a:.3f}", f"{a - b:+.3f}", f"{max(r['reward/kl'] for r in metrics):.2f}",
                         f"{statistics.mean(gap):.4f}" if gap else "-"])
    first = engines[0]
    spread = max(gains[first]) - min(gains[first])
    verdicts = [f"{e}: gain {statistics.mean(gains[e]) * 100:+.1f} points against {first}'s "
                f"{statistics.mean(gains[first]) * 100:+.1f}; one seed, so no seed-to-seed spread to judge it by "
                f"(target: within {first}'s spread over 3 seeds)" for e in engines[1:]] if len(seeds) < 2 else [
                f"{e}: mean gain {statistics.mean(gains[e]) * 100:+.1f} points against {first}'s "
                f"{statistics.mean(gains[first]) * 100:+.1f} (seed-to-seed spread of {first}'s gains "
                f"{spread * 100:.1f}): "
                f"{'within' if abs(statistics.mean(gains[e]) - statistics.mean(gains[first])) <= spread else 'outside'}"
                for e in engines[1:]]
    table = md_table(["rollout.engine", "seed", "exact match, SFT model", "after GRPO", "gain", "max KL in training",
                      "mismatch / token"], rows)
    text = (f"### configs/smollm2_math.yaml on each rollout engine ({', '.join(engines)}), seeds {seeds}\n\n"
            f"Command: `python -m bench.real_model --engines {' '.join(engines)} --seeds {' '.join(map(str, seeds))}` "
            f"(each run `rlfuse run "
            f"configs/smollm2_math.yaml run.seed=S rollout.engine=E`, the engines alternated per seed; speed: "
            f"docs/benchmarks/engines.md). Machine: "
            f"{describe_machine()}.\n\n{table}\n\n" + "\n".join(f"- {v}" for v in verdicts))
    figure = "; ".join(f"{e}: {statistics.mean(gains[e]) * 100:+.1f} points" for e in engines) + (
        f" (mean of {len(seeds)} seeds; {first}'s seed-to-seed spread {spread * 100:.1f})" if len(seeds) > 1 else
        " of held-out exact match (one seed)")
    return text, figure


def hh_section(seed: int = 0) -> tuple[str, str]:
    d = run(CONFIGS["hh"], seed)
    ev, secs = read_json(d / "eval.json"), stage_seconds(d)
    acc = read_json(d / "rm" / "summary.json")["accuracy"]
    rows = rl_rows(d)
    kls = [r["reward/kl"] for r in rows]
    first, last = rows[: max(1, len(rows) // 5)], rows[-max(1, len(rows) // 5):]
    train_before = statistics.mean(r["reward/mean"] for r in first)
    train_after = statistics.mean(r["reward/mean"] for r in last)
    total = sum(secs.values()) / 60
    target = kl_target(d)
    table = md_table(["", "before PPO (SFT model)", "after PPO"], [
        ["held-out reward (reward model)", f"{ev['before']['reward_mean']:.3f}", f"{ev['after']['reward_mean']:.3f}"],
        ["held-out KL to the reference", f"{ev['before']['kl']:.3f}", f"{ev['after']['kl']:.3f}"],
        ["held-out reply length (tokens)", f"{ev['before']['mean_length']:.1f}", f"{ev['after']['mean_length']:.1f}"],
        [f"training reward, first / last {len(first)} iterations", f"{train_before:.3f}", f"{train_after:.3f}"]])
    verdicts = [
        f"reward model held-out pairwise accuracy {acc:.3f} (target >= 0.60): {'met' if acc >= 0.60 else 'missed'}",
        f"held-out reward {'rises' if ev['after']['reward_mean'] > ev['before']['reward_mean'] else 'does not rise'}"
        f" ({ev['before']['reward_mean']:.3f} -> {ev['after']['reward_mean']:.3f})",
        f"KL over the last {len(last)} iterations {statistics.mean(r['reward/kl'] for r in last):.2f} (target "
        f"{target}; max over the run {max(kls):.2f})",
        f"{total:.1f} minutes (SFT {secs['sft']:.0f} s, RM {secs['rm']:.0f} s, PPO {secs['rl']:.0f} s; target <= "
        f"{HH_MINUTES}): {'met' if total <= HH_MINUTES else 'missed'}"]
    samples = read_json(d / "rl" / "samples_after.json")
    text = (f"### configs/smollm2_hh.yaml: chat SFT -> reward model -> PPO with LoRA on one shared base, seed {seed}"
            f"\n\nCommand: `python -m bench.real_model --configs hh` (`rlfuse run configs/smollm2_hh.yaml`). Machine: "
            f"{describe_machine()}. Sample conversations before and after: the run's report.html.\n\n{table}\n\n"
            + "\n".join(f"- {v}" for v in verdicts) + (f"\n\n{len(samples)} held-out replies after PPO in "
                                                       "rl/samples_after.json." if samples else ""))
    figure = (f"reward-model accuracy {acc:.3f}; held-out reward {ev['before']['reward_mean']:.2f} -> "
              f"{ev['after']['reward_mean']:.2f}, KL {ev['after']['kl']:.2f} (rl.kl_target {target}); {total:.0f} min")
    return text, figure


def kl_target(run_dir: Path):
    for line in (run_dir / "config.yaml").read_text().splitlines():
        if line.strip().startswith("kl_target:"):
            return line.split(":", 1)[1].strip()
    return "none"


def describe_machine() -> str:
    m = machine()
    return f"{m['cpu']}, {m['cores']} cores, {m['gpu'] or 'no GPU'}, torch {m['torch']}, transformers {m['transformers']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["math", "hh"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="the math config's seeds")
    ap.add_argument("--no-write", action="store_true", help="print the tables; write no page or headline")
    ap.add_argument("--engines", nargs="+", choices=["rlfuse", "vllm"],
                    help="the math config on each of these rollout engines instead (seeds alternated)")
    a = ap.parse_args()
    if a.engines:
        text, figure = engines_section(a.seeds, a.engines)
        print(text + "\n")
        if not a.no_write:
            write_section("real_model_engines", text, "real_model")
            write_headline("real_model_engines", figure, "rlfuse's own engine, same seeds",
                           f"python -m bench.real_model --engines {' '.join(a.engines)} --seeds "
                           f"{' '.join(map(str, a.seeds))}", machine_short(),
                           what="Real model, math config: vLLM vs rlfuse's engine", page="real_model")
        return
    for name in a.configs:
        if name == "hh" and not (SHARED_DATA / "hh_rlhf_harmless_1800.jsonl.gz").exists():
            print(f"[bench] hh skipped: {SHARED_DATA / 'hh_rlhf_harmless_1800.jsonl.gz'} is absent")
            continue
        text, figure = math_section(a.seeds) if name == "math" else hh_section()
        print(text + "\n")
        if not a.no_write:
            write_section(f"real_model_{name}", text, "real_model")
            write_headline(f"real_model_{name}", figure, "the SFT model (before RL)",
                           f"python -m bench.real_model --configs {name}", machine_short(),
                           what=f"Real model: configs/{CONFIGS[name]}.yaml", page="real_model")


if __name__ == "__main__":
    main()
