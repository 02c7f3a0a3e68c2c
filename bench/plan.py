"""The planner's predictions against real runs (issue 13, item 4): plans for 2 workers run for a few iterations on
the default task and on real IMDb prompts, predicted vs measured per stage from each run's rl/metrics.jsonl.

    python -m bench.plan --models RUN_DIR     # RUN_DIR/sft/model and RUN_DIR/rm/model (e.g. an `rlfuse run` folder)
    python -m bench.plan                      # first trains them (`rlfuse sft`, `rlfuse rm`, default config)
    python -m bench.plan --models RUN_DIR --fresh --repeats 3   # rerun every plan (not reusing earlier runs)
    python -m bench.plan --paper              # the at-scale predictions (`rlfuse plan --paper`) into the page
    python -m bench.plan --tasks smollm2_math smollm2_hh --iterations 4 --repeats 1   # the real model (issue 28)

Inputs of the predictions, all taken before any plan runs: the machine profile (`rlfuse plan --profile`, measured at
the start, Ray overheads included), the config, the mean prompt tokens of the task and the distinct prompt lengths
in an iteration's prompts (the first iterations' prompts tokenised as `rlfuse plan` does,
rlfuse/models/prompt_workload.py: one prefill call per length), and the response lengths (mean,
longest) and the prompts (mean tokens, distinct lengths) of each iteration of a single-process calibration run per
task, as many iterations as the plans run: samples do not depend on the placement, so every plan decodes the same
prompts and lengths, and the lengths drift as the policy trains. A plan's prediction per stage is the median over
iterations 2..N of each iteration's prediction from its own prompts and lengths, as its measurement is the median of each iteration's time; plans are ranked by it. Each plan runs --repeats
times (2 by default), the repeats interleaved (every plan once, then every plan again) so that a change of load
falls on all plans alike. Measured, per run and iteration 2..N (the first warms up): time/rollout, time/training,
time/weight_sync, time/iteration, and each worker's peak RSS (worker/<i>/rss_peak_mb); per plan and stage: the
median over the iterations of each iteration's median over the runs (iteration i is the same work in every run), the
median of the peak RSS over the runs, and the spread of the runs' own median iteration times ((max - min) / median).
Reported: relative error of iteration time (mean, max), Kendall tau of predicted vs measured iteration times, the
planner's choice against the best measured plan, memory error per worker, the run-to-run spread. Writes the
`plan_bench` section of docs/benchmarks/plan.md and the planner's row of BENCHMARKS.md; `--paper` writes the
`plan_paper` section of the same page."""

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

from bench.common import ROOT, SHARED_DATA, WORK, machine_short, md_table, write_headline, write_section

IMDB = SHARED_DATA / "imdb_reviews_2000.csv"
TASKS = {  # task -> (config file, None for the embedded default; its overrides)
    "default": (None, []),
    "imdb": (None, ["data.kind=imdb", f"data.path={IMDB}"]),
    "smollm2_math": (ROOT / "configs" / "smollm2_math.yaml", []),
    "smollm2_hh": (ROOT / "configs" / "smollm2_hh.yaml", []),
}
REAL_MODEL = ("smollm2_math", "smollm2_hh")
DEFAULT_TASKS = ["default", "imdb"]
"""The real-model tasks: each plans and runs its shipped config from the SFT (and reward model) of its seed-0 run by
`python -m bench.real_model` (bench/.work/real_model/<task>-s0), and predicts from a profile of its own model's shape
(`rlfuse plan CONFIG --profile`): the embedded model's rates do not carry to a 576-wide model."""
# which plans run besides the planner's choice: (strategy, micro-batch, checkpointing) per task; migration as the
# config (0.2). A micro-batch that gives the same per-rank micro-batches as another is the same plan (spec.dp_micro_size:
# on 2 flattened ranks micro 16 trains 8 rows per rank, as micro 8 does) and runs once.
RUNS = {
    "default": [("flattened", 16, False), ("separated", 16, False), ("interleaved", 16, False),
                ("flattened", 4, False), ("flattened", 16, True), ("flattened", 2, False)],
    "imdb": [("flattened", 16, False), ("separated", 16, False), ("interleaved", 16, False), ("flattened", 4, False)],
    # micro 8: plans first run after the cost model's fixes for prompt sharing and step-bounded chunks, which the
    # micro-32 runs showed; they check the fixes on runs the fixes were not read from
    # micro 16: first run after the cost model's second pass for prefix-shared micro-batches (2026-11-27), which
    # the micro-8 runs showed
    # fsdp: the planner's choice of 2026-11-27 22:02, its collectives then priced at DDP's rate (run: 53 s an
    # iteration, the median of 2, against 32.6 predicted), kept to check them at FSDP's own (fsdp_bytes_s)
    "smollm2_math": [("flattened", 32, False), ("separated", 32, False), ("interleaved", 32, False),
                     ("flattened", 8, False), ("separated", 8, False), ("flattened", 16, False),
                     ("separated", 16, False), ("flattened", 32, False, "fsdp")],
    # the shared base now runs flattened on 2 Ray workers (each holding the base and the roles' adapters): micro 8
    # and 2 (4 and 1 rows per rank), and the single process at micro 4 (the plans of the 2026-11-24 rows)
    "smollm2_hh": [("flattened", 8, False), ("flattened", 2, False), ("single", 4, False)],
}


