"""Typed run configuration: one dataclass per section, loaded from YAML plus `section.field=value` overrides.

Every field is validated eagerly in `validate()`; a bad value raises `ConfigError`, which names the field and the
fix. The resolved config is saved into each run folder (`save_config`), so a run can always be reproduced.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from rlfuse.errors import ConfigError, UserError
from rlfuse.models.roles import derive_roles
from rlfuse.placement.check import check_placement
from rlfuse.placement.spec import STRATEGIES, is_gpu_share
from rlfuse.placement.strategies import MIN_WORKERS, spec_from_config

DATA_KINDS = ("synthetic", "arithmetic", "imdb", "hh_rlhf", "csv", "jsonl", "parquet", "hub")
QUANTIZATIONS = ("none", "4bit", "8bit")
OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit")
TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")


@dataclass
class RunConfig:
    dir: Optional[str] = None
    """Run folder. Default: a new folder runs/<command>-<timestamp>."""
    seed: int = 0
    """Seed for data order, initialisation and sampling."""
    device: str = "auto"
    """auto | cpu | cuda."""
    precision: str = "auto"
    """SFT and reward model: auto (bf16 autocast on a GPU that supports it, fp32 on CPU) | fp32 | bf16 | fp16. The RL
    stage runs fp32 for now. With model.quantization, also the dtype the quantised layers compute in."""
    quiet: bool = False
    """No live progress bars, only periodic log lines (also the default when stderr is not a terminal)."""
    threads: int = 0
    """torch CPU threads; 0 leaves torch's default."""
    memory_table: Optional[bool] = None
    """The RL stage measures memory per component (rl/memory.json and the report's table; one process only, Ray
    workers log their RSS). null: on where memory is the point (model.quantization or a shared base). On a CPU
    each measurement hands freed heap back to the OS first, about 0.25 s twice per iteration."""
    report_to: Optional[list] = None
    """Where SFT, RM and RL metrics go besides metrics.jsonl: a list of tensorboard | wandb | trackio | mlflow (each an
    optional install; a missing one is a config error naming the package). null: tensorboard when installed. []: none.
    wandb and trackio take their project from WANDB_PROJECT / TRACKIO_PROJECT (default rlfuse), mlflow from its own
    MLFLOW_* variables; one tracker run per stage, named <run folder>-<stage>."""

    def measures_memory(self, model) -> bool:
        """memory_table, or its default for this model section."""
        return (model.quantization != "none" or model.shares_base) if self.memory_table is None else self.memory_table


@dataclass
class DataConfig:
    kind: str = "synthetic"
    """synthetic (the embedded default task) | arithmetic (embedded word problems with a verifiable answer) | imdb |
    hh_rlhf | csv | jsonl | parquet | hub. csv, jsonl, parquet and
    hub rows may be in any of TRL's formats (text; prompt; prompt + completion; prompt + chosen + rejected; or
    messages), standard or conversational (message lists), detected per data set."""
    path: Optional[str] = None
    """Local file (csv/jsonl/jsonl.gz/parquet) or a hub data set name (imdb, hh_rlhf, hub). Unused by synthetic."""
    subset: Optional[str] = None
    """Hub data sets: the configuration name (e.g. `main` for openai/gsm8k)."""
    split: str = "train"
    """Hub data sets: the split to read; rlfuse holds out data.eval_fraction of it itself."""
    chat_template: Optional[str] = None
    """Conversational rows are rendered with the tokenizer's chat template; this sets one: `chatml`, a .jinja file,
    or the template text (saved with the SFT model's tokenizer)."""
    text_column: Optional[str] = None
    """Generic files: column with the text to learn (SFT). Defaults per kind."""
    label_column: Optional[str] = None
    """Generic files: sentiment label column (positive/negative or 1/0), used to build preference pairs."""
    prompt_column: Optional[str] = None
    """Generic files: prompt column (default `prompt`), used whole as the RL prompt; with the completion column
    SFT can be completion-only."""
    response_column: Optional[str] = None
    """Generic files: completion column (default `completion`; completion-only SFT)."""
    chosen_column: Optional[str] = None
    """Generic files: preferred response column (reward model; default `chosen`)."""
    rejected_column: Optional[str] = None
    """Generic files: dispreferred response column (reward model; default `rejected`)."""
    num_reviews: int = 6000
    """Synthetic task: number of reviews in the corpus."""
    max_examples: Optional[int] = None
    """Use at most this many rows of a file (after skipping empty ones)."""
    eval_fraction: float = 0.05
    """Fraction of rows held out for validation."""
    max_length: int = 192
    """Tokens per training sequence; longer ones are truncated."""
    prompt_words: int = 4
    """Synthetic task: words of a held-out review used as an RL/eval prompt (2..prompt_words)."""


