"""KV-cache storage for the live decode batch, and lean decode steps for GPT-2 and Llama-style models.

Two stores behind one small interface (keep some rows, cut left padding, merge two batches, width, decode, copy one
row's cache out):
- `HFCacheKV` wraps a transformers cache and decodes through the model's own forward: any causal LM works;
- `BufferKV` keeps all layers' keys and values in one preallocated tensor (L, 2, rows, heads, capacity, head_dim)
  and decodes with `Gpt2DecodeStep`, which runs the model's own weights through the same operations as
  transformers' GPT-2 but writes the new keys/values in place and skips the per-call machinery (mask building,
  cache objects, output classes, module dispatch). Why ours: on 2 CPU cores with 16 rows of a 4-layer 256-dim
  GPT-2, an engine step through transformers' forward takes 5-6 ms, of which 1.3-1.6 ms are the matrix multiplies;
  through this step 3.6-3.9 ms (`bench/decode_step.py`). `LlamaDecodeStep` does the same for Llama-style models
  (Llama, Qwen2, Mistral without a sliding window), calling the model's own norm, projection and MLP modules
  (1.1-1.2x per step). Equality with transformers' forward is tested (log-probs
  within 1e-5 in fp32). Any other model, or one with options these steps do not implement, keeps transformers' path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache

from rlfuse.models.hf_cache import cache_of, with_cache
from rlfuse.models.layout import has_llama_decode_step, packed_product, transposed_product
from rlfuse.models.lean import is_swiglu_mlp, runs_stock


class HFCacheKV:
    """A transformers DynamicCache, left-padded to a common width across rows."""

    def __init__(self, cache):
        self.cache = cache

    @property
    def width(self) -> int:
        return self.cache.layers[0].keys.shape[2]

    def keep_rows(self, idx: Tensor) -> None:
        self.cache.batch_select_indices(idx)

    def repeat_rows(self, repeats: Tensor) -> None:
        """Row i becomes repeats[i] consecutive copies (a prompt's k samples share its prefill)."""
        for layer in self.cache.layers:
            layer.keys = layer.keys.repeat_interleave(repeats, dim=0)
            layer.values = layer.values.repeat_interleave(repeats, dim=0)

    def cut_left(self, first: int) -> None:
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]

    def merge(self, other: "HFCacheKV") -> None:
        width = max(self.width, other.width)
        for a, b in zip(self.cache.layers, other.cache.layers):
            a.keys = torch.cat([left_pad(a.keys, width, 2), left_pad(b.keys, width, 2)])
            a.values = torch.cat([left_pad(a.values, width, 2), left_pad(b.values, width, 2)])

    def row(self, i: int, n: int) -> Tensor | None:
        """Row i's last n columns (its whole unpadded cache) as one (L, 2, 1, H, n, D) copy; None where a layer is not
        a plain full cache (a sliding window keeps only its last columns: they are not the sequence)."""
        if any(type(layer).__name__ != "DynamicLayer" for layer in self.cache.layers):
            return None
        w = self.width
        return torch.stack([torch.stack([layer.keys[i: i + 1, :, w - n: w], layer.values[i: i + 1, :, w - n: w]])
                            for layer in self.cache.layers])

    def decode(self, model, last: Tensor, pos: Tensor, attn: Tensor) -> Tensor:
        out = model(input_ids=last[:, None], attention_mask=attn, position_ids=pos[:, None],
                    use_cache=True, **with_cache(self.cache))
        self.cache = cache_of(out)
        return out.logits[:, -1]


