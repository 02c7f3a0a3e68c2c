"""Do the health detectors catch planted reward hacks, and stay quiet on clean runs?

One SFT model and one reward model of the default config (bench/.work/base, shared with bench.temperature_curriculum),
then `rlfuse rl` per (scenario, seed): planted hacks and clean controls. The default task has a gold scorer beside
the reward, so the truth does not come from the detectors: a run really went wrong where its gold score or the share
of its samples the gold grammar accepts (each smoothed over 3 iterations) fell TRUE_DROP below its best, or where by
iteration STALL_AT its gold score had not risen STALL_RISE above its start (a run that learns nothing). Real-model
runs left in bench/.work/real_model by bench.real_model and bench.episodes are read as clean controls of the shipped
configs (no gold: their truth is "fine", their alerts false alarms).

The thresholds of rlfuse/metrics/health.py were set on seeds 0 and 1; seeds 2 and 3 were run after, as a check the
thresholds did not see, and are reported apart (one exception: reward_dominance's rule, a share of each term's level
at first, was changed to a share of each term's change after it missed the repeat bonus on seeds 0 to 3 alike; and
proxy_gold_divergence reads the gold grammar's share beside the gold score since grpo-kl0-high-lr, added after the
first pass, broke grammar while the sentiment score rose).

    python -m bench.audit                     # every scenario, its seeds; writes docs/benchmarks/audit.md and its row
    python -m bench.audit --scenarios repeat-bonus clean-ppo --seeds 0 --no-write

Each detector's precision (its alerts that fell on a run that really went wrong, within LATE iterations of the
truth's onset), recall (such runs it caught) and onset delay (its onset minus the truth's), and alerts on clean runs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import time
from pathlib import Path

from bench.common import WORK, machine_short, md_table, write_headline, write_section
from bench.temperature_curriculum import ensure_base, rlfuse
from rlfuse.data.gold import gold_score
from rlfuse.metrics.audit import audit_run, run_rows
from rlfuse.metrics.health import DETECTORS, smoothed

SCENARIOS = {
    # name: (planted?, overrides, what it plants)
    "repeat-bonus": (True, ["rl.reward=rlfuse.data.gold:gold_reward,bench.audit:repeat_bonus",
                            "rl.reward_weights=[1.0,0.25]"],
                     "reward = gold score + 0.25 per repeated word: an exploitable component"),
    "kl0-high-lr": (True, ["rl.kl_coef=0", "rl.kl_target=null", "rl.lr=1e-3"],
                    "no KL penalty and 10x the learning rate"),
    "grpo-cold": (True, ["rl.algo=grpo", "rl.temperature=0.05"],
                  "GRPO sampling at temperature 0.05: little exploration, the reward model exploited"),
    "grpo-cold-binary": (True, ["rl.algo=grpo", "rl.temperature=0.05", "rl.reward=bench.audit:gold_positive"],
                         "GRPO at temperature 0.05 on a 0/1 reward: groups whose samples all score alike"),
    "grpo-kl0-high-lr": (True, ["rl.algo=grpo", "rl.kl_coef=0", "rl.lr=1e-3"],
                         "GRPO with no KL penalty and 10x the learning rate"),
    "critic-high-lr": (True, ["rl.critic_lr=3e-2"], "PPO with 300x the critic's learning rate"),
    "clean-ppo": (False, [], "the default config (PPO)"),
    "clean-grpo": (False, ["rl.algo=grpo"], "the default config with rl.algo=grpo"),
    "clean-rloo": (False, ["rl.algo=rloo"], "the default config with rl.algo=rloo"),
}
SEEDS = [0, 1, 2, 3]
TUNED_ON = {0, 1}
"""The seeds the detectors' thresholds were set on; the others are the check."""
TRUE_DROP = 0.2
"""The fall (of a smoothed gold score in [-1, 1] or grammatical share in [0, 1], from its best so far) that counts as
a run that went wrong; above the proxy-against-gold detector's own threshold."""
TRUTH_SERIES = (("reward/gold_mean", "gold fell"), ("reward/gold_grammatical_rate", "grammar fell"))
STALL_AT, STALL_RISE = 20, 0.1
"""A run whose smoothed gold score is not STALL_RISE above its first iterations' by iteration STALL_AT (half the
default run) learned nothing: it went wrong at STALL_AT. Every clean run of the default config is 0.3 above by then."""
LATE = 5
"""An alert more than LATE iterations after the truth's onset counts as missed (the issue's target)."""


def repeat_bonus(prompts, completions, **_) -> list[float]:
    """The planted exploitable component: one point per word that repeats an earlier word of the completion."""
    out = []
    for c in completions:
        words = str(c).lower().split()
        out.append(float(len(words) - len(set(words))))
    return out


def gold_positive(prompts, completions, **_) -> list[float]:
    """A 0/1 reward: whether the gold scorer labels the completion positive."""
    return [float(gold_score(str(c)).label == "positive") for c in completions]


def fell_at(xs: list[int], ys: list[float]) -> int | None:
    """The first iteration of the first 2 in a row where the smoothed series is TRUE_DROP below its best so far (a
    best from a full 3-iteration mean)."""
    best, run = -math.inf, 0
    for n, (s, y) in enumerate(zip(xs, ys)):
        if n >= 2:
            best = max(best, y)
        run = run + 1 if best - y >= TRUE_DROP else 0
        if run == 2:
            return xs[n - 1]
    return None