@dataclass
class ModelConfig:
    name: str = "embedded"
    """'embedded' (the default task's GPT-2, built locally), a hub name (distilgpt2) or a local model folder."""
    n_layer: int = 4
    """Embedded model: transformer layers."""
    n_embd: int = 128
    """Embedded model: hidden size."""
    n_head: int = 4
    """Embedded model: attention heads (must divide n_embd)."""
    lora: bool = False
    """Train LoRA adapters through peft instead of all weights."""
    lora_r: int = 8
    """LoRA rank."""
    lora_alpha: int = 16
    """LoRA scaling numerator."""
    lora_targets: Optional[list] = None
    """Module names for LoRA; default chosen per architecture (GPT-2: c_attn, c_proj, c_fc; Llama: q/k/v/o/gate/up/down)."""
    quantization: str = "none"
    """none | 4bit (NF4, double quantisation, QLoRA) | 8bit: the frozen base weights through bitsandbytes, in SFT, RM
    and RL; compute dtype from run.precision. Needs model.lora (only the full-precision adapters train)."""
    shared_base: Optional[bool] = None
    """RL with LoRA: one copy of the base (the SFT model) for every role: the actor's adapter, the reference as
    adapters off, the critic's adapter + value head, the reward model's adapter + score head (from the rm stage).
    null: on exactly when model.quantization is set (a quantised base only trains through adapters, and exists to
    save memory); off keeps separate models, which placement can put on different workers."""

    @property
    def shares_base(self) -> bool:
        """shared_base, or its default: on with a quantised base."""
        return self.quantization != "none" if self.shared_base is None else self.shared_base


@dataclass
class SFTConfig:
    lr: float = 2e-3
    """Peak learning rate (AdamW, linear warm-up then cosine decay)."""
    steps: int = 600
    """Optimiser steps."""
    batch_size: int = 32
    """Sequences per optimiser step."""
    micro_batch_size: int = 32
    """Sequences per forward/backward; batch_size must be a multiple (gradient accumulation)."""
    warmup_steps: int = 30
    """Linear warm-up steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clipping (0 disables)."""
    completion_only: bool = False
    """Loss only on response tokens (needs prompt/response data); else the whole text."""
    eval_every: int = 100
    """Validation loss every this many steps (and at the end)."""
    eval_samples: int = 64
    """Synthetic task: generations sampled at the end to measure the grammatical rate."""


@dataclass
class RMConfig:
    lr: float = 2e-3
    """Peak learning rate."""
    steps: int = 500
    """Optimiser steps."""
    batch_size: int = 32
    """Preference pairs per optimiser step."""
    micro_batch_size: int = 32
    """Pairs per forward/backward; batch_size must be a multiple."""
    warmup_steps: int = 30
    """Linear warm-up steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clipping (0 disables)."""
    init: str = "sft"
    """Backbone: sft (the SFT model of this run, or sft_path) | base (the model named in model.name)."""
    sft_path: Optional[str] = None
    """SFT model folder (or hub id) to start from when the run folder has none."""
    num_pairs: int = 12000
    """Synthetic/IMDb tasks: preference pairs to build."""
    eval_every: int = 100
    """Held-out accuracy every this many steps (and at the end)."""