class BufferKV:
    """All layers' keys and values in one tensor (L, 2, R, H, capacity, D); columns [0, width) are in use.

    Capacity grows geometrically (by half the width, at least GROW columns) instead of reserving max_new_tokens up
    front: with a long-tailed batch most rows leave long before the limit, and reserving the limit for every row made
    the rollout benchmark 3x slower and 5x larger above idle (each retirement also copied the unused columns)."""

    GROW = 32

    def __init__(self, kv: Tensor, width: int, step: Gpt2DecodeStep | LlamaDecodeStep):
        self.kv, self._width, self.step = kv, width, step

    @classmethod
    def from_cache(cls, cache, repeats: int | Tensor, spare: int, step: Gpt2DecodeStep | LlamaDecodeStep) -> "BufferKV":
        """One allocation for `repeats` rows of each cached sequence (int, or one count per sequence) and up to
        `spare` empty columns (at most GROW)."""
        spare = min(spare, cls.GROW)
        layers = cache.layers
        L, (B, H, P, D) = len(layers), layers[0].keys.shape
        rows = B * repeats if isinstance(repeats, int) else int(repeats.sum())
        kv = layers[0].keys.new_zeros(L, 2, rows, H, P + spare, D)  # zeros: a masked column still meets V (0 * NaN = NaN)
        for i, layer in enumerate(layers):
            kv[i, 0, :, :, :P] = layer.keys.repeat_interleave(repeats, dim=0)
            kv[i, 1, :, :, :P] = layer.values.repeat_interleave(repeats, dim=0)
        return cls(kv, P, step)

    @property
    def width(self) -> int:
        return self._width

    def keep_rows(self, idx: Tensor) -> None:
        """Compact the kept rows to the front of the same buffer, in order. Why not `kv[:, :, idx]`: that allocates a
        new buffer at every retirement, each of a different size, and on a CPU the freed ones fragment the heap (the
        long-tailed rollout of bench/vs_trl.py workload (b) grew RSS by ~4x its largest KV buffer that way). On a GPU
        the caching allocator reuses blocks, and one gather beats a launch per moved row."""
        if self.kv.device.type != "cpu":
            self.kv = self.kv[:, :, idx]
            return
        keep = idx.tolist()
        assert keep == sorted(keep), "in-place compaction needs the kept rows in ascending order"
        for dst, src in enumerate(keep):
            if dst != src:
                self.kv[:, :, dst].copy_(self.kv[:, :, src])
        self.kv = self.kv[:, :, : len(idx)]

    def cut_left(self, first: int) -> None:
        self.kv, self._width = self.kv[..., first:, :], self._width - first

    def row(self, i: int, n: int) -> Tensor:
        """Row i's last n used columns (its whole unpadded cache) as one (L, 2, 1, H, n, D) copy."""
        return self.kv[:, :, i: i + 1, :, self._width - n: self._width].clone()

    def merge(self, other: "BufferKV") -> None:
        width = max(self.width, other.width)
        spare = min(max(self.kv.shape[4] - self.width, other.kv.shape[4] - other.width), self.GROW)
        a, b = self.kv.shape[2], other.kv.shape[2]
        kv = self.kv.new_zeros(*self.kv.shape[:2], a + b, self.kv.shape[3], width + spare, self.kv.shape[5])
        kv[:, :, :a, :, width - self.width: width] = self.kv[..., : self.width, :]
        kv[:, :, a:, :, width - other.width: width] = other.kv[..., : other.width, :]
        self.kv, self._width = kv, width

    def decode(self, model, last: Tensor, pos: Tensor, attn: Tensor) -> Tensor:
        if self._width == self.kv.shape[4]:  # out of spare columns: grow (amortised: by half the width)
            grown = self.kv.new_zeros(*self.kv.shape[:4], self._width + max(self.GROW, self._width // 2), self.kv.shape[5])
            grown[..., : self._width, :] = self.kv
            self.kv = grown
        logits = self.step(self.kv, self._width, last, pos, attn)
        self._width += 1
        return logits


def dynamic_cache(kv: Tensor):
    """A transformers cache holding kv (L, 2, rows, H, n, D, as BufferKV.row gives): a forward over it continues
    those sequences at position n."""
    cache = DynamicCache()
    for i in range(kv.shape[0]):
        cache.update(kv[i, 0], kv[i, 1], i)
    return cache


def left_pad(t: Tensor, width: int, dim: int) -> Tensor:
    pad = [0, 0] * (t.dim() - 1 - dim) + [width - t.shape[dim], 0]
    return F.pad(t, pad)


class Gpt2DecodeStep:
    """One decode step of a transformers GPT2LMHeadModel in eval mode over a BufferKV tensor."""

    def __init__(self, model):
        self.model = model
        cfg = model.config
        self.E, self.H = cfg.n_embd, cfg.n_head
        self.D = self.E // self.H
        self.scale = self.D ** -0.5 if cfg.scale_attn_weights else 1.0
        self.refresh()

    def pack(self) -> None:
        """Nothing to pack (LlamaDecodeStep's packed weights have no GPT-2 counterpart)."""

    def release(self) -> None:
        """Nothing held beyond the model's own tensors."""

    def refresh(self) -> None:
        """Collect the weight tensors once per generate call (attribute lookups through nn.Module cost ~10 us each;
        the optimiser updates these same tensors in place)."""
        tr = self.model.transformer
        ln = lambda m: (m.weight, m.bias, m.eps)
        self.embed = (tr.wte.weight, tr.wpe.weight)
        self.blocks = [(ln(b.ln_1), b.attn.c_attn.weight, b.attn.c_attn.bias, b.attn.c_proj.weight, b.attn.c_proj.bias,
                        ln(b.ln_2), b.mlp.c_fc.weight, b.mlp.c_fc.bias, b.mlp.c_proj.weight, b.mlp.c_proj.bias,
                        b.mlp.act) for b in tr.h]  # the model's own activation (models.load.fuse_activations)
        self.ln_f, self.lm_head = ln(tr.ln_f), self.model.lm_head

    @staticmethod
    def supports(model) -> bool:
        cfg = getattr(model, "config", None)
        # it reads the projections' weights itself: a LoRA-wrapped (shared base) or quantised layer would be skipped
        plain = lambda m: type(m).__name__ == "Conv1D"
        blocks = getattr(getattr(model, "transformer", None), "h", [])
        return (type(model).__name__ == "GPT2LMHeadModel" and cfg is not None
                and all(plain(m) for b in blocks for m in (b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj))
                and not getattr(cfg, "scale_attn_by_inverse_layer_idx", False)
                and not getattr(cfg, "reorder_and_upcast_attn", False)
                and not getattr(cfg, "add_cross_attention", False))

    def __call__(self, kv: Tensor, w: int, last: Tensor, pos: Tensor, attn: Tensor) -> Tensor:
        """kv: (L, 2, R, H, C, D) with columns [0, w) filled; writes column w. attn: (R, w + 1) bool, True = attend.
        -> next-token logits (R, V)."""
        E, H, D, R = self.E, self.H, self.D, last.shape[0]
        x = self.embed[0][last] + self.embed[1][pos]
        mask = attn[:, None, None, :]
        for i, (ln1, w_qkv, b_qkv, w_o, b_o, ln2, w_fc, b_fc, w_out, b_out, act) in enumerate(self.blocks):
            h = F.layer_norm(x, (E,), *ln1)
            qkv = torch.addmm(b_qkv, h, w_qkv).view(R, 3, H, D)
            keys, values = kv[i, 0], kv[i, 1]
            keys[:, :, w], values[:, :, w] = qkv[:, 1], qkv[:, 2]
            a = F.scaled_dot_product_attention(qkv[:, 0, :, None], keys[:, :, : w + 1], values[:, :, : w + 1],
                                               attn_mask=mask, scale=self.scale)
            x = torch.addmm(b_o, a.reshape(R, E), w_o).add_(x)
            h = F.layer_norm(x, (E,), *ln2)
            x = torch.addmm(b_out, act(torch.addmm(b_fc, h, w_fc)), w_out).add_(x)
        return self.lm_head(F.layer_norm(x, (E,), *self.ln_f))


class LlamaDecodeStep:
    """One decode step of a Llama-style model (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM without a
    sliding window) in eval mode over a BufferKV tensor (L, 2, R, kv_heads, C, D). The norms, projections, MLP and
    rotary tables are the model's own modules; only the cache write and attention over the buffer are ours. A bf16
    model on a CPU whose oneDNN packs bf16 multiplies its plain linears from weights packed by pack() (the engine, at
    each generate call) and dropped by release() (when the call ends, and by release_weights)."""

    def __init__(self, model):
        self.model = model
        cfg = model.config
        self.H, self.KVH = cfg.num_attention_heads, cfg.num_key_value_heads
        self.D = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H
        self.packed: dict[int, object] = {}
        self.refresh()

    def refresh(self) -> None:
        body = self.model.model
        self.embed, self.rotary, self.norm, self.layers = body.embed_tokens, body.rotary_emb, body.norm, list(body.layers)
        self.lm_head = self.model.lm_head

    def pack(self) -> None:
        """Pack the bf16 linears' weights for this generate call (the engine's _start, after refresh)."""
        self.packed = {}
        for module in self._linears():
            product = packed_product(module)
            if product is not None:
                self.packed[id(module)] = product

    def release(self) -> None:
        """Drop the packed weights (a second copy of every matrix) until the next pack()."""
        self.packed = {}

    def _linears(self):
        for layer in self.layers:
            a, mlp = layer.self_attn, layer.mlp
            yield from (a.q_proj, a.k_proj, a.v_proj, a.o_proj)
            yield from (getattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj") if hasattr(mlp, name))
        yield self.lm_head

    def linear(self, module):
        """module's packed product where pack() packed it and no hook has come since, else module itself."""
        product = self.packed.get(id(module))
        return product if product is not None and runs_stock(module) else module

    @staticmethod
    def supports(model) -> bool:
        return has_llama_decode_step(model)  # beside the layout rule: the probe asks it too (models/layout.py)

    def __call__(self, kv: Tensor, w: int, last: Tensor, pos: Tensor, attn: Tensor) -> Tensor:
        """Same contract as Gpt2DecodeStep.__call__."""
        H, KVH, D, R = self.H, self.KVH, self.D, last.shape[0]
        x = self.embed(last)[:, None]  # (R, 1, E)
        cos, sin = self.rotary(x, position_ids=pos[:, None])
        cos, sin = cos[:, None], sin[:, None]  # (R, 1, 1, D)
        mask = attn[:, None, None, :]
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            products = [transposed_product(m, R) for m in (a.q_proj, a.k_proj, a.v_proj, a.o_proj)]
            transposed = all(p is not None for p in products)
            h = layer.input_layernorm(x)
            if transposed:
                q, k, v = self.rotated_qkv_transposed(products[:3], h, cos, sin)
            else:
                q, k, v = self.rotated_qkv(a, h, cos, sin)
            keys, values = kv[i, 0], kv[i, 1]
            keys[:, :, w], values[:, :, w] = k[:, :, 0], v[:, :, 0]
            # a key head's H / KVH query heads as that many query positions of one head: the same attention as
            # enable_gqa, whose CPU kernel takes 1.5-3x longer on one query position per head (0.55-0.70 against
            # 0.23-0.33 ms a layer at SmolLM2's 9 / 3 heads and 16 rows)
            o = F.scaled_dot_product_attention(q.reshape(R, KVH, H // KVH, D), keys[:, :, : w + 1],
                                               values[:, :, : w + 1], attn_mask=mask, scale=a.scaling)
            if transposed:
                x = x + products[3](o.reshape(R, H * D).t().contiguous()).t()[:, None]
            else:
                x = x + self.linear(a.o_proj)(o.reshape(R, 1, H * D))
            x = x + self.mlp(layer.mlp, layer.post_attention_layernorm(x), R)
        h = self.norm(x)[:, 0]
        head = transposed_product(self.lm_head, R)
        return head(h.t().contiguous()).t().contiguous() if head is not None else self.linear(self.lm_head)(h)

    def mlp(self, mlp, h: Tensor, rows: int) -> Tensor:
        """The MLP of h (R, 1, E): a SwiGLU of plain row-major projections as W @ h^T throughout (the product stays
        transposed from gate and up through down), or from packed weights; any other, or one hooked (runs_stock: a
        forward set on the instance counts unless it acts only in training, as lean activations' and checkpointing's
        do), through its own forward."""
        stock = is_swiglu_mlp(mlp) and runs_stock(mlp, decoding=True)
        products = [transposed_product(m, rows) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)] \
            if stock else [None]
        if all(p is not None for p in products):
            gate, up, down = products
            ht = h[:, 0].t().contiguous()
            return down(mlp.act_fn(gate(ht)).mul_(up(ht))).t()[:, None]
        if stock and all(id(m) in self.packed for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            gate, up, down = (self.linear(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
            return down(mlp.act_fn(gate(h)).mul_(up(h)))
        return mlp(h)

    def rotated_qkv_transposed(self, products, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """rotated_qkv with the query, key and value projections as W @ h^T (their transposed_product); the heads made
        contiguous again, so that rotary and attention run on dense tensors (a strided query sends attention to its
        slow math path)."""
        R, H, KVH, D = h.shape[0], self.H, self.KVH, self.D
        ht = h[:, 0].t().contiguous()
        heads = lambda product, n: product(ht).t().contiguous().view(R, 1, n, D).transpose(1, 2)
        q, k, v = heads(products[0], H), heads(products[1], KVH), heads(products[2], KVH)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def rotated_qkv(self, attn, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """One layer's query, key and value heads of h (R, 1, E), rotary applied: (R, H, 1, D), (R, KVH, 1, D) x 2."""
        R, H, KVH, D = h.shape[0], self.H, self.KVH, self.D
        q = self.linear(attn.q_proj)(h).view(R, 1, H, D).transpose(1, 2)
        k = self.linear(attn.k_proj)(h).view(R, 1, KVH, D).transpose(1, 2)
        v = self.linear(attn.v_proj)(h).view(R, 1, KVH, D).transpose(1, 2)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def decode_step_for(model):
    """The lean decode step for this model's architecture, or None (decode through transformers' forward)."""
    for step in (Gpt2DecodeStep, LlamaDecodeStep):
        if step.supports(model):
            return step(model)
    return None
