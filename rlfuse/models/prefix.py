"""Prefix-shared forward: the k samples of one prompt run the prompt through the transformer body once; each sample's
continuation then attends to that prompt's keys and values (repeated to its row, or to each row of that prompt's
continuations packed end to end) through a transformers cache.
The prompt's activations get the summed gradient of the k continuations through autograd (indexing's backward
sums the rows), so a training forward is shared as well as a scoring one.

Why our own cache layers and not DynamicCache: DynamicCache appends on every update, so a checkpointed layer
replayed in the backward would append the prompt a second time; transformers therefore drops any cache under
gradient checkpointing. _PromptLayer records a layer's keys/values once and _SharedPrefixLayer stores nothing, so a
replay reads exactly what the forward read, and `_cache_through_checkpointing` lets the cache reach the layers.

Masks are explicit 4D masks and positions explicit ids (prompts right-padded: no query row is fully masked, so no
NaN can reach the keys). GPT-2 and Llama-style models (Llama, Qwen2, Mistral without a sliding window) with eager or
SDPA attention; `supports` says no to any other, and callers keep the full forward there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

from rlfuse.models.hf_cache import with_cache

MODEL_TYPES = ("gpt2", "llama", "qwen2", "mistral")


@dataclass
class PrefixBatch:
    """Samples grouped by prompt: each distinct prompt once, each sample's continuation after it."""
    prompt_ids: Tensor     # (U, P) distinct prompts, right-padded
    prompt_lens: Tensor    # (U,)
    group: Tensor          # (B,) row in prompt_ids of each sample's prompt
    cont_ids: Tensor       # (B, C) continuations, right-padded (C may be 0)
    cont_lens: Tensor      # (B,)
    saved_tokens: int
    """Prompt token-forwards not computed: sum over distinct prompts of length x (samples - 1)."""
    packed: "PackedBatch | None" = None
    """Set when the continuations run packed (group_by_prompt's pack): laid end to end in a few rows, each attending
    to its own prompt's keys and causally to itself, from its positions after its prompt (cont_ids then unused)."""


def group_by_prompt(prompts: list[list[int]], continuations: list[list[int]], pad_id: int, device,
                    pack: bool = False) -> PrefixBatch:
    """PrefixBatch of B samples; prompts equal as token lists share one row, in order of first appearance. pack: the
    continuations also laid end to end, each prompt's in rows of their own (pack_by_prompt_layout), instead of one
    right-padded row each."""
    rows: dict[tuple, int] = {}
    group = [rows.setdefault(tuple(p), len(rows)) for p in prompts]
    distinct = list(rows)
    P, C = max(map(len, distinct)), max(map(len, continuations))
    ids = torch.full((len(distinct), P), pad_id, dtype=torch.long)
    for u, p in enumerate(distinct):
        ids[u, : len(p)] = torch.tensor(p)
    cont = torch.full((len(prompts), C), pad_id, dtype=torch.long)
    for b, c in enumerate(continuations):
        cont[b, : len(c)] = torch.tensor(c, dtype=torch.long)
    saved = sum(map(len, prompts)) - sum(map(len, distinct))
    lens, cont_lens = torch.tensor([len(p) for p in distinct]), torch.tensor([len(c) for c in continuations])
    packed = _pack_by_prompt(continuations, group, [len(p) for p in prompts], pad_id, device) if pack and C > 0 else None
    return PrefixBatch(ids.to(device), lens.to(device), torch.tensor(group).to(device), cont.to(device),
                       cont_lens.to(device), saved, packed)


def pack_by_prompt_layout(lengths: list[int], group: list[int]) -> tuple[list[list[int]], list[int], int]:
    """(rows of sample indices, each row's prompt, the widest row's tokens): each prompt's continuations of these
    lengths packed into rows of their own (pack_rows at max(PACK_ROW_TOKENS, longest) tokens a row)."""
    capacity = max(PACK_ROW_TOKENS, max(lengths))
    rows, row_prompt = [], []
    for u in dict.fromkeys(group):
        mine = [b for b in range(len(group)) if group[b] == u]
        rows += [[mine[i] for i in row] for row in pack_rows([lengths[b] for b in mine], capacity)]
        row_prompt += [u] * (len(rows) - len(row_prompt))
    return rows, row_prompt, max(sum(lengths[b] for b in row) for row in rows)


