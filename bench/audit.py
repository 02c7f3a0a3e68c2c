"""Do the health detectors catch planted reward hacks, and stay quiet on clean runs?

One SFT model and one reward model of the default config (bench/.work/base, shared with bench.temperature_curriculum),
then `rlfuse rl` per (scenario, seed): planted hacks and clean controls. The default task has a gold scorer beside
the reward, so the truth does not come from the detectors: a run really went wrong where its gold score (smoothed
over 3 iterations) fell TRUE_DROP below its best so far and stayed there to the end; the low-temperature GRPO run is
broken by construction from its first iteration (its samples within a group are near copies). Real-model runs left
in bench/.work/real_model by bench.real_model and bench.episodes are read as clean controls of the shipped configs.

    python -m bench.audit                     # every scenario, its seeds; writes docs/benchmarks/audit.md and its row
    python -m bench.audit --scenarios repeat-bonus clean-ppo --seeds 0 --no-write

Each detector's precision (its alerts that fell on a run that really went wrong, within LATE iterations of the
truth's onset), recall (such runs it caught) and onset delay (its onset minus the truth's), and alerts on clean runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

from bench.common import WORK, machine_short, md_table, write_headline, write_section
from bench.temperature_curriculum import ensure_base, rlfuse
from rlfuse.metrics.audit import audit_run, run_rows
from rlfuse.metrics.health import DETECTORS, smoothed

SCENARIOS = {
    # name: (planted?, overrides, what it plants)
    "repeat-bonus": (True, ["rl.reward=rlfuse.data.gold:gold_reward,bench.audit:repeat_bonus",
                            "rl.reward_weights=[1.0,0.25]"],
                     "reward = gold score + 0.25 per repeated word: an exploitable component"),
    "kl0-high-lr": (True, ["rl.kl_coef=0", "rl.kl_target=null", "rl.lr=1e-3"],
                    "no KL penalty and 10x the learning rate"),
    "grpo-cold": (True, ["rl.algo=grpo", "rl.temperature=0.05"], "GRPO sampling at temperature 0.05"),
    "clean-ppo": (False, [], "the default config (PPO)"),
    "clean-grpo": (False, ["rl.algo=grpo"], "the default config with rl.algo=grpo"),
    "clean-rloo": (False, ["rl.algo=rloo"], "the default config with rl.algo=rloo"),
}
SEEDS = {"clean-ppo": [0, 1, 2]}
"""Seeds per scenario where not the default [0, 1]."""
TRUE_DROP = 0.2
"""The gold score's fall (of a smoothed [-1, 1] score, from its best so far) that counts as a run that went wrong;
twice the proxy-against-gold detector's own threshold, and it must last to the end of the run."""
LATE = 5
"""An alert more than LATE iterations after the truth's onset counts as missed (the issue's target)."""
BY_CONSTRUCTION = {"grpo-cold": 1}
"""Scenarios broken from this iteration by their settings, whatever the gold says."""


def repeat_bonus(prompts, completions, **_) -> list[float]:
    """The planted exploitable component: one point per word that repeats an earlier word of the completion."""
    out = []
    for c in completions:
        words = str(c).lower().split()
        out.append(float(len(words) - len(set(words))))
    return out


def true_onset(run_dir: Path, scenario: str) -> int | None:
    """The iteration at which the run really went wrong, by the gold score (or by construction); None if it did not."""
    if scenario in BY_CONSTRUCTION:
        return BY_CONSTRUCTION[scenario]
    xs, gold = smoothed(run_rows(run_dir), "reward/gold_mean")
    if not gold:
        return None
    best, onset = gold[0], None
    for s, g in zip(xs, gold):
        if g > best:
            best, onset = g, None
        elif best - g >= TRUE_DROP and onset is None:
            onset = s
    return onset if onset is not None and max(gold) - gold[-1] >= TRUE_DROP else None


def run_one(base: Path, scenario: str, seed: int, threads: int) -> Path:
    run_dir = WORK / "audit" / f"{scenario}-s{seed}"
    if not (run_dir / "eval.json").exists():
        if run_dir.exists():
            subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        t = time.perf_counter()
        try:
            rlfuse("rl", f"run.dir={run_dir}", f"run.seed={seed}", f"run.threads={threads}",
                   f"rl.sft_path={base / 'sft' / 'model'}", f"rl.rm_path={base / 'rm' / 'model'}",
                   *SCENARIOS[scenario][1], log=WORK / "audit.log")
        except subprocess.CalledProcessError:  # a planted run may stop itself (a blown update): audit what it logged
            (run_dir / "eval.json").write_text(json.dumps({"stopped": True}))
        (run_dir / "wall.json").write_text(json.dumps({"wall_s": time.perf_counter() - t}))
    return run_dir