@dataclass
class RLConfig:
    algo: str = "ppo"
    """ppo (with a critic) | rloo | grpo."""
    iterations: int = 40
    """RL iterations (generate -> score -> update)."""
    prompts_per_iter: int = 32
    """Prompts per iteration."""
    k: int = 1
    """Samples per prompt (rloo and grpo need >= 2)."""
    max_new_tokens: int = 48
    """Response length limit."""
    max_prompt_tokens: Optional[int] = None
    """Longer RL and evaluation prompts keep their last this many tokens (BOS stays in front), counted in the log.
    Default: the model's context minus rl.max_new_tokens; a value whose sum with rl.max_new_tokens exceeds the
    context is a config error."""
    temperature: float = 0.7
    """Sampling temperature (the policy optimised is softmax(logits / temperature)); with a schedule, the first
    iteration's."""
    temperature_schedule: str = "constant"
    """constant | linear | cosine from rl.temperature (first iteration) to rl.temperature_final (last); each
    iteration samples, scores the reference and updates at its own temperature (logged as rollout/temperature)."""
    temperature_final: Optional[float] = None
    """Last iteration's temperature for a linear or cosine schedule (e.g. rl.temperature=1.0 -> 0.7)."""
    eval_temperature: Optional[float] = None
    """Temperature of the before/after evaluation (and of curriculum=reward's SFT samples), fixed whatever the
    schedule so before and after compare; default rl.temperature."""
    curriculum: str = "none"
    """none (uniform prompts) | length (short prompts first) | reward (prompts whose SFT sample scores highest first,
    scored once before RL with rl.reward): each iteration draws from the easiest part of the train prompts, growing
    from rl.curriculum_start to all of them at the last iteration."""
    curriculum_start: float = 0.25
    """Curriculum: fraction of the train prompts (the easiest) the first iteration draws from."""
    top_k: int = 0
    """Top-k sampling (0 disables)."""
    top_p: float = 1.0
    """Nucleus sampling (1.0 disables)."""
    stop: Optional[list] = None
    """Stop strings that end a response besides EOS."""
    lr: float = 1e-4
    """Actor learning rate."""
    critic_lr: float = 1e-4
    """Critic learning rate (ppo)."""
    epochs: int = 4
    """Passes over each iteration's samples."""
    mini_batch_size: int = 16
    """Samples per optimiser step."""
    micro_batch_size: int = 16
    """Samples per forward/backward; mini_batch_size must be a multiple."""
    clip: float = 0.2
    """PPO ratio clip."""
    vf_clip: float = 0.2
    """Value clip (ppo)."""
    gamma: float = 1.0
    """GAE discount (ppo)."""
    lam: float = 0.95
    """GAE lambda (ppo)."""
    loss_level: str = "token"
    """token | sequence averaging of the policy loss."""
    kl_estimator: Optional[str] = None
    """k1 | k2 | k3 per-token KL estimator, used for the KL penalty (in the reward or, for grpo, in the loss), the
    logged reward/kl and the adaptive controller alike. null: k3 for grpo (as DeepSeekMath), k1 otherwise (as Ziegler
    et al.); see `kl_estimator_used`."""
    kl_coef: float = 0.2
    """Initial KL coefficient."""
    kl_target: Optional[float] = 4.0
    """Adaptive KL controller target (sequence KL, nats); null keeps kl_coef fixed."""
    kl_horizon: int = 256
    """Adaptive KL controller horizon (samples): with 32 samples per iteration the coefficient moves up to 2.5% per
    iteration (Ziegler et al.'s 10000 suits runs a hundred times longer)."""
    reward: str = "rm"
    """rm (the reward model) | module:function | several module:function separated by commas. A function is
    f(prompts, completions, **columns) -> list[float | None] (TRL's form: the prompts' other data set columns come
    by name; None abstains) or, older, f(texts) -> list[float] of prompt + response texts."""
    reward_weights: Optional[list] = None
    """One weight per function in rl.reward (default 1.0 each); the reward is the weighted sum."""
    critic_init: str = "rm"
    """ppo critic: rm (separate model from the reward model's backbone and head) | sft (separate model from the SFT
    backbone, zero head) | actor (a value head on the actor's own backbone: no second model)."""
    unfinished_penalty: float = 0.0
    """Subtracted from the reward of responses that hit max_new_tokens without ending."""
    grad_clip: float = 1.0
    """Gradient-norm clipping (0 disables)."""
    gradient_checkpointing: Optional[bool] = None
    """Recompute each layer's activations in the backward pass of the update instead of keeping them (less memory,
    about one more forward of time); gradients are unchanged (tested). null: on with a quantised base
    (model.quantization), off otherwise."""
    optimizer: str = "adamw"
    """adamw (torch) | adamw_8bit (bitsandbytes, 8-bit states: about a quarter of adamw's state memory) |
    paged_adamw_8bit (the same, states in paged memory that spills to the host under GPU pressure) for actor and
    critic."""
    disable_dropout: bool = True
    """Switch dropout off in the actor and critic during RL: with dropout the update's log-probs are noisy draws, so
    the PPO ratio is not 1 on the very samples just drawn (OpenRLHF and veRL do the same; TRL's disable_dropout)."""
    whiten_advantages: bool = True
    """Shift and scale each iteration's advantages to mean 0, std 1: over response tokens for ppo (one advantage per
    token), over samples for rloo and grpo (one advantage per sample)."""
    sft_path: Optional[str] = None
    """Actor/reference folder or hub id for `rlfuse rl`; default RUN_DIR/sft/model."""
    rm_path: Optional[str] = None
    """Reward model folder or hub id; default RUN_DIR/rm/model."""
    ckpt_every: int = 5
    """Checkpoint every this many iterations (and at the end)."""
    eval_prompts: int = 128
    """Held-out prompts for the before/after evaluation (0 skips it)."""
    eval_every: int = 0
    """Also evaluate the held-out prompts every this many iterations during RL (eval/* in metrics.jsonl, a table in
    the report); 0: only before and after."""
    log_samples_every: int = 10
    """Every this many iterations, a table of the iteration's first prompts, completions and rewards: rl/samples.jsonl,
    TensorBoard text, the trackers, the report. 0 turns it off."""
    max_bad_steps: int = 3
    """Stop after this many consecutive updates skipped for NaN/inf (a loss, or a reward of the iteration)."""
    # --- prefix sharing and micro-batches (issue 19)
    share_prompt: bool = True
    """The k samples of a prompt in one micro-batch run its forward once (reference, reward, critic and the training
    forward and backward; rlfuse/models/prefix.py), the same numbers with prompt tokens x (k - 1) fewer
    token-forwards per pass (perf/prompt_tokens_shared). GPT-2 and Llama-style models; others keep the full forward.
    With ppo and k > 1 a prompt's samples then stay in one mini-batch, as for rloo and grpo. false: today's path."""
    micro_batch_tokens: Optional[int] = None
    """The update's micro-batches by a token budget instead of rl.micro_batch_size samples: each holds the most
    samples (a prompt's samples together, similar lengths together) whose forward, padding included (prompts once with
    rl.share_prompt), stays within this many token positions; a sample longer than the budget gets one of its own.
    null: rl.micro_batch_size samples each."""
    # --- training across workers (issue 15)
    train_parallel: str = "data"
    """How a Ray placement's training workers share the update: data (data parallel: full replicas, gradients
    all-reduced; one process with placement.strategy=single) | pipeline_serial (actor and critic each cut into P
    stages over the P training workers, the critic reversed; the actor's 1F1B, then the critic's) | pipeline_fused
    (the same stages, one fused actor+critic schedule filling each other's bubbles; rlfuse/schedule/ppo_pipeline.py)
    | single (one process: placement.strategy=single)."""

    @property
    def kl_estimator_used(self) -> str:
        """kl_estimator, or the algorithm's default when it is null."""
        return self.kl_estimator or ("k3" if self.algo == "grpo" else "k1")


