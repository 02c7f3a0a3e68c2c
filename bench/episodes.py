"""Multi-turn episodes learning on the real model: the calculator tool task against the same pipeline with tools off.

    python -m bench.episodes                     # configs/smollm2_calculator.yaml and its tools-off twin, seeds 0 1 2
    python -m bench.episodes --seeds 0           # one seed of each
    python -m bench.episodes --guess             # also configs/smollm2_guess.yaml (seed 0): turns to find the number

Each run is `rlfuse run configs/<config>.yaml run.seed=S` (a run whose readings are in bench/readings/ is read, not
run again; a killed one resumes). The page reports, per seed and config, the held-out exact match of the SFT
model and after GRPO, and with tools the share of episodes that called the calculator and of calls that were well
formed, before and after; the minutes each seed took; one held-out episode before and after RL (the first whose
reward RL changed), every turn shown. The guessing game: the held-out games' turns, reward (1 / guesses when
found) and the share cut at rl.max_turns, before and after GRPO. `--finished-only` reports the runs that have
finished and starts none. Writes docs/benchmarks/episodes.md and its BENCHMARKS.md row.
"""

from __future__ import annotations

import argparse
import statistics

from bench.common import md_table, write_headline, write_section
from bench.real_model import finished, machines, ran_on, read_json, rl_threads, run, run_folder, stage_seconds

SHOWN_CHARS = 1500
"""An episode shown on the page is cut after this many characters."""


def reward_of(text: str) -> str | None:
    """The reward an evaluated episode ends with ("... [reward 1]", rlfuse/evaluation.py), as written."""
    tail = text.rstrip()
    return tail[tail.rindex("[reward ") + 8:-1] if tail.endswith("]") and "[reward " in tail else None


def episodes_shown(run_dir, title: str) -> str:
    """One held-out episode before RL (rl/eval_before.json) and after (rl/samples_after.json), every turn: the first
    whose reward RL changed, else the first."""
    before = read_json(run_dir / "rl" / "eval_before.json").get("samples") or []
    after = read_json(run_dir / "rl" / "samples_after.json")
    after = after if isinstance(after, list) else after.get("samples", []) if isinstance(after, dict) else []
    changed = [i for i, (b, a) in enumerate(zip(before, after)) if reward_of(str(b)) != reward_of(str(a))]
    i = changed[0] if changed else 0
    which = f"held-out episode {i + 1}, the first whose reward RL changed" if changed else "the first held-out episode"
    out = [f"{title}, {which}:"]
    for when, texts in (("before RL", before), ("after RL", after)):
        if len(texts) > i:
            text = str(texts[i])
            out.append(f"\n{when}:\n\n```text\n{text[:SHOWN_CHARS]}{' ...' if len(text) > SHOWN_CHARS else ''}\n```")
    return "\n".join(out)


CONFIGS = {"tools": "smollm2_calculator", "no tools": "smollm2_calculator_notools"}
MINUTES = 40
"""The issue's budget per seed on 2 cores."""
FULL_THREADS = 2
"""Runs on this many torch threads (both cores to themselves) are held to MINUTES."""


NONE_FINISHED = "no run finished yet"


