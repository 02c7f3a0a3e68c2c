"""The published GRPO-family recipes on the real model, on the same budget: configs/smollm2_math.yaml under
rl.recipe grpo, dapo, gspo and dr_grpo (algos/policy_losses.py, config/algorithms.py RECIPES).

    python -m bench.losses                           # 4 recipes x seeds 0 1 2 (about 20 min a run on 2 cores)
    python -m bench.losses --recipes grpo dapo --seeds 0

Each run is `rlfuse run configs/smollm2_math.yaml rl.recipe=R run.seed=S` (a finished folder in
bench/.work/real_model/ is read, a killed one resumes). The page reports per recipe and seed the held-out exact match
before and after, the policy entropy and mean response length at the first and last iteration, the refills dynamic
sampling drew, and the minutes; no target: a fair comparison on one budget. Writes docs/benchmarks/losses.md and its
BENCHMARKS.md row.
"""

from __future__ import annotations

import argparse
import statistics

from bench.common import md_table, write_headline, write_section
from bench.real_model import describe_machine, read_json, rl_rows, run, stage_seconds

RECIPES = ("grpo", "dapo", "gspo", "dr_grpo")


def recipes_section(recipes: list[str], seeds: list[int]) -> tuple[str, str]:
    rows, after = [], {r: [] for r in recipes}
    for seed in seeds:
        for recipe in recipes:
            d = run("smollm2_math", seed, extra=(f"rl.recipe={recipe}",), tag=recipe)
            ev, metrics, secs = read_json(d / "eval.json"), rl_rows(d), stage_seconds(d)
            b, a = ev["before"]["reward_mean"], ev["after"]["reward_mean"]
            after[recipe].append(a)
            first, last = metrics[0], metrics[-1]
            refills = sum(m.get("rollout/refills", 0) for m in metrics)
            rows.append([recipe, seed, f"{b:.3f}", f"{a:.3f}", f"{a - b:+.3f}",
                         f"{first['train/entropy']:.2f} -> {last['train/entropy']:.2f}",
                         f"{first['rollout/length_mean']:.1f} -> {last['rollout/length_mean']:.1f}", refills,
                         f"{sum(secs.values()) / 60:.1f}"])
    table = md_table(["rl.recipe", "seed", "exact match, SFT model", "after", "gain", "entropy first -> last",
                      "length first -> last", "refills", "minutes"], rows)
    text = (f"### configs/smollm2_math.yaml under each recipe, seeds {seeds}\n\nCommand: `python -m bench.losses "
            f"--recipes {' '.join(recipes)} --seeds {' '.join(map(str, seeds))}`. Machine: {describe_machine()}.\n\n"
            f"{table}")
    figure = ", ".join(f"{r} {statistics.mean(after[r]):.3f}" for r in recipes)
    return text, f"held-out exact match after RL ({len(seeds)} seed(s)): {figure}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--no-write", action="store_true", help="print the table; write no page or headline")
    a = ap.parse_args()
    text, figure = recipes_section(a.recipes, a.seeds)
    print(text)
    if not a.no_write:
        write_section("losses_recipes", text, "losses")
        write_headline("losses_recipes", figure, "grpo (the same config, the same budget)",
                       f"python -m bench.losses --recipes {' '.join(a.recipes)} --seeds {' '.join(map(str, a.seeds))}",
                       describe_machine(), what="GRPO-family recipes on the real model (math)", page="losses")


if __name__ == "__main__":
    main()