def _pack_by_prompt(continuations: list[list[int]], group: list[int], prompt_lens: list[int], pad_id: int,
                    device) -> "PackedBatch":
    """The continuations of each distinct prompt packed into rows of their own (pack_by_prompt_layout), every row
    padded to the widest: a row attends to one prompt's keys, so rows of several prompts never attend over all of
    them. Positions follow each sample's prompt; row_prompt is each row's prompt."""
    rows, row_prompt, width = pack_by_prompt_layout([len(c) for c in continuations], group)
    return pack_sequences(continuations, pad_id, device, (rows, width), prompt_lens, row_prompt)


def prompt_tokens_saved(prompts: list[list[int]]) -> int:
    """Prompt token-forwards a shared forward saves on these samples' prompts (0: no prompt repeats)."""
    return sum(map(len, prompts)) - sum(len(p) for p in {tuple(p) for p in prompts})


def supports(model) -> bool:
    """Whether the prefix-shared forward is implemented (and tested) for this model's body."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in MODEL_TYPES:
        return False
    sliding = getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True)
    return not sliding and getattr(cfg, "_attn_implementation", None) in ("eager", "sdpa")


class _PromptLayer(DynamicLayer):
    """Keeps the first keys/values it is given (the prompt's); a checkpointed layer's replay leaves them."""

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.keys, self.values, self.is_initialized = key_states, value_states, True
        return key_states, value_states


class _SharedPrefixLayer(DynamicLayer):
    """The prompt's keys/values repeated to each sample's row, in front of the continuation's own; stores nothing."""

    def __init__(self, keys: Tensor, values: Tensor):
        super().__init__()
        self.keys, self.values, self.is_initialized = keys, values, True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return torch.cat([self.keys, key_states], -2), torch.cat([self.values, value_states], -2)


@contextlib.contextmanager
def _cache_through_checkpointing(body):
    """Under gradient checkpointing transformers hands layers no cache (GPT2Model passes None; each checkpointed
    layer drops the cache keyword unless its `_can_checkpoint_with_cache`). Our cache layers replay
    identically, so let the cache through; the layers still checkpoint."""
    if not (getattr(body, "gradient_checkpointing", False) and body.training):
        yield
        return
    layers = [m for m in body.modules() if hasattr(type(m), "_can_checkpoint_with_cache")]
    body.gradient_checkpointing = False  # the body's own flag: its layers keep theirs
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        body.gradient_checkpointing = True
        for layer in layers:
            del layer._can_checkpoint_with_cache


def _mask(allowed: Tensor, body) -> Tensor:
    """(N, 1, Q, K) attention mask from a bool `allowed` in the format the body's attention takes: bool for SDPA,
    additive float for eager (as transformers' own mask builders give)."""
    if body.config._attn_implementation == "sdpa":
        return allowed[:, None]
    dtype = body.get_input_embeddings().weight.dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min)[:, None]