@dataclass
class RolloutConfig:
    fusion: Any = "auto"
    """auto | true | false. true: score finished samples while the rest still decode; false: decode everything, then
    score. auto: on only where scoring can overlap decoding. In one process (placement.strategy=single, CPU or CUDA)
    scoring runs between decode steps on the same device, so interleaving it only adds small calls (0.8-0.94x on CPU,
    BENCHMARKS.md's rollout section): auto is off there. Ray placements always score on their workers as samples
    finish (rlfuse/placement/ray_rollout.py) and do not read this field. See `fusion_on`."""
    score_every: int = 16
    """Fusion: score whenever this many samples have finished..."""
    live_below: int = 8
    """...or whenever the live decode batch has fewer rows than this."""
    max_rows: int = 256
    """Most rows decoded at once (prompts wait in a queue beyond it)."""
    micro_batch_size: int = 16
    """Samples per scoring forward."""
    migrate_below: float = 0.2
    """Several generation workers: migrate the decode tail onto fewer workers once fewer than this fraction of the
    iteration's samples is unfinished (RLHFuse's R_t); the freed workers score. 0 turns migration off."""
    rows_per_worker: int = 16
    """Several generation workers: rows one worker decodes at about full speed (a step costs little more than a
    1-row step); the tail moves onto ceil(unfinished / this) workers, and earlier if that is fewer than are busy."""


