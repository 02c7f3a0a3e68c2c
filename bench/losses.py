"""The published GRPO-family recipes on the real model, on the same budget: configs/smollm2_math.yaml under
rl.recipe grpo, dapo, gspo and dr_grpo (algos/policy_losses.py, config/algorithms.py RECIPES).

    python -m bench.losses                           # 4 recipes x seeds 0 1 2 (about 25 min a run on 2 cores)
    python -m bench.losses --recipes grpo dapo --seeds 0

Each run is `rlfuse run configs/smollm2_math.yaml rl.recipe=R run.seed=S` (a run whose readings
are in bench/readings/ is read, a killed one resumes). The page reports per recipe and seed the held-out exact match
before and after, the policy entropy and mean response length at the first and last iteration, the refills dynamic
sampling drew, the samples decoded, the share of trained groups whose rewards differ (the others carry no signal),
and the minutes, with a figure of the reward, entropy, length and that share per iteration (mean over seeds); no
target: a fair comparison on one budget. `--finished-only` reports the runs that have finished and runs nothing.
Writes docs/benchmarks/losses.md, docs/benchmarks/losses.png and the BENCHMARKS.md row.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.common import PAGES, md_table, write_headline, write_section  # noqa: E402
from bench.real_model import (describe_machine, finished, read_json, rl_rows, rl_threads, run,  # noqa: E402
                              run_folder, stage_seconds)

RECIPES = ("grpo", "dapo", "gspo", "dr_grpo")
CURVES = (("reward/mean", "reward of the trained samples"), ("train/entropy", "policy entropy (nats per token)"),
          ("rollout/length_mean", "mean response length (tokens)"),
          ("signal", "share of trained groups whose rewards differ"))
SMOOTH = 5
"""The figure's curves are trailing means over this many iterations: one batch of 16 prompts is noisy."""


def signal_share(row: dict) -> float:
    """The share of the iteration's trained groups with a reward spread (the rest have zero advantage)."""
    return 1.0 - row.get("reward/frac_zero_spread", 0.0)


def recipe_run(recipe: str, seed: int, finished_only: bool) -> Path | None:
    """The run of the math config under `recipe` (None with finished_only where it has not finished)."""
    if finished_only and not finished(run_folder("smollm2_math", seed, tag=recipe)):
        return None
    return run("smollm2_math", seed, extra=(f"rl.recipe={recipe}",), tag=recipe)


def trailing_mean(values: list[float], n: int = SMOOTH) -> list[float]:
    return [statistics.mean(values[max(0, i - n + 1):i + 1]) for i in range(len(values))]


