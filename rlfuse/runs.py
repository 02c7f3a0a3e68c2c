"""Run folders: one per run, holding the resolved config, per-stage outputs and metrics; what the CLI and the Python
API both do around the trainers (the folder, the RL results and report, stage models named by hub id)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from rlfuse.config import Config, is_hub_id, save_config
from rlfuse.errors import UserError
from rlfuse.files import write_text_atomic


def make_run_dir(cfg: Config, command: str) -> Path:
    """`run.dir` if given, else a new runs/<command>-<timestamp>; the resolved config is saved into it."""
    if cfg.run.dir:
        run_dir = Path(cfg.run.dir)
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = Path("runs") / f"{command}-{stamp}"
        i = 1
        while run_dir.exists():
            run_dir = Path("runs") / f"{command}-{stamp}-{i}"
            i += 1
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir)
    return run_dir


def stage_summary(run_dir: Path, stage: str) -> dict | None:
    """A finished stage's summary.json (None when the stage has not finished)."""
    path = Path(run_dir) / stage / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def write_rl_results(run_dir: Path, result: dict) -> Path:
    """eval.json (before/after, in rl/ and the run folder), samples_after.json, rl/summary.json (time, prompt budget
    and how many prompts were cut to it), and the report; returns its path."""
    # torch and matplotlib: only when a run has finished (the API and `rlfuse --help` import this module)
    from rlfuse.evaluation import EVAL_SAMPLES_KEPT
    from rlfuse.metrics.report import write_report

    evals = json.dumps({"before": result["before"], "after": result["after"]}, indent=2)
    write_text_atomic(run_dir / "rl" / "eval.json", evals)
    write_text_atomic(run_dir / "eval.json", evals)
    write_text_atomic(run_dir / "rl" / "samples_after.json", json.dumps(result["samples_after"][:EVAL_SAMPLES_KEPT],
                                                                        indent=1))
    summary = {"seconds": result["seconds"], **result["prompts"], "model_dir": str(run_dir / "rl" / "model")}
    write_text_atomic(run_dir / "rl" / "summary.json", json.dumps(summary, indent=2))
    return write_report(run_dir)


# ------------------------------------------------------------------------------- stage models by hub id

# what a model needs to load (weights, configs, tokenizer, chat template), not every file of the repository
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def _snapshot_download(repo_id: str, allow_patterns: list[str]) -> str:
    from huggingface_hub import snapshot_download  # only for a stage model named by hub id

    return snapshot_download(repo_id, allow_patterns=allow_patterns)


def hub_model_folder(name: str, field: str) -> str:
    """The local folder of hub model `name` (the hub cache, downloading what is missing; offline, the cache alone):
    what transformers' from_pretrained resolves, as one folder, since the RL stage loads several roles from it and
    saves its adapter on it. Repositories with only pytorch_model.bin get those too."""
    try:
        folder = _snapshot_download(name, HUB_FILES)
        if not any(Path(folder).glob("*.safetensors")):
            folder = _snapshot_download(name, HUB_FILES + ["*.bin"])
    except Exception as e:  # the hub's errors are many; the message and the fix are the same
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(f"config error: {field}: could not fetch hub model {name!r} ({type(e).__name__}: {first}); "
                        f"check the name, or download it where there is network, or set {field} to a local folder") from None
    if not (Path(folder) / "config.json").is_file() and not (Path(folder) / "adapter_config.json").is_file():
        raise UserError(f"config error: {field}: hub repository {name!r} has no config.json, so it is not a model; "
                        f"set {field} to a model's hub id or folder")
    return str(folder)


STAGE_PATHS = (("rl", "sft_path"), ("rl", "rm_path"), ("rm", "sft_path"))
"""The fields that name a stage's starting model, which take hub ids as well as folders."""


def with_local_stage_paths(cfg: Config) -> Config:
    """cfg with rl.sft_path, rl.rm_path and rm.sft_path given as hub ids replaced by their local folders. Done after
    the run folder saved the config, so config.yaml keeps the hub ids."""
    for section, name in STAGE_PATHS:
        part = getattr(cfg, section)
        if (value := getattr(part, name)) and is_hub_id(value):
            local = hub_model_folder(value, f"{section}.{name}")
            cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(part, **{name: local})})
    return cfg