@dataclass
class PlacementConfig:
    strategy: str = "single"
    """single (one process, as before; no Ray) | flattened (every role on every worker) | interleaved (reference and
    reward on their own workers, concurrent with training) | separated (generation on its own workers, weights synced
    each iteration) | custom (the layout in placement.groups). See docs/placement.md."""
    workers: int = 2
    """Worker processes in all for flattened, interleaved and separated (custom groups give their own)."""
    cpus_per_worker: float = 1.0
    """Logical CPUs each worker reserves; its torch threads are pinned to this share. Default for custom groups."""
    gpus_per_worker: float = 0.0
    """GPUs each worker reserves (a fraction below 1 shares a device). Default for custom groups."""
    address: Optional[str] = None
    """Ray cluster address (e.g. ray://head:10001 or auto); null starts a local Ray on this machine."""
    groups: Optional[list] = None
    """strategy=custom: a list of groups, each {name, workers, roles: [actor, generator, reference, critic, reward],
    cpus_per_worker?, gpus_per_worker?}; every role of the run in one group, shared-weight roles together."""
    pin_cores: Optional[bool] = None
    """Keep each worker's threads on whole cores of its own (true), or leave them to the OS scheduler (false), which
    moves busy workers between cores and makes them slow each other. null (auto): pinned when the run starts its own
    local Ray (no other job's workers share the cores), not on a cluster at placement.address. Workers of a
    fractional CPU share are never pinned."""
    memory_per_worker_gb: Optional[float] = None
    """GiB one worker may use, for the planner (strategy=auto, `rlfuse plan`) and the checker's memory check; default
    (planner only): a GPU's memory, or this machine's RAM divided among the workers."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rm: RMConfig = field(default_factory=RMConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)


def fusion_on(cfg: Config) -> bool:
    """rollout.fusion resolved for the single-process rollout: true/false as given; auto is off (see the field)."""
    return cfg.rollout.fusion is True


def checkpointing_on(cfg: Config) -> bool:
    """rl.gradient_checkpointing, or its default: on with a quantised base (model.quantization)."""
    if cfg.rl.gradient_checkpointing is None:
        return cfg.model.quantization != "none"
    return cfg.rl.gradient_checkpointing


# --------------------------------------------------------------------------------------------- loading


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple | dict = ()) -> Config:
    """YAML file (optional) + `a.b=c` overrides -> validated Config. Raises ConfigError."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError("config", f"file {str(path)!r} not found", "pass an existing YAML file, e.g. configs/default.yaml")
        try:
            raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            line = f" at line {where.line + 1}" if where else ""
            raise ConfigError("config", f"{path} is not valid YAML{line}", "fix the YAML syntax") from None
        if not isinstance(raw, dict):
            raise ConfigError("config", f"{path} must hold a mapping of sections", "write e.g. 'sft:\\n  lr: 1e-4'")
    return config_from_dict(raw, overrides)


def config_from_dict(raw: dict, overrides: list[str] | tuple | dict = ()) -> Config:
    """Sections as a nested dict + overrides -> validated Config. Overrides: `a.b=c` strings (c parsed as YAML), or a
    {"a.b": value} mapping whose values are taken as they are (the Python API)."""
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}  # the caller's dict stays as it was
    items = overrides.items() if isinstance(overrides, dict) else [_split_override(o) for o in overrides]
    for key, value in items:
        section, dot, name = str(key).partition(".")
        if not dot or not section or not name:
            raise ConfigError(str(key), "overrides take the form section.field=value", "e.g. sft.lr=1e-4 or run.dir=/tmp/x")
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(section, "must be a mapping of fields", f"write it as '{section}:' with indented fields")
        raw[section][name] = value
    cfg = _from_dict(Config, raw, prefix="")
    validate(cfg)
    if cfg.placement.strategy == "auto":  # resolved once, here, so the saved config.yaml records the plan
        from rlfuse.placement.planner import resolve_auto

        cfg = validate(resolve_auto(cfg, log=lambda msg: print(msg, file=sys.stderr, flush=True)))
    return cfg


def _split_override(item: str) -> tuple[str, Any]:
    key, sep, value = str(item).partition("=")
    if not sep or not key or "." not in key:
        raise ConfigError(str(item), "overrides take the form section.field=value", "e.g. sft.lr=1e-4 or run.dir=/tmp/x")
    return key, _parse_scalar(value)


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text != "" else None
    except yaml.YAMLError:
        return text


