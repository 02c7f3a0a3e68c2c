"""`rlfuse run|sft|rm|validate CONFIG [section.field=value ...]`: each subcommand loads the config, builds, calls a
trainer. User errors print one line and exit 2; no traceback."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rlfuse.config import Config, load_config
from rlfuse.errors import UserError


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _split_args(args: list[str]) -> tuple[str | None, list[str]]:
    """First argument without '=' is the config file; the rest are overrides."""
    config, overrides = None, []
    for a in args:
        if "=" in a or config is not None:
            overrides.append(a)
        else:
            config = a
    return config, overrides


def cmd_sft(cfg: Config) -> int:
    from rlfuse.runs import make_run_dir
    from rlfuse.trainers.sft import train_sft

    run_dir = make_run_dir(cfg, "sft")
    train_sft(cfg, run_dir, log)
    print(f"run folder: {run_dir}")
    return 0


def cmd_rm(cfg: Config) -> int:
    from rlfuse.runs import make_run_dir
    from rlfuse.trainers.rm import train_rm

    run_dir = make_run_dir(cfg, "rm")
    train_rm(cfg, run_dir, log)
    print(f"run folder: {run_dir}")
    return 0


def write_rl_results(run_dir: Path, result: dict) -> Path:
    """eval.json (before/after, in rl/ and the run folder), samples_after.json, rl/summary.json (time, prompt budget
    and how many prompts were cut to it), and the report; returns its path."""
    import json

    from rlfuse.evaluation import EVAL_SAMPLES_KEPT
    from rlfuse.metrics.report import write_report

    evals = json.dumps({"before": result["before"], "after": result["after"]}, indent=2)
    (run_dir / "rl" / "eval.json").write_text(evals)
    (run_dir / "eval.json").write_text(evals)
    (run_dir / "rl" / "samples_after.json").write_text(json.dumps(result["samples_after"][:EVAL_SAMPLES_KEPT], indent=1))
    summary = {"seconds": result["seconds"], **result["prompts"], "model_dir": str(run_dir / "rl" / "model")}
    (run_dir / "rl" / "summary.json").write_text(json.dumps(summary, indent=2))
    return write_report(run_dir)


def cmd_rl(cfg: Config, resume: str | None = None) -> int:
    from rlfuse.evaluation import eval_table
    from rlfuse.runs import make_run_dir
    from rlfuse.trainers.rl import train_rl

    run_dir = Path(resume) if resume else make_run_dir(cfg, "rl")
    result = train_rl(cfg, run_dir, log, resume=bool(resume))
    report = write_rl_results(run_dir, result)
    print(eval_table(result))
    print(f"report: {report}")
    print(f"run folder: {run_dir}")
    return 0


def cmd_run(cfg: Config, resume: str | None = None) -> int:
    """The whole pipeline on one config: SFT, reward model on the SFT backbone, then RL. With --resume, finished
    stages are kept and RL continues from its last checkpoint."""
    from rlfuse.evaluation import eval_table
    from rlfuse.runs import make_run_dir
    from rlfuse.trainers.rl import train_rl
    from rlfuse.trainers.rm import train_rm
    from rlfuse.trainers.sft import train_sft

    t0 = time.perf_counter()
    run_dir = Path(resume) if resume else make_run_dir(cfg, "run")
    log(f"[run] run folder: {run_dir}")
    done = lambda stage: (run_dir / stage / "summary.json").exists()
    sft = _summary(run_dir, "sft") if done("sft") else vars(train_sft(cfg, run_dir, log))
    rm = _summary(run_dir, "rm") if done("rm") else vars(train_rm(cfg, run_dir, log))
    rl = train_rl(cfg, run_dir, log, resume=bool(resume))
    report = write_rl_results(run_dir, rl)
    total = time.perf_counter() - t0
    gram = f", grammatical rate {sft['grammatical_rate']:.3f}" if sft.get("grammatical_rate") is not None else ""
    print("\n".join([
        "",
        "  stage   seconds  result",
        f"  sft     {sft['seconds']:7.0f}  val perplexity {sft['perplexity']:.2f}{gram}",
        f"  rm      {rm['seconds']:7.0f}  held-out pairwise accuracy {rm['accuracy']:.3f}",
        f"  rl      {rl['seconds']:7.0f}  {cfg.rl.algo}, {cfg.rl.iterations} iterations",
        f"  total   {total:7.0f}",
        "",
        eval_table(rl),
        "",
    ]))
    print(f"report: {report}")
    print(f"run folder: {run_dir}")
    return 0


def _summary(run_dir: Path, stage: str) -> dict:
    import json

    return json.loads((run_dir / stage / "summary.json").read_text())


def cmd_report(run_dir: str, baseline: str | None = None) -> int:
    from rlfuse.metrics.report import write_report

    path = write_report(run_dir, baseline)
    print(f"report: {path}")
    return 0


def cmd_validate(cfg: Config) -> int:
    import yaml

    from rlfuse.config import config_to_dict

    print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
    print("config OK", file=sys.stderr)
    return 0


COMMANDS = {
    "run": (cmd_run, "SFT -> reward model -> RL on one config (the embedded default task without a config)"),
    "sft": (cmd_sft, "supervised fine-tuning"),
    "rm": (cmd_rm, "reward-model training on preference pairs"),
    "rl": (cmd_rl, "online RL (ppo | rloo | grpo) from SFT and reward-model folders"),
    "validate": (cmd_validate, "load and check a config, print it resolved"),
}


RESUMABLE = ("run", "rl")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlfuse", description="Fast, memory-lean RLHF.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("args", nargs="*", metavar="CONFIG|section.field=value",
                       help="optional YAML config, then overrides like sft.lr=1e-4 run.dir=/tmp/x")
        if name in RESUMABLE:
            p.add_argument("--resume", metavar="RUN_DIR", help="continue a killed run from its last checkpoint "
                           "(its saved config.yaml is used; overrides still apply)")
    rp = sub.add_parser("report", help="redraw a run's figures and report.html (also on a running or killed run)")
    rp.add_argument("run_dir", metavar="RUN_DIR")
    rp.add_argument("--baseline", metavar="RUN_DIR", help="a measured baseline run (e.g. rollout.fusion=false) for "
                    "speedup_comparison.png")
    from rlfuse.schedule import cli as schedule_cli

    sp = sub.add_parser("schedule", help="fused actor/critic pipeline schedule: serial vs 1F1B vs fused, with a chart")
    schedule_cli.add_arguments(sp)
    from rlfuse.placement import plan_cli

    plan_cli.add_arguments(sub.add_parser("plan", help="rank placements of an RL run by predicted time and memory",
                                          description=plan_cli.__doc__))
    ns = parser.parse_args(argv)
    if ns.command == "schedule":
        return schedule_cli.run(ns)
    if ns.command == "plan":
        return plan_cli.run(ns)
    if ns.command == "report":
        try:
            return cmd_report(ns.run_dir, ns.baseline)
        except UserError as e:
            print(f"rlfuse report: {e}", file=sys.stderr)
            return e.exit_code
    fn, _ = COMMANDS[ns.command]
    try:
        config, overrides = _split_args(ns.args)
        resume = getattr(ns, "resume", None)
        if resume:
            saved = Path(resume) / "config.yaml"
            if not saved.exists():
                raise UserError(f"--resume: {resume} is not a run folder (no config.yaml); give the folder a run printed")
            cfg = load_config(saved, [f"run.dir={resume}", *overrides])
            return fn(cfg, resume=resume)
        cfg = load_config(config, overrides)
        return fn(cfg)
    except UserError as e:
        print(f"rlfuse {ns.command}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"rlfuse {ns.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