def shipped_runs() -> list[tuple[str, int, Path]]:
    """Finished real-model runs of the shipped configs (bench.real_model, bench.episodes) as clean controls."""
    out = []
    for d in sorted((WORK / "real_model").glob("*-s[0-9]")):
        if (d / "eval.json").exists():
            out.append((f"shipped {d.name.rsplit('-s', 1)[0]}", int(d.name.rsplit("-s", 1)[1]), d))
    return out


def evaluate(runs: list[tuple[str, int, Path, bool]]) -> tuple[list[list], dict, list[str]]:
    """Per-run rows, per-detector stats, and the verdict lines."""
    rows, stats = [], {d.name: {"tp": 0, "fp": 0, "delays": []} for d in DETECTORS}
    truths = caught = clean = clean_alarms = 0
    for scenario, seed, d, planted in runs:
        findings, n = audit_run(d)
        truth = true_onset(d, scenario) if planted else None
        if not planted and true_onset(d, scenario) is not None:
            truth = true_onset(d, scenario)  # a clean config whose gold fell: counted as a real failure
        in_time = [f for f in findings if truth is not None and f.onset <= truth + LATE]
        for f in findings:
            s = stats[f.detector]
            if f in in_time:
                s["tp"] += 1
                s["delays"].append(f.onset - truth)
            else:
                s["fp"] += 1
        if truth is not None:
            truths += 1
            caught += bool(in_time)
        if not planted:
            clean += 1
            clean_alarms += bool(findings)
        label = "planted" if planted else "clean"
        truth_txt = "-" if truth is None else (f"{truth} (by construction)" if scenario in BY_CONSTRUCTION
                                              else str(truth))
        fired = ", ".join(f"{f.detector} @{f.onset}" for f in findings) or "none"
        rows.append([scenario, label, seed, n, truth_txt, fired,
                     "-" if truth is None else ("yes" if in_time else "no")])
    verdicts = [f"planted hacks that really happened (by the gold score or by construction): {truths}; caught by at "
                f"least one detector within {LATE} iterations: {caught} (target: all)",
                f"clean runs with any alert: {clean_alarms} of {clean} (target: none)"]
    return rows, stats, verdicts


def detector_table(stats: dict, truths: int) -> str:
    out = []
    for d in DETECTORS:
        s = stats[d.name]
        alerts = s["tp"] + s["fp"]
        delays = s["delays"]
        out.append([d.name, alerts, f"{s['tp'] / alerts:.2f}" if alerts else "-",
                    f"{s['tp']}/{truths}" if truths else "-",
                    f"{statistics.median(delays):+g} ({min(delays):+d}..{max(delays):+d})" if delays else "-"])
    return md_table(["detector", "alerts", "precision", "recall (runs)", "onset delay, median (range)"], out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    ap.add_argument("--seeds", nargs="+", type=int, help="seeds for every scenario (default: 0 1, clean-ppo 0 1 2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--base", type=Path, default=WORK / "base", help="run folder with sft/model and rm/model")
    ap.add_argument("--no-shipped", action="store_true", help="leave out the real-model runs of bench/.work")
    ap.add_argument("--no-write", action="store_true", help="print the tables; write no page or headline")
    a = ap.parse_args()
    base = ensure_base(a.base.resolve())
    runs = []
    for scenario in a.scenarios:
        for seed in a.seeds or SEEDS.get(scenario, [0, 1]):
            print(f"[bench] {scenario} seed {seed}", flush=True)
            runs.append((scenario, seed, run_one(base, scenario, seed, a.threads), SCENARIOS[scenario][0]))
    if not a.no_shipped:
        runs += [(name, seed, d, False) for name, seed, d in shipped_runs()]
    rows, stats, verdicts = evaluate(runs)
    truths = sum(r[4] != "-" for r in rows)
    scen = "\n".join(f"- `{n}`: {SCENARIOS[n][2]} (`{' '.join(SCENARIOS[n][1]) or 'no overrides'}`)"
                     for n in a.scenarios)
    text = (f"Machine: {machine_short()}. Command: `python -m bench.audit"
            f"{' --scenarios ' + ' '.join(a.scenarios) if a.scenarios != list(SCENARIOS) else ''}"
            f"{' --seeds ' + ' '.join(map(str, a.seeds)) if a.seeds else ''}`. Default task (one SFT + reward model "
            f"for all runs), everything else at the default config.\n\n{scen}\n\n"
            f"Truth: the gold score fell {TRUE_DROP} below its best and stayed down, or broken by construction.\n\n"
            + md_table(["scenario", "kind", "seed", "iterations", "truth onset", "detectors fired (onset)",
                        f"caught within {LATE}"], rows)
            + "\n\n" + detector_table(stats, truths) + "\n\n" + "\n".join(f"- {v}" for v in verdicts))
    print(text)
    if not a.no_write:
        write_section("audit", text, "audit")
        write_headline("audit", "; ".join(verdicts), "no peer ships validated detectors",
                       "python -m bench.audit", machine_short(),
                       what="Run health: planted hacks caught, clean runs quiet", page="audit")


if __name__ == "__main__":
    main()