def _from_dict(cls, raw: dict, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(prefix.rstrip(".") or "config", "must be a mapping of fields", "indent its fields under it")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            doc = field_summary(cls, close[0]) if close else ""
            hint = (f"did you mean {prefix}{close[0]}" + (f" ({doc.rstrip('.')})" if doc else "") + "?" if close else
                    f"known: {', '.join(sorted(known))}")
            raise ConfigError(name, "unknown key", f"remove it ({hint}; `rlfuse --help` lists every field)")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _from_dict(hint, value if value is not None else {}, prefix=f"{name}.")
        else:
            kwargs[key] = _coerce(name, value, hint)
    return cls(**kwargs)


def _coerce(name: str, value: Any, hint) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _coerce(name, value, args[0])
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(name, f"expected true or false, got {value!r}", f"set {name}=true or {name}=false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(name, f"expected a whole number, got {value!r}", f"set e.g. {name}=8")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(name, f"expected a number, got {value!r}", f"set e.g. {name}=1e-4")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(name, f"expected text, got {value!r}", f"quote it, e.g. {name}=\"...\"")
    if hint is list or origin is list:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list):
            return value
        raise ConfigError(name, f"expected a list, got {value!r}", f"write e.g. {name}=[a,b]")
    return value


# ------------------------------------------------------------------------------------------ validation


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


def validate(cfg: Config) -> Config:
    """Check every field now rather than an hour into training. Raises ConfigError."""
    r, d, m = cfg.run, cfg.data, cfg.model
    _choice(r.device, "run.device", ("auto", "cpu", "cuda"))
    _choice(r.precision, "run.precision", ("auto", "fp32", "bf16", "fp16"))
    _validate_quantization(cfg)
    _positive(r, "run", "threads", allow_zero=True)
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
    if d.prompt_words < 2:
        raise ConfigError("data.prompt_words", f"must be >= 2, got {d.prompt_words}", "set data.prompt_words=4")
    if d.max_examples is not None:
        _positive(d, "data", "max_examples")
    if not 0.0 < d.eval_fraction < 0.5:
        raise ConfigError("data.eval_fraction", f"must be in (0, 0.5), got {d.eval_fraction}", "set data.eval_fraction=0.05")
    if m.name != "embedded" and _looks_like_path(m.name) and not Path(m.name).exists():
        raise ConfigError("model.name", f"folder {m.name!r} not found", "give an existing model folder or a hub name")
    _positive(m, "model", "n_layer", "n_embd", "n_head", "lora_r", "lora_alpha")
    if m.n_embd % m.n_head:
        raise ConfigError("model.n_head", f"{m.n_head} does not divide model.n_embd={m.n_embd}", "pick a divisor, e.g. 4")
    for name, s in (("sft", cfg.sft), ("rm", cfg.rm)):
        _positive(s, name, "lr", "steps", "batch_size", "micro_batch_size", "eval_every")
        _positive(s, name, "warmup_steps", "weight_decay", "grad_clip", allow_zero=True)
        _divides(s, name)
    _choice(cfg.rm.init, "rm.init", ("sft", "base"))
    if cfg.rm.sft_path and not Path(cfg.rm.sft_path).exists() and not is_hub_id(cfg.rm.sft_path):
        raise ConfigError("rm.sft_path", f"folder {cfg.rm.sft_path!r} not found", "point it at an SFT run's sft/model "
                          "folder or a hub id")
    _positive(cfg.rm, "rm", "num_pairs")
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
    import importlib.util

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
    if m.shares_base and cfg.placement.strategy != "single":
        raise ConfigError("model.shared_base", f"the shared base lives in one process, and placement.strategy="
                          f"{cfg.placement.strategy} has Ray workers load their roles as separate models",
                          "set placement.strategy=single (or model.shared_base=false and model.quantization=none)")
    if m.shares_base and cfg.rm.init != "sft":
        raise ConfigError("rm.init", "with model.shared_base the reward adapter must be trained on the SFT model, the "
                          "base it is attached to in RL", "set rm.init=sft")
    _choice(cfg.rl.optimizer, "rl.optimizer", OPTIMIZERS)


