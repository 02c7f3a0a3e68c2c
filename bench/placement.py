"""Placement benchmark, generation + scoring part (issue 12, item 9): on one machine, the same rollout

  (1) in one process with N threads (generate_rollouts, fusion on);
  (2) on N Ray generation workers with one thread each, no migration (each scores its own samples as it goes);
  (3) the same N workers with tail migration (rollout.migrate_below, rollout.rows_per_worker): the tail moves onto
      fewer workers and the freed ones score.

Every row produces the same samples (same seed, per-sample random streams). Workloads: the default task's SFT model
with its natural long-tailed lengths, and a sweep of tail heaviness (each sample's length drawn from a lognormal of
spread sigma, as bench.rollout's sweep; EOS off so the lengths are exactly those). Rows (2) and (3) run in one
child process on one Ray instance, alternated (2 3 2 3 ...); row (1) in its own child; the median of the repeats.

    python -m bench.placement            # writes docs/benchmarks/placement.md and its row of BENCHMARKS.md
    python -m bench.placement --quick    # small smoke run, prints only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

from bench.common import WORK, machine, machine_short, md_table, run_child, write_headline, write_section
from bench.rollout import ensure_sft_model, target_lengths, workload_prompts


def reward_folder(sft: Path) -> Path:
    """A reward model on the SFT body with a seeded head (as bench.rollout's load_roles), saved once so every
    process loads the same one; it is also the critic's start."""
    out = WORK / "placement_rm"
    if not (out / "config.json").exists():
        import torch

        from rlfuse.models.load import load_reward_model, load_tokenizer

        tok = load_tokenizer(str(sft))
        torch.manual_seed(0)
        load_reward_model(str(sft), pad_token_id=tok.pad_token_id).save_pretrained(out)
        tok.save_pretrained(out)
    return out


def setup(args):
    from rlfuse.models.load import load_tokenizer
    from rlfuse.runtime.ray_rollout import RolloutSettings, WorkerModels
    from rlfuse.rollout.engine import SamplingParams
    from rlfuse.rollout.fusion import LengthTable

    sft = str(args.model)
    tok = load_tokenizer(sft)
    prompts = workload_prompts("default", args.prompts, tok)
    sweep = args.sigma is not None
    lengths = (LengthTable(tuple(map(tuple, target_lengths(len(prompts), args.k, args.sigma, 32, args.max_new).tolist())))
               if sweep else None)
    models = WorkerModels(generator=sft, reference=sft, reward=str(args.rm), critic=str(args.rm))
    settings = RolloutSettings(max_rows=256, micro_batch_size=16, score_every=16, live_below=8,
                               migrate_below=args.migrate_below, rows_per_worker=args.rows_per_worker,
                               eos_token_id=-1 if sweep else None)
    return models, settings, prompts, lengths, SamplingParams(max_new_tokens=args.max_new)


def summary(exp, wall: float) -> dict:
    return {"total_s": wall, "tokens": int(exp.mask.sum()), "completions": len(exp),
            "length_max": int(exp.mask.sum(1).max()), **{k: float(v) for k, v in exp.timing.items()}}


def child_single(args) -> None:
    import torch

    from rlfuse.runtime.ray_rollout import build_worker_roles
    from rlfuse.rollout.fusion import FusionPolicy, generate_rollouts

    torch.set_num_threads(args.workers)
    models, settings, prompts, lengths, params = setup(args)
    engine, scorer, _ = build_worker_roles(models, settings)
    fusion = FusionPolicy(True, settings.score_every, settings.live_below)
    runs = []
    for _ in range(args.repeats + 1):  # the first is a warm-up
        t = time.perf_counter()
        exp = generate_rollouts(engine, scorer, prompts, args.k, params, 0, fusion, lengths=lengths)
        runs.append(summary(exp, time.perf_counter() - t))
    print(json.dumps({"single": runs[1:]}))


def child_workers(args) -> None:
    import ray

    from rlfuse.runtime.ray_rollout import MultiWorkerRollout, start_generation_workers

    models, settings, prompts, lengths, params = setup(args)
    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    try:
        workers = start_generation_workers(args.workers, models, settings, 1)
        driver = MultiWorkerRollout(workers, settings)
        deferred = MultiWorkerRollout(workers, dataclasses.replace(settings, defer_scoring=True))  # RLHFuse's order
        driver.generate(prompts, args.k, params, 0, lengths, migrate=False)  # warm-up
        runs = {"no_migration": [], "migration": [], "migration_deferred": []}
        for _ in range(args.repeats):  # alternated, so a change in the machine's load hits all
            for name, d, migrate in (("no_migration", driver, False), ("migration", driver, True),
                                     ("migration_deferred", deferred, True)):
                t = time.perf_counter()
                exp = d.generate(prompts, args.k, params, 0, lengths, migrate=migrate)
                runs[name].append(summary(exp, time.perf_counter() - t))
    finally:
        ray.shutdown()
    print(json.dumps(runs))


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["total_s"])[len(runs) // 2]


def measure(args, sigma=None, prompts=64, max_new=256) -> dict:
    common = ["--model", str(args.model), "--rm", str(args.rm), "--k", str(args.k), "--prompts", str(prompts),
              "--max-new", str(max_new), "--workers", str(args.workers), "--repeats", str(args.repeats),
              "--migrate-below", str(args.migrate_below), "--rows-per-worker", str(args.rows_per_worker)]
    common += [] if sigma is None else ["--sigma", str(sigma)]
    load_before = os.getloadavg()[0]
    res = (run_child("bench.placement", ["--child", "workers", *common])
           | run_child("bench.placement", ["--child", "single", *common]))
    out = {name: median_run(rs) | {"all_s": [r["total_s"] for r in rs]} for name, rs in res.items()}
    out["load_avg_1min"] = [load_before, os.getloadavg()[0]]
    return out


def rows_of(label: str, r: dict) -> list:
    single, plain, mig = r["single"], r["no_migration"], r["migration"]
    return [label, single["length_max"], single["tokens"] / single["completions"], single["total_s"], plain["total_s"],
            mig["total_s"], plain["total_s"] / mig["total_s"], single["total_s"] / mig["total_s"],
            r["migration_deferred"]["total_s"],
            mig.get("migration/migrated_at_unfinished", 0), mig.get("migration/rows_moved", 0),
            mig.get("migration/tokens_moved", 0), mig.get("migration/reprefill_s", 0.0),
            mig.get("migration/scoring_on_freed_s", 0.0), f"{r['load_avg_1min'][0]:.1f}/{r['load_avg_1min'][1]:.1f}"]


HEADER = ["workload", "max length", "mean length", "(1) one process s", "(2) workers, no migration s",
          "(3) workers, migration s", "(2)/(3)", "(1)/(3)", "(4) migration, scoring deferred (RLHFuse's order) s",
          "migrated at unfinished", "rows moved", "tokens moved",
          "re-prefill s", "scoring on freed s", "load avg before/after"]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.placement", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=["single", "workers"])
    ap.add_argument("--model")
    ap.add_argument("--rm")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--sigma", type=float, default=None)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--migrate-below", type=float, default=0.2)
    ap.add_argument("--rows-per-worker", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="16 prompts, 64 new tokens, 1 repeat; prints, writes nothing")
    args = ap.parse_args()
    if args.child:
        return {"single": child_single, "workers": child_workers}[args.child](args)
    args.model = ensure_sft_model()
    args.rm = reward_folder(args.model)
    t0 = time.time()
    if args.quick:
        args.repeats = 1
        print(md_table(HEADER, [rows_of("default, 16 x 4", measure(args, prompts=16, max_new=64))]))
        return
    res = {"default": measure(args)}
    rows = [rows_of(f"default SFT, {args.prompts} x k={args.k}", res["default"])]
    for sigma in (0.5, 1.0, 1.5):
        res[f"sweep_{sigma}"] = measure(args, sigma=sigma, prompts=32)
        rows.append(rows_of(f"lognormal sigma={sigma}, 32 x k={args.k}", res[f"sweep_{sigma}"]))
    (WORK / "placement.json").write_text(json.dumps(res, indent=2))
    target = res["default"]["no_migration"]["total_s"] / res["default"]["migration"]["total_s"]
    text = "\n".join([
        f"Machine: {json.dumps(machine())}", "",
        f"Command: `python -m bench.placement` ({args.workers} Ray workers x 1 thread vs one process x {args.workers} "
        f"threads; rollout.migrate_below={args.migrate_below}, rollout.rows_per_worker={args.rows_per_worker}; "
        f"median of {args.repeats} alternated runs after a warm-up; up to {args.max_new} new tokens).", "",
        "Generation + scoring seconds for one iteration's rollout (decode, then reward, reference log-probs and "
        "critic values of every sample), identical samples in every column:", "",
        md_table(HEADER, rows), "",
        f"Migration vs no migration on the default long-tailed workload: {target:.2f}x (target 1.25x). "
        f"Wall time of the whole benchmark: {time.time() - t0:.0f} s.", ""])
    print(text)
    write_section("placement", text, page="placement")
    write_headline("placement", f"tail migration {target:.2f}x the speed of no migration on the default task's "
                   f"long-tailed rollout ({args.workers} Ray workers)",
                   f"the same {args.workers} Ray workers without migration",
                   "python -m bench.placement", machine_short(os.getloadavg()[0]))


if __name__ == "__main__":
    main()
