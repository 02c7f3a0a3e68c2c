"""Every field checked when the config loads, rather than an hour into training: a bad value raises ConfigError, which
names the field and the fix. What needs the placement checker or the planner is rlfuse/plan/resolve.py's."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import re
import sys
from pathlib import Path

from rlfuse.config.algorithms import ALGORITHMS, BEHAVIOUR_WEIGHT_MODES, RECIPES
from rlfuse.config.callables import check_callable
from rlfuse.config.model_files import gguf_file_of
from rlfuse.config.sections import (
    DATA_KINDS,
    MIN_WORKERS,
    OPTIMIZERS,
    QUANTIZATIONS,
    STRATEGIES,
    TRACKERS,
    Config,
    RLConfig,
    own_generator_copy,
)
from rlfuse.errors import ConfigError


def _episodes(cfg: Config) -> None:
    """rl.tools, rl.environment and their limits."""
    rl = cfg.rl
    if rl.reward == "environment" and not rl.environment:
        raise ConfigError("rl.reward", "environment: the reward of rl.environment, but none is set",
                          "set rl.environment=module:Class, or rl.reward to rm or reward functions")
    if not (rl.tools or rl.environment):
        return
    if rl.tools:
        rl.tools = ",".join(check_callable(x.strip(), "rl.tools") for x in rl.tools.split(","))
    if rl.environment:
        rl.environment = check_callable(rl.environment, "rl.environment")
    _positive(rl, "rl", "max_turns", "max_tool_calls", "tool_timeout_s")
    if rl.max_episode_tokens is not None:
        _positive(rl, "rl", "max_episode_tokens")
        if rl.max_episode_tokens < rl.max_new_tokens:
            raise ConfigError("rl.max_episode_tokens", f"{rl.max_episode_tokens} < rl.max_new_tokens="
                              f"{rl.max_new_tokens}: an episode could not hold one whole turn",
                              f"set it >= {rl.max_new_tokens}, or null (rl.max_new_tokens x rl.max_turns)")
    where = "rl.tools" if rl.tools else "rl.environment"
    if rl.partial_rollout_after:
        raise ConfigError(where, "an episode cannot be parked across a weight update (partial rollouts) for now",
                          "set rl.partial_rollout_after=0")


def _positive(cfg_section, section: str, *names: str, allow_zero: bool = False):
    for n in names:
        v = getattr(cfg_section, n)
        if v < 0 or (v == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"{section}.{n}", f"must be {bound}, got {v}", f"set {section}.{n} to a positive value")


def _divides(section, name: str, batch: str = "batch_size", micro: str = "micro_batch_size"):
    b, m = getattr(section, batch), getattr(section, micro)
    if b % m:
        raise ConfigError(
            f"{name}.{batch}",
            f"{b} is not a multiple of {name}.{micro}={m}",
            f"set {name}.{batch} to a multiple of {m} (e.g. {m * max(1, b // m)}) or change {name}.{micro}",
        )


def _choice(value, section: str, choices):
    if value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(section, f"{value!r} is not one of {', '.join(choices)}", f"pick one of them{hint}")


def _finite_numbers(cfg: Config) -> None:
    """No field takes NaN or infinity: every limit has its own off switch (0 or null), and a NaN compares false
    with everything, so it would pass the range checks below."""
    for section in dataclasses.fields(cfg):
        part = getattr(cfg, section.name)
        for f in dataclasses.fields(part):
            v = getattr(part, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                default = f.default if f.default is not dataclasses.MISSING else None
                raise ConfigError(f"{section.name}.{f.name}", f"must be a finite number, got {v}",
                                  f"set a finite value (default {default})")


def _learning_rates(cfg: Config) -> None:
    """AdamW moves every weight by about lr per step, so lr >= 1 wrecks any model at the first step."""
    for name, value in (("sft.lr", cfg.sft.lr), ("rm.lr", cfg.rm.lr), ("rl.lr", cfg.rl.lr),
                        ("rl.critic_lr", cfg.rl.critic_lr)):
        if value >= 1:
            raise ConfigError(name, f"{value} is not a learning rate AdamW can train with (each step moves every "
                              "weight by about that much)", f"set {name} between 1e-6 and 1e-2 (fine-tuning: "
                              "1e-5 to 1e-4 full, 1e-4 to 1e-3 LoRA)")


PATH_FIELDS = (("run", "dir"), ("data", "path"), ("model", "name"), ("model", "gguf_file"), ("rm", "sft_path"),
               ("rl", "sft_path"), ("rl", "rm_path"), ("data", "chat_template"))
NAME_MAX = 255
"""Bytes a file or folder name may have on Linux, macOS and Windows file systems alike."""


def _path_parts(cfg: Config) -> None:
    """A path with a part the file system cannot name fails as an OSError wherever it is first touched (pathlib's
    exists() raises ENAMETOOLONG): said here, naming the field."""
    for section, name in PATH_FIELDS:
        value = getattr(getattr(cfg, section), name)
        if not isinstance(value, str):
            continue
        longest = max((len(part.encode()) for part in value.replace("\\", "/").split("/")), default=0)
        if longest > NAME_MAX and "\n" not in value and "{" not in value:  # a chat template's text is not a path
            raise ConfigError(f"{section}.{name}", f"a part of the path is {longest} bytes long, over the {NAME_MAX} a "
                              "file name may have", "shorten it")


def validate(cfg: Config) -> Config:
    """Check every field now rather than an hour into training. Raises ConfigError."""
    _finite_numbers(cfg)
    _learning_rates(cfg)
    _path_parts(cfg)
    r, d, m = cfg.run, cfg.data, cfg.model
    _choice(r.device, "run.device", ("auto", "cpu", "cuda"))
    _choice(r.precision, "run.precision", ("auto", "fp32", "bf16", "fp16"))
    _validate_quantization(cfg)
    _positive(r, "run", "threads", allow_zero=True)
    _choice(r.cpu_heap, "run.cpu_heap", ("lean", "update", "reuse"))
    _validate_report_to(r.report_to)
    _choice(d.kind, "data.kind", DATA_KINDS)
    if d.kind in ("csv", "jsonl", "parquet", "hub") and not d.path:
        raise ConfigError("data.path", f"data.kind={d.kind} needs a file or hub name",
                          "set data.path=/path/to/file (or a hub data set name with data.kind=hub)")
    if not d.split:
        raise ConfigError("data.split", "empty", "set data.split=train")
    if d.path and d.kind != "synthetic" and not Path(d.path).exists() and _looks_like_path(d.path):
        raise ConfigError("data.path", f"file {d.path!r} not found", "point data.path at an existing file")
    _positive(d, "data", "num_reviews", "max_length", "prompt_words")
    _choice(d.arithmetic_format, "data.arithmetic_format", ("text", "chat", "calculator"))
    if d.kind == "arithmetic" and d.arithmetic_format == "calculator" and "calculator" not in (cfg.rl.tools or ""):
        raise ConfigError("data.arithmetic_format", "calculator: the demonstrations call a calculator tool that "
                          "rl.tools does not give the policy", "set rl.tools=rlfuse.data.arithmetic:calculator")
    if d.kind == "guessing" and not cfg.rl.environment:
        raise ConfigError("data.kind", "guessing: a game played against an environment, but rl.environment is not "
                          "set", "set rl.environment=rlfuse.data.guessing:GuessNumber and rl.reward=environment")
    if d.arithmetic_steps not in (1, 2):
        raise ConfigError("data.arithmetic_steps", f"{d.arithmetic_steps} is not one of 1, 2", "set 1 or 2")
    if d.max_operand < 4:
        raise ConfigError("data.max_operand", f"must be >= 4, got {d.max_operand}", "set e.g. data.max_operand=9")
    if d.prompt_words < 2:
        raise ConfigError("data.prompt_words", f"must be >= 2, got {d.prompt_words}", "set data.prompt_words=4")
    if d.max_examples is not None:
        _positive(d, "data", "max_examples")
    if not 0.0 < d.eval_fraction < 0.5:
        raise ConfigError("data.eval_fraction", f"must be in (0, 0.5), got {d.eval_fraction}", "set data.eval_fraction=0.05")
    gguf = gguf_file_of(m.name, m.gguf_file)  # a GGUF model's file is there, or a ConfigError says which is not
    if gguf is None and m.name != "embedded" and _looks_like_path(m.name) and not Path(m.name).exists():
        raise ConfigError("model.name", f"folder {m.name!r} not found", "give an existing model folder or a hub name")
    _positive(m, "model", "n_layer", "n_embd", "n_head", "lora_r", "lora_alpha")
    if m.n_embd % m.n_head:
        raise ConfigError("model.n_head", f"{m.n_head} does not divide model.n_embd={m.n_embd}", "pick a divisor, e.g. 4")
    for name, s in (("sft", cfg.sft), ("rm", cfg.rm)):
        _positive(s, name, "lr", "steps", "batch_size", "micro_batch_size", "eval_every", "ckpt_every", "max_bad_steps")
        _positive(s, name, "warmup_steps", "weight_decay", "grad_clip", allow_zero=True)
        _divides(s, name)
    _choice(cfg.rm.init, "rm.init", ("sft", "base"))
    if cfg.rm.sft_path and not Path(cfg.rm.sft_path).exists() and not is_hub_id(cfg.rm.sft_path):
        raise ConfigError("rm.sft_path", f"folder {cfg.rm.sft_path!r} not found", "point it at an SFT run's sft/model "
                          "folder or a hub id")
    _positive(cfg.rm, "rm", "num_pairs")
    if cfg.rm.max_length is not None:
        _positive(cfg.rm, "rm", "max_length")
    _positive(cfg.sft, "sft", "eval_samples", allow_zero=True)
    _validate_rl(cfg)
    _validate_placement(cfg)
    _validate_train_parallel(cfg)
    if cfg.sft.completion_only and d.kind == "synthetic":
        raise ConfigError("sft.completion_only", "the synthetic task has no prompt/response split", "set sft.completion_only=false")
    return cfg


# the package each tracker imports, as pip installs it
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}


def _validate_report_to(report_to) -> None:
    """Each tracker named and installed, so a missing one stops the run before training rather than at its end."""
    for name in report_to or ():
        _choice(name, "run.report_to", TRACKERS)
        if not package_installed(TRACKER_PACKAGES[name]):
            raise tracker_missing(name)


def tracker_missing(name: str) -> ConfigError:
    """The one-line error for a run.report_to tracker that is not installed (validation and opening it alike)."""
    return ConfigError("run.report_to", f"{name} is not installed", f"pip install {TRACKER_PACKAGES[name]} "
                       f"(or remove {name} from run.report_to)")


def package_installed(name: str) -> bool:
    """Importable without importing it (wandb and mlflow take seconds to import); a module set to None in
    sys.modules, as tests do to hide one, counts as missing."""
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _validate_quantization(cfg: Config) -> None:
    m = cfg.model
    _choice(m.quantization, "model.quantization", QUANTIZATIONS)
    if m.quantization != "none" and not m.lora:
        raise ConfigError("model.quantization", f"{m.quantization} weights are frozen: only LoRA adapters can train on "
                          "them", "set model.lora=true (or model.quantization=none)")
    if m.shared_base and not m.lora:
        raise ConfigError("model.shared_base", "the roles share one base as LoRA adapters", "set model.lora=true")
    if m.quantization != "none" and m.shared_base is False:
        raise ConfigError("model.shared_base", "a quantised base is loaded once and shared by the RL roles as adapters",
                          "set model.shared_base=true (or leave it unset)")
    if m.shares_base and cfg.placement.strategy not in ("single", "flattened", "auto"):
        raise ConfigError("model.shared_base", f"every role is an adapter on one base, so a worker holding the base "
                          f"holds them all, and placement.strategy={cfg.placement.strategy} puts the roles on "
                          "different workers", "set placement.strategy=flattened (every worker holds the base and "
                          "all roles; the adapters train data-parallel) or single (or model.shared_base=false and "
                          "model.quantization=none)")
    if m.shares_base and cfg.rl.train_parallel == "fsdp":
        raise ConfigError("rl.train_parallel", "the shared base trains its adapters on replicas of the (quantised) "
                          "base, which fsdp does not shard", "set rl.train_parallel=data (or model.shared_base=false "
                          "and model.quantization=none)")
    if m.shares_base and cfg.rm.init != "sft":
        raise ConfigError("rm.init", "with model.shared_base the reward adapter must be trained on the SFT model, the "
                          "base it is attached to in RL", "set rm.init=sft")
    _choice(cfg.rl.optimizer, "rl.optimizer", OPTIMIZERS)


def _validate_staleness(cfg: Config) -> None:
    """rl.max_staleness and its importance-weight settings."""
    rl = cfg.rl
    _positive(rl, "rl", "max_staleness", "partial_rollout_after", allow_zero=True)
    if rl.partial_rollout_after and not rl.max_staleness:
        raise ConfigError("rl.partial_rollout_after", "partial rollouts carry a batch decoded ahead over a weight "
                          "update, and rl.max_staleness=0 decodes nothing ahead", "set rl.max_staleness=1 or "
                          "rl.partial_rollout_after=0")
    _positive(rl, "rl", "behaviour_weight_cap")
    _choice(rl.behaviour_weight_mode, "rl.behaviour_weight_mode", BEHAVIOUR_WEIGHT_MODES)
    if rl.max_staleness and rl.train_parallel.startswith("pipeline"):
        raise ConfigError("rl.max_staleness", f"asynchronous RL trains data-parallel only, not with "
                          f"rl.train_parallel={rl.train_parallel}", "set rl.train_parallel=data or rl.max_staleness=0")


def _validate_rl(cfg: Config) -> None:
    rl, ro = cfg.rl, cfg.rollout
    _choice(rl.algo, "rl.algo", tuple(ALGORITHMS))
    algo = ALGORITHMS[rl.algo]
    _choice(rl.loss_level, "rl.loss_level", ("token", "sequence"))
    if rl.loss_agg is not None:
        _choice(rl.loss_agg, "rl.loss_agg", ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                             "seq-mean-token-sum-norm"))
    _choice(rl.policy_loss, "rl.policy_loss", ("ppo", "gspo", "cispo", "gpg"))
    _choice(rl.scale_rewards, "rl.scale_rewards", ("group", "batch", "none"))
    _positive(rl, "rl", "overlong_buffer", allow_zero=True)
    _choice(rl.reward_normalization, "rl.reward_normalization", ("sum", "per_function"))
    if rl.reward_normalization == "per_function" and not ALGORITHMS[rl.algo].groups_prompts:
        raise ConfigError("rl.reward_normalization", f"per_function normalises each reward in its prompt's group; "
                          f"{rl.algo} samples no groups", "use it with rl.algo=grpo or rloo, or set it to sum")
    if rl.overlong_buffer > rl.response_limit:
        raise ConfigError("rl.overlong_buffer", f"{rl.overlong_buffer} exceeds the response limit of "
                          f"{rl.response_limit} tokens", f"set it below {rl.response_limit} (e.g. a quarter of it)")
    if rl.recipe is not None:
        _choice(rl.recipe, "rl.recipe", tuple(RECIPES))
        if not ALGORITHMS[rl.algo].groups_prompts:
            raise ConfigError("rl.recipe", f"{rl.recipe} is a recipe for group-relative algorithms, not {rl.algo}",
                              "set rl.algo=grpo (or rloo), or leave rl.recipe unset")
    if rl.clip_high is not None and not rl.clip_high > 0:
        raise ConfigError("rl.clip_high", f"must be > 0, got {rl.clip_high}", "e.g. 0.28 (DAPO), or null for rl.clip")
    if rl.dual_clip is not None and not rl.dual_clip > 1:
        raise ConfigError("rl.dual_clip", f"must be > 1, got {rl.dual_clip}", "e.g. 3 (Ye et al.), or null for off")
    if rl.kl_estimator is not None:
        _choice(rl.kl_estimator, "rl.kl_estimator", ("k1", "k2", "k3"))
    _choice(rl.critic_init, "rl.critic_init", ("rm", "sft", "actor"))
    _choice(rl.checkpoint_scope, "rl.checkpoint_scope", ("layer", "mlp"))
    _positive(rl, "rl", "iterations", "prompts_per_iter", "k", "max_new_tokens", "temperature", "lr", "critic_lr",
              "epochs", "mini_batch_size", "micro_batch_size", "clip", "kl_horizon", "ckpt_every", "max_bad_steps")
    _positive(rl, "rl", "top_k", "vf_clip", "kl_coef", "unfinished_penalty", "grad_clip", "eval_prompts", allow_zero=True)
    if rl.kl_target is not None:
        _positive(rl, "rl", "kl_target")
    _validate_staleness(cfg)
    _validate_temperature_and_curriculum(rl)
    if rl.max_prompt_tokens is not None:
        _positive(rl, "rl", "max_prompt_tokens")
    if rl.micro_batch_tokens is not None:
        _positive(rl, "rl", "micro_batch_tokens")
    if not 0 < rl.top_p <= 1:
        raise ConfigError("rl.top_p", f"must be in (0, 1], got {rl.top_p}", "set rl.top_p=1.0 to disable nucleus sampling")
    if not (0 <= rl.gamma <= 1 and 0 <= rl.lam <= 1):
        raise ConfigError("rl.gamma" if not 0 <= rl.gamma <= 1 else "rl.lam", "must be in [0, 1]", "e.g. rl.gamma=1.0 rl.lam=0.95")
    if rl.k < algo.min_k:
        raise ConfigError("rl.k", f"{rl.algo} needs at least {algo.min_k} samples per prompt, got {rl.k}", "set rl.k=4")
    _divides(rl, "rl", "mini_batch_size", "micro_batch_size")
    n = rl.prompts_per_iter * rl.k
    if n % rl.mini_batch_size:
        raise ConfigError("rl.mini_batch_size", f"{rl.mini_batch_size} does not divide the {n} samples per iteration "
                          f"(rl.prompts_per_iter x rl.k)", f"pick a divisor of {n}")
    if algo.groups_prompts and rl.mini_batch_size % rl.k:
        raise ConfigError("rl.mini_batch_size", f"must be a multiple of rl.k={rl.k} so a prompt's samples stay together",
                          f"set it to a multiple of {rl.k}")
    _positive(rl, "rl", "max_refills", allow_zero=True)
    if rl.dynamic_sampling and not algo.groups_prompts:
        raise ConfigError("rl.dynamic_sampling", f"draws prompt groups whose k rewards differ; {rl.algo} samples no "
                          "groups", "use it with rl.algo=grpo or rloo, or set it false")
    if rl.skip_zero_advantage and algo.advantage not in ("rloo", "grpo"):
        raise ConfigError("rl.skip_zero_advantage", f"{rl.algo}'s advantages (GAE on a critic's values) are not 0 "
                          f"for a group of equal rewards", "use it with rl.algo=grpo or rloo, or set it false")
    if rl.skip_zero_advantage and cfg.placement.strategy not in ("single", "auto"):
        raise ConfigError("rl.skip_zero_advantage", f"runs in one process for now (placement.strategy="
                          f"{cfg.placement.strategy}: its data-parallel update is not yet tested against it)",
                          "set placement.strategy=single or the option false")
    if rl.skip_zero_advantage and rl.train_parallel.startswith("pipeline"):
        raise ConfigError("rl.skip_zero_advantage", f"the pipeline schedule (rl.train_parallel={rl.train_parallel}) "
                          f"runs a fixed number of micro-batches", "set rl.train_parallel=data or the option false")
    _episodes(cfg)
    specs = rl.reward_functions
    if specs:  # each function found now (no user code runs yet), a file path kept absolute
        rl.reward = ",".join(check_callable(x, "rl.reward") for x in specs)
    if rl.reward_weights is not None:
        if len(rl.reward_weights) != len(specs):
            raise ConfigError("rl.reward_weights", f"{len(rl.reward_weights)} weights for {len(specs)} reward "
                              "function(s) in rl.reward", "give one weight per function, or leave it unset")
        try:
            rl.reward_weights = [float(w) for w in rl.reward_weights]
        except (TypeError, ValueError):
            raise ConfigError("rl.reward_weights", f"{rl.reward_weights!r} are not all numbers", "e.g. [1.0, 0.5]") from None
    for name in ("sft_path", "rm_path"):
        v = getattr(rl, name)
        if v and not Path(v).exists() and not is_hub_id(v):  # a hub id is fetched when the stage starts
            raise ConfigError(f"rl.{name}", f"folder {v!r} not found", "point it at a saved model folder or a hub id")
    _positive(rl, "rl", "eval_every", "log_samples_every", allow_zero=True)
    if not (isinstance(ro.fusion, bool) or ro.fusion == "auto"):
        raise ConfigError("rollout.fusion", f"expected auto, true or false, got {ro.fusion!r}",
                          "set rollout.fusion=auto (the default), true or false")
    _positive(ro, "rollout", "score_every", "max_rows", "micro_batch_size")
    _positive(ro, "rollout", "live_below", allow_zero=True)
    _positive(ro, "rollout", "rows_per_worker")
    if not 0.0 <= ro.migrate_below <= 1.0:
        raise ConfigError("rollout.migrate_below", f"must be a fraction in [0, 1], got {ro.migrate_below}",
                          "set it to e.g. 0.2 (0 turns tail migration off)")
    if ro.max_rows < rl.k:
        raise ConfigError("rollout.max_rows", f"{ro.max_rows} < rl.k={rl.k}: a prompt's samples must fit", f"set it >= {rl.k}")
    _choice(ro.weight_sync, "rollout.weight_sync", ("auto", "merged", "adapters"))
    _choice(ro.engine, "rollout.engine", ("auto", "rlfuse", "vllm"))
    _positive(ro, "rollout", "vllm_kv_cache_gb")
    if ro.engine == "vllm" and cfg.placement.strategy not in ("single", "auto", "separated"):
        raise ConfigError("rollout.engine", f"vllm generates in the trainer's process or on generation workers of its "
                          f"own, not on workers that also train (placement.strategy={cfg.placement.strategy})",
                          "use placement.strategy=single or separated with vllm, or rollout.engine=rlfuse")
    if ro.engine == "vllm" and rl.partial_rollout_after:
        raise ConfigError("rl.partial_rollout_after", "vllm cannot park a rollout's rows across a weight update",
                          "set rl.partial_rollout_after=0 with rollout.engine=vllm, or rollout.engine=rlfuse")
    if ro.engine == "vllm" and cfg.model.shares_base:
        raise ConfigError("rollout.engine", "vllm decodes a merged copy of its own, which model.shared_base exists to "
                          "avoid", "set model.shared_base=false with vllm, or rollout.engine=rlfuse")
    _choice(ro.generator_dtype, "rollout.generator_dtype", ("auto", "fp32", "bf16"))
    _choice(ro.weight_layout, "rollout.weight_layout", ("auto", "row", "column"))
    fp32_training = rl.train_parallel not in ("data", "single")
    if ro.generator_dtype == "bf16" and (cfg.model.shares_base or fp32_training):
        # a bf16 copy decodes in one process and on Ray's decoding workers alike (models/device.py
        # generator_copy_dtype), but not beside a shared base, nor with sharded or pipelined training
        where = ("with model.shared_base the engine decodes the shared base" if cfg.model.shares_base else
                 f"rl.train_parallel={rl.train_parallel} trains and decodes in fp32")
        raise ConfigError("rollout.generator_dtype", f"bf16 needs a generator copy of its own; {where}",
                          "set rollout.generator_dtype=auto (the default) or fp32")
    if ro.weight_layout == "column" and not own_generator_copy(cfg):
        where = (f"placement.strategy={cfg.placement.strategy} is not single: Ray workers' generators stay row-major"
                 if cfg.placement.strategy not in ("single", "auto") else
                 "with model.shared_base the engine decodes the shared base" if cfg.model.shares_base else
                 "full fine-tuning decodes the actor itself (rollout.generator_dtype=bf16 gives it a copy of its own)")
        raise ConfigError("rollout.weight_layout", f"column needs a generator copy of its own in this process; {where}",
                          "set rollout.weight_layout=auto (the default) or row")
    if ro.weight_sync == "adapters" and (not cfg.model.lora or cfg.model.shares_base):
        why = ("with model.shared_base the workers decode the base itself: nothing is synced" if cfg.model.lora else
               "only LoRA adapters can be sent alone; full fine-tuning changes every weight")
        raise ConfigError("rollout.weight_sync", why, "set rollout.weight_sync=auto")


GROUP_KEYS = ("name", "workers", "roles", "cpus_per_worker", "gpus_per_worker")


def _validate_train_parallel(cfg: Config) -> None:
    """A pipeline mode needs a separate PPO critic and plain (not LoRA) models; single needs one process; fsdp Ray
    workers. Whether the placement gives it two or more training workers, and models it can cut into that many
    stages, is rlfuse/plan/resolve.py's to check."""
    rl, p, field_name = cfg.rl, cfg.placement, "rl.train_parallel"
    _choice(rl.train_parallel, field_name, ("single", "data", "fsdp", "pipeline_serial", "pipeline_fused"))
    if rl.train_parallel == "single" and p.strategy not in ("single", "auto"):
        raise ConfigError(field_name, f"single trains in one process, but placement.strategy={p.strategy} trains on "
                          "Ray workers", "set rl.train_parallel=data (or a pipeline mode), or placement.strategy=single")
    if rl.train_parallel == "fsdp" and p.strategy == "single":
        raise ConfigError(field_name, "fsdp shards the training over the Ray training workers, but placement.strategy="
                          "single trains in one process", "set placement.strategy=flattened (or separated, interleaved) "
                          "with placement.workers=2 or more, or rl.train_parallel=data")
    if not rl.train_parallel.startswith("pipeline") or p.strategy == "auto":  # auto: checked once resolved
        return
    if not ALGORITHMS[rl.algo].critic or rl.critic_init == "actor":
        raise ConfigError(field_name, f"{rl.train_parallel} pipelines an actor and a separate critic (rl.algo=ppo, "
                          f"rl.critic_init sft or rm), got rl.algo={rl.algo}, rl.critic_init={rl.critic_init}",
                          "set rl.algo=ppo and rl.critic_init=rm, or rl.train_parallel=data")
    if cfg.model.lora or cfg.model.shares_base or cfg.model.quantization != "none":
        raise ConfigError(field_name, "pipeline stages hold plain full-weight models (no LoRA, shared base or "
                          "quantisation)", "set model.lora=false, or rl.train_parallel=data")


