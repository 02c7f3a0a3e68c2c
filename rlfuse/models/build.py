"""RL model setup, one loader per role of `derive_roles(cfg)`: actor, generator, reference, critic and the reward
(a model or a function). Nothing here trains or decodes: rlfuse/learn trains the `Models`, the rollout engine
(rlfuse/runtime/local.py decode_engine) decodes them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from rlfuse.config import Config, checkpointing_on
from rlfuse.config.callables import load_callable
from rlfuse.errors import UserError
from rlfuse.models.device import autocast_to, generator_copy_dtype, rl_compute_dtype
from rlfuse.models.gguf import local_model
from rlfuse.models.heads import ValueModel
from rlfuse.models.layout import column_major, generator_layout
from rlfuse.models.lean import enable_lean_activations, training_only
from rlfuse.models.load import apply_lora, load_causal_lm, load_reward_model, load_tokenizer
from rlfuse.models.mapped import map_frozen_weights
from rlfuse.models.quantize import place
from rlfuse.models.rewards import FunctionReward, reward_model_fn
from rlfuse.models.shared import (
    AdapterRewardModel,
    add_critic,
    attach_reward_adapter,
    recompute_with_same_adapter,
    reward_adapter_folder,
)
from rlfuse.plan.roles import Roles, derive_roles


@dataclass
class Models:
    tokenizer: object
    actor: torch.nn.Module
    generator: torch.nn.Module | None
    """The engine's own plain causal LM in generator_copy_dtype, the actor's weights copied in through
    DecodeEngine.load_weights: with LoRA the merged weights (decoding them is faster than through the adapters); in
    full fine-tuning a bf16 copy, whose storage lives only from a sync to the end of the rollout. None where the
    engine decodes the actor itself (full fine-tuning in fp32) or the shared base (model.shared_base)."""
    ref: torch.nn.Module | None
    """None: the actor with its LoRA adapters disabled."""
    critic: ValueModel | None
    reward_fn: object
    roles: Roles
    policy_source: str
    """The SFT folder the policy started from: the base of the saved RL adapter."""
    shared_base: torch.nn.Module | None = None
    """model.shared_base: the one peft model holding the base and every role's adapter (the actor itself); the
    critic (AdapterValueModel) and the reward model are views of it. None: separate models."""
    compute_dtype: torch.dtype | None = None
    """The dtype the update's forwards and the scoring passes autocast to (run.precision: models/device.py
    rl_compute_dtype); None: fp32. The weights, gradients and optimiser states stay fp32 either way."""
    generator_transient: bool = False
    """The generator copy is needed only from a sync to the end of the rollout (full fine-tuning's bf16 copy): the
    engine frees it in between (DecodeEngine transient_weights), so the update's peak does not hold it."""

    def autocast(self):
        """The update's and scoring's mixed-precision context (compute_dtype), a null one in fp32."""
        return autocast_to(next(self.actor.parameters()).device, self.compute_dtype)


def _folder(given: str | None, default: Path, field: str, stage: str) -> str:
    path = Path(given) if given else default
    if not path.exists():
        raise UserError(f"config error: {field}: {path} does not exist; run `rlfuse {stage}` into this run.dir "
                        f"first or set {field}=<folder>")
    return str(path)


def load_reward_function(spec: str):
    return load_callable(spec, "rl.reward")


def load_policy(folder: str) -> torch.nn.Module:
    """A plain causal LM from an SFT folder; a saved adapter is merged into its base, so that "adapters off" later
    means the SFT policy."""
    model = load_causal_lm(folder)
    return model.merge_and_unload() if hasattr(model, "merge_and_unload") else model


def frozen(model: torch.nn.Module, device) -> torch.nn.Module:
    return model.eval().requires_grad_(False).to(device)


def with_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The model's parameters in dtype, its buffers as they are: module.to(dtype) would also round the rotary
    frequency tables (Llama's inv_freq), whose bf16 angles drift by ~0.2 rad 200 positions apart."""
    for p in model.parameters():  # tied weights are one parameter: they stay tied
        p.data = p.data.to(dtype)
    return model


def stage_folders(cfg: Config, run_dir: Path, roles: Roles) -> tuple[str, str | None]:
    """(SFT folder, reward-model folder or None when no role loads from it): rl.sft_path / rl.rm_path, else this
    run folder's sft/model and rm/model; a missing one says which stage to run first."""
    rl = cfg.rl
    sft_dir = _folder(rl.sft_path, run_dir / "sft" / "model", "rl.sft_path", "sft")
    needs_rm = any(r.source == "rm" for r in roles.roles)
    rm_dir = _folder(rl.rm_path, run_dir / "rm" / "model", "rl.rm_path", "rm") if needs_rm else None
    return sft_dir, rm_dir


def build_models(cfg: Config, run_dir: Path, device, weight_layout: str | None = None) -> Models:
    """Load every role derive_roles(cfg) names, each from its source (model.shared_base: all on one base).
    weight_layout: the generator copy's layout as decided before (a resumed run's), instead of resolving
    rollout.weight_layout again (auto measures, and a close call could go the other way)."""
    rl, roles = cfg.rl, derive_roles(cfg)
    sft_dir, rm_dir = stage_folders(cfg, run_dir, roles)
    tokenizer = load_tokenizer(sft_dir)
    if cfg.model.shares_base:
        return build_shared_models(cfg, roles, sft_dir, rm_dir, tokenizer, device)
    actor = load_policy(sft_dir)
    copy_dtype = generator_copy_dtype(cfg, device)
    generator = with_dtype(frozen(load_policy(sft_dir), device), copy_dtype) if copy_dtype is not None else None
    if generator is not None and (weight_layout or generator_layout(cfg, device, generator)) == "column":
        column_major(generator)
    ref = None if roles["reference"].shares_with == "actor" else frozen(load_policy(sft_dir), device)
    # resident only from its scoring pass to the next update; FSDP shards the reference instead (runtime/fsdp.py)
    if ref is not None and cfg.rl.release_reference and torch.device(device).type == "cpu" and \
            cfg.rl.train_parallel != "fsdp":
        map_frozen_weights(ref, local_model(sft_dir))
    if cfg.model.lora:
        actor = apply_lora(actor, cfg.model)
    actor = prepare_trainable(actor.to(device), rl, checkpointing_on(cfg), cfg.model.lean_activations)
    reward_fn = reward_function(rm_dir if roles["reward"].has_model else roles["reward"].source, tokenizer, device,
                                rl.reward_weights)
    critic = (build_critic(roles, actor, sft_dir, rm_dir, tokenizer.pad_token_id, device, rl, checkpointing_on(cfg),
                           cfg.model.lean_activations)
              if "critic" in roles else None)
    return Models(tokenizer, actor, generator, ref, critic, reward_fn, roles, sft_dir,
                  compute_dtype=rl_compute_dtype(cfg, device), generator_transient=not cfg.model.lora)


def build_shared_models(cfg: Config, roles: Roles, sft_dir: str, rm_dir: str | None, tokenizer, device) -> Models:
    """One base (the SFT model, quantised with model.quantization) for every role: the actor's adapter, the reference
    as adapters off, the critic's adapter + value head, the reward model's adapter + score head (rlfuse/models/
    shared.py). There is no generator: the engine decodes this base with the actor's adapter (decode_engine)."""
    rl, pad = cfg.rl, tokenizer.pad_token_id
    base = place(load_causal_lm(sft_dir, cfg.model, precision=cfg.run.precision, device=device), device)
    score = None
    if rm_dir is not None:  # the reward model and/or a critic started from it
        score = attach_reward_adapter(base, reward_adapter_folder(rm_dir, sft_dir), cfg.model)
    actor = prepare_trainable(base, rl, checkpointing=False, lean=cfg.model.lean_activations)
    if checkpointing_on(cfg):  # the backward's recompute must run the adapter its forward ran, not the active one
        enable_gradient_checkpointing(base, context_fn=recompute_with_same_adapter(base), scope=rl.checkpoint_scope)
    if roles["reward"].has_model:
        reward_fn = reward_model_fn(AdapterRewardModel(base, score, pad), tokenizer.eos_token_id, pad)
    else:
        reward_fn = reward_function(roles["reward"].source, tokenizer, device, rl.reward_weights)
    critic = None
    if "critic" in roles:
        source = roles["critic"].source
        critic = ValueModel.from_causal_lm(actor).to(device) if source == "actor" else add_critic(base, source, cfg.model, score)
        critic.train()
    return Models(tokenizer, actor, None, None, critic, reward_fn, roles, sft_dir, shared_base=base,
                  compute_dtype=rl_compute_dtype(cfg, device))


def build_critic(roles: Roles, actor, sft_dir: str, rm_dir: str | None, pad_id: int, device, rl,
                 checkpointing: bool | None = None, lean: bool = False) -> ValueModel:
    source = roles["critic"].source
    if source == "actor":  # the actor's own body: dropout and checkpointing are already set on it
        return ValueModel.from_causal_lm(actor).to(device).train()
    critic = value_model(source, rm_dir if source == "rm" else sft_dir, pad_id)
    return prepare_trainable(critic.to(device), rl, checkpointing, lean)


def reward_function(source: str, tokenizer, device, weights: list[float] | None = None):
    """The reward as a function of finished samples: a reward-model folder (frozen, scored at its last text token), or
    "function:module:name[,module:name...]", Python reward functions (models/rewards.py) summed with `weights`
    (Role.source of the reward)."""
    if source.startswith("function:"):
        specs = [s for s in source.removeprefix("function:").split(",") if s.strip()]  # none: rl.reward=environment
        return FunctionReward([load_reward_function(s.strip()) for s in specs], weights, tokenizer)
    rm = frozen(load_reward_model(source, pad_token_id=tokenizer.pad_token_id), device)
    return reward_model_fn(rm, tokenizer.eos_token_id, tokenizer.pad_token_id)


def value_model(init: str, folder: str, pad_id: int) -> ValueModel:
    """A critic from the reward model in `folder` (its body and scalar head: it starts out predicting the reward,
    init="rm") or from a causal LM (its body, a zero head)."""
    if init == "rm":
        return ValueModel.from_reward_model(load_reward_model(folder, pad_token_id=pad_id))
    return ValueModel.from_causal_lm(load_policy(folder))


def prepare_trainable(model: torch.nn.Module, rl, checkpointing: bool | None = None,
                      lean: bool = False) -> torch.nn.Module:
    """Training mode, dropout off (rl.disable_dropout), lean SwiGLU activations (`lean`: model.lean_activations),
    activation checkpointing (`checkpointing`; None reads rl.gradient_checkpointing, unset meaning off)."""
    model.train()
    if rl.disable_dropout:
        disable_dropout(model)
    if lean:  # before checkpointing, whose MLP scope then wraps the lean forward
        enable_lean_activations(model)
    if rl.gradient_checkpointing if checkpointing is None else checkpointing:
        enable_gradient_checkpointing(model.backbone if isinstance(model, ValueModel) else model,
                                      scope=rl.checkpoint_scope)
    return model


def disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off everywhere in the model, in training mode too: nn.Dropout modules and the float attention-dropout
    attributes that attention implementations read at call time (Llama-style `attention_dropout`)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def enable_gradient_checkpointing(model: torch.nn.Module, context_fn=None, scope: str = "layer") -> None:
    """transformers' per-layer activation checkpointing, non-reentrant (works with LoRA's frozen inputs and with the
    backbone called directly, as response_logprobs does). It acts only in training mode: the engine decodes in eval.
    scope "mlp" (rl.checkpoint_scope): each decoder layer's MLP alone is recomputed, its attention's activations kept."""
    kwargs = {"use_reentrant": False} | ({"context_fn": context_fn} if context_fn is not None else {})
    if scope == "mlp":
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] == "mlp":
                module.forward = _recomputed_in_training(module, module.forward, kwargs)
        return
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _recomputed_in_training(module: torch.nn.Module, forward, kwargs: dict):
    """module's forward, checkpointed while the module trains with gradients on (as transformers' layer
    checkpointing acts), called as is otherwise (decoding, scoring)."""
    def run(*args, **kw):
        if module.training and torch.is_grad_enabled():
            return checkpoint(forward, *args, **kwargs, **kw)
        return forward(*args, **kw)
    return training_only(run)