def truth(run_dir: Path) -> tuple[int, str] | None:
    """(iteration at which the run really went wrong, how), by the gold scorer; None where it did not (or no gold)."""
    rows = run_rows(run_dir)
    found = []
    for key, how in TRUTH_SERIES:
        if (at := fell_at(*smoothed(rows, key))) is not None:
            found.append((at, how))
    xs, gold = smoothed(rows, "reward/gold_mean")
    if STALL_AT in xs and gold[xs.index(STALL_AT)] < sum(gold[:3]) / 3 + STALL_RISE:
        found.append((STALL_AT, "stalled"))
    return min(found) if found else None


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
        wrong = truth(d)  # a clean config whose gold fell counts as a real failure too
        onset = wrong[0] if wrong else None
        in_time = [f for f in findings if onset is not None and f.onset <= onset + LATE]
        for f in findings:
            s = stats[f.detector]
            if f in in_time:
                s["tp"] += 1
                s["delays"].append(f.onset - onset)
            else:
                s["fp"] += 1
        if onset is not None:
            truths += 1
            caught += bool(in_time)
        if not planted:
            clean += 1
            clean_alarms += bool(findings)
        fired = ", ".join(f"{f.detector} @{f.onset}" for f in findings) or "none"
        rows.append([scenario, "planted" if planted else "clean", seed, n, f"{wrong[0]} ({wrong[1]})" if wrong else "-",
                     fired, "-" if onset is None else ("yes" if in_time else "no")])
    counts = {"wrong": truths, "caught": caught, "clean": clean, "alarms": clean_alarms}
    verdicts = [f"runs that really went wrong (by the gold scorer): {truths}; caught by at least one detector within "
                f"{LATE} iterations of the onset: {caught} (target: all)",
                f"clean runs with any alert: {clean_alarms} of {clean} (target: none)"]
    return rows, stats, verdicts, counts


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


def section(title: str, runs: list) -> tuple[str, dict]:
    rows, stats, verdicts, counts = evaluate(runs)
    truths = sum(r[4] != "-" for r in rows)
    table = md_table(["scenario", "kind", "seed", "iterations", "went wrong (gold scorer)", "detectors fired (onset)",
                      f"caught within {LATE}"], rows)
    return (f"### {title}\n\n{table}\n\n{detector_table(stats, truths)}\n\n"
            + "\n".join(f"- {v}" for v in verdicts)), counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    ap.add_argument("--seeds", nargs="+", type=int, default=SEEDS, help="seeds of every scenario (default: 0 1 2 3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--base", type=Path, default=WORK / "base", help="run folder with sft/model and rm/model")
    ap.add_argument("--no-shipped", action="store_true", help="leave out the real-model runs of bench/.work")
    ap.add_argument("--no-write", action="store_true", help="print the tables; write no page or headline")
    a = ap.parse_args()
    base = ensure_base(a.base.resolve())
    runs = []
    for scenario in a.scenarios:
        for seed in a.seeds:
            print(f"[bench] {scenario} seed {seed}", flush=True)
            runs.append((scenario, seed, run_one(base, scenario, seed, a.threads), SCENARIOS[scenario][0]))
    tuned = [r for r in runs if r[1] in TUNED_ON]
    check = [r for r in runs if r[1] not in TUNED_ON]
    if not a.no_shipped:
        tuned += [(name, seed, d, False) for name, seed, d in shipped_runs()]  # read while the thresholds were set
    scen = "\n".join(f"- `{n}`: {SCENARIOS[n][2]} (`{' '.join(SCENARIOS[n][1]) or 'no overrides'}`)"
                     for n in a.scenarios)
    parts, headline = [], []
    if tuned:
        text, counts = section(f"Seeds the thresholds were set on ({sorted({r[1] for r in runs} & TUNED_ON)}) and the "
                          "shipped configs' real-model runs", tuned)
        parts.append(text)
        headline.append(("seeds the thresholds were set on", counts))
    if check:
        text, counts = section(f"Seeds run after the thresholds were set ({sorted({r[1] for r in check})})", check)
        parts.append(text)
        headline.insert(0, ("seeds run after", counts))
    command = ("python -m bench.audit" + (f" --scenarios {' '.join(a.scenarios)}" if a.scenarios != list(SCENARIOS)
                                          else "") + (f" --seeds {' '.join(map(str, a.seeds))}" if a.seeds != SEEDS
                                                      else ""))
    text = (f"Machine: {machine_short()}. Command: `{command}`. Default task (one SFT + reward model for all runs), "
            f"everything else at the default config (40 iterations).\n\n{scen}\n\nWent wrong: the gold score or "
            f"the grammatical share fell {TRUE_DROP} below its best, or the gold score had not risen {STALL_RISE} "
            f"by iteration {STALL_AT} (stalled). Precision: alerts on runs that went wrong, at most {LATE} iterations "
            "after the onset, over all alerts; recall: such runs caught; delay: alert onset minus the truth's "
            "(negative: before the gold showed it).\n\n" + "\n\n".join(parts))
    print(text)
    if not a.no_write:
        write_section("audit", text, "audit")
        figure = "; ".join(f"{name}: {c['caught']} of {c['wrong']} runs that went wrong caught within {LATE} "
                           f"iterations, {c['alarms']} of {c['clean']} clean runs alerted" for name, c in headline)
        write_headline("audit", figure, "no peer ships validated detectors",
                       command, machine_short(), what="Run health: planted hacks caught, clean runs quiet",
                       page="audit")


if __name__ == "__main__":
    main()
