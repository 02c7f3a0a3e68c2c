"""`rlfuse run|sft|rm|rl|validate CONFIG [section.field=value ...]`: each subcommand loads the config and calls the
Python API (rlfuse/api.py); `rlfuse generate MODEL --prompt ...` samples from a saved model, `rlfuse env` prints
versions, `rlfuse audit RUN_DIR` runs the health detectors, `rlfuse plan` ranks placements (plan.py), `rlfuse
schedule` compares pipeline schedules (schedule.py). `--help` lists the config fields with their docs. User errors
print one line and exit 2; no traceback."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import yaml

from rlfuse import api
from rlfuse.api import log_stderr
from rlfuse.cli import plan as plan_cli
from rlfuse.cli import schedule as schedule_cli
from rlfuse.config import Config, config_to_dict, field_docs, field_summary, load_config, section_class, split_args
from rlfuse.config.docs import COMMON_FIELDS, field_default
from rlfuse.config.trl_names import SHARED, TRL_NAMES, TrlName, trl_hint
from rlfuse.errors import UserError, os_error_line
from rlfuse.metrics.audit import audit_run, audit_text, run_folder
from rlfuse.metrics.health import DETECTORS

log = log_stderr


def cmd_sft(cfg: Config, resume: str | None = None, overwrite: bool = False) -> int:
    result = api.train_sft(cfg, resume, resume=bool(resume), overwrite=overwrite, log=log)
    print(f"run folder: {result.model_dir.parent.parent}")
    return 0


def cmd_rm(cfg: Config, resume: str | None = None, overwrite: bool = False) -> int:
    result = api.train_rm(cfg, resume, resume=bool(resume), overwrite=overwrite, log=log)
    print(f"run folder: {result.model_dir.parent.parent}")
    return 0


def cmd_rl(cfg: Config, resume: str | None = None, overwrite: bool = False) -> int:
    from rlfuse.evaluation import eval_table  # torch: only once a run has finished

    result = api.train_rl(cfg, resume, resume=bool(resume), overwrite=overwrite, log=log)
    print(eval_table(vars(result)))
    print(f"report: {result.report}")
    print(f"run folder: {result.run_dir}")
    return 0


def cmd_run(cfg: Config, resume: str | None = None, overwrite: bool = False) -> int:
    """The whole pipeline on one config: SFT, reward model on the SFT backbone, then RL. With --resume, finished
    stages are kept and the one that was killed continues from its last checkpoint."""
    from rlfuse.evaluation import eval_table  # torch: only once a run has finished

    r = api.run_pipeline(cfg, resume, resume=bool(resume), overwrite=overwrite, log=log)
    sft, rm = r.sft, r.rm
    gram = f", grammatical rate {sft['grammatical_rate']:.3f}" if sft.get("grammatical_rate") is not None else ""
    print("\n".join([
        "",
        "  stage   seconds  result",
        f"  sft     {sft['seconds']:7.0f}  val perplexity {sft['perplexity']:.2f}{gram}",
        f"  rm      {rm['seconds']:7.0f}  held-out pairwise accuracy {rm['accuracy']:.3f}" if rm else
        "  rm            -  skipped (no role uses a reward model)",
        f"  rl      {r.rl.seconds:7.0f}  {cfg.rl.algo}, {cfg.rl.iterations} iterations",
        f"  total   {r.seconds:7.0f}",
        "",
        eval_table(vars(r.rl)),
        "",
    ]))
    print(f"report: {r.report}")
    print(f"run folder: {r.run_dir}")
    return 0


def cmd_report(run_dir: str, baseline: str | None = None) -> int:
    from rlfuse.metrics.report import write_report  # matplotlib: only when figures are drawn

    path = write_report(run_dir, baseline)
    print(f"report: {path}")
    return 0


def cmd_audit(run_dir: str) -> int:
    """The health detectors on a run folder: findings printed, exit 1 when one fired (for CI scripts), 0 when none."""
    folder = run_folder(run_dir)
    findings, iterations = audit_run(folder)
    print(audit_text(folder, findings, iterations))
    return 1 if findings else 0


def cmd_validate(cfg: Config) -> int:
    """The config as a run would use it: planned (placement.strategy=auto) and checked (plan.resolve)."""
    print(yaml.safe_dump(config_to_dict(api.resolved(cfg, log)), sort_keys=False), end="")
    print("config OK", file=sys.stderr)
    return 0


def cmd_env() -> int:
    """Versions and hardware for a bug report."""
    for key, value in env_report().items():
        print(f"{key + ':':<16}{value}")
    return 0


def env_report() -> dict:
    """python, platform, CPU, torch with CUDA and GPUs, and each library rlfuse uses ("not installed" where absent),
    read from package metadata so nothing heavy is imported but torch."""
    import torch  # the one heavy import: `rlfuse --help` and the other commands' parsing stay light

    out = {"rlfuse": metadata.version("rlfuse") if _has_dist("rlfuse") else "not installed (source tree)",
           "python": sys.version.split()[0], "platform": platform.platform(), "cpu": f"{_cpu_name()}, {os.cpu_count()} "
           f"logical cores, torch threads {torch.get_num_threads()}", "torch": torch.__version__,
           "cuda": (f"{torch.version.cuda} (available, {torch.cuda.device_count()} device(s))" if torch.cuda.is_available()
                    else f"{torch.version.cuda or 'none'} (no GPU visible)")}
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(i)
        out[f"gpu {i}"] = f"{props.name}, {props.total_memory / 2**30:.1f} GiB"
    for dist in ENV_PACKAGES:
        out[dist] = metadata.version(dist) if _has_dist(dist) else "not installed"
    return out


ENV_PACKAGES = ("transformers", "peft", "tokenizers", "datasets", "accelerate", "bitsandbytes", "ray", "trl", "vllm",
                "tensorboard", "wandb", "trackio", "mlflow", "matplotlib", "numpy")


def _has_dist(name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cmd_generate(ns) -> int:
    outs = api.generate(ns.model, ns.prompt, max_new_tokens=ns.max_new_tokens, temperature=ns.temperature,
                        top_k=ns.top_k, top_p=ns.top_p, n=ns.n, seed=ns.seed, device=ns.device, log=log)
    for prompt, completions in zip(ns.prompt, outs):
        for c in completions:
            print(f"{prompt}{c}" if ns.n == 1 and len(ns.prompt) == 1 else f"[{prompt}] {c}")
    return 0


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="a saved stage model (RUN_DIR/rl/model, RUN_DIR/sft/model), a LoRA "
                   "adapter folder (RUN_DIR/rl/adapter), a run folder (its rl/model, else sft/model) or a hub id")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for several")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="a finite number > 0 (1.0: the model as it is)")
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 disables")
    p.add_argument("-n", type=int, default=1, help=f"samples per prompt (1 to {api.GENERATE_MAX_N})")
    p.add_argument("--seed", type=int, default=0, help="the same seed gives the same samples")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")


COMMANDS = {
    "run": (cmd_run, "SFT -> reward model -> RL on one config (the embedded default task without a config)"),
    "sft": (cmd_sft, "supervised fine-tuning"),
    "rm": (cmd_rm, "reward-model training on preference pairs"),
    "rl": (cmd_rl, "online RL (ppo | rloo | grpo) from SFT and reward-model folders"),
    "validate": (cmd_validate, "load and check a config, print it resolved"),
}

# the config sections each command reads, listed with their fields in its --help
COMMAND_SECTIONS = {"sft": ("run", "data", "model", "sft"), "rm": ("run", "data", "model", "rm"),
                    "rl": ("run", "data", "model", "rl", "rollout", "placement")}

# what each command may change on --resume (config/resume.py CHANGEABLE), for its --help
RL_RESUME = "rl.iterations, rl.lr, logging and evaluation"
STAGE_RESUME = "the learning rate, clipping and warm-up, logging, evaluation and checkpoint intervals"
RESUMABLE = {"run": RL_RESUME, "rl": RL_RESUME, "sft": STAGE_RESUME, "rm": STAGE_RESUME}
WRITES_RUN = ("run", "sft", "rm", "rl")


def fields_help(sections: tuple[str, ...] | None = None, every: bool = True) -> str:
    """The settings of `sections` (default all): the common ones by topic with their first sentence (config.docs
    COMMON_FIELDS), then, with `every`, the others by name and default; `rlfuse explain FIELD` and docs/settings.md
    say the rest."""
    width = min(120, shutil.get_terminal_size((100, 20)).columns)
    names = sections or tuple(f.name for f in dataclasses.fields(Config))
    lines = ["common settings (section.field=value after the command, or in a YAML file; = the default):"]
    common = set()
    for topic, fields in COMMON_FIELDS:
        shown = [f for f in fields if f.split(".")[0] in names]
        common |= set(shown)
        if shown:
            lines.append(f"\n  {topic}")
            lines += [_field_line(*f.split("."), width) for f in shown]
    if every:
        lines.append("\nthe other settings (`rlfuse explain FIELD` says what one does):")
        for section in names:
            other = [f"{section}.{f.name}={field_default(section, f.name).split(' (')[0]}"
                     for f in dataclasses.fields(section_class(section)) if f"{section}.{f.name}" not in common]
            lines += textwrap.wrap("  ".join(other), width, initial_indent="  ", subsequent_indent="  ",
                                   break_on_hyphens=False)
    lines.append("\nEach setting in depth: docs/settings.md. Coming from TRL: docs/from_trl.md.")
    return "\n".join(lines)


def _field_line(section: str, name: str, width: int) -> str:
    head = f"    {section}.{name} = {field_default(section, name)}"
    text = field_summary(section_class(section), name)
    if len(head) < 42:
        return "\n".join(textwrap.wrap(text, width, initial_indent=f"{head:<42} ", subsequent_indent=" " * 43))
    return head + "\n" + "\n".join(textwrap.wrap(text, width, initial_indent=" " * 43, subsequent_indent=" " * 43))


def cmd_explain(fields: list[str]) -> int:
    """Each field's whole docstring and default: what `--help` shortens to a sentence."""
    for name in fields:
        section, dot, field = name.partition(".")
        if not dot or not field:
            raise UserError(f"{name!r} is not section.field; e.g. rlfuse explain rl.kl_target (rlfuse --help "
                            "lists the settings)")
        hint = trl_hint(section, field)
        if hint is not None and section in TRL_NAMES and field not in field_docs(section_class(section)):
            print(f"{name}: {hint[0]}")
            mapped = (TRL_NAMES[section].get(field) or TrlName(SHARED.get(field))).field
            if mapped is None:
                continue
            name, (section, _, field) = mapped, mapped.partition(".")
        try:
            doc = field_docs(section_class(section))[field]
        except KeyError:
            load_config(None, [f"{name}=null"])  # the unknown-key error, with its closest field
            raise UserError(f"{name} is not a setting; `rlfuse --help` lists them") from None
        print(f"{name} = {field_default(section, field)}")
        print("\n".join(textwrap.wrap(" ".join(doc.split()), 100, initial_indent="    ", subsequent_indent="    ")))
    return 0


