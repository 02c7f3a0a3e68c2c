"""One base, four roles (model.shared_base): the SFT model is loaded once (quantised if asked) and every role is a view
of it. The actor is peft's default adapter; the reference is the actor with adapters off; the critic is its own
adapter plus a value head; the reward model is the reward-model stage's adapter plus its score head.

peft keeps one active adapter per model: a role's forward switches to its adapter and back (use_adapter). Switching
also flips requires_grad in peft, which would hand one role's adapter to another's optimiser, so the flags are put
back; each learner owns an explicit parameter list (role_parameters)."""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from rlfuse.errors import UserError
from rlfuse.models.load import fused_lora, lora_config

ACTOR, CRITIC, REWARD = "default", "critic", "reward"


@contextlib.contextmanager
def use_adapter(peft_model, name: str):
    """Run the shared base with adapter `name` active, then the one active before; requires_grad flags unchanged."""
    before = peft_model.active_adapter
    if before == name:
        yield
        return
    flags = [(p, p.requires_grad) for p in peft_model.parameters()]
    peft_model.set_adapter(name)
    try:
        yield
    finally:
        peft_model.set_adapter(before)
        for p, flag in flags:
            p.requires_grad_(flag)


@contextlib.contextmanager
def adapters_off(peft_model):
    """The reference on a LoRA actor: the base with every adapter off (peft's disable_adapter), then every adapter's
    requires_grad put back. Leaving peft's context re-activates the active adapter and freezes all others, and
    autograd accumulates only into leaves that require grad when the backward runs: the critic's adapter on a shared
    base would silently stop training after the first reference pass (its own forward switches it on, but the flag
    is back off before its backward)."""
    flags = [(p, p.requires_grad) for p in peft_model.parameters()]
    try:
        with peft_model.disable_adapter():
            yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


@contextlib.contextmanager
def eval_for_decoding(model: nn.Module):
    """The context of one decode forward on a model that is also trained (DecodeEngine's decode_context): eval mode
    for that forward only (no dropout; transformers turns the KV cache off when a checkpointed model is in training
    mode), then the mode before, so that scoring and updates between the engine's yields see the model as they would
    without it."""
    was_training = model.training
    if was_training:
        model.eval()
    try:
        yield
    finally:
        if was_training:
            model.train()


@contextlib.contextmanager
def actor_decoding(peft_model):
    """The context of one decode forward on the shared base: the actor's adapter active (the critic's or the reward
    model's may have been the last used), never the reference's adapters-off, in eval_for_decoding."""
    if getattr(peft_model, "_adapters_disabled", False):  # peft's disable_adapter() flag
        raise RuntimeError("decoding on the shared base inside its adapters-off (reference) context")
    with use_adapter(peft_model, ACTOR), eval_for_decoding(peft_model):
        yield


def recompute_with_same_adapter(peft_model):
    """torch.utils.checkpoint's context_fn: a checkpointed layer's recompute (in the backward) runs with the adapter
    that was active in its forward. The critic's backward comes after its forward has switched back to the actor's
    adapter; recomputing with that one would give the critic's loss the actor's activations, silently."""

    def context_fn():
        return contextlib.nullcontext(), use_adapter(peft_model, peft_model.active_adapter)

    return context_fn


def role_parameters(peft_model, adapter: str) -> list[nn.Parameter]:
    """The LoRA tensors of one adapter (named `...lora_A.<adapter>.weight`)."""
    return [p for n, p in peft_model.named_parameters() if f".{adapter}." in n and ".lora_" in n]


def body(peft_model) -> nn.Module:
    """The transformer body under the peft wrapper (GPT-2: .transformer, Llama: .model): its LoRA layers run whichever
    adapter is active."""
    base = peft_model.get_base_model()
    return getattr(base, base.base_model_prefix)


class AdapterValueModel(nn.Module):
    """The critic on a shared base: its own adapter and a value head, (B, L) values like ValueModel. Only the head is
    a registered submodule: the base is the actor's (its state dict, the critic adapter included, is saved with the
    actor), so the critic's own state is the head."""

    def __init__(self, peft_model, head: nn.Linear, adapter: str = CRITIC):
        super().__init__()
        self.head, self.adapter = head, adapter
        object.__setattr__(self, "_shared", peft_model)  # not a submodule: no second copy in state_dict / .to()

    @property
    def backbone(self) -> nn.Module:
        return body(self._shared)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return role_parameters(self._shared, self.adapter) + list(self.head.parameters())

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with use_adapter(self._shared, self.adapter):
            hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()


class _Scores:
    def __init__(self, logits):
        self.logits = logits