def prefix_shared_hidden(body, pb: PrefixBatch) -> tuple[Tensor, Tensor]:
    """-> (prompt hidden (U, P, H), continuation hidden (B, C, H), or (R, W, H) over pb.packed's rows): the body's
    last hidden states of each distinct prompt, and of each sample's continuation as if it followed its prompt in one
    sequence (hidden_at reads either layout). Differentiable."""
    dev = pb.prompt_ids.device
    U, P = pb.prompt_ids.shape
    B, C = pb.cont_ids.shape
    ar_p, ar_c = torch.arange(P, device=dev), torch.arange(C, device=dev)
    causal_p = ar_p[None, :, None] >= ar_p[None, None, :]                                   # (1, P, P)
    prompt_keys = ar_p[None, :] < pb.prompt_lens[:, None]                                   # (U, P)
    cache = Cache(layer_class_to_replicate=_PromptLayer)
    with _cache_through_checkpointing(body):
        h_prompt = body(input_ids=pb.prompt_ids, attention_mask=_mask(causal_p & prompt_keys[:, None], body),
                        position_ids=ar_p[None].expand(U, P), use_cache=False, **with_cache(cache)).last_hidden_state
        if C == 0:
            return h_prompt, h_prompt.new_zeros(B, 0, h_prompt.shape[-1])
        if pb.packed is not None:
            return h_prompt, _packed_continuations(body, pb, cache, prompt_keys)
        # indexing, not index_select: on CPU index_select of these strided (U, heads, P, D) views is 5-30x slower
        shared = Cache(layers=[_SharedPrefixLayer(layer.keys[pb.group], layer.values[pb.group]) for layer in cache.layers])
        lens = pb.prompt_lens[pb.group]                                                     # (B,)
        allowed = torch.cat([prompt_keys[pb.group][:, None].expand(B, C, P),                # a sample's own prompt
                             (ar_c[:, None] >= ar_c[None, :])[None].expand(B, C, C)], -1)   # causal continuation
        # padding stays at its sample's last position: a short continuation after a long prompt must not index
        # past the model's context (GPT-2's position table)
        steps = torch.minimum(ar_c[None], (pb.cont_lens[:, None] - 1).clamp(min=0))
        h_cont = body(input_ids=pb.cont_ids, attention_mask=_mask(allowed, body), position_ids=lens[:, None] + steps,
                      use_cache=False, **with_cache(shared)).last_hidden_state
    return h_prompt, h_cont


def _packed_continuations(body, pb: PrefixBatch, cache: Cache, prompt_keys: Tensor) -> Tensor:
    """(R, W, H) the body's last hidden states of pb.packed's rows: each row's prompt's keys and values in front of
    it, each continuation token attending to them and, causally, to its own continuation. Against one padded row per
    sample this forwards no padding inside a row, and a prompt's keys once per row instead of once per sample; each
    token attends over P + W keys instead of P + C (more attention, fewer of the matrix multiplies that cost more:
    collate packs where it cuts the token positions enough)."""
    pk = pb.packed
    W = pk.ids.shape[1]
    # indexing, not index_select: see prefix_shared_hidden
    shared = Cache(layers=[_SharedPrefixLayer(layer.keys[pk.row_prompt], layer.values[pk.row_prompt])
                           for layer in cache.layers])
    ar = torch.arange(W, device=pk.ids.device)
    allowed = torch.cat([((pk.segment >= 0)[..., None] & prompt_keys[pk.row_prompt][:, None, :]),  # its prompt
                         (pk.segment[:, :, None] == pk.segment[:, None, :]) & (ar[:, None] >= ar[None, :])], -1)
    return body(input_ids=pk.ids, attention_mask=_mask(allowed, body), position_ids=pk.position_ids,
                use_cache=False, **with_cache(shared)).last_hidden_state


def hidden_at(h_prompt: Tensor, h_cont: Tensor, pb: PrefixBatch, positions: Tensor) -> Tensor:
    """(B, T, H) hidden states at sequence positions (B, T) of prompt + continuation (positions past a sample's
    sequence give some row's state: callers mask them). h_cont: (B, C, H), or pb.packed's rows (R, W, H)."""
    lens = pb.prompt_lens[pb.group][:, None]                                                # (B, 1)
    in_prompt = positions < lens
    H = h_prompt.shape[-1]
    from_prompt = h_prompt[pb.group[:, None], positions.clamp(max=h_prompt.shape[1] - 1)]   # (B, T, H)
    if h_cont.shape[1] == 0:
        return from_prompt
    if pb.packed is not None:
        width = h_cont.shape[1]
        start = torch.tensor([r * width + c for r, c in pb.packed.starts], device=positions.device)[:, None]
        at = (start + positions - lens).clamp(0, h_cont.shape[0] * width - 1)
        from_cont = h_cont.reshape(-1, H)[at]
    else:
        at = (positions - lens).clamp(0, h_cont.shape[1] - 1)
        from_cont = h_cont.gather(1, at[..., None].expand(-1, -1, H))
    return torch.where(in_prompt[..., None], from_prompt, from_cont)