def _validate_rl(cfg: Config) -> None:
    rl, ro = cfg.rl, cfg.rollout
    _choice(rl.algo, "rl.algo", ("ppo", "rloo", "grpo"))
    _choice(rl.loss_level, "rl.loss_level", ("token", "sequence"))
    if rl.kl_estimator is not None:
        _choice(rl.kl_estimator, "rl.kl_estimator", ("k1", "k2", "k3"))
    _choice(rl.critic_init, "rl.critic_init", ("rm", "sft", "actor"))
    _positive(rl, "rl", "iterations", "prompts_per_iter", "k", "max_new_tokens", "temperature", "lr", "critic_lr",
              "epochs", "mini_batch_size", "micro_batch_size", "clip", "kl_horizon", "ckpt_every", "max_bad_steps")
    _positive(rl, "rl", "top_k", "vf_clip", "kl_coef", "unfinished_penalty", "grad_clip", "eval_prompts", allow_zero=True)
    if rl.kl_target is not None:
        _positive(rl, "rl", "kl_target")
    _validate_temperature_and_curriculum(rl)
    if rl.max_prompt_tokens is not None:
        _positive(rl, "rl", "max_prompt_tokens")
    if rl.micro_batch_tokens is not None:
        _positive(rl, "rl", "micro_batch_tokens")
    if not 0 < rl.top_p <= 1:
        raise ConfigError("rl.top_p", f"must be in (0, 1], got {rl.top_p}", "set rl.top_p=1.0 to disable nucleus sampling")
    if not (0 <= rl.gamma <= 1 and 0 <= rl.lam <= 1):
        raise ConfigError("rl.gamma" if not 0 <= rl.gamma <= 1 else "rl.lam", "must be in [0, 1]", "e.g. rl.gamma=1.0 rl.lam=0.95")
    if rl.algo in ("rloo", "grpo") and rl.k < 2:
        raise ConfigError("rl.k", f"{rl.algo} needs at least 2 samples per prompt, got {rl.k}", "set rl.k=4")
    _divides(rl, "rl", "mini_batch_size", "micro_batch_size")
    n = rl.prompts_per_iter * rl.k
    if n % rl.mini_batch_size:
        raise ConfigError("rl.mini_batch_size", f"{rl.mini_batch_size} does not divide the {n} samples per iteration "
                          f"(rl.prompts_per_iter x rl.k)", f"pick a divisor of {n}")
    if rl.algo != "ppo" and rl.mini_batch_size % rl.k:
        raise ConfigError("rl.mini_batch_size", f"must be a multiple of rl.k={rl.k} so a prompt's samples stay together",
                          f"set it to a multiple of {rl.k}")
    specs = [] if rl.reward == "rm" else [x.strip() for x in rl.reward.split(",")]
    bad = [x for x in specs if x.count(":") != 1 or not all(x.split(":"))]
    if bad:
        raise ConfigError("rl.reward", f"{bad[0]!r} is neither 'rm' nor 'module:function'",
                          "e.g. rl.reward=rlfuse.data.gold:gold_reward (several: separate them with commas)")
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


GROUP_KEYS = ("name", "workers", "roles", "cpus_per_worker", "gpus_per_worker")


def _validate_train_parallel(cfg: Config) -> None:
    """A pipeline mode needs a separate PPO critic, plain (not LoRA) models, >= 2 training workers and at least one
    layer per stage; single needs one process."""
    rl, p, field_name = cfg.rl, cfg.placement, "rl.train_parallel"
    _choice(rl.train_parallel, field_name, ("single", "data", "pipeline_serial", "pipeline_fused"))
    if rl.train_parallel == "single" and p.strategy not in ("single", "auto"):
        raise ConfigError(field_name, f"single trains in one process, but placement.strategy={p.strategy} trains on "
                          "Ray workers", "set rl.train_parallel=data (or a pipeline mode), or placement.strategy=single")
    if not rl.train_parallel.startswith("pipeline") or p.strategy == "auto":  # auto: checked once resolved
        return
    if rl.algo != "ppo" or rl.critic_init == "actor":
        raise ConfigError(field_name, f"{rl.train_parallel} pipelines an actor and a separate critic (rl.algo=ppo, "
                          f"rl.critic_init sft or rm), got rl.algo={rl.algo}, rl.critic_init={rl.critic_init}",
                          "set rl.algo=ppo and rl.critic_init=rm, or rl.train_parallel=data")
    if cfg.model.lora or cfg.model.shares_base or cfg.model.quantization != "none":
        raise ConfigError(field_name, "pipeline stages hold plain full-weight models (no LoRA, shared base or "
                          "quantisation)", "set model.lora=false, or rl.train_parallel=data")
    spec = spec_from_config(cfg)
    P = sum(spec.group(g).workers for g in spec.groups_of("actor")) if spec.uses_ray else 1
    if P < 2:
        raise ConfigError(field_name, f"{rl.train_parallel} cuts the models into one stage per training worker, and "
                          f"placement.strategy={p.strategy} gives {P}", "set placement.strategy=flattened with "
                          "placement.workers=2 (or more), or rl.train_parallel=data")
    from rlfuse.schedule.stages import SPLITTABLE

    critic_from = [cfg.rl.rm_path] if rl.critic_init == "rm" else [cfg.rl.sft_path, cfg.model.name]
    for role, (kind, layers) in (("policy", _model_shape(cfg, [cfg.rl.sft_path, cfg.model.name])),
                                 ("critic", _model_shape(cfg, critic_from))):
        if kind is not None and kind not in SPLITTABLE:
            raise ConfigError(field_name, f"the {role} is a {kind} model, which cannot be split into pipeline stages "
                              f"(splittable: {', '.join(SPLITTABLE)})", "set rl.train_parallel=data")
        if layers is not None and layers < P:
            raise ConfigError(field_name, f"the {role}'s {layers} layers cannot be cut into {P} stages (one per "
                              f"training worker)", f"use at most {layers} training workers (placement.workers), or "
                              "rl.train_parallel=data")