class AdapterRewardModel(nn.Module):
    """The reward model on a shared base: the rm stage's adapter and score head. Called like a sequence-
    classification model (`.logits` (B, 1), `.config` with pad_token_id), it pools as transformers does: at the
    rightmost token that is not the pad id."""

    def __init__(self, peft_model, score: nn.Linear, pad_token_id: int, adapter: str = REWARD):
        super().__init__()
        self.score, self.adapter = score, adapter
        object.__setattr__(self, "_shared", peft_model)
        self.config = peft_model.get_base_model().config
        self.pad_token_id = pad_token_id

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> _Scores:
        with use_adapter(self._shared, self.adapter):
            hidden = body(self._shared)(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        last = (positions * (input_ids != self.pad_token_id)).argmax(-1)  # (B,): transformers' pooling
        pooled = hidden[torch.arange(len(input_ids), device=hidden.device), last]
        return _Scores(self.score(pooled.to(self.score.weight.dtype)).float())


def reward_adapter_folder(rm_dir: str, sft_dir: str) -> Path:
    """The rm stage's adapter/ beside its model/ folder, checked to be trained on the SFT model the base is."""
    folder = Path(rm_dir).parent / "adapter"
    config = folder / "adapter_config.json"
    if not config.is_file():
        raise UserError(f"model error: model.shared_base needs the reward model's LoRA adapter, and {folder} has none; "
                        "train the reward model with model.lora=true (rlfuse rm), or set model.shared_base=false")
    base = json.loads(config.read_text())["base_model_name_or_path"]
    if Path(base).resolve() != Path(sft_dir).resolve():
        raise UserError(f"model error: the reward adapter {folder} was trained on {base}, not on the SFT model {sft_dir} "
                        "that RL shares; re-run `rlfuse rm` with rm.init=sft on this SFT model, or set "
                        "model.shared_base=false")
    return folder


def attach_reward_adapter(peft_model, folder: Path, cfg) -> nn.Linear:
    """Load the rm stage's adapter (LoRA on the body + the trained score head) onto the shared base as adapter
    "reward", frozen; returns the score head. The rm stage trained it on a sequence-classification model whose body
    has the same module names as the causal LM's, so the LoRA tensors load by name."""
    saved = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    score_keys = [k for k in tensors if ".score." in k or k.startswith("score.")]
    lcfg = lora_config(peft_model.get_base_model(), cfg, task_type=None)
    lcfg.r, lcfg.lora_alpha, lcfg.target_modules = saved["r"], saved["lora_alpha"], saved["target_modules"]
    peft_model.add_adapter(REWARD, lcfg)
    fused_lora(peft_model)  # layers the adapter adds on new modules: models/lora_linear.py
    body_tensors = {k: v for k, v in tensors.items() if k not in score_keys}
    from peft import set_peft_model_state_dict  # deferred: see models/load.py apply_lora

    result = set_peft_model_state_dict(peft_model, body_tensors, adapter_name=REWARD)
    missing = [k for k in result.missing_keys if f".{REWARD}." in k]
    if missing:
        raise RuntimeError(f"reward adapter {folder}: {len(missing)} LoRA tensors missing, e.g. {missing[0]}")
    weight = next(tensors[k] for k in score_keys if k.endswith("weight"))
    score = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    score.weight.data.copy_(weight)
    for p in role_parameters(peft_model, REWARD):
        p.requires_grad_(False)
    device = next(p for p in peft_model.parameters() if p.requires_grad).device
    return score.to(device).requires_grad_(False)


def copy_adapter(peft_model, source: str, target: str) -> None:
    """A new adapter `target` with the LoRA tensors of `source` (the critic starting from the reward model)."""
    peft_model.add_adapter(target, copy.deepcopy(peft_model.peft_config[source]))
    fused_lora(peft_model)  # layers the adapter adds on new modules: models/lora_linear.py
    src = dict(zip_names(peft_model, source))
    with torch.no_grad():
        for name, p in zip_names(peft_model, target):
            p.copy_(src[name])


def zip_names(peft_model, adapter: str):
    for n, p in peft_model.named_parameters():
        if f".{adapter}." in n and ".lora_" in n:
            yield n.replace(f".{adapter}.", "."), p


def add_critic(peft_model, init: str, cfg, reward_score: nn.Linear | None) -> AdapterValueModel:
    """The critic's adapter and value head: init="rm" starts from the reward adapter and its score head (the critic
    first predicts the reward), "sft" from a fresh adapter (the SFT body: LoRA's B is zero) and a zero head."""
    if init == "rm":
        copy_adapter(peft_model, REWARD, CRITIC)
        head = nn.Linear(reward_score.in_features, 1, bias=False)
        head.weight.data.copy_(reward_score.weight.data)
    else:
        peft_model.add_adapter(CRITIC, lora_config(peft_model.get_base_model(), cfg, task_type=None))
        fused_lora(peft_model)  # layers the adapter adds on new modules: models/lora_linear.py
        head = nn.Linear(peft_model.get_base_model().config.hidden_size, 1, bias=False)
        nn.init.zeros_(head.weight)
    for p in role_parameters(peft_model, CRITIC):  # peft leaves a new, inactive adapter frozen
        p.requires_grad_(True)
    device = role_parameters(peft_model, ACTOR)[0].device
    return AdapterValueModel(peft_model, head.to(device))