# ------------------------------------------------------------------------------------------- packed sequences

PACK_ROW_TOKENS = 1024
"""A packed row holds sequences up to this many tokens in all (or the longest sequence, if longer): attention over a
row grows with its length squared, so a micro-batch is not packed into one row without bound."""


@dataclass
class PackedBatch:
    """A micro-batch's sequences laid end to end in a few rows, each attending only to itself (a block-diagonal
    causal mask) from its own positions 0, 1, ...: no padding inside a row, only at the end of the shorter rows."""
    ids: Tensor            # (R, W)
    position_ids: Tensor   # (R, W) each sequence's own positions; padding 0
    segment: Tensor        # (R, W) the sequence's index in the micro-batch; padding -1 - column (each on its own)
    starts: list[tuple[int, int]]
    """(row, column) where each sequence starts, in the micro-batch's order."""
    saved_tokens: int
    """Padding token-forwards not computed: rows x longest sequence of the padded batch less R x W."""
    row_prompt: Tensor | None = None
    """(R,) a prefix-shared batch's packed continuations (group_by_prompt's pack): the prompt each row follows."""


def pack_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sequence indices per row, first fit by decreasing length (ties: lower index first) into rows of `capacity`
    tokens: a deterministic layout of these lengths."""
    rows: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = next((r for r, u in enumerate(used) if u + lengths[i] <= capacity), None)
        if r is None:
            rows.append([i])
            used.append(lengths[i])
        else:
            rows[r].append(i)
            used[r] += lengths[i]
    return rows


def pack_layout(lengths: list[int]) -> tuple[list[list[int]], int]:
    """The rows sequences of these lengths pack into (pack_rows, at max(PACK_ROW_TOKENS, longest) tokens a row) and
    the widest row's tokens, which every row is padded to."""
    rows = pack_rows(lengths, max(PACK_ROW_TOKENS, max(lengths)))
    return rows, max(sum(lengths[i] for i in row) for row in rows)


def pack_sequences(seqs: list[list[int]], pad_id: int, device, layout: tuple[list[list[int]], int] | None = None,
                   first_positions: list[int] | None = None, row_prompt: list[int] | None = None) -> PackedBatch:
    """PackedBatch of these token sequences: in pack_layout's rows, or `layout`'s (rows, width); each sequence's
    positions from 0, or from its first_positions entry (a continuation after its prompt)."""
    lengths = [len(s) for s in seqs]
    rows, W = layout or pack_layout(lengths)
    first = first_positions or [0] * len(seqs)
    ids = torch.full((len(rows), W), pad_id, dtype=torch.long)
    pos = torch.zeros(len(rows), W, dtype=torch.long)
    seg = -1 - torch.arange(W).repeat(len(rows), 1)
    starts = [(0, 0)] * len(seqs)
    for r, row in enumerate(rows):
        col = 0
        for i in row:
            n = lengths[i]
            ids[r, col: col + n] = torch.tensor(seqs[i], dtype=torch.long)
            pos[r, col: col + n], seg[r, col: col + n] = first[i] + torch.arange(n), i
            starts[i] = (r, col)
            col += n
    saved = len(seqs) * max(lengths) - len(rows) * W
    return PackedBatch(ids.to(device), pos.to(device), seg.to(device), starts, saved,
                       None if row_prompt is None else torch.tensor(row_prompt, device=device))


def packed_hidden(body, pk: PackedBatch) -> Tensor:
    """(R, W, H) the body's last hidden states of a packed batch: each sequence as if it ran alone. Differentiable."""
    W = pk.ids.shape[1]
    ar = torch.arange(W, device=pk.ids.device)
    allowed = (pk.segment[:, :, None] == pk.segment[:, None, :]) & (ar[:, None] >= ar[None, :])[None]  # (R, W, W)
    return body(input_ids=pk.ids, attention_mask=_mask(allowed, body), position_ids=pk.position_ids,
                use_cache=False).last_hidden_state
