"""Split a GPT-2 or Llama-style model (causal LM or value model) into pipeline stages by layers.

A stage runs exactly the calls the unsplit body makes on its layers (the same causal mask from the same 2D attention
mask, the same position ids and rotary embeddings), so a pipelined forward gives the unsplit model's numbers.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask

from rlfuse.models.heads import backbone_and_head
from rlfuse.models.hf_cache import mask_cache
from rlfuse.plan.resolve import SPLITTABLE


class Stage(nn.Module):
    """Layers [lo, hi) of a GPT-2 or Llama-style body; the first stage embeds token ids, the last applies the final
    norm and holds the head (the LM head for the actor, the value head for the critic) for its caller to apply."""

    def __init__(self, body, lo: int, hi: int, first: bool, last: bool, head: nn.Module | None, kind: str):
        super().__init__()
        self.first, self.last, self.kind = first, last, kind
        self.body_config = body.config
        self.gpt2 = hasattr(body, "h")
        if self.gpt2:
            self.embed, self.wpe, self.drop = (body.wte, body.wpe, body.drop) if first else (None, None, None)
            layers, norm = body.h, body.ln_f
        else:
            self.embed = body.embed_tokens if first else None
            self.rotary_emb = body.rotary_emb  # no parameters: every stage needs the rotary embeddings
            layers, norm = body.layers, body.norm
        self.blocks = nn.ModuleList(layers[lo:hi])
        self.norm = norm if last else None
        self.head = head if last else None

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: token ids (B, L) on the first stage, else the previous stage's hidden states (B, L, H); attention_mask
        (B, L), 1 on real tokens (None: no padding). Returns hidden states (B, L, H), after the final norm on the last
        stage."""
        L = x.shape[1]
        pos = torch.arange(L, device=x.device)[None]
        if self.first:
            x = self.embed(x)
            if self.gpt2:
                x = self.drop(x + self.wpe(pos))
        mask = create_causal_mask(config=self.body_config, inputs_embeds=x, attention_mask=attention_mask,
                                  position_ids=pos, **mask_cache(None))
        if self.gpt2:
            for block in self.blocks:
                x = block(x, None, mask, position_ids=pos)
        else:
            rope = self.rotary_emb(x, position_ids=pos)
            for layer in self.blocks:
                x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        return self.norm(x) if self.last else x


def layer_bounds(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    if n_stages > n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {n_stages} stages")
    base, extra = divmod(n_layers, n_stages)
    out, lo = [], 0
    for s in range(n_stages):
        hi = lo + base + (1 if s < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def _split(body, head, n_stages: int, kind: str) -> list[Stage]:
    """The stages of `body`; a model whose type plan/resolve.py could not see in advance (a hub id) is checked here
    as it loads."""
    model_type = getattr(body.config, "model_type", None)
    if model_type not in SPLITTABLE or hasattr(body, "peft_config"):
        raise ValueError(f"a {model_type} model (or one with LoRA adapters) cannot be split into pipeline stages; "
                         f"splittable: {', '.join(SPLITTABLE)}")
    b = layer_bounds(len(body.h if hasattr(body, "h") else body.layers), n_stages)
    return [Stage(body, lo, hi, s == 0, s == n_stages - 1, head, kind) for s, (lo, hi) in enumerate(b)]


def split_actor(lm, n_stages: int) -> list[Stage]:
    body, head = backbone_and_head(lm)
    return _split(body, head, n_stages, "actor")


def split_critic(value_model, n_stages: int) -> list[Stage]:
    return _split(value_model.backbone, value_model.head, n_stages, "critic")