def rlfuse(*args: str, log: Path) -> None:
    env = os.environ | {"TRANSFORMERS_VERBOSITY": "error"}
    with log.open("w") as f:
        subprocess.run([sys.executable, "-m", "rlfuse", *args], check=True, stdout=f, stderr=subprocess.STDOUT, env=env,
                       cwd=ROOT)


def ensure_models(work: Path, models: Path | None) -> Path:
    if models is not None:
        return models
    out = work / "models"
    if not (out / "rm" / "model" / "config.json").exists():
        rlfuse("sft", f"run.dir={out}", "run.quiet=true", log=work / "sft.log")
        rlfuse("rm", f"run.dir={out}", "run.quiet=true", log=work / "rm.log")
    return out


def task_models(task: str, models: Path) -> Path:
    """The run folder whose sft/model (and rm/model) the task's RL starts from: `models` for the embedded model's
    tasks, the seed-0 run of bench.real_model for a real-model task."""
    if task not in REAL_MODEL:
        return models
    run = WORK / "real_model" / f"{task}-s0"
    if not (run / "sft" / "model" / "config.json").exists():
        raise SystemExit(f"[plan bench] {task}: no SFT model in {run}; run `python -m bench.real_model --configs "
                         f"{task.removeprefix('smollm2_')} --seeds 0` first")
    return run


def task_config(task: str) -> Path | None:
    return TASKS[task][0]


def common_overrides(models: Path, task: str, iterations: int) -> list[str]:
    models = task_models(task, models)
    rm = [f"rl.rm_path={models / 'rm' / 'model'}"] if (models / "rm" / "model").exists() else []
    return [f"rl.sft_path={models / 'sft' / 'model'}", *rm, f"rl.iterations={iterations}", "rl.eval_prompts=0",
            "run.quiet=true", *TASKS[task][1]]


def rl_args(models: Path, task: str, iterations: int) -> list[str]:
    """`rlfuse rl`'s arguments for the task: its config file, if any, then the overrides."""
    config = task_config(task)
    return [*([str(config)] if config else []), *common_overrides(models, task, iterations)]


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rl" / "metrics.jsonl").read_text().splitlines() if line.strip()]


STAGES = ("rollout", "train", "sync", "iteration")
METRIC = {"rollout": "time/rollout", "train": "time/training", "sync": "time/weight_sync",
          "iteration": "time/iteration"}


def measured(run: Path) -> dict:
    """One run's medians over its iterations after the first (which warms up: first calls, allocator growth), and
    each of those iterations' seconds per stage (per_iteration)."""
    rows = metrics(run)[1:]
    per = {k: [r[METRIC[k]] for r in rows] for k in STAGES}
    ranks = sorted({int(k.split("/")[1]) for r in rows for k in r if k.startswith("worker/") and k.endswith("rss_mb")})
    # the peak since the worker started where the workers report it (training included), else the largest sample
    rss = lambda w: max(r.get(f"worker/{w}/rss_peak_mb", r.get(f"worker/{w}/rss_mb", 0.0)) for r in rows)
    return {**{k: statistics.median(v) for k, v in per.items()}, "rss_mb": {w: rss(w) for w in ranks},
            "per_iteration": per}