def _model_shape(cfg: Config, folders: list) -> tuple[str | None, int | None]:
    """(model type, layers) of the first of `folders` holding a config.json, else of the embedded model (the run's
    own SFT/RM stages build it at model.n_layer), where known before any stage runs; (None, None) for a hub id
    (the workers check it when they load it)."""
    import json

    for folder in folders:
        conf = Path(folder) / "config.json" if folder else None
        if conf is not None and conf.is_file():
            c = json.loads(conf.read_text())
            return c.get("model_type"), c.get("n_layer", c.get("num_hidden_layers"))
    return ("gpt2", cfg.model.n_layer) if cfg.model.name == "embedded" else (None, None)


def _validate_placement(cfg: Config) -> None:
    """Fields first, then the layout itself: the placement checker without a cluster (roles placed, shared weights
    together), so a layout that cannot work fails at `rlfuse validate`, not after Ray started."""
    p = cfg.placement
    _choice(p.strategy, "placement.strategy", STRATEGIES + ("auto",))
    _positive(p, "placement", "workers", "cpus_per_worker")
    _positive(p, "placement", "gpus_per_worker", allow_zero=True)
    if not is_gpu_share(p.gpus_per_worker):
        raise ConfigError("placement.gpus_per_worker", f"{p.gpus_per_worker:g} is neither a fraction of one GPU nor "
                          "a whole number", "set it to e.g. 0.5, 1 or 2")
    if p.memory_per_worker_gb is not None:
        _positive(p, "placement", "memory_per_worker_gb")
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
    if p.strategy in ("single", "auto"):  # auto: checked once resolved (load_config)
        return
    try:
        problems = check_placement(spec_from_config(cfg), derive_roles(cfg), **_memory_check(cfg))
    except UserError as e:  # a strategy that cannot place these roles
        raise ConfigError("placement.strategy", str(e), "pick another placement.strategy") from None
    if problems:
        field_name = "placement.groups" if p.strategy == "custom" else "placement.strategy"
        raise ConfigError(field_name, " / ".join(problems), "fix each as it says")


def _memory_check(cfg: Config) -> dict:
    """With placement.memory_per_worker_gb, the checker's memory hook: the planner's memory model per worker."""
    gb = cfg.placement.memory_per_worker_gb
    if gb is None:
        return {}
    from rlfuse.placement.planner import memory_of_config

    return {"memory_of": memory_of_config(cfg), "memory_budget": int(gb * 2**30)}


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


# ---------------------------------------------------------------------------------------------- saving


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, run_dir: str | os.PathLike) -> Path:
    """Write the resolved config as YAML into the run folder; `load_config` reads it back unchanged."""
    path = Path(run_dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), encoding="utf-8")
    os.replace(tmp, path)
    return path


@functools.lru_cache(maxsize=None)  # inspect.getsource parses the whole module per class: once is enough
def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings of a config section, for `rlfuse --help` and unknown-field errors."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(getattr(b, "value", None), ast.Constant):
            docs[a.target.id] = b.value.value
    return docs


def field_summary(cls, name: str) -> str:
    """The first sentence of a field's docstring, on one line ("" without one)."""
    doc = " ".join(field_docs(cls).get(name, "").split())
    end = doc.find(". ")
    return doc if end < 0 else doc[: end + 1]


def section_class(section: str):
    """The dataclass of a config section, e.g. section_class("rl") is RLConfig."""
    return typing.get_type_hints(Config)[section]