HEALTH_HELP = (textwrap.fill(
    "Run the health detectors over a run folder's metrics (rl/metrics.jsonl, config.yaml, eval.json), finished, "
    "running or killed, and print what they found: when it started, how strong, what to do. Exit status 1 when a "
    "detector fired, 0 when none did, 2 when RUN_DIR is not a run folder. Rules and thresholds: docs/health.md.", 100)
    + "\n\ndetectors:\n" + "\n".join(f"  {d.name:22} {d.title}" for d in DETECTORS))


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="rlfuse", description="Fast, memory-lean RLHF: SFT -> reward model -> "
                                     "PPO | RLOO | GRPO. `rlfuse COMMAND --help` lists every setting the command "
                                     "reads.", formatter_class=raw, epilog=fields_help(every=False))
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=raw,
                           epilog=fields_help(COMMAND_SECTIONS.get(name)))
        p.add_argument("args", nargs="*", metavar="CONFIG|section.field=value",
                       help="optional YAML config, then overrides like sft.lr=1e-4 run.dir=/tmp/x")
        if name in WRITES_RUN:
            p.add_argument("--overwrite", action="store_true", help="replace what an earlier run wrote into run.dir "
                           "for this command (without it such a folder is refused)")
        if name in RESUMABLE:
            p.add_argument("--resume", metavar="RUN_DIR", help="continue a killed run from its last checkpoint "
                           f"(its saved config.yaml, or a CONFIG given; overrides apply: {RESUMABLE[name]} may change, "
                           "settings the checkpoint depends on may not)")
    rp = sub.add_parser("report", help="redraw a run's figures and report.html (also on a running or killed run)")
    rp.add_argument("run_dir", metavar="RUN_DIR")
    rp.add_argument("--baseline", metavar="RUN_DIR", help="a measured baseline run (e.g. rollout.fusion=true) for "
                    "speedup_comparison.png")
    ap = sub.add_parser("audit", help="run health: length drift, KL acceleration, entropy or group collapse, reward "
                        "hacking...; exit 1 when a detector fires (also on a running or killed run)",
                        description=HEALTH_HELP, formatter_class=raw)
    ap.add_argument("run_dir", metavar="RUN_DIR")
    add_generate_arguments(sub.add_parser("generate", help="sample completions from a saved model with the rollout "
                                          "engine", description=api.generate.__doc__))
    sub.add_parser("env", help="print versions and hardware for a bug report")
    ep = sub.add_parser("explain", help="what a setting does, in full: rlfuse explain rl.kl_target")
    ep.add_argument("fields", nargs="+", metavar="section.field")
    sp = sub.add_parser("schedule", help="fused actor/critic pipeline schedule: serial vs 1F1B vs fused, with a chart")
    schedule_cli.add_arguments(sp)
    plan_cli.add_arguments(sub.add_parser("plan", help="rank placements of an RL run by predicted time and memory",
                                          description=plan_cli.__doc__))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # overrides on both sides of a flag (rlfuse rl a=1 --overwrite b=2): argparse gives the positional list only
    # the run before the flag, so the rest comes back as unknown and joins it, in order
    ns, extra = parser.parse_known_args(argv)
    if extra:
        if not isinstance(getattr(ns, "args", None), list) or any(e.startswith("-") for e in extra):
            parser.parse_args(argv)  # argparse's own one-line error for what is really unknown
        ns.args += extra
    if ns.command == "schedule":
        return schedule_cli.run(ns)
    if ns.command == "plan":
        return plan_cli.run(ns)
    if ns.command == "env":
        return cmd_env()
    if ns.command in ("report", "generate", "explain", "audit"):
        try:
            if ns.command == "explain":
                return cmd_explain(ns.fields)
            if ns.command == "audit":
                return cmd_audit(ns.run_dir)
            return cmd_report(ns.run_dir, ns.baseline) if ns.command == "report" else cmd_generate(ns)
        except UserError as e:
            print(f"rlfuse {ns.command}: {e}", file=sys.stderr)
            return e.exit_code
        except OSError as e:  # a path the OS refuses (too long, a loop of links, no permission): one line
            if (line := os_error_line(e, ns.command)) is None:
                raise
            print(f"rlfuse {ns.command}: {line}", file=sys.stderr)
            return 1
    fn, _ = COMMANDS[ns.command]
    resume = run_dir = getattr(ns, "resume", None)  # run_dir: where a failed write's fix points
    try:
        config, overrides = split_args(ns.args)
        if resume:
            saved = Path(resume) / "config.yaml"
            if not saved.exists():
                raise UserError(f"--resume: {resume} is not a run folder (no config.yaml); give the folder a run printed")
            if getattr(ns, "overwrite", False):
                raise UserError("--resume and --overwrite: one continues the run, the other replaces it; give one")
            # a config file given with --resume is the run's new config, held to the resume rules like overrides
            cfg = load_config(config or saved, [f"run.dir={resume}", *overrides])
            return fn(cfg, resume=resume)
        cfg = load_config(config, overrides)
        run_dir = cfg.run.dir
        return fn(cfg, overwrite=ns.overwrite) if ns.command in WRITES_RUN else fn(cfg)
    except UserError as e:
        print(f"rlfuse {ns.command}: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # a full disk, a read-only folder: the path and the fix, not a traceback
        if (line := os_error_line(e, ns.command, run_dir)) is None:
            raise
        print(f"rlfuse {ns.command}: {line}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"rlfuse {ns.command}: interrupted", file=sys.stderr)
        return 130