def require_ray(what: str) -> None:
    """A placement on Ray workers needs Ray: said when the config loads, not once the models have loaded."""
    if not package_installed("ray"):
        raise ConfigError("placement.strategy", f"{what} runs on Ray workers, and Ray is not installed",
                          "install it (bash scripts/install.sh ray, or pip install 'ray>=2.40'), or set "
                          "placement.strategy=single")


def _validate_placement(cfg: Config) -> None:
    """The placement section's fields; the layout itself (roles placed, shared weights together, memory) is the
    placement checker's, run by rlfuse/plan/resolve.py before any worker starts."""
    p = cfg.placement
    _choice(p.strategy, "placement.strategy", STRATEGIES + ("auto",))
    _positive(p, "placement", "workers", "cpus_per_worker")
    _positive(p, "placement", "gpus_per_worker", allow_zero=True)
    if not is_gpu_share(p.gpus_per_worker):
        raise ConfigError("placement.gpus_per_worker", f"{p.gpus_per_worker:g} is neither a fraction of one GPU nor "
                          "a whole number", "set it to e.g. 0.5, 1 or 2")
    if p.memory_per_worker_gb is not None:
        _positive(p, "placement", "memory_per_worker_gb")
    if p.strategy not in ("single", "auto"):
        require_ray(f"placement.strategy={p.strategy}")
    least = MIN_WORKERS.get(p.strategy, 1)
    if p.workers < least:
        raise ConfigError("placement.workers", f"placement.strategy={p.strategy} needs at least {least} workers, got "
                          f"{p.workers}", f"set placement.workers={least} or more")
    if p.strategy == "single":
        if p.address is not None:
            raise ConfigError("placement.address", "only a Ray strategy uses a cluster; single runs in this process",
                              "set placement.strategy=flattened|interleaved|separated, or remove placement.address")
    if (p.groups is not None) != (p.strategy == "custom"):
        raise ConfigError("placement.groups", "is read by placement.strategy=custom and only by it",
                          "set placement.strategy=custom with placement.groups, or remove placement.groups")
    if p.strategy == "custom":
        _validate_groups(p.groups)


