"""A model's forward over finished samples, as the scorer and the update both run it: samples collated into a
micro-batch padded to its own longest sequence (or, where that pays, each prompt once: rlfuse/models/prefix.py),
then per response token the log-prob (from the body's hidden states, the LM head pushed over a chunk of positions at
a time, so the full (B, T, V) logits never exist at once) or the critic's value."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from rlfuse.models import prefix
from rlfuse.models.heads import backbone_and_head, scalar_head
from rlfuse.models.shared import use_adapter
from rlfuse.plan.cost import SHARE_BELOW  # the planner prices the same test (Workload.shares)
from rlfuse.plan.memory import LOGIT_CHUNK_TOKENS  # 48 MiB of fp32 logits at SmolLM2's 49k vocabulary a chunk


@dataclass
class MicroBatch:
    """Right-padded prompt+response sequences (or, shared, each prompt once: `prefix`) and where each response
    sits."""
    input_ids: Tensor | None       # (B, L); None when shared
    attention_mask: Tensor | None  # (B, L); None when shared
    positions: Tensor       # (B, T): position whose output predicts response token j (prompt_len + j - 1)
    targets: Tensor         # (B, T): response token ids (0 on padding)
    mask: Tensor            # (B, T): 1 on response tokens
    prefix: prefix.PrefixBatch | None = None
    """Set when the micro-batch runs prefix-shared: distinct prompts once, each response without its last token
    (nothing reads the state after it)."""
    packed: prefix.PackedBatch | None = None
    """Set when the micro-batch runs packed (prefix.pack_sequences): `positions` then index the packed rows
    flattened, row * width + column."""


PACK_BELOW = 0.8
"""A micro-batch that does not run prefix-shared runs packed (its sequences end to end, a block-diagonal mask) where
that cuts its token positions to this fraction of the padded ones or less: SmolLM2 on hh-rlhf's chat prompts (60
to 160 tokens, answers up to 48) padded 4 sequences of 100-200 tokens to the longest."""



def _token_counts(prompts: list[list[int]], responses: list[list[int]]) -> tuple[int, int]:
    """(full, shared) token positions of a micro-batch's forward, padding included: rows x longest sequence, and
    distinct prompts x longest prompt + the continuations (each response less its last token) as they run: packed
    (pack_continuations) or rows x the longest."""
    distinct = {tuple(p) for p in prompts}
    full = len(prompts) * max(len(p) + len(r) for p, r in zip(prompts, responses))
    conts = [r[:-1] for r in responses]
    padded = len(conts) * max(map(len, conts))
    cont_tokens = _continuation_tokens(prompts, conts) if pack_continuations(prompts, conts) else padded
    return full, len(distinct) * max(map(len, distinct)) + cont_tokens


def worth_sharing(prompts: list[list[int]], responses: list[list[int]]) -> bool:
    """Whether these samples' forward runs prefix-shared (with rl.share_prompt): a prompt repeats and sharing cuts
    the forward to SHARE_BELOW of the full one or less."""
    if prefix.prompt_tokens_saved(prompts) == 0:
        return False
    full, shared = _token_counts(prompts, responses)
    return shared <= SHARE_BELOW * full


def _packed_tokens(seqs: list[list[int]]) -> int:
    """Token positions of these sequences packed (prefix.pack_layout): rows x the widest row."""
    rows, width = prefix.pack_layout([len(s) for s in seqs])
    return len(rows) * width


def worth_packing(seqs: list[list[int]]) -> bool:
    """Whether these sequences run packed (with rl.share_prompt, where no prompt repeats enough to share): packing
    cuts the forward to PACK_BELOW of the padded one or less (prompts and answers of mixed lengths)."""
    return _packed_tokens(seqs) <= PACK_BELOW * len(seqs) * max(map(len, seqs))


def _continuation_tokens(prompts: list[list[int]], continuations: list[list[int]]) -> int:
    """Token positions of a prefix-shared micro-batch's continuations packed by prompt (prefix.pack_by_prompt_layout):
    rows x the widest row."""
    rows: dict[tuple, int] = {}
    group = [rows.setdefault(tuple(p), len(rows)) for p in prompts]
    packed_rows, _, width = prefix.pack_by_prompt_layout([len(c) for c in continuations], group)
    return len(packed_rows) * width


def pack_continuations(prompts: list[list[int]], continuations: list[list[int]]) -> bool:
    """Whether a prefix-shared micro-batch runs its continuations packed (prefix.group_by_prompt's pack): each
    prompt's continuations end to end in rows of their own cut the positions to PACK_BELOW of one padded row each
    or less. d2's micro-batches (4 of one prompt's 8 replies, by length) padded 4 x 127 tokens for replies of 16-128;
    packed, they put 14% fewer tokens through the model, prompts included."""
    longest = max(map(len, continuations))
    return longest > 0 and _continuation_tokens(prompts, continuations) <= PACK_BELOW * len(continuations) * longest


def forward_tokens(prompts: list[list[int]], responses: list[list[int]], share_prompt: bool) -> int:
    """Token positions collate's micro-batch puts through a model, padding included (_token_counts; packed where
    collate packs)."""
    full, shared = _token_counts(prompts, responses)
    if not share_prompt:
        return full
    if worth_sharing(prompts, responses):
        return shared
    seqs = [p + r for p, r in zip(prompts, responses)]
    return _packed_tokens(seqs) if worth_packing(seqs) else full


def collate(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device,
            share_prompt: bool = False) -> MicroBatch:
    """share_prompt (the caller's models support explicit-mask forwards: can_share): group samples of one prompt
    (prefix-shared forwards) where that pays (worth_sharing), else pack the sequences where that pays
    (worth_packing); otherwise right-padded rows."""
    B, T = len(prompts), max(map(len, responses))
    shared = share_prompt and worth_sharing(prompts, responses)
    pos, tgt, mask = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        pos[b, : len(r)] = torch.arange(len(p) - 1, len(p) + len(r) - 1)
        tgt[b, : len(r)] = torch.tensor(r)
        mask[b, : len(r)] = 1
    pos, tgt, mask = pos.to(device), tgt.to(device), mask.to(device)
    if shared:
        conts = [r[:-1] for r in responses]
        return MicroBatch(None, None, pos, tgt, mask, prefix.group_by_prompt(prompts, conts, pad_id, device,
                                                                             pack_continuations(prompts, conts)))
    seqs = [p + r for p, r in zip(prompts, responses)]
    L = max(map(len, seqs))
    if share_prompt and worth_packing(seqs):
        packed = prefix.pack_sequences(seqs, pad_id, device)
        width = packed.ids.shape[1]
        offset = torch.tensor([row * width + col for row, col in packed.starts], device=device)
        return MicroBatch(None, None, (pos + offset[:, None]) * mask.long(), tgt, mask, packed=packed)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros(B, L, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)], attn[b, : len(s)] = torch.tensor(s), 1
    return MicroBatch(ids.to(device), attn.to(device), pos, tgt, mask)


def response_hidden(body, mb: MicroBatch) -> Tensor:
    """The body's last hidden state at mb.positions: (B, T, H), one full forward or the prefix-shared pair."""
    if mb.prefix is not None:
        return prefix.hidden_at(*prefix.prefix_shared_hidden(body, mb.prefix), mb.prefix, mb.positions)
    if mb.packed is not None:
        hidden = prefix.packed_hidden(body, mb.packed)
        return hidden.reshape(-1, hidden.shape[-1])[mb.positions]
    hidden = body(input_ids=mb.input_ids, attention_mask=mb.attention_mask).last_hidden_state
    return hidden.gather(1, mb.positions[..., None].expand(-1, -1, hidden.shape[-1]))


def response_logprobs(model, mb: MicroBatch, temperature: float = 1.0, chunk_tokens: int = LOGIT_CHUNK_TOKENS,
                      with_entropy: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """log p(response token | prefix) under softmax(logits / temperature): (B, T), 0 on padding. Differentiable.
    With with_entropy, also the per-position entropy (B, T). The LM head runs over chunk_tokens tokens at a time (a
    scoring pass over 16 rows once ran 64 positions x 16 rows with three (tokens, V) buffers, 600 MB at SmolLM2's
    vocabulary: d1's peak)."""
    body, head = backbone_and_head(model)
    h = response_hidden(body, mb)  # (B, T, H)
    if type(head) is torch.nn.Linear and head.bias is None:
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = TokenLogprobs.apply(h, head.weight, mb.targets, temperature, chunk_tokens, with_entropy)
        else:  # scoring: the same chunks, no graph
            lp, ent = chunked_logprobs(h, head.weight, mb.targets, temperature, chunk_tokens, with_entropy)[:2]
            lp, ent = lp.view(mb.targets.shape), ent.view(mb.targets.shape)
        return (lp * mb.mask, ent * mb.mask) if with_entropy else lp * mb.mask
    out, ent = [], []
    chunk = max(1, chunk_tokens // max(1, h.shape[0]))
    weight = getattr(head, "weight", None)
    if torch.is_autocast_enabled(h.device.type) and weight is not None and weight.is_floating_point():
        h = h.to(weight.dtype)  # the head outside autocast, in its weights' dtype (the loop below)
    for s in range(0, h.shape[1], chunk):
        with torch.autocast(h.device.type, enabled=False):
            logits = head(h[:, s: s + chunk]).float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        out.append(logp.gather(-1, mb.targets[:, s: s + chunk, None]).squeeze(-1))
        if with_entropy:  # differentiable (an entropy bonus); on this path only, for heads that are not plain
            ent.append(-(logp.exp() * logp).sum(-1))
    lp = torch.cat(out, 1) * mb.mask
    return (lp, torch.cat(ent, 1) * mb.mask) if with_entropy else lp


def head_compute_dtype(h: Tensor) -> torch.dtype:
    """The dtype the LM head's products run in: bf16 where the body computes in it (h in bf16, or bf16 autocast on),
    else h's own."""
    dev = h.device.type
    if h.dtype == torch.bfloat16 or (torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) == torch.bfloat16):
        return torch.bfloat16
    return h.dtype


class _Head:
    """The LM head as the chunks multiply it. In bf16, each token's logits less its target's, z - z_target, from one
    bf16 product whose fp32 accumulation does the subtraction: x gets two more columns, z_target's high and low bf16
    halves (z_target a dot product in fp32), and W two columns of -1. The bf16 output is then rounded near the
    target's logit rather than near 30, and the target's log-prob, -logsumexp(z - z_target), keeps an error of about
    2^-9 of its own size. On SmolLM2 (a bf16 body, 1352 sampled tokens), against an fp64 head on the same hidden
    states: mean error 0.012 (plain bf16 logits 0.020, bf16 inputs alone 0.007), beside the bf16 body's own 0.022
    against the fp32 model; the product ran 6.3x faster than fp32 on a Xeon with AMX (15 ms against 96 for 512
    tokens; the fp32 head had been about a fifth of a d1 training micro-batch). One-off measurements of 2026-12-02,
    not a bench command. In any other dtype: plain logits, h W^T."""

    def __init__(self, weight: Tensor, compute: torch.dtype):
        self.shifted = compute == torch.bfloat16
        self.hidden = weight.shape[1]
        self.rows = weight  # the target rows' dot products read it as it is
        self.w = (torch.cat([weight.to(compute), weight.new_full((len(weight), 2), -1.0, dtype=compute)], 1)
                  if self.shifted else weight.to(compute))

    @property
    def weight(self) -> Tensor:
        """W in the compute dtype (the gradient's products)."""
        return self.w[:, : self.hidden]

    def logits(self, x: Tensor, tgt: Tensor, acc: torch.dtype) -> tuple[Tensor, Tensor | None]:
        """(x's logits in acc, less the shift; the shift, z_target in acc, or None)."""
        if not self.shifted:
            return (x.to(self.w.dtype) @ self.w.T).to(acc), None
        shift = (x.to(acc) * self.rows[tgt].to(acc)).sum(-1)
        high = shift.to(self.w.dtype)
        low = (shift - high.to(acc)).to(self.w.dtype)
        return (torch.cat([x.to(self.w.dtype), high[:, None], low[:, None]], 1) @ self.w.T).to(acc), shift


def chunked_logprobs(h: Tensor, weight: Tensor, targets: Tensor, temperature: float, chunk_tokens: int,
                     with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(log-prob of each target, entropy or zeros, log-sum-exp), flat over h's tokens: the LM head (_Head: in bf16
    where the body computes in it) over chunk_tokens tokens at a time, each chunk's logits turned into log-probs in
    place (one (chunk, V) buffer and logsumexp's, or the probabilities' for the entropy)."""
    return _head_logprobs(h, _Head(weight, head_compute_dtype(h)), targets, temperature, chunk_tokens, with_entropy)


def _head_logprobs(h: Tensor, head: _Head, targets: Tensor, temperature: float, chunk_tokens: int,
                   with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """chunked_logprobs with its head built."""
    flat, tgt = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    acc = torch.promote_types(h.dtype, torch.float32)  # fp32 logits under bf16, as the loop's .float()
    lse, picked, ent = (torch.empty(len(tgt), device=h.device, dtype=acc) for _ in range(3))
    with torch.autocast(h.device.type, enabled=False):
        _chunks(flat, head, tgt, temperature, chunk_tokens, with_entropy, acc, lse, picked, ent)
    return picked, (ent if with_entropy else ent.zero_()), lse


def logsumexp_(z: Tensor) -> Tensor:
    """torch.logsumexp(z, -1) of a 2-D z, using z as its buffer (z holds exp(z - rowmax) after): no (rows, V)
    temporary beside it. Rows of -inf give -inf, rows with +inf give +inf, as torch's."""
    top = z.amax(-1, keepdim=True)
    top.masked_fill_(~torch.isfinite(top), 0.0)
    return z.sub_(top).exp_().sum(-1).log_().add_(top.squeeze(-1))


def _chunks(flat, head, tgt, temperature, chunk_tokens, with_entropy, acc, lse, picked, ent) -> None:
    """chunked_logprobs' loop, filling lse (of the unshifted logits), picked and ent. Each pass over a (chunk, V)
    buffer costs about as much as the bf16 product that fills it, so: no division at temperature 1 and, without the
    entropy, the target's logit read before the log-sum-exp consumes the buffer (two passes fewer than log-softmax)."""
    for s in range(0, len(tgt), chunk_tokens):
        t = tgt[s: s + chunk_tokens, None]
        z, shift = head.logits(flat[s: s + chunk_tokens], t.squeeze(1), acc)
        if temperature != 1.0:
            z.div_(temperature)
        if with_entropy:  # sum_v p log p as one dot product per row: no (chunk, V) product beside p
            lse_z = torch.logsumexp(z, dim=-1)
            logp = z.sub_(lse_z[:, None])
            picked[s: s + chunk_tokens] = logp.gather(1, t).squeeze(1)
            ent[s: s + chunk_tokens] = -torch.bmm(logp.exp().unsqueeze(1), logp.unsqueeze(2)).view(-1)
        else:
            target = z.gather(1, t).squeeze(1)
            lse_z = logsumexp_(z)
            picked[s: s + chunk_tokens] = target - lse_z
        lse[s: s + chunk_tokens] = lse_z if shift is None else lse_z + shift / temperature


class TokenLogprobs(torch.autograd.Function):
    """log-softmax(h W^T / temperature) at the target ids, for training, without keeping any (tokens, V) logits for
    the backward. Through autograd each chunk's log-softmax would stay alive until the backward: all of the (B, T, V)
    at once, 400 MB for 16 x 128 tokens of SmolLM2's 49k vocabulary, and the backward's own transients on top. Here
    the forward keeps h and each token's log-sum-exp, and the backward recomputes the logits one chunk of tokens at a
    time, turning them in place into the gradient g (onehot - softmax) / temperature: one more pass of the LM head,
    for one (chunk, V) buffer at the peak. The same function as the loop in response_logprobs, to rounding.

    Under bf16 autocast (or a bf16 h) the head's products run in bf16 with each token's logits shifted by its
    target's (_Head), the gradient's too; the softmax, the log-sum-exp and the weight gradient's sum stay fp32."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, targets: Tensor, temperature: float, chunk_tokens: int,
                with_entropy: bool) -> tuple[Tensor, Tensor]:
        head = _Head(weight, head_compute_dtype(h))
        picked, ent, lse = _head_logprobs(h, head, targets, temperature, chunk_tokens, with_entropy)
        ctx.save_for_backward(h, weight, targets, lse, ent)
        # the head in its compute dtype kept for the backward, as autocast keeps a Linear's cast weight
        ctx.head, ctx.temperature, ctx.chunk_tokens, ctx.with_entropy = head, temperature, chunk_tokens, with_entropy
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None: no work for it
        return picked.view(targets.shape), ent.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_lp: Tensor | None, grad_ent: Tensor | None):
        if grad_lp is None and grad_ent is None:
            return None, None, None, None, None, None
        with torch.autocast((grad_lp if grad_lp is not None else grad_ent).device.type, enabled=False):
            return TokenLogprobs._backward(ctx, grad_lp, grad_ent)

    @staticmethod
    def _backward(ctx, grad_lp: Tensor | None, grad_ent: Tensor | None):
        """The gradient of the log-probs (onehot - softmax), and of the entropy where the loss uses it (an entropy
        bonus): dH/dz = -p (log p + H), per row of the logits over the temperature."""
        h, weight, targets, lse, ent = ctx.saved_tensors
        acc, head = lse.dtype, ctx.head
        flat, tgt = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        g = torch.zeros(len(tgt), dtype=acc, device=h.device) if grad_lp is None else grad_lp.reshape(-1).to(acc)
        g_ent = None if grad_ent is None or not ctx.with_entropy else grad_ent.reshape(-1).to(acc)
        grad_h = torch.zeros_like(flat) if ctx.needs_input_grad[0] else None
        grad_w = None
        n = ctx.chunk_tokens
        for s in range(0, len(tgt), n):
            x, gs = flat[s: s + n], g[s: s + n, None]
            z, shift = head.logits(x, tgt[s: s + n], acc)
            lse_z = lse[s: s + n] if shift is None else lse[s: s + n] - shift / ctx.temperature
            # d logp / dz = onehot - softmax; times the upstream g, over the temperature: in place in z
            if ctx.temperature != 1.0:
                z.div_(ctx.temperature)
            z.sub_(lse_z[:, None])  # log p
            if g_ent is None:
                z.exp_().mul_(-gs)
            else:  # p (-g - g_ent (log p + H)): one more (chunk, V) buffer, only for an entropy bonus
                coef = z.add(ent[s: s + n, None]).mul_(-g_ent[s: s + n, None]).sub_(gs)
                z.exp_().mul_(coef)
                del coef
            z.scatter_add_(1, tgt[s: s + n, None], gs)
            if ctx.temperature != 1.0:
                z.div_(ctx.temperature)
            dz = z.to(head.w.dtype)
            if grad_h is not None:
                grad_h[s: s + n] = dz @ head.weight
            if ctx.needs_input_grad[1]:  # each chunk's product in the compute dtype, their sum in fp32
                if grad_w is None:
                    grad_w = (dz.T @ x.to(dz.dtype)).to(acc)
                elif dz.dtype == acc:
                    grad_w.addmm_(dz.T, x)
                else:
                    grad_w += dz.T @ x.to(dz.dtype)
        return (grad_h.view_as(h) if grad_h is not None else None,
                grad_w.to(weight.dtype) if grad_w is not None else None, None, None, None, None)


def response_values(critic, mb: MicroBatch) -> Tensor:
    """Critic value of the state before each response token: (B, T), 0 on padding."""
    if mb.prefix is None and mb.packed is None:
        v = critic(input_ids=mb.input_ids, attention_mask=mb.attention_mask)
        return v.gather(1, mb.positions) * mb.mask
    with adapter_of(critic):
        h = response_hidden(critic.backbone, mb)
    return scalar_head(critic.head, h) * mb.mask


def adapter_of(role):
    """A role on the shared base (models/shared.py AdapterValueModel, AdapterRewardModel) runs the base with its own
    adapter active, as its forward does; any other role needs nothing."""
    if hasattr(role, "adapter") and hasattr(role, "_shared"):
        return use_adapter(role._shared, role.adapter)
    return contextlib.nullcontext()


def can_share(model) -> bool:
    """Whether `model` (a causal LM, ValueModel or reward model, peft-wrapped or on the shared base) has a body the
    prefix-shared forward supports."""
    return model is not None and prefix.supports(getattr(model, "backbone", model))
