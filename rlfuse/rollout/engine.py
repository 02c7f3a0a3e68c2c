"""Decode engine: prompts, k, sampling settings -> an iterator of finished samples, in the order they finish.

Over any transformers causal LM with a KV cache (our own loop; see BENCHMARKS.md for why not `generate_batch`):
- each prompt is prefilled once and its KV cache repeated for its k samples, which then sample independently;
- a row leaves the decode batch (with its KV rows) as soon as it hits EOS, a stop string or the length limit, and
  the left padding no live row needs any more is cut off the cache;
- continuous batching: prompts wait in a queue and are prefilled when the live batch has room (`max_rows`);
- sampling (temperature, top-k, top-p) draws from the engine's own seeded generator, so the samples depend only on
  the seed, the prompts and the model, never on what the caller does between samples (e.g. scoring them).
The log-probs recorded are those of the sampled tokens under softmax(logits / temperature), the distribution the
RL losses optimise; they equal a full forward pass over the finished sequence (tested to 1e-4 in fp32).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor

from rlfuse.rollout.kv import BufferKV, HFCacheKV, decode_step_for, left_pad


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    """0 disables."""
    top_p: float = 1.0
    """1.0 disables."""
    stop_strings: tuple[str, ...] = ()


@dataclass
class Sample:
    prompt_id: int
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: Tensor
    """(len(token_ids),) float32 log-probs of the sampled tokens."""
    finish_reason: str
    """eos | stop | length."""


@dataclass
class EngineStats:
    """What the engine did: for tests and metrics (rows really leave the batch; prompts prefilled once)."""
    decode_steps: int = 0
    decode_rows: int = 0
    """Sum over decode forwards of the rows in the batch (the compute actually spent)."""
    prefill_tokens: int = 0
    max_live_rows: int = 0
    rows_per_step: list[int] = field(default_factory=list)


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Mask all but the top-k tokens and the smallest set whose probability reaches top_p. logits: (R, V)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_tokens(probs: Tensor, gen: torch.Generator) -> Tensor:
    """One token per row by inverse-CDF sampling: one uniform draw per row (torch.multinomial on the CPU spent
    0.44 ms per call on 16 x 1023 probabilities, a tenth of a decode step; this takes 0.04 ms, bench/decode_step.py).
    Tokens with zero probability are never drawn: their CDF step is empty. probs: (R, V) -> (R,)."""
    cum = probs.cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=gen, device=probs.device, dtype=cum.dtype) * cum[:, -1:]
    return torch.searchsorted(cum, u, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(1)


class _Live:
    """The live decode batch: KV store left-padded to a common width, its (rows, width) bool mask (True = attend),
    plus per-row bookkeeping."""

    def __init__(self, kv: HFCacheKV | BufferKV, attn: Tensor, pos: Tensor, last: Tensor, rows: list[dict]):
        self.kv, self.attn, self.pos, self.last, self.rows = kv, attn, pos, last, rows

    def __len__(self):
        return len(self.rows)

    def select(self, keep: list[int]) -> None:
        idx = torch.tensor(keep, dtype=torch.long, device=self.attn.device)
        self.kv.keep_rows(idx)
        self.attn, self.pos, self.last = self.attn[idx], self.pos[idx], self.last[idx]
        self.rows = [self.rows[i] for i in keep]
        # columns that no live row attends to any more are left padding: cut them off the cache
        first = int(self.attn.any(0).to(torch.int8).argmax())
        if first > 0:
            self.attn = self.attn[:, first:]
            self.kv.cut_left(first)

    def merge(self, other: "_Live") -> None:
        """Append other's rows; the narrower cache is left-padded (masked) to the wider one's width."""
        width = max(self.attn.shape[1], other.attn.shape[1])
        self.kv.merge(other.kv)
        self.attn = torch.cat([left_pad(self.attn, width, 1), left_pad(other.attn, width, 1)])
        self.pos, self.last = torch.cat([self.pos, other.pos]), torch.cat([self.last, other.last])
        self.rows += other.rows


class DecodeEngine:
    def __init__(self, model, eos_token_id: int, max_rows: int = 256, tokenizer=None, fast_decode: bool = True):
        self.model, self.eos, self.max_rows, self.tokenizer = model, eos_token_id, max_rows, tokenizer
        self.stats = EngineStats()
        # a lean decode step (rollout/kv.py) where the architecture has one; transformers' own forward otherwise
        self.fast_step = decode_step_for(model) if fast_decode else None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def load_weights(self, tensors) -> int:
        """TEMP stub (the engine branch brings the real one): copy tensors into the engine model by its own
        state_dict names, refresh the lean decode step; returns the bytes copied."""
        own = self.model.state_dict()
        items = tensors.items() if hasattr(tensors, "items") else tensors
        n = 0
        for name, t in items:
            if name not in own:
                raise KeyError(f"load_weights: the engine model has no tensor {name!r}")
            own[name].copy_(t)
            n += t.numel() * t.element_size()
        if self.fast_step is not None:
            self.fast_step.refresh()
        return n

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], k: int, params: SamplingParams, seed: int,
                 lengths=None) -> Iterator[Sample]:
        """Yield every (prompt, sample) pair once, as it finishes. prompts: token ids, BOS included.
        lengths(prompt_id, sample_index) -> int, if given, overrides max_new_tokens per sample (benchmarks use it to
        set the length distribution)."""
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer")
        self.stats = EngineStats()
        if self.fast_step is not None:
            self.fast_step.refresh()
        self.live_rows = 0
        self._prompts, self._lengths = prompts, lengths
        gen = torch.Generator(device=self.device).manual_seed(seed)
        queue = list(range(len(prompts)))
        live: _Live | None = None
        was_training = self.model.training
        self.model.eval()
        try:
            while queue or live is not None:
                room = self.max_rows - (len(live) if live is not None else 0)
                if queue and room >= k:  # admit waiting prompts: one prefill each, k rows each
                    admit, queue = queue[: max(1, room // k)], queue[max(1, room // k):]
                    new, logits = self._prefill(prompts, admit, k, params.max_new_tokens)
                    yield from self._sample_and_retire(new, logits, params, gen)
                    if live is None:
                        live = new
                    else:
                        live.merge(new)
                else:
                    logits = self._decode_step(live)
                    yield from self._sample_and_retire(live, logits, params, gen)
                if live is not None and not len(live):
                    live = None
                self.live_rows = len(live) if live is not None else 0
        finally:
            self.model.train(was_training)

    def _prefill(self, prompts: list[list[int]], admit: list[int], k: int, spare: int) -> tuple[_Live, Tensor]:
        """One forward per prompt length (no padding inside a prefill), then k rows per prompt."""
        by_len: dict[int, list[int]] = defaultdict(list)
        for pid in admit:
            by_len[len(prompts[pid])].append(pid)
        batch, last_logits = None, []
        for length, pids in sorted(by_len.items()):
            ids = torch.tensor([prompts[p] for p in pids], device=self.device)
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
            self.stats.prefill_tokens += ids.numel()
            part = _Live(HFCacheKV(out.past_key_values), torch.ones_like(ids, dtype=torch.bool), torch.full((len(pids),), length, device=self.device),
                         ids[:, -1], [{"pid": p} for p in pids])
            last_logits.append(out.logits[:, -1].float())
            if batch is None:
                batch = part
            else:
                batch.merge(part)
        logits = torch.cat(last_logits)
        # k samples share their prompt's prefill: repeat the KV rows, never re-run the prompt
        if self.fast_step is not None:  # into one buffer with room for the new tokens
            batch.kv = BufferKV.from_cache(batch.kv.cache, k, spare, self.fast_step)
        else:
            batch.kv.cache.batch_repeat_interleave(k)
        rep = lambda t: t.repeat_interleave(k, dim=0)
        batch.attn, batch.pos, batch.last, logits = rep(batch.attn), rep(batch.pos), rep(batch.last), rep(logits)
        batch.rows = [{"pid": r["pid"], "j": j, "tokens": [], "logprobs": []} for r in batch.rows for j in range(k)]
        return batch, logits

    def _decode_step(self, live: _Live) -> Tensor:
        attn = torch.cat([live.attn, torch.ones_like(live.attn[:, :1])], dim=1)
        logits = live.kv.decode(self.model, live.last, live.pos, attn)
        live.attn = attn
        live.pos = live.pos + 1
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(live)
        self.stats.rows_per_step.append(len(live))
        self.stats.max_live_rows = max(self.stats.max_live_rows, len(live))
        return logits.float()

    def _sample_and_retire(self, live: _Live, logits: Tensor, params: SamplingParams, gen):
        scaled = logits / params.temperature
        logp = torch.log_softmax(scaled, dim=-1)
        probs = torch.softmax(filter_logits(scaled, params.top_k, params.top_p), dim=-1)
        tokens = sample_tokens(probs, gen)
        token_logp = logp.gather(1, tokens[:, None]).squeeze(1)
        live.last = tokens
        # note: one device-to-host sync per step, to decide which rows retire (token ids < 2**24 are exact in float32)
        tok_list, lp_list = torch.stack([tokens.to(token_logp.dtype), token_logp]).tolist()
        keep, done = [], []
        for i, row in enumerate(live.rows):
            row["tokens"].append(int(tok_list[i]))
            row["logprobs"].append(lp_list[i])
            limit = self._lengths(row["pid"], row["j"]) if self._lengths else params.max_new_tokens
            reason = self._finish_reason(row["tokens"], params, limit)
            (done if reason else keep).append((i, reason))
        for i, reason in done:
            row = live.rows[i]
            yield Sample(row["pid"], row["j"], list(self._prompts[row["pid"]]), row["tokens"], torch.tensor(row["logprobs"]), reason)
        if done:
            live.select([i for i, _ in keep])

    def _finish_reason(self, tokens: list[int], params: SamplingParams, limit: int) -> str | None:
        if tokens[-1] == self.eos:
            return "eos"
        if params.stop_strings:
            tail = self.tokenizer.decode(tokens[-8:])
            if any(s in tail for s in params.stop_strings):
                return "stop"
        if len(tokens) >= limit:
            return "length"
        return None
