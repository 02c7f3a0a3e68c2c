"""TRL's setting names (GRPOConfig, RLOOConfig, SFTConfig, RewardConfig, peft's LoraConfig) and the rlfuse field
each one is: an unknown key that is a TRL name gets the field in its error, not a list of fifty. docs/from_trl.md
shows the same mapping with its notes; tests/unit/test_trl_names.py keeps the two in step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrlName:
    field: str | None
    """The rlfuse field (section.name), or None where rlfuse has no equivalent."""
    note: str = ""
    """What differs, in a few words (said after the field)."""
    same_value: bool = True
    """TRL's value means the same in rlfuse's field, so the error may say `set field=value`."""


_RL = {
    "num_generations": TrlName("rl.k"),
    "beta": TrlName("rl.kl_coef", "fixed for grpo and rloo; rl.kl_target adapts it"),
    "learning_rate": TrlName("rl.lr"),
    "max_completion_length": TrlName("rl.max_new_tokens"),
    "max_prompt_length": TrlName("rl.max_prompt_tokens"),
    "num_iterations": TrlName("rl.epochs", "passes over each rollout"),
    "max_steps": TrlName("rl.iterations", "rollouts, each rl.epochs x mini-batches optimiser steps", same_value=False),
    "num_train_epochs": TrlName("rl.iterations", "rollouts, each rl.epochs x mini-batches optimiser steps", same_value=False),
    "per_device_train_batch_size": TrlName("rl.micro_batch_size", "completions per forward/backward"),
    "gradient_accumulation_steps": TrlName("rl.mini_batch_size", "completions per optimiser step", same_value=False),
    "generation_batch_size": TrlName("rl.prompts_per_iter", "prompts per rollout; samples are this x rl.k", same_value=False),
    "steps_per_generation": TrlName("rl.prompts_per_iter", "prompts per rollout; samples are this x rl.k", same_value=False),
    "epsilon": TrlName("rl.clip"),
    "max_grad_norm": TrlName("rl.grad_clip"),
    "loss_type": TrlName("rl.recipe", "grpo, dr_grpo, dapo (or gspo); rl.loss_agg and rl.policy_loss set the parts "
                         "one by one"),
    "reward_funcs": TrlName("rl.reward", "module:function or path/to/file.py:function, comma-separated"),
    "scale_rewards": TrlName("rl.scale_rewards", "group, batch or none; rl.whiten_advantages then whitens over the "
                             "iteration"),
    "normalize_advantages": TrlName("rl.whiten_advantages", same_value=False),
    "mask_truncated_completions": TrlName("rl.mask_truncated"),
    "eval_steps": TrlName("rl.eval_every"),
    "log_completions": TrlName("rl.log_samples_every", same_value=False),
    "num_completions_to_print": TrlName("rl.log_samples_every", same_value=False),
    "save_steps": TrlName("rl.ckpt_every"),
    "optim": TrlName("rl.optimizer"),
    "model_name_or_path": TrlName("rl.sft_path"),
    "use_vllm": TrlName("rollout.engine", "vllm or rlfuse (auto: vllm with a CUDA GPU)", same_value=False),
    "epsilon_high": TrlName("rl.clip_high"),
    "delta": TrlName("rl.dual_clip", "a negative advantage's ratio capped at this value"),
    "importance_sampling_level": TrlName("rl.policy_loss", "gspo for sequence-level ratios, ppo for token-level",
                                         same_value=False),
    "warmup_steps": TrlName(None, "RL's learning rate is constant"),
    "lr_scheduler_type": TrlName(None, "RL's learning rate is constant"),
}

_SFT = {
    "learning_rate": TrlName("sft.lr"),
    "max_steps": TrlName("sft.steps", same_value=False),
    "num_train_epochs": TrlName("sft.steps", "optimiser steps, not epochs", same_value=False),
    "per_device_train_batch_size": TrlName("sft.micro_batch_size"),
    "gradient_accumulation_steps": TrlName("sft.batch_size", "sequences per optimiser step", same_value=False),
    "max_length": TrlName("data.max_length"),
    "max_seq_length": TrlName("data.max_length"),
    "dataset_text_field": TrlName("data.text_column"),
    "completion_only_loss": TrlName("sft.completion_only"),
    "assistant_only_loss": TrlName("sft.completion_only", "on messages data: every assistant turn", same_value=False),
    "max_grad_norm": TrlName("sft.grad_clip"),
    "eval_steps": TrlName("sft.eval_every"),
    "save_steps": TrlName("sft.ckpt_every"),
    "model_name_or_path": TrlName("model.name"),
    "packing": TrlName(None, "batches are grouped by length instead"),
}

_RM = {
    "learning_rate": TrlName("rm.lr"),
    "max_steps": TrlName("rm.steps", same_value=False),
    "num_train_epochs": TrlName("rm.steps", "optimiser steps, not epochs", same_value=False),
    "per_device_train_batch_size": TrlName("rm.micro_batch_size"),
    "gradient_accumulation_steps": TrlName("rm.batch_size", "pairs per optimiser step", same_value=False),
    "max_length": TrlName("rm.max_length"),
    "max_grad_norm": TrlName("rm.grad_clip"),
    "eval_steps": TrlName("rm.eval_every"),
    "save_steps": TrlName("rm.ckpt_every"),
    "model_name_or_path": TrlName("rm.sft_path"),
}

_MODEL = {
    "model_name_or_path": TrlName("model.name"),
    "r": TrlName("model.lora_r"),
    "target_modules": TrlName("model.lora_targets"),
    "use_peft": TrlName("model.lora", same_value=False),
    "load_in_4bit": TrlName("model.quantization", "model.quantization=4bit", same_value=False),
    "load_in_8bit": TrlName("model.quantization", "model.quantization=8bit", same_value=False),
}

_RUN = {
    "output_dir": TrlName("run.dir"),
    "bf16": TrlName("run.precision", "auto, bf16, fp16 or fp32", same_value=False),
    "fp16": TrlName("run.precision", "auto, bf16, fp16 or fp32", same_value=False),
    "logging_dir": TrlName("run.dir"),
}

TRL_NAMES: dict[str, dict[str, TrlName]] = {"rl": _RL, "sft": _SFT, "rm": _RM, "model": _MODEL, "run": _RUN}
"""section -> TRL's name as a user writes it under that section -> the rlfuse field."""