def calculator_section(seeds: list[int], finished_only: bool = False) -> tuple[str, str, str]:
    """The page's section, the headline figure and the machine(s) the runs ran on."""
    rows, after, minutes, dirs = [], {name: {} for name in CONFIGS}, [], []
    for seed in seeds:
        for name, config in CONFIGS.items():
            if finished_only and not finished(run_folder(config, seed)):
                continue
            d = run(config, seed)
            dirs.append(d)
            ev, secs = read_json(d / "eval.json"), stage_seconds(d)
            b, a = ev["before"], ev["after"]
            after[name][seed] = a["reward_mean"]
            total, threads = sum(secs.values()) / 60, rl_threads(d)
            if threads == str(FULL_THREADS) and name == "tools":  # the budget is the tool task's
                minutes.append(total)
            calls = lambda e: (f"{e['tool_calls']:.2f} / {e['tool_calls_valid']:.2f}" if "tool_calls" in e else "-")
            rows.append([name, seed, f"{b['reward_mean']:.3f}", f"{a['reward_mean']:.3f}",
                         f"{a['reward_mean'] - b['reward_mean']:+.3f}", calls(b), calls(a), f"{total:.1f}", threads,
                         ran_on(d)["commit"]])
    paired = sorted(set(after["tools"]) & set(after["no tools"]))  # seeds with both runs: the comparison's
    mean = lambda name: statistics.mean(after[name][seed] for seed in paired) if paired else float("nan")
    table = md_table(["config", "seed", "exact match, SFT model", "after GRPO", "gain",
                      "calls per episode / well formed, before", "after", "minutes", "threads", "commit"], rows)
    verdicts = [f"with tools: held-out exact match {mean('tools'):.3f} after GRPO against {mean('no tools'):.3f} "
                f"without (mean over seeds {paired})" if paired else "no seed has both runs yet: no comparison",
                f"at most {max(minutes):.1f} minutes per run with tools on {FULL_THREADS} threads (target <= "
                f"{MINUTES}): {'met' if max(minutes) <= MINUTES else 'missed'}" if minutes else
                f"no run with tools had {FULL_THREADS} threads: no reading of the {MINUTES}-minute target"]
    flag = " --finished-only" if finished_only else ""
    text = (f"### configs/smollm2_calculator.yaml against tools off, seeds {sorted({row[1] for row in rows})}\n\n"
            f"Command: `python -m bench.episodes --seeds {' '.join(map(str, seeds))}{flag}` (each run `rlfuse run "
            f"configs/<config>.yaml run.seed=S`). Machine: {machines(dirs)}. Minutes compare only between runs "
            "on as many threads (a run started beside another is given fewer).\n\n"
            f"{table}\n\n" + "\n".join(f"- {v}" for v in verdicts))
    figure = (f"exact match with a calculator tool {mean('tools'):.3f} vs {mean('no tools'):.3f} without, after "
              f"GRPO ({len(paired)} seed(s))" if paired else
              f"exact match with a calculator tool after GRPO {statistics.mean(after['tools'].values()):.3f} "
              f"({len(after['tools'])} seed(s); tools off not yet run)" if after["tools"] else NONE_FINISHED)
    shown = next((row[1] for row in rows if row[0] == "tools"), None)
    if shown is not None:
        text += "\n\n" + episodes_shown(run(CONFIGS["tools"], shown), f"With tools, seed {shown}")
    return text, figure, machines(dirs)


def guess_section(seed: int = 0) -> str:
    d = run("smollm2_guess", seed)
    ev, secs = read_json(d / "eval.json"), stage_seconds(d)
    b, a = ev["before"], ev["after"]
    rows = [[name, f"{b.get(key, float('nan')):.3f}", f"{a.get(key, float('nan')):.3f}"]
            for name, key in (("turns per game", "turns"), ("reward (1 / guesses, 0 if not found)", "reward_mean"),
                              ("share cut at rl.max_turns", "truncated"))]
    return (f"### configs/smollm2_guess.yaml, seed {seed}\n\nCommand: `python -m bench.episodes --guess` (`rlfuse run "
            f"configs/smollm2_guess.yaml run.seed={seed}`), {sum(secs.values()) / 60:.1f} minutes on "
            f"{rl_threads(d)} thread(s) (wall time: longer where other work ran beside it), commit "
            f"{ran_on(d)['commit']}. Machine: "
            f"{machines([d])}. Held-out games ({b.get('n', '?')}), SFT model against after GRPO:\n\n"
            + md_table(["", "SFT model", "after GRPO"], rows) + "\n\n" + episodes_shown(d, "The guessing game"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--guess", action="store_true", help="also the guessing game (configs/smollm2_guess.yaml)")
    ap.add_argument("--finished-only", action="store_true", help="report the finished runs; start none")
    ap.add_argument("--no-write", action="store_true", help="print the table; write no page or headline")
    a = ap.parse_args()
    text, figure, ran_on_machines = calculator_section(a.seeds, a.finished_only)
    calculator_ran = figure != NONE_FINISHED  # else the page and headline keep what they said
    print(text)
    guess_ready = not a.finished_only or finished(run_folder("smollm2_guess", a.seeds[0]))
    guess = guess_section(a.seeds[0]) if a.guess and guess_ready else None
    if guess:
        print(guess)
    if not a.no_write and guess:
        write_section("episodes_guess", guess, "episodes")
    if not a.no_write and calculator_ran:
        write_section("episodes_calculator", text, "episodes")
        write_headline("episodes_calculator", figure, "the same pipeline with tools off",
                       f"python -m bench.episodes --seeds {' '.join(map(str, a.seeds))}"
                       + (" --finished-only" if a.finished_only else ""), ran_on_machines,
                       what="Tool use learned on the real model (calculator task)", page="episodes")


if __name__ == "__main__":
    main()
