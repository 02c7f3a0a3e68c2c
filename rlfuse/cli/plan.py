"""`rlfuse plan [CONFIG] [section.field=value ...] [--workers N] [--cpus-per-worker C] [--gpus-per-worker G]
[--memory-per-worker GB] [--profile] [--lengths-from RUN_DIR] [--out plan.yaml] [--paper]`.

Prints the ranked plans, the memory table of the best one and the overrides that run it, and writes the best as
config sections (`placement:`, with its rl micro-batch and checkpointing and rollout migration) to --out.
The workload's prompts are the run's own, measured with the model's tokenizer (rlfuse/models/prompt_workload.py),
or as --lengths-from's run recorded them; where neither can be had, the planner's table, with a line saying so.
`--profile` first measures this machine (rlfuse/runtime/profile.py) and saves the profile file.
`--paper` prints the at-scale predictions from published device figures instead (rlfuse/plan/paper.py).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import yaml

from rlfuse.config import load_config, split_args
from rlfuse.errors import UserError
from rlfuse.metrics.tracker import measured_lengths, measured_prompts
from rlfuse.plan.cost import policy_shape
from rlfuse.plan.memory import GiB
from rlfuse.plan.paper import paper_report
from rlfuse.plan.planner import first_fitting, plan, plan_memory_table, plan_table, problem_from_config
from rlfuse.plan.profiles import default_profile_path, load_profile


def _positive(kind, zero: bool = False):
    """An argparse type: a finite number > 0 (0 workers, CPUs or GiB is never what a user means; NaN or inf GiB
    would make every plan fit, or none), or >= 0 with zero=True (GPUs per worker)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"expected a finite number {'>=' if zero else '>'} 0, got {text!r}")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def usable_path(path: str | None, flag: str, fix: str) -> None:
    """A path given on the command line that the OS refuses to look up (a part over 255 bytes: File name too long;
    a folder without search permission) is one line naming the flag, not pathlib's OSError from deep inside; one that
    does not exist yet is the caller's business."""
    if path is None:
        return
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as e:
        raise UserError(f"{flag} {path}: {e.strerror}; {fix}") from None


def machine_cores() -> int:
    """The cores this process may run on: what a local Ray gives its workers."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_cpus_per_worker(cpus: float, flag: str, address: str | None) -> None:
    """A worker is one process on one machine: a local plan (no placement.address) cannot give one more CPUs than
    this machine has (several workers beyond them are priced as sharing the cores). A cluster's nodes are not
    this machine's: any number is taken there."""
    cores = machine_cores()
    if address is None and cpus > cores:
        raise UserError(f"{flag} {cpus:g}: a worker is one process on one machine, and this one has {cores} cores; "
                        f"give at most {cores}, or plan for a cluster with placement.address=ray://HEAD:10001")


def add_arguments(p) -> None:
    p.add_argument("args", nargs="*", metavar="CONFIG|section.field=value", help="optional YAML config, then overrides")
    p.add_argument("--workers", type=_positive(int), help="workers in all (default placement.workers)")
    p.add_argument("--cpus-per-worker", type=_positive(float), help="CPUs per worker (default placement.cpus_per_worker)")
    p.add_argument("--gpus-per-worker", type=_positive(float, zero=True),
                   help="GPUs per worker (default placement.gpus_per_worker)")
    p.add_argument("--memory-per-worker", type=_positive(float), metavar="GB",
                   help="GiB one worker may use (default placement.memory_per_worker_gb, else a GPU's memory or the "
                        "machine's RAM divided among the workers)")
    p.add_argument("--profile", action="store_true",
                   help="measure this machine on the config's model shape first and save it (under a minute for the "
                        "embedded model, about 20 on 2 cores for SmolLM2-135M)")
    p.add_argument("--profile-path", metavar="FILE", help="profile file to write/read (default "
                   "$RLFUSE_CACHE/machine_profile.json, i.e. ~/.cache/rlfuse/machine_profile.json)")
    p.add_argument("--lengths-from", metavar="RUN_DIR", help="response (and prompt) lengths measured by an RL run "
                   "(its rl/metrics.jsonl) instead of the config's defaults (and of the prompts measured here)")
    p.add_argument("--out", default="plan.yaml", metavar="FILE", help="where the best plan's YAML goes (plan.yaml)")
    p.add_argument("--top", type=_positive(int), default=12, help="rows of the ranked table")
    p.add_argument("--paper", action="store_true", help="the at-scale predictions from published GPU figures")


def workload_prompts(cfg, lengths_from: str | None, log) -> tuple[dict, str]:
    """(problem_from_config's prompt_tokens and prompt_lengths, the line saying where they came from): as the
    --lengths-from run recorded them where it did (what ran beats what is predicted to run), else the config's
    prompts measured with the model's tokenizer, else ({}: the planner's table) and a line saying why."""
    recorded = measured_prompts(lengths_from) if lengths_from else None
    if recorded is not None:
        tokens, distinct, longest = recorded  # the longest sizes memory (0: a run that did not record it, the mean)
        return ({"prompt_tokens": tokens, "prompt_lengths": distinct, "prompt_longest": longest},
                f"prompts: {tokens:.1f} tokens on average{f' (longest {longest})' if longest else ''}, "
                f"{distinct:.1f} distinct lengths per iteration, as the RL iterations of {lengths_from} recorded them")
    from rlfuse.models.prompt_workload import planner_prompt_inputs  # torch and transformers: only when measuring

    return planner_prompt_inputs(cfg, log)