SHARED = {"output_dir": "run.dir", "seed": "run.seed", "report_to": "run.report_to", "bf16": "run.precision",
          "fp16": "run.precision"}
"""TRL's names of settings rlfuse keeps in another section, whatever section they are written under."""

TRL_SECTIONS = {"grpo": "rl", "rloo": "rl", "ppo": "rl", "trainer": "rl", "training": "rl", "args": "rl",
                "reward": "rm", "peft": "model", "lora": "model"}
"""Section names a TRL user might write -> rlfuse's section."""


def trl_hint(section: str, name: str, value=None) -> tuple[str, str] | None:
    """(problem, fix) for `section.name` when it is one of TRL's names, else None."""
    entry = TRL_NAMES.get(section, {}).get(name)
    if entry is None and name in SHARED:
        entry = TrlName(SHARED[name], same_value=name not in ("bf16", "fp16"))
    if entry is None:
        return None
    if entry.field is None:
        return f"TRL's {name} has no rlfuse equivalent ({entry.note})", "remove it (docs/from_trl.md maps TRL's settings)"
    shown = "" if value is None or not entry.same_value or isinstance(value, (dict, list)) else f"={value}"
    note = f" ({entry.note})" if entry.note else ""
    return f"TRL's name; rlfuse calls it {entry.field}{note}", f"set {entry.field}{shown} instead"