def median_of_runs(runs: list[dict]) -> dict:
    """A plan's measurement: per stage, the median over the iterations of each iteration's median over the runs
    (every run of every plan decodes and trains the same samples at iteration i, so a run slowed for a few
    iterations by something else on the machine is outvoted there, not carried into its whole median); the median
    over the runs of each worker's peak RSS; the spread of the runs' own medians of iteration time, (max - min) /
    median. Runs stored without their iterations: the median over the runs of each run's median."""
    per = [r.get("per_iteration") for r in runs]
    if all(per) and len({len(p["iteration"]) for p in per}) == 1:
        out = {k: statistics.median(statistics.median(p[k][i] for p in per) for i in range(len(per[0][k])))
               for k in STAGES}
    else:
        out = {k: statistics.median(r[k] for r in runs) for k in STAGES}
    out["rss_mb"] = {w: statistics.median(r["rss_mb"][w] for r in runs) for w in runs[0]["rss_mb"]}
    its = [r["iteration"] for r in runs]
    out["spread"] = (max(its) - min(its)) / statistics.median(its)
    out["iterations"] = its
    return out


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a over all pairs (ties count as neither concordant nor discordant)."""
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            x, y = a[i] - a[j], b[i] - b[j]
            s += (x * y > 0) - (x * y < 0)
    return s / (n * (n - 1) / 2) if n > 1 else float("nan")


def plans_for(task: str, models: Path, profile_path: Path, inputs: dict) -> list:
    """Every plan for the task's workers (2), ranked, from the profile and the
    measured inputs (lengths, prompt tokens, distinct prompt lengths): no model runs, so a stored run can be
    predicted again in a second."""
    from rlfuse.config import load_config
    from rlfuse.plan.planner import plan, problem_from_config
    from rlfuse.plan.profiles import load_profile

    cfg = load_config(task_config(task), common_overrides(models, task, 3))
    inputs = {k: v for k, v in inputs.items() if k not in ("iteration_lengths", "iteration_prompts")}
    inputs["lengths"] = tuple(inputs["lengths"]) if inputs.get("lengths") else None
    return plan(problem_from_config(cfg, load_profile(profile_path), workers=2, **inputs))


def iteration_lengths(run: Path) -> list[tuple[float, int]]:
    """(mean, longest) response tokens of each iteration after the first: the iterations `measured` takes."""
    return [(r["rollout/length_mean"], int(r["rollout/length_max"])) for r in metrics(run)[1:]]


def iteration_prompts(run: Path) -> list[tuple[float, float]]:
    """(mean tokens, distinct lengths) of the prompts of each iteration after the first, as the run recorded them:
    the iterations `measured` takes. Every run of a task draws the same prompts at iteration i (samples depend on the
    seed and the prompt, not the placement). On smollm2_hh their mean went 85, 123, 137, 151 tokens over iterations
    1-4, so the prompts of iterations 1-3 (115 on average) priced iterations 2-4 (137) 6-8% low."""
    rows = metrics(run)[1:]
    if not all("rollout/prompt_length_mean" in r for r in rows):  # a run from before rlfuse logged them: none, not
        return []                                                  # some (the i-th would price another iteration)
    return [(r["rollout/prompt_length_mean"], r["rollout/prompt_lengths_distinct"]) for r in rows]


def predicted_seconds(task: str, models: Path, profile_path: Path, inputs: dict) -> dict:
    """label -> predicted seconds per stage, the median over the measured iterations of each one's prediction
    from its own response lengths (as `measured` takes the median of each one's time): the policy's lengths drift
    as it trains, the same in every plan (samples do not depend on the placement). Without per-iteration lengths
    (a results.json from before them): the prediction at the calibration's median lengths. Each iteration is priced
    at its own prompts (mean tokens, distinct lengths) where all of them were recorded, else at the measured mean."""
    per = inputs.get("iteration_lengths") or [inputs["lengths"]]
    prompts = inputs.get("iteration_prompts") or []
    at = lambda i: ({"prompt_tokens": prompts[i][0], "prompt_lengths": prompts[i][1]} if len(prompts) == len(per)
                    else {})  # each iteration's own prompts where they were recorded, else the measured mean's
    runs = [{pl.label(): pl.seconds
             for pl in reversed(plans_for(task, models, profile_path, dict(inputs, lengths=L, **at(i))))}
            for i, L in enumerate(per)]
    return {label: {k: statistics.median(r[label][k] for r in runs) for k in runs[0][label]} for label in runs[0]}


def ranked_plans(task: str, models: Path, profile_path: Path, inputs: dict) -> tuple[list, dict]:
    """Every plan, ranked as the planner ranks them but by the time predicted over the measured iterations, and
    those predictions (predicted_seconds)."""
    seconds = predicted_seconds(task, models, profile_path, inputs)
    plans = sorted(plans_for(task, models, profile_path, inputs),
                   key=lambda p: (not p.fits, seconds[p.label()]["iteration"], p.peak_bytes))
    return plans, seconds


def predict_all(task: str, models: Path, profile_path: Path, work: Path,
                iterations: int) -> tuple[dict, list, dict]:
    from rlfuse.config import load_config
    from rlfuse.metrics.tracker import measured_lengths
    from rlfuse.models.prompt_workload import measure_prompts
    from rlfuse.plan.spec import dp_micro_size

    # the calibration runs as many iterations as the plans do: its lengths are the measured window's
    calib = work / f"calibrate_{task}"
    if not (calib / "rl" / "metrics.jsonl").exists() or len(metrics(calib)) < iterations:
        shutil.rmtree(calib, ignore_errors=True)
        rlfuse("rl", *rl_args(models, task, iterations), "run.threads=1", f"run.dir={calib}",
               log=work / f"calibrate_{task}.log")
        drop_weights(calib)
    cfg = load_config(task_config(task), common_overrides(models, task, 3))
    prompts = measure_prompts(cfg, lambda m: None)  # rl.sft_path's tokenizer, the run's first iterations' batches
    inputs = {"lengths": measured_lengths(calib), "prompt_tokens": prompts.tokens, "prompt_lengths": prompts.distinct,
              "prompt_longest": prompts.longest,
              "iteration_lengths": iteration_lengths(calib)[: iterations - 1],
              "iteration_prompts": iteration_prompts(calib)[: iterations - 1]}
    plans, seconds = ranked_plans(task, models, profile_path, inputs)
    chosen = [plans[0]]  # the planner's own choice always runs
    for strategy, micro, ckpt, *parallel in RUNS[task]:
        ranks = lambda p: sum(g.workers for g in p.spec.groups if "actor" in g.roles)
        wanted = parallel[0] if parallel else cfg.rl.train_parallel  # DDP (data) or FSDP: as configured unless named
        same = [p for p in plans if p.strategy == strategy and p.gradient_checkpointing == ckpt
                and dp_micro_size(cfg.rl.mini_batch_size, p.micro_batch_size, ranks(p))
                == dp_micro_size(cfg.rl.mini_batch_size, micro, ranks(p))
                and (not parallel or p.train_parallel == wanted)]
        if not same:
            print(f"[plan bench] {task}: no plan {strategy} micro {micro} ckpt {ckpt} {wanted} among the candidates",
                  file=sys.stderr)
            continue
        # migration and the training's parallelism as configured (or named) where they apply
        configured = lambda p: (p.migrate_below == cfg.rollout.migrate_below,
                                (p.train_parallel or cfg.rl.train_parallel) == wanted)
        pick = max(same, key=configured)  # the first plan with the most of them, the best ranked among equals
        if pick not in chosen:
            chosen.append(pick)
    return inputs, [(p, plans.index(p) + 1) for p in chosen], seconds


def run_dir(task: str, pl, work: Path, repeat: int) -> Path:
    """The folder of `pl`'s `repeat`-th run."""
    ckpt = "ckpt" if pl.gradient_checkpointing else "nockpt"
    fsdp = "_fsdp" if pl.train_parallel == "fsdp" else ""  # a DDP run's folder must not stand in for an FSDP plan's
    return work / f"{task}_{pl.strategy}{pl.split}_mb{pl.micro_batch_size}_{ckpt}_mig{pl.migrate_below:g}{fsdp}_r{repeat}"


def drop_weights(run: Path) -> None:
    """Remove a measured run's saved policy and checkpoints (~2 GB each with the real model: a bench of 24 runs kept
    50 GB); its metrics, logs and report, all this bench reads, stay."""
    for folder in ("model", "adapter"):
        shutil.rmtree(run / "rl" / folder, ignore_errors=True)
    for f in (run / "rl").glob("checkpoint.pt*"):
        shutil.rmtree(f, ignore_errors=True) if f.is_dir() else f.unlink(missing_ok=True)


def run_plan(task: str, pl, models: Path, work: Path, iterations: int, repeat: int,
             fresh: bool = False) -> tuple[Path, bool]:
    """Run `pl` for `iterations` iterations (its `repeat`-th run), reusing a finished earlier run unless fresh.
    -> (its folder, whether it ran now)."""
    d = run_dir(task, pl, work, repeat)
    if fresh or not (d / "rl" / "metrics.jsonl").exists() or len(metrics(d)) < iterations:
        shutil.rmtree(d, ignore_errors=True)
        block = pl.config_block()
        flat = [f"{s}.{k}={str(v).lower() if isinstance(v, bool) else v}" for s, sec in block.items()
                for k, v in sec.items()]
        one = ["run.threads=1"] if pl.strategy == "single" else []  # 1 worker x 1 CPU, as planned (and profiled)
        rlfuse("rl", *rl_args(models, task, iterations), *flat, *one, f"run.dir={d}", log=d.parent / (d.name + ".log"))
        drop_weights(d)
        return d, True
    return d, False


def signed(r: dict, stage: str) -> float:
    """A plan's prediction error of one stage: predicted / measured - 1."""
    return r["predicted"][stage] / r["measured"][stage] - 1


def told_apart(results: list[dict]) -> tuple[int, int, int]:
    """(pairs of plans whose runs do not overlap, of them ordered as predicted, pairs in all): every run of one plan
    faster than every run of the other is an order the measurement is sure of; the other pairs' order is the
    machine's noise as much as the plans'."""
    sure = right = 0
    for i, a in enumerate(results):
        for b in results[i + 1:]:
            ra, rb = a["measured"]["iterations"], b["measured"]["iterations"]
            pa, pb = a["predicted"]["iteration"], b["predicted"]["iteration"]
            if (max(ra) < min(rb) or max(rb) < min(ra)) and pa != pb:  # a tie predicts no order: left out
                sure += 1
                right += (min(ra) < min(rb)) == (pa < pb)
    n = len(results)
    return sure, right, n * (n - 1) // 2


def scores(results: list[dict]) -> dict:
    """The figures the targets are about: iteration-time error (mean, max), Kendall tau per task and over all plans,
    and per task the planner's choice among the plans run against the best measured of them."""
    err = lambda r: abs(r["predicted"]["iteration"] / r["measured"]["iteration"] - 1)
    out = {"mean_error": statistics.mean(map(err, results)), "max_error": max(map(err, results)),
           "tau": kendall_tau([r["predicted"]["iteration"] for r in results],
                              [r["measured"]["iteration"] for r in results]), "tasks": {},
           "told_apart": told_apart(results)}
    for task in dict.fromkeys(r["task"] for r in results):
        rs = [r for r in results if r["task"] == task]
        pick = min(rs, key=lambda r: r["predicted"]["iteration"])
        best = min(rs, key=lambda r: r["measured"]["iteration"])
        out["tasks"][task] = {"tau": kendall_tau([r["predicted"]["iteration"] for r in rs],
                                                 [r["measured"]["iteration"] for r in rs]),
                              "pick": pick, "best": best, "plans": len(rs),
                              "slower": pick["measured"]["iteration"] / best["measured"]["iteration"] - 1}
    return out


def memory_errors(results: list[dict]) -> list[float]:
    """|predicted / measured - 1| of each worker's peak memory in every plan."""
    return [abs(r["mem_pred"][w] / r["measured"]["rss_mb"][w] - 1) for r in results for w in r["measured"]["rss_mb"]]


def headline(results: list[dict]) -> str:
    """BENCHMARKS.md's row, in a user's words: how far the predictions were from the runs, and the choice's cost."""
    sc = scores(results)
    worst = max(t["slower"] for t in sc["tasks"].values())
    return (f"predicted iteration time off by {sc['mean_error'] * 100:.1f}% on average ({sc['max_error'] * 100:.1f}% "
            f"at most) over {len(results)} plans, their order Kendall tau {sc['tau']:.2f}; the planner's choice within "
            f"{worst * 100:.1f}% of the fastest measured; memory per worker within "
            f"{max(memory_errors(results)) * 100:.1f}%")


def report(results: list[dict], profile_desc: str, header: str) -> str:
    rows, lines = [], []
    for r in results:
        p, m = r["predicted"], r["measured"]
        mem = "; ".join(f"w{w}: {r['mem_pred'][w]:.0f} / {m['rss_mb'][w]:.0f}" for w in sorted(m["rss_mb"]))
        rows.append([r["task"], r["label"], r["rank"], p["rollout"], m["rollout"], p["train"], m["train"], p["sync"],
                     m["sync"], p["iteration"], m["iteration"], f"{(p['iteration'] / m['iteration'] - 1) * 100:+.0f}%",
                     f"{m['spread'] * 100:.0f}% ({len(m['iterations'])})", mem])
    mem_errs = memory_errors(results)
    lines += [header, "", md_table(["task", "plan", "planner rank", "rollout s pred", "rollout s meas", "train s pred",
                                    "train s meas", "sync s pred", "sync s meas", "iteration s pred",
                                    "iteration s meas", "iteration error", "run spread (runs)",
                                    "worker MiB pred / meas"], rows), ""]
    sc = scores(results)
    for task, t in sc["tasks"].items():
        lines.append(f"- {task}: the planner's choice among these, {t['pick']['label']}, measured "
                     f"{t['pick']['measured']['iteration']:.3f} s per iteration; the best measured, "
                     f"{t['best']['label']}, {t['best']['measured']['iteration']:.3f} s ({t['slower'] * 100:+.1f}%, "
                     f"target within 10%); Kendall tau {t['tau']:+.2f} over {t['plans']} plans")
    lines += [f"- iteration time: mean relative error {sc['mean_error'] * 100:.1f}% (target <= 15%), max "
              f"{sc['max_error'] * 100:.1f}% (target <= 30%); Kendall tau over all {len(results)} plans "
              f"{sc['tau']:+.2f} (target >= 0.8)",
              "- per stage, predicted over measured - 1 (mean; mean of absolute values): " + "; ".join(
                  f"{k} {statistics.mean(signed(r, k) for r in results) * 100:+.0f}% "
                  f"({statistics.mean(abs(signed(r, k)) for r in results) * 100:.0f}%)" for k in ("rollout", "train")),
              "- pairs of plans whose runs do not overlap (every run of one faster than every run of the other): "
              "{0} of {2}, {1} of them in the predicted order".format(*sc["told_apart"]),
              f"- run-to-run spread of iteration time over each plan's runs ((max - min) / median): mean "
              f"{statistics.mean(r['measured']['spread'] for r in results) * 100:.1f}%, max "
              f"{max(r['measured']['spread'] for r in results) * 100:.1f}%: plans closer than that are not told apart",
              f"- peak memory per worker (predicted total vs measured RSS): mean error "
              f"{statistics.mean(mem_errs) * 100:.1f}%, max {max(mem_errs) * 100:.1f}% (target within 20%)",
              f"- profile: {profile_desc}"]
    return "\n".join(lines)


def across_profiles(stored: Path, models: Path | None, profiles: list[Path]) -> str:
    """The same measured runs predicted from each of several profiles of the machine: how much of the error is the
    profile's (each is a ~40 s measurement on a machine whose timings jitter), as a table of the target figures."""
    from rlfuse.plan.profiles import load_profile

    rows, tasks = [], []
    for path in profiles:
        prof, sc = load_profile(path), scores(repredict(stored, models, path))
        tasks = list(sc["tasks"])
        worst = max(t["slower"] for t in sc["tasks"].values())
        when = next((part for part in prof.source.split(", ") if "UTC" in part), prof.source)
        rows.append([path.name, when, f"{prof.pair_decode_slowdown:.2f} / {prof.pair_train_slowdown:.2f}",
                     f"{sc['mean_error'] * 100:.1f}%", f"{sc['max_error'] * 100:.1f}%", f"{sc['tau']:+.2f}",
                     " / ".join(f"{t['tau']:+.2f}" for t in sc["tasks"].values()), f"{worst * 100:+.1f}%"])
    return md_table(["profile", "measured", "pair decode / train", "mean error", "max error",
                     "tau (all)", f"tau ({' / '.join(tasks)})", "choice vs best (worst task)"], rows)


def planned(task: str, pl, rank: int, inputs: dict, seconds: dict) -> dict:
    """A plan's prediction as results.json keeps it (the measurement is added beside it); seconds: its
    predicted_seconds."""
    mem_pred = {w: pl.memory[g.name]["total"] / 2**20 for g in pl.spec.groups for w in pl.spec.worker_ranks(g.name)}
    return {"task": task, "label": pl.label(), "rank": rank, "predicted": seconds, "mem_pred": mem_pred,
            "inputs": inputs}


def repredict(stored: Path, models: Path | None, profile_path: Path) -> list[dict]:
    """The runs measured in `stored` (a results.json this script wrote) predicted again by the current model from
    `profile_path` and the inputs stored with them: a model change checked against real runs in seconds, without
    running any. The measurements are taken again from the runs' folders beside it where they are all there (so a
    change to how runs are summed up applies too), else the stored ones; the label of each plan is the stored one
    (it must still be a candidate)."""
    results = json.loads(stored.read_text())
    models = models or (Path(results[0]["models"]) if results and "models" in results[0] else None)
    if models is None:
        raise SystemExit(f"--repredict: {stored} does not say which models its runs used; give --models RUN_DIR")
    out = []
    for task in dict.fromkeys(r["task"] for r in results):
        rs = [r for r in results if r["task"] == task]
        inputs = rs[0]["inputs"]
        calib = stored.parent / f"calibrate_{task}"
        if "iteration_prompts" not in inputs and (calib / "rl" / "metrics.jsonl").exists():
            # stored before the bench took each iteration's prompts: the calibration run beside it recorded them
            # (every run of the task draws the same prompts)
            window, prompts = len(inputs.get("iteration_lengths") or []), iteration_prompts(calib)
            if window and len(prompts) >= window:
                inputs = dict(inputs, iteration_prompts=prompts[:window])
                print(f"[plan bench] {task}: each iteration's prompts from {calib} (not stored in {stored}): mean "
                      + ", ".join(f"{t:.0f}" for t, _ in prompts[:window]) + " tokens", file=sys.stderr)
        plans, seconds = ranked_plans(task, models, profile_path, inputs)
        by_label = {pl.label(): (pl, i + 1) for i, pl in reversed(list(enumerate(plans)))}
        for r in rs:
            if r["label"] not in by_label:
                raise SystemExit(f"--repredict: {task} plan {r['label']!r} is no longer among the candidates")
            pl, rank = by_label[r["label"]]
            new = planned(task, pl, rank, inputs, seconds[r["label"]])
            dirs = [run_dir(task, pl, stored.parent, i) for i in range(len(r["runs"]))]
            if dirs and all((d / "rl" / "metrics.jsonl").exists() for d in dirs):  # measured again from their logs
                new["runs"] = [m | {"rss_mb": {str(w): v for w, v in m["rss_mb"].items()}}  # as stored: JSON keys
                               for m in map(measured, dirs)]
                new["measured"] = median_of_runs(new["runs"])
            new["mem_pred"] = {str(w): v for w, v in new["mem_pred"].items()}  # as the stored measurement's keys
            out.append(r | new)
    return out


def profile_line(prof) -> str:
    """The profile the predictions came from: its source and how slow two workers computing at once were."""
    from dataclasses import asdict

    from rlfuse.runtime.probe import pair_note

    return f"{prof.name}: {prof.source}; {pair_note(asdict(prof), 'its')}"


def task_profile(task: str, work: Path) -> Path:
    """Where the profile a task predicts from lives: the embedded model's tasks share one; each real-model task has
    its own, of SmolLM2's shape (about 20 minutes on 2 cores), so each is taken with its own runs (this VM's rates
    drift over hours, and the two configs' runs are hours apart)."""
    return work / (f"machine_profile-{task}.json" if task in REAL_MODEL else "machine_profile.json")


def fresh_profile(work: Path, fresh: bool, task: str = "default") -> Path:
    """The machine profile the task's predictions use: measured now (`rlfuse plan [CONFIG] --profile`, on the task's
    own model shape) unless one with the Ray overheads is there already and --fresh was not given."""
    from rlfuse.plan.cost import MachineProfile

    path = task_profile(task, work)
    if fresh or not path.exists() or not MachineProfile.load(path).ray_round_trip_s:
        config = task_config(task)
        rlfuse("plan", *([str(config)] if config else []), "--profile", "--profile-path", str(path), "--out",
               str(work / f"plan-{task}.yaml"), log=work / f"profile-{task}.log")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=WORK / "plan")
    ap.add_argument("--models", type=Path, help="a run folder with sft/model and rm/model")
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="runs per plan (their median is the measurement)")
    ap.add_argument("--fresh", action="store_true", help="measure the profile and run every plan again")
    ap.add_argument("--tasks", nargs="+", choices=list(RUNS), default=DEFAULT_TASKS,
                    help="a subset of the tasks (default: the embedded model's; smollm2_math smollm2_hh: the real "
                         "model's shipped configs, from their bench.real_model runs)")
    ap.add_argument("--plans", type=int, default=0, help="only the first N plans of each task (a quick check)")
    ap.add_argument("--no-write", action="store_true", help="print only; write neither the page nor BENCHMARKS.md")
    ap.add_argument("--dry", action="store_true", help="profile, calibrate and print the plans; run none")
    ap.add_argument("--repredict", type=Path, metavar="RESULTS_JSON",
                    help="run nothing: predict the runs stored in a results.json again with the current model (and "
                         "sum up their folders' metrics again) and print the report (nothing is written)")
    ap.add_argument("--profile", type=Path, nargs="+",
                    help="with --repredict: the machine profile to predict from (default: the task's, beside the "
                         "results: task_profile); several: a table of the target figures from each, one row per profile")
    ap.add_argument("--paper", action="store_true",
                    help="run nothing: write `rlfuse plan --paper`'s at-scale predictions into the plan_paper section")
    args = ap.parse_args()
    if args.paper:
        from rlfuse.plan.paper import paper_report

        text = paper_report()
        print(text)
        if not args.no_write:
            write_section("plan_paper", text, page="plan")
        return
    from rlfuse.plan.profiles import load_profile

    if args.repredict and args.profile and len(args.profile) > 1:
        print(across_profiles(args.repredict, args.models, args.profile))
        return
    if args.repredict:
        stored = json.loads(args.repredict.read_text())
        task = stored[0]["task"] if stored else "default"
        profile_path = args.profile[0] if args.profile else task_profile(task, args.repredict.parent)
        results, prof = repredict(args.repredict, args.models, profile_path), load_profile(profile_path)
        print(report(results, profile_line(prof), f"Re-predicted `{args.repredict}` from `{profile_path}` (the "
                     f"measurements from the runs' folders where they are there, else as stored)."))
        return
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0, loads = time.time(), []  # the load average after each run made now (a reused run's is not known)
    real = all(task in REAL_MODEL for task in args.tasks)
    models = WORK / "real_model" if real else ensure_models(work, args.models)  # a real task: task_models
    todo = []  # (task, plan, planner rank, inputs)
    seconds, profiles = {}, {}
    for task in args.tasks:
        profiles[task] = fresh_profile(work, args.fresh, task)
        inputs, chosen, seconds[task] = predict_all(task, models, profiles[task], work, args.iterations)
        print(f"[plan bench] {task}: prompt tokens {inputs['prompt_tokens']:.1f} (longest "
              f"{inputs['prompt_longest']}, {inputs['prompt_lengths']:.1f} distinct lengths per iteration), response "
              f"lengths {inputs['lengths']}; the measured iterations' prompts: mean "
              + (", ".join(f"{t:.0f}" for t, _ in inputs["iteration_prompts"]) or "not recorded") + " tokens",
              file=sys.stderr)
        todo += [(task, pl, rank, inputs) for pl, rank in chosen[: args.plans or None]]
    if args.dry:
        for task, pl, rank, _ in todo:
            s = seconds[task][pl.label()]
            print(f"{task}: rank {rank} {pl.label()}: {s['iteration']:.3f} s", {k: round(v, 3) for k, v in s.items()})
        return
    runs: dict[int, list] = {i: [] for i in range(len(todo))}
    for repeat in range(args.repeats):  # every plan once, then every plan again: load changes hit all plans alike
        for i, (task, pl, rank, inputs) in enumerate(todo):
            d, ran = run_plan(task, pl, models, work, args.iterations, repeat, args.fresh)
            runs[i].append(measured(d))
            if ran:
                loads.append(os.getloadavg()[0])
            print(f"[plan bench] {task} {pl.label()} run {repeat + 1}/{args.repeats}: predicted "
                  f"{seconds[task][pl.label()]['iteration']:.3f} s, "
                  f"measured {runs[i][-1]['iteration']:.3f} s" + (f" (load average {loads[-1]:.1f})" if ran else
                                                                   " (an earlier run, reused)"), file=sys.stderr)
    results = [planned(task, pl, rank, inputs, seconds[task][pl.label()])
               | {"measured": median_of_runs(runs[i]), "runs": runs[i], "models": str(models)}
               for i, (task, pl, rank, inputs) in enumerate(todo)]
    profile_desc = "; ".join(f"{task}: {profile_line(load_profile(path))}" for task, path in profiles.items())
    cmd = " ".join(["python -m bench.plan", *(["--models", str(args.models)] if args.models else []),
                    *(["--fresh"] if args.fresh else []), f"--iterations {args.iterations}",
                    f"--repeats {args.repeats}", *(["--tasks", *args.tasks] if args.tasks != DEFAULT_TASKS else []),
                    *([f"--plans {args.plans}"] if args.plans else [])])
    load_note = (f"load average {min(loads):.1f}-{max(loads):.1f} after the runs made now" if loads else
                 "every run reused from an earlier invocation (their load is in its log)")
    one = " (1 x 1 CPU for a single-process plan)" if any(pl.strategy == "single" for _, pl, _, _ in todo) else ""
    header = (f"Command: `{cmd}` ({args.iterations} iterations per run, {args.repeats} runs per plan, 2 workers x 1 "
              f"CPU{one}; {time.time() - t0:.0f} s; {load_note}, on 2 cores shared with other work).")
    text = report(results, profile_desc, header)
    # the real model's rows in a section and a headline row of their own; one real task alone in its own, so a run
    # of one config does not drop the other's rows
    name = ("real_model" if set(args.tasks) == set(REAL_MODEL) else "_".join(args.tasks)) if real else ""
    (work / (f"results_{name}.json" if real else "results.json")).write_text(json.dumps(results, indent=1,
                                                                                        default=str))
    print(text)
    if not args.no_write:
        write_section(f"plan_bench_{name}" if real else "plan_bench", text, page="plan")
        write_headline(f"plan_{name}" if real else "plan", headline(results),
                       f"the same {len(results)} plans run ({args.repeats} runs each, 2 Ray workers x 1 CPU)", cmd,
                       f"{machine_short()}; {load_note}",
                       what=(f"Planner on SmolLM2-135M{'' if name == 'real_model' else ', ' + name} (predicted vs "
                             "measured runs)" if real else None), page="plan")


if __name__ == "__main__":
    main()
