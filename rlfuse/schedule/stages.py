"""Split a GPT-2 (causal LM or value model) into pipeline stages by layers."""

from __future__ import annotations

import torch
from torch import nn


class Stage(nn.Module):
    """Layers [lo, hi) of a GPT-2 body; the first stage embeds token ids, the last applies the final norm and a head
    (the LM head for the actor: log-probs of the targets; the value head for the critic: values)."""

    def __init__(self, body, lo: int, hi: int, first: bool, last: bool, head: nn.Module | None, kind: str):
        super().__init__()
        self.first, self.last, self.kind = first, last, kind
        self.wte = body.wte if first else None
        self.wpe = body.wpe if first else None
        self.blocks = nn.ModuleList(body.h[lo:hi])
        self.ln_f = body.ln_f if last else None
        self.head = head if last else None

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)[None]
            x = self.wte(x) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)  # no padding inside a micro-batch: SDPA applies the causal mask itself
        if not self.last:
            return x
        h = self.ln_f(x)
        if self.kind == "actor":  # log-probs of the next tokens, (B, T-1)
            logp = torch.log_softmax(self.head(h[:, :-1]).float(), dim=-1)
            return logp.gather(-1, targets[:, 1:, None]).squeeze(-1)
        return self.head(h[:, :-1]).squeeze(-1).float()  # values, (B, T-1)


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


def split_actor(lm, n_stages: int) -> list[Stage]:
    body = lm.transformer
    b = layer_bounds(len(body.h), n_stages)
    return [Stage(body, lo, hi, s == 0, s == n_stages - 1, lm.lm_head, "actor") for s, (lo, hi) in enumerate(b)]


def split_critic(value_model, n_stages: int) -> list[Stage]:
    body = value_model.backbone
    b = layer_bounds(len(body.h), n_stages)
    return [Stage(body, lo, hi, s == 0, s == n_stages - 1, value_model.head, "critic") for s, (lo, hi) in enumerate(b)]
