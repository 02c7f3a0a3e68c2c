"""Value model: a causal-LM backbone with a linear head giving one value per position (the PPO critic)."""

from __future__ import annotations

import torch
from torch import nn


def backbone_and_head(model):
    """(transformer body, LM head) of a causal LM, also through a peft wrapper, so callers can run the body once and
    apply the vocabulary projection only where they need it."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return getattr(base, base.base_model_prefix), base.get_output_embeddings()


def scalar_head(head: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """A score or value head (hidden -> 1) on h, squeezed, as fp32: in the head's own dtype outside any autocast.
    Under bf16 autocast a reward near 4 would come out in steps of 0.03, which GRPO's group differences and the
    critic's values would read; the head is one row of weights, its cost nothing."""
    with torch.autocast(h.device.type, enabled=False):
        return head(h.to(head.weight.dtype)).squeeze(-1).float()


class ValueModel(nn.Module):
    """values = head(backbone(x)): (B, L) per-position values. Initialised from a reward model (its backbone and
    scalar head: the critic starts out predicting the reward) or from a causal LM (fresh zero head)."""

    def __init__(self, backbone: nn.Module, head: nn.Linear):
        super().__init__()
        self.backbone, self.head = backbone, head

    @classmethod
    def from_reward_model(cls, rm) -> "ValueModel":
        base = rm.get_base_model() if hasattr(rm, "get_base_model") else rm
        return cls(getattr(base, base.base_model_prefix), base.score)

    @classmethod
    def from_causal_lm(cls, lm) -> "ValueModel":
        """A zero-initialised head on lm's backbone. Pass the actor itself to share its backbone (the value loss then
        also trains the actor's body); pass a separate copy for a separate critic."""
        body, _ = backbone_and_head(lm)
        head = nn.Linear(body.config.hidden_size, 1, bias=False)
        nn.init.zeros_(head.weight)
        return cls(body, head)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return scalar_head(self.head, hidden)