def recipes_figure(curves: dict[str, list[list[dict]]], path: Path) -> Path:
    """Per recipe, the mean over its seeds of each CURVES series, smoothed: one panel per series."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (key, title) in zip(axes.flat, CURVES):
        for recipe, runs in curves.items():
            if not runs:
                continue
            n = min(len(rows) for rows in runs)
            per_seed = [[signal_share(r) if key == "signal" else r.get(key, float("nan")) for r in rows[:n]]
                        for rows in runs]
            ax.plot(range(1, n + 1), trailing_mean([statistics.mean(v) for v in zip(*per_seed)]),
                    label=f"{recipe} ({len(runs)} seed{'s' if len(runs) > 1 else ''})")
        ax.set(xlabel="RL iteration", title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"configs/smollm2_math.yaml under each rl.recipe (trailing mean over {SMOOTH} iterations)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def recipes_section(recipes: list[str], seeds: list[int], finished_only: bool = False) -> tuple[str, str, dict]:
    rows, after, gains, curves = [], {r: [] for r in recipes}, {r: [] for r in recipes}, {r: [] for r in recipes}
    for seed in seeds:
        for recipe in recipes:
            d = recipe_run(recipe, seed, finished_only)
            if d is None:
                continue
            ev, metrics, secs = read_json(d / "eval.json"), rl_rows(d), stage_seconds(d)
            b, a = ev["before"]["reward_mean"], ev["after"]["reward_mean"]
            after[recipe].append(a)
            gains[recipe].append(a - b)
            curves[recipe].append(metrics)
            first, last = metrics[0], metrics[-1]
            refills = sum(m.get("rollout/refills", 0) for m in metrics)
            drawn = sum(m.get("rollout/samples", 0) * (1 + m.get("rollout/refills", 0)) for m in metrics)
            signal = statistics.mean(signal_share(m) for m in metrics)
            rows.append([recipe, seed, f"{b:.3f}", f"{a:.3f}", f"{a - b:+.3f}",
                         f"{first['train/entropy']:.2f} -> {last['train/entropy']:.2f}",
                         f"{first['rollout/length_mean']:.1f} -> {last['rollout/length_mean']:.1f}", f"{signal:.2f}",
                         refills, drawn, f"{sum(secs.values()) / 60:.1f}", rl_threads(d)])
    table = md_table(["rl.recipe", "seed", "exact match, SFT model", "after", "gain", "entropy first -> last",
                      "length first -> last", "groups with a signal", "refills", "samples decoded", "minutes",
                      "threads"], rows)
    done = [r for r in recipes if after[r]]
    seeds_of = {r: len(after[r]) for r in done}
    per_recipe = md_table(["rl.recipe", "seeds", "exact match after RL, mean", "min - max", "gain, mean"],
                          [[r, seeds_of[r], f"{statistics.mean(after[r]):.3f}",
                            f"{min(after[r]):.3f} - {max(after[r]):.3f}", f"{statistics.mean(gains[r]):+.3f}"]
                           for r in done])
    flag = " --finished-only" if finished_only else ""
    ran = sorted({row[1] for row in rows})
    text = (f"### configs/smollm2_math.yaml under each recipe, seeds {ran}\n\nCommand: `python -m bench.losses "
            f"--recipes {' '.join(recipes)} --seeds {' '.join(map(str, seeds))}{flag}`. Machine: "
            f"{describe_machine()}. Each run: SFT, then 60 GRPO iterations of 16 prompts x 8 samples; exact match on "
            "the held-out problems before and after RL. \"Groups with a signal\": the mean share of an iteration's "
            "trained groups whose 8 rewards differ (the others have zero advantage); dapo refills (rl.dynamic_sampling"
            ", 16 more prompts a draw, at most rl.max_refills = 4 draws) until 16 groups have one. Minutes compare "
            "only between runs on as many threads (a run started beside another is given fewer).\n\n"
            f"{per_recipe}\n\nEach run:\n\n{table}\n\n![reward, entropy, length and signal per iteration](losses.png)")
    figure = ", ".join(f"{r} {statistics.mean(after[r]):.3f}" + (f" ({seeds_of[r]} seeds)" if seeds_of[r] != max(
        seeds_of.values()) else "") for r in done)
    n = max(seeds_of.values()) if seeds_of else 0
    return text, f"held-out exact match after RL (mean of {n} seed(s)): {figure}", curves


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--finished-only", action="store_true", help="report the finished runs; start none")
    ap.add_argument("--no-write", action="store_true", help="print the table; write no page or headline")
    a = ap.parse_args()
    text, figure, curves = recipes_section(a.recipes, a.seeds, a.finished_only)
    print(text)
    if not a.no_write:
        recipes_figure(curves, PAGES / "losses.png")
        write_section("losses_recipes", text, "losses")
        write_headline("losses_recipes", figure, "grpo (the same config, the same budget)",
                       f"python -m bench.losses --recipes {' '.join(a.recipes)} --seeds {' '.join(map(str, a.seeds))}"
                       + (" --finished-only" if a.finished_only else ""),
                       describe_machine(), what="GRPO-family recipes on the real model (math)", page="losses")


if __name__ == "__main__":
    main()