def is_gpu_share(gpus: float) -> bool:
    """Ray grants a fraction of one GPU or whole GPUs, nothing in between (1.5 is refused)."""
    return gpus >= 0 and (gpus <= 1 or gpus == int(gpus))


def _validate_groups(groups) -> None:
    """The shape of placement.groups; what the roles mean is the placement checker's business."""
    if not isinstance(groups, list) or not groups:
        raise ConfigError("placement.groups", f"expected a list of groups, got {groups!r}",
                          "write it in the YAML file as a list of {name, workers, roles}")
    for i, g in enumerate(groups):
        where = f"placement.groups[{i}]"
        if not isinstance(g, dict):
            raise ConfigError(where, f"expected a mapping, got {g!r}", "write it as {name: train, workers: 1, roles: [actor]}")
        for key in g:
            if key not in GROUP_KEYS:
                close = difflib.get_close_matches(str(key), GROUP_KEYS, n=1)
                hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(GROUP_KEYS)}"
                raise ConfigError(f"{where}.{key}", "unknown key", f"remove it ({hint})")
        for key in ("name", "workers", "roles"):
            if key not in g:
                raise ConfigError(f"{where}.{key}", "missing", f"give the group its {key}")
        if not isinstance(g["name"], str) or not g["name"]:
            raise ConfigError(f"{where}.name", f"expected a name, got {g['name']!r}", "e.g. name: train")
        if isinstance(g["workers"], bool) or not isinstance(g["workers"], int) or g["workers"] < 1:
            raise ConfigError(f"{where}.workers", f"expected a whole number >= 1, got {g['workers']!r}", "e.g. workers: 1")
        roles = g["roles"]
        if not (isinstance(roles, str) or (isinstance(roles, list) and all(isinstance(r, str) for r in roles))):
            raise ConfigError(f"{where}.roles", f"expected a list of role names, got {roles!r}", "e.g. roles: [actor, critic]")
        for key in ("cpus_per_worker", "gpus_per_worker"):
            v = g.get(key, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ConfigError(f"{where}.{key}", f"expected a number >= 0, got {v!r}", f"e.g. {key}: 1")


def _validate_temperature_and_curriculum(rl: RLConfig) -> None:
    _choice(rl.temperature_schedule, "rl.temperature_schedule", ("constant", "linear", "cosine"))
    _choice(rl.curriculum, "rl.curriculum", ("none", "length", "reward"))
    for name in ("temperature_final", "eval_temperature"):
        if getattr(rl, name) is not None:
            _positive(rl, "rl", name)
    if rl.temperature_schedule != "constant" and rl.temperature_final is None:
        raise ConfigError("rl.temperature_final", f"rl.temperature_schedule={rl.temperature_schedule} needs the last "
                          "iteration's temperature", "set e.g. rl.temperature=1.0 rl.temperature_final=0.7")
    if rl.temperature_schedule == "constant" and rl.temperature_final is not None:
        raise ConfigError("rl.temperature_final", "is set but rl.temperature_schedule=constant ignores it",
                          "set rl.temperature_schedule=linear (or cosine), or remove rl.temperature_final")
    if not 0 < rl.curriculum_start <= 1:
        raise ConfigError("rl.curriculum_start", f"must be in (0, 1], got {rl.curriculum_start}",
                          "set e.g. rl.curriculum_start=0.25")


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def is_hub_id(name: str) -> bool:
    """'org/name' or 'name', not an existing local path: a model on the hub (rl.sft_path, rl.rm_path, rm.sft_path)."""
    return bool(HUB_ID.match(name)) and not Path(name).expanduser().exists() and not _looks_like_path(name)


def _looks_like_path(name: str) -> bool:
    """Hub names look like 'org/name'; local paths start with . / ~ or end in a file suffix."""
    return name.startswith((".", "/", "~")) or Path(name).suffix in (".csv", ".jsonl", ".gz", ".parquet", ".json")