def run(ns) -> int:
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    try:
        if ns.paper:
            print(paper_report())
            return 0
        usable_path(ns.out, "--out", "give another path for the plan's YAML")
        usable_path(ns.lengths_from, "--lengths-from", "give an RL run folder")
        usable_path(ns.profile_path, "--profile-path", "give another file")
        config, overrides = split_args(ns.args)
        cfg = load_config(config, overrides)
        if cfg.placement.strategy != "single" and ns.workers is None and cfg.placement.workers < 2:
            raise UserError("rlfuse plan: give --workers N (2 or more)")
        check_cpus_per_worker(*((ns.cpus_per_worker, "--cpus-per-worker") if ns.cpus_per_worker is not None else
                                (cfg.placement.cpus_per_worker, "placement.cpus_per_worker")), cfg.placement.address)
        if ns.profile:
            from rlfuse.runtime.profile import measure_profile  # torch and Ray: only when measuring

            path = Path(ns.profile_path) if ns.profile_path else default_profile_path(policy_shape(cfg.model))
            threads = int(ns.cpus_per_worker or cfg.placement.cpus_per_worker)
            measure_profile(policy_shape(cfg.model), threads=max(1, threads), log=log).save(path)
            log(f"[plan] machine profile written to {path}")
        profile = load_profile(ns.profile_path, log=log, shape=policy_shape(cfg.model))
        lengths = None
        if ns.lengths_from:
            lengths = measured_lengths(ns.lengths_from)
            if lengths is None:
                raise UserError(f"--lengths-from {ns.lengths_from}: no rl/metrics.jsonl with response lengths there; "
                                "give an RL run folder")
        prompts, prompts_line = workload_prompts(cfg, ns.lengths_from, log)
        budget = ns.memory_per_worker if ns.memory_per_worker is not None else cfg.placement.memory_per_worker_gb
        prob = problem_from_config(cfg, profile, ns.workers, ns.cpus_per_worker,
                                   ns.gpus_per_worker, None if budget is None else budget * GiB, lengths,
                                   staleness=(0, max(1, cfg.rl.max_staleness)), **prompts)  # asynchronous plans beside
        plans = plan(prob)
        if prob.workers > 1:  # the single process on the same cores, ranked beside the layouts (no Ray to pay for)
            whole = problem_from_config(cfg, profile, 1, prob.workers * prob.resources.cpus, ns.gpus_per_worker,
                                        None if budget is None else budget * prob.workers * GiB, lengths, **prompts)
            plans = sorted(plans + plan(whole), key=lambda p: (not p.fits, p.iteration_s, p.peak_bytes))
        print(f"profile: {profile.name} ({profile.source})")
        print(prompts_line)
        w = prob.workload
        longest = f", longest {w.prompt_longest:g}" if w.prompt_longest else ""
        print(f"workload: {w.samples} samples x {w.prompt_tokens:.1f} prompt ({w.prompt_lengths:.1f} distinct "
              f"lengths{longest}) + {w.response_mean:.1f} response tokens (at most {w.response_max}), "
              f"{w.epochs} epochs, mini-batch {w.mini_batch}; {prob.workers} workers; "
              f"budget {'none' if prob.memory_budget is None else f'{prob.memory_budget / GiB:.2f} GiB'} per worker\n")
        print(plan_table(plans, ns.top))
        best = first_fitting(plans, prob.workers)  # after the table: it shows what did not fit
        print(f"\nbest: {best.label()}, predicted {best.iteration_s:.3f} s per iteration\n")
        print(best.spec.describe())
        print("\npredicted peak memory per worker of the best plan, by component:")
        print(plan_memory_table(best))
        block = best.config_block()
        text = yaml.safe_dump(block, sort_keys=False)
        if not Path(ns.out).resolve().parent.is_dir():
            raise UserError(f"--out {ns.out}: its folder does not exist; create it or give another path")
        try:
            Path(ns.out).write_text(text)
        except OSError as e:  # a read-only folder, a full disk: the plan above is printed all the same
            raise UserError(f"--out {ns.out}: cannot write it ({e.strerror}); give another path") from None
        print(f"\n{text}", end="")
        if block["placement"]["strategy"] != "custom":
            flat = [f"{s}.{k}={str(v).lower() if isinstance(v, bool) else v}" for s, d in block.items()
                    for k, v in d.items() if k != "address"]
            print(f"\nrun it: rlfuse run {config or ''} {' '.join(flat)}".replace("  ", " "))
        print(f"written: {ns.out}")
        return 0
    except UserError as e:
        print(f"rlfuse plan: {e}", file=sys.stderr)
        return e.exit_code
