"""Decode engine: prompts, k, sampling settings -> an iterator of finished samples, in the order they finish.

Over any transformers causal LM with a KV cache (our own loop; see docs/benchmarks/rollout.md for why not `generate_batch`):
- each prompt is prefilled once and its KV cache repeated for its k samples, which then sample independently;
- a row leaves the decode batch (with its KV rows) as soon as it hits EOS, a stop string or the length limit, and
  the left padding no live row needs any more is cut off the cache;
- continuous batching: prompts wait in a queue and are prefilled when the live batch has room (`max_rows`);
- sampling (temperature, top-k, top-p) draws each row's token with a uniform from that sample's own counter-based
  stream (rollout/streams.py), a function of (seed, prompt id, sample index, tokens drawn so far): the samples depend
  only on the seed, the prompts and the model, never on max_rows, admission order, what the caller does between
  samples (e.g. scoring them), or which engine decodes a row;
- kept KV (keep_finished_kv, for episodes): a finished row's cache stays, and the same row coming back longer (its
  next turn: the tool's answer appended) prefills only the new tokens on top of it, not the whole conversation;
- state: while the iterator is suspended, export_state() hands out the unfinished rows and waiting prompts as plain
  data (rollout/state.py) and ends it; resume(state) on any engine with the same weights continues them to the same
  samples. Weights arrive by an explicit copy, load_weights (rollout/weights.py), unless the engine decodes the
  trainer's own model (decode_context given: a shared base, see runtime/local.py decode_engine), which needs none.
  An engine whose copy lives only from one load to the end of its rollout (release_weights: full fine-tuning's bf16
  copy, rollout.generator_dtype) frees the copy's storage until the next load_weights allocates it again.
The log-probs recorded are those of the sampled tokens under softmax(logits / temperature), the distribution the
RL losses optimise; they equal a full forward pass over the finished sequence (tested to 1e-4 in fp32).
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor

from rlfuse.errors import UserError
from rlfuse.models.hf_cache import cache_of, with_cache
from rlfuse.models.load import first_nonfinite_weight
from rlfuse.rollout.generator import ENGINES
from rlfuse.rollout.kv import BufferKV, HFCacheKV, decode_step_for, dynamic_cache, left_pad
from rlfuse.rollout.state import EngineState, RowState, Sample, SamplingParams, WaitingPrompt
from rlfuse.rollout.streams import stream_keys, stream_uniforms
from rlfuse.rollout.weights import NamedTensors, copy_weights, weight_buckets  # noqa: F401  (weight_buckets: re-export)


@dataclass
class EngineStats:
    """What the engine did: for tests and metrics (rows really leave the batch; prompts prefilled once)."""
    decode_steps: int = 0
    decode_rows: int = 0
    """Sum over decode forwards of the rows in the batch (the compute actually spent)."""
    prefill_tokens: int = 0
    max_live_rows: int = 0
    rows_per_step: list[int] = field(default_factory=list)

    def __add__(self, other: "EngineStats") -> "EngineStats":
        """Two calls' counts as one (an episode rollout restarts the engine while answers are awaited)."""
        return EngineStats(self.decode_steps + other.decode_steps, self.decode_rows + other.decode_rows,
                           self.prefill_tokens + other.prefill_tokens, max(self.max_live_rows, other.max_live_rows),
                           self.rows_per_step + other.rows_per_step)


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


def check_sampling(params: SamplingParams) -> None:
    """A UserError for sampling settings no draw can use: a temperature that is not a finite number > 0 (NaN passes
    every comparison; inf flattens the distribution to noise), top_p outside (0, 1], top_k < 0, max_new_tokens < 1."""
    t, p = params.temperature, params.top_p
    if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
        raise UserError(f"sampling: temperature must be a finite number > 0, got {t}; e.g. temperature 0.7 (1.0 "
                        "samples the model as it is)")
    if not (isinstance(p, (int, float)) and 0 < p <= 1):
        raise UserError(f"sampling: top_p must be in (0, 1], got {p}; 1.0 disables nucleus sampling")
    if params.top_k < 0 or params.max_new_tokens < 1:
        raise UserError(f"sampling: top_k must be >= 0 (0 disables) and max_new_tokens >= 1, got top_k "
                        f"{params.top_k}, max_new_tokens {params.max_new_tokens}")


def checked_prompt_ids(prompts: list[list[int]], prompt_ids: list[int] | None) -> list[int]:
    """The prompts' global ids (default 0..len-1), after checking there is one per prompt and no prompt is empty."""
    prompt_ids = list(range(len(prompts))) if prompt_ids is None else list(prompt_ids)
    if len(prompt_ids) != len(prompts):
        raise ValueError(f"prompt_ids has {len(prompt_ids)} ids for {len(prompts)} prompts")
    if empty := [pid for pid, p in zip(prompt_ids, prompts) if len(p) == 0]:
        raise ValueError(f"prompt {empty[0]} has no tokens: a sample continues a prompt of at least one (BOS)")
    return prompt_ids


def sample_tokens(probs: Tensor, u: Tensor) -> Tensor:
    """One token per row by inverse-CDF sampling with the row's uniform u (rollout/streams.py): torch.multinomial on
    the CPU spent 0.44 ms per call on 16 x 1023 probabilities, a tenth of a decode step (bench/decode_step.py).
    Tokens with zero probability are never drawn: their CDF step is empty, and u * total < total (u has 24 bits, at
    most 1 - 2**-24, so in float32 the product rounds below the total). probs: (R, V) float32, u: (R,) -> (R,)."""
    cum = probs.cumsum(-1)
    return torch.searchsorted(cum, u[:, None] * cum[:, -1:], right=True).squeeze(1)


class _Live:
    """The live decode batch: KV store left-padded to a common width, its (rows, width) bool mask (True = attend),
    each row's position, last token, stream key and stream position (tokens drawn), plus per-row bookkeeping."""

    def __init__(self, kv: HFCacheKV | BufferKV, attn: Tensor, pos: Tensor, last: Tensor, keys: Tensor, drawn: Tensor,
                 rows: list[dict]):
        self.kv, self.attn, self.pos, self.last, self.keys, self.drawn, self.rows = kv, attn, pos, last, keys, drawn, rows

    def __len__(self):
        return len(self.rows)

    def select(self, keep: list[int]) -> None:
        idx = torch.tensor(keep, dtype=torch.long, device=self.attn.device)
        self.kv.keep_rows(idx)
        self.attn, self.pos, self.last = self.attn[idx], self.pos[idx], self.last[idx]
        self.keys, self.drawn = self.keys[idx], self.drawn[idx]
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
        self.keys, self.drawn = torch.cat([self.keys, other.keys]), torch.cat([self.drawn, other.drawn])
        self.rows += other.rows


@dataclass
class _Entry:
    """A queue entry: a sequence to prefill and the rows that continue from it (k fresh samples of a waiting prompt,
    or one imported row whose sequence is prompt + tokens so far)."""
    ids: list[int]
    rows: list[dict]


@dataclass
class _Run:
    """One generate()/resume() call's progress, readable by export_state while the iterator is suspended."""
    seed: int
    params: SamplingParams
    queue: deque
    live: _Live | None = None
    outbox: deque = field(default_factory=deque)
    """Finished samples of the current step not yet handed out."""
    iterator: Iterator[Sample] | None = None


def _row(pid: int, j: int, prompt: list[int], limit: int, tokens=(), logprobs=(), stop_from: int = 0) -> dict:
    return {"pid": pid, "j": j, "prompt": prompt, "limit": limit, "tokens": list(tokens), "logprobs": list(logprobs),
            "start": stop_from}


def _queue_of(state: EngineState) -> list[_Entry]:
    """An exported state's rows (to re-prefill: prompt + tokens so far) and waiting prompts as queue entries."""
    queue = [_Entry(r.prompt_ids + r.token_ids, [_row(r.prompt_id, r.sample_index, list(r.prompt_ids), r.limit,
                                                     r.token_ids, r.logprobs, r.stop_from)]) for r in state.rows]
    return queue + [_Entry(list(w.prompt_ids), [_row(w.prompt_id, j, list(w.prompt_ids), w.limits[j])
                                                for j in range(w.k)]) for w in state.waiting]


class DecodeEngine:
    """rlfuse's own engine (rollout/generator.py: the "rlfuse" row of ENGINES). decode_context: None for the engine's own model (put in eval mode for the whole generate() call); or a
    function giving the context every forward of `model` runs in, when the model is also trained and scored between
    the iterator's yields (a shared base: the actor's adapter active, eval mode for that forward only, see
    models/shared.py actor_decoding). Such an engine shares the trainer's weights: there is nothing to load.
    transient_weights: the model is a copy made at every load_weights and needed only until the rollout ends, whose
    caller then calls release_weights (full fine-tuning's bf16 copy: its bytes are not held through the update)."""
    capabilities = ENGINES["rlfuse"]
    name = "rlfuse"

    def __init__(self, model, eos_token_id: int, max_rows: int = 256, tokenizer=None, fast_decode: bool = True,
                 decode_context=None, transient_weights: bool = False):
        self.model, self.eos, self.max_rows, self.tokenizer = model, eos_token_id, max_rows, tokenizer
        self.decode_context = decode_context
        if transient_weights and decode_context is not None:
            raise ValueError("transient_weights: the engine decodes the trainer's own model, whose weights it may "
                             "not release")
        self.transient_weights = transient_weights
        self._released: list[tuple[torch.nn.Parameter, torch.Size, tuple[int, ...]]] | None = None
        self._forward = decode_context or contextlib.nullcontext
        self.stats = EngineStats()
        self.live_rows = 0
        self._run: _Run | None = None
        self._keep_kv = False
        self._kept: dict[tuple[int, int], tuple[list[int], Tensor]] = {}
        """(prompt id, sample index) -> the token ids a finished row's cache holds, and that cache (BufferKV.row)."""
        # a lean decode step (rollout/kv.py) where the architecture has one; transformers' own forward otherwise
        self.fast_step = decode_step_for(model) if fast_decode else None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the engine's model decodes in (rollout.generator_dtype)."""
        return next(self.model.parameters()).dtype

    @property
    def shares_weights(self) -> bool:
        """Whether the engine decodes the trainer's own model (decode_context given): no weight sync is needed."""
        return self.decode_context is not None

    def load_weights(self, tensors: NamedTensors) -> int:
        """Copy named tensors (the names of the engine model's own state_dict; a whole state dict or one bucket of
        it, see weight_buckets) into the engine's model in place. Returns bytes written. ValueError on an unknown name
        or a shape mismatch, before anything is copied."""
        if self.shares_weights:  # copying merged weights into the trainer's own base would corrupt what it trains
            raise RuntimeError("load_weights: this engine decodes the trainer's own model (the actor, or a shared "
                               "base): it has no weights of its own to load")
        if self._released is not None:  # storage again, in the layout it had (rollout.weight_layout)
            tensors = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
            own = self.model.state_dict(keep_vars=True)
            loaded = {id(own[name]) for name, _ in tensors if name in own}
            missing = [name for name, t in own.items() if isinstance(t, torch.nn.Parameter) and id(t) not in loaded]
            if missing:
                raise ValueError(f"load_weights: the engine's weights were released, so every one must be loaded; "
                                 f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''}")
            with torch.no_grad():
                for p, shape, stride in self._released:
                    p.data = torch.empty_strided(shape, stride, dtype=p.dtype, device=p.device)
            self._released = None
        written = copy_weights(self.model, tensors)
        self._kept.clear()  # the old weights' keys and values
        if self.fast_step is not None:
            self.fast_step.refresh()
            # packs of the old weights go: a live call (a partial rollout) decodes on from new ones
            self.fast_step.pack() if self._run is not None else self.fast_step.release()
        return written

    def release_weights(self) -> int:
        """Free the model's parameter storage until the next load_weights (which must load every tensor: the freed
        ones hold nothing); generating before it is an error. Only for transient_weights. Returns bytes freed."""
        if not self.transient_weights:
            raise RuntimeError("release_weights: this engine's weights are not transient (its model is no copy made "
                               "at every load)")
        if self._released is not None:
            return 0
        freed, self._released = 0, []
        self._kept.clear()
        if self.fast_step is not None:
            self.fast_step.release()
        with torch.no_grad():
            for p in self.model.parameters():  # tied weights are one parameter, listed once
                freed += p.numel() * p.element_size()
                self._released.append((p, p.shape, p.stride()))
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        return freed

    def keep_finished_kv(self, on: bool) -> None:
        """While on, a row that finishes keeps its KV cache here, and when that row comes back as the same tokens and
        more (extend or resume: an episode's next turn, the tool's answer appended) only the new tokens are
        prefilled. The caller drops a row's cache when it will not come back (drop_kv); switching off drops all, as
        does load_weights (they are the old weights'). The samples are the same either way, to float rounding."""
        self._keep_kv = on
        self._kept.clear()

    def drop_kv(self, prompt_id: int, sample_index: int) -> None:
        """Forget a finished row's kept cache (its episode ended)."""
        self._kept.pop((prompt_id, sample_index), None)

    @property
    def released(self) -> bool:
        """Whether release_weights freed the weights and no load_weights has brought them back."""
        return self._released is not None

    def generate(self, prompts: list[list[int]], k: int, params: SamplingParams, seed: int, lengths=None,
                 prompt_ids: list[int] | None = None) -> Iterator[Sample]:
        """Yield every (prompt, sample) pair once, as it finishes. prompts: token ids, BOS included.
        prompt_ids: the prompts' global ids (default 0..len-1): Sample.prompt_id, the key of their random streams, and
        the first argument of lengths. A prompt's samples are the same whichever engine, batch or max_rows decodes it.
        lengths(prompt_id, sample_index) -> int, if given, overrides max_new_tokens per sample (benchmarks use it to
        set the length distribution)."""
        prompt_ids = checked_prompt_ids(prompts, prompt_ids)
        self.keep_finished_kv(False)  # a new rollout: no row comes back from an earlier one
        limit = lengths or (lambda pid, j: params.max_new_tokens)
        queue = [_Entry(list(p), [_row(pid, j, list(p), limit(pid, j)) for j in range(k)])
                 for pid, p in zip(prompt_ids, prompts)]
        return self._start(queue, params, seed)

    def resume(self, state: EngineState) -> Iterator[Sample]:
        """Continue an exported state (from this or another engine, whole, split or combined): first the samples it
        had finished, then its rows (re-prefilled: prompt + tokens so far, no repeat) and waiting prompts, decoded as
        generate() would have. Seed and sampling params come from the state: the rows' streams are keyed by them."""
        return self._start(_queue_of(state), state.params, state.seed, finished=state.finished)

    def extend(self, state: EngineState) -> None:
        """Add an exported state to the suspended generate()/resume() iterator of this engine: its finished samples
        come out next, its rows and waiting prompts join the queue and are admitted (re-prefilled) as rows free up,
        while this engine's own live rows keep their KV cache. The samples are those resume() would give (each
        row's stream is keyed by seed, prompt id and sample index); seed and sampling params must match."""
        run = self._run
        if run is None or run.iterator is None:
            raise RuntimeError("extend: no generate() or resume() iterator is suspended on this engine; use resume()")
        if (state.seed, state.params) != (run.seed, run.params):
            raise ValueError("extend: the state was sampled with another seed or sampling params than this run")
        run.queue.extend(_queue_of(state))
        run.outbox.extend(state.finished)

    def export_state(self) -> EngineState:
        """Everything the suspended generate()/resume() iterator has not finished, as plain data; that iterator ends
        here (it yields nothing more), so no sample is produced twice. Call between two of its yields."""
        run = self._run
        if run is None or run.iterator is None:
            raise RuntimeError("export_state: no generate() or resume() iterator is suspended on this engine")
        rows = [] if run.live is None else [
            RowState(r["pid"], r["j"], r["prompt"], r["tokens"], r["logprobs"], r["limit"], r["start"])
            for r in run.live.rows]
        for e in run.queue:
            if e.rows[0]["tokens"]:  # an imported row not yet re-prefilled
                r = e.rows[0]
                rows.append(RowState(r["pid"], r["j"], r["prompt"], r["tokens"], r["logprobs"], r["limit"], r["start"]))
        waiting = [WaitingPrompt(e.rows[0]["pid"], e.ids, len(e.rows), [r["limit"] for r in e.rows])
                   for e in run.queue if not e.rows[0]["tokens"]]
        state = EngineState(run.seed, run.params, rows, waiting, list(run.outbox))
        run.iterator.close()  # runs its `finally`: the model's train/eval mode is restored now
        self._run, self.live_rows = None, 0
        return state

    def _start(self, queue: list[_Entry], params: SamplingParams, seed: int, finished=()) -> Iterator[Sample]:
        check_sampling(params)
        if self._released is not None:
            raise RuntimeError("the engine's weights were released after its last rollout (transient_weights): "
                               "load_weights (sync_weights) before generating")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer")
        self.stats = EngineStats()
        if self.fast_step is not None:
            self.fast_step.refresh()
            self.fast_step.pack()  # once per call, not at each load_weights too: a pass over every weight
        run = _Run(seed, params, deque(queue), outbox=deque(finished))
        run.iterator = self._loop(run)
        self._run = run
        return run.iterator

    @torch.no_grad()
    def _loop(self, run: _Run) -> Iterator[Sample]:
        was_training = self.model.training
        if self.decode_context is None:  # our own model: eval for the whole call; a shared one per forward instead
            self.model.eval()
        try:
            while run.outbox:
                yield run.outbox.popleft()
            while run.queue or run.live is not None:
                live = run.live
                room = self.max_rows - (len(live) if live is not None else 0)
                admit = self._take(run.queue, room, force=live is None)
                if admit:  # one prefill per sequence length; a waiting prompt's k rows share one
                    new, logits = self._prefill(admit, run.params.max_new_tokens, run.seed)
                    self._sample_and_retire(new, logits, run)
                    if len(new):
                        if live is None:
                            run.live = new
                        else:
                            live.merge(new)
                else:
                    logits = self._decode_step(live)
                    self._sample_and_retire(live, logits, run)
                if run.live is not None and not len(run.live):
                    run.live = None
                self.live_rows = len(run.live) if run.live is not None else 0
                # every row is in run.live or run.queue here, so export_state between these yields misses none
                while run.outbox:
                    yield run.outbox.popleft()
        finally:
            if self.decode_context is None:
                self.model.train(was_training)
            if self.fast_step is not None:
                self.fast_step.release()  # its packed weights, if any: the next generate call packs them again
            if self._run is run:
                self._run = None

    @staticmethod
    def _take(queue: deque, room: int, force: bool) -> list[_Entry]:
        """Queue entries whose rows fit in `room` (the first one anyway when nothing is live)."""
        admit = []
        while queue and (len(queue[0].rows) <= room or (force and not admit)):
            room -= len(queue[0].rows)
            admit.append(queue.popleft())
        return admit

    def _prefill(self, entries: list[_Entry], spare: int, seed: int) -> tuple[_Live, Tensor]:
        """One forward per sequence length (no padding inside a prefill), then each entry's KV repeated for its rows
        (a waiting prompt's k samples share their prompt's prefill, never re-run it). -> the new rows, their logits."""
        by_len: dict[int, list[_Entry]] = defaultdict(list)
        continued: dict[int, list[tuple[_Entry, Tensor]]] = defaultdict(list)  # by the number of new tokens
        for e in entries:
            kept = self._kept_cache_of(e)
            if kept is None:
                by_len[len(e.ids)].append(e)
            else:
                continued[len(e.ids) - kept.shape[4]].append((e, kept))
        kv, attn, last, logits, order = None, [], [], [], []
        passes = [(group, None) for _, group in sorted(by_len.items())]
        passes += [([e for e, _ in group], [c for _, c in group]) for _, group in sorted(continued.items())]
        for group, kept in passes:
            if kept is None:  # whole sequences of one length
                ids = torch.tensor([e.ids for e in group], device=self.device)
                mask, extra = torch.ones_like(ids, dtype=torch.bool), {}
            else:  # the new tokens of each row over its kept cache, left-padded to the longest
                ids, mask, extra = self._over_kept(group, kept)
            with self._forward():
                out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **extra)
            self.stats.prefill_tokens += ids.numel()
            part = HFCacheKV(cache_of(out))
            if kv is None:
                kv = part
            else:
                kv.merge(part)
            attn.append(mask)
            last.append(ids[:, -1])
            logits.append(out.logits[:, -1].float())
            order += group
        reps = torch.tensor([len(e.rows) for e in order], device=self.device)
        if self.fast_step is not None:  # into one buffer with room for the new tokens
            kv = BufferKV.from_cache(kv.cache, reps, spare, self.fast_step)
        else:
            kv.repeat_rows(reps)
        rep = lambda t: t.repeat_interleave(reps, dim=0)
        attn = rep(torch.cat([left_pad(a, kv.width, 1) for a in attn]))
        rows = [r for e in order for r in e.rows]
        # each row's stream: keyed by (seed, prompt id, sample index), at position = tokens it has drawn so far
        as_tensor = lambda key: torch.tensor([key(r) for r in rows], device=self.device)
        keys = stream_keys(seed, as_tensor(lambda r: r["pid"]), as_tensor(lambda r: r["j"]))
        live = _Live(kv, attn, attn.sum(1), rep(torch.cat(last)), keys, as_tensor(lambda r: len(r["tokens"])), rows)
        return live, rep(torch.cat(logits))

    def _over_kept(self, group: list[_Entry], kept: list[Tensor]) -> tuple[Tensor, Tensor, dict]:
        """One forward's inputs for rows that continue their kept caches by as many new tokens each: the new token
        ids, the (rows, width + new) mask of the caches left-padded to the widest, and the forward's keywords (that
        mask, each row's own positions, the padded caches)."""
        held = [c.shape[4] for c in kept]
        width = max(held)
        L, two, _, H, _, D = kept[0].shape
        # zeros, not empty: a masked column still meets the attention's values (0 * NaN = NaN)
        past = kept[0].new_zeros(L, two, len(kept), H, width, D)
        for i, c in enumerate(kept):
            past[:, :, i, :, width - held[i]:] = c[:, :, 0]
        ids = torch.tensor([e.ids[n:] for e, n in zip(group, held)], device=self.device)
        new = ids.shape[1]
        mask = torch.ones((len(group), width + new), dtype=torch.bool, device=self.device)
        for i, n in enumerate(held):
            mask[i, : width - n] = False
        positions = torch.tensor(held, device=self.device)[:, None] + torch.arange(new, device=self.device)
        return ids, mask, {"attention_mask": mask.long(), "position_ids": positions, **with_cache(dynamic_cache(past))}

    def _kept_cache_of(self, e: _Entry) -> Tensor | None:
        """The kept cache an imported row continues (taken out of the store), or None: none kept, or its tokens are
        not the start of the row's (then the whole sequence is prefilled, as for any row)."""
        if len(e.rows) != 1 or not self._kept:
            return None
        row = e.rows[0]
        held, kv = self._kept.pop((row["pid"], row["j"]), (None, None))
        if held is None or len(held) >= len(e.ids) or e.ids[: len(held)] != held:
            return None
        return kv

    def _decode_step(self, live: _Live) -> Tensor:
        attn = torch.cat([live.attn, torch.ones_like(live.attn[:, :1])], dim=1)
        with self._forward():
            logits = live.kv.decode(self.model, live.last, live.pos, attn)
        live.attn = attn
        live.pos = live.pos + 1
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(live)
        self.stats.rows_per_step.append(len(live))
        self.stats.max_live_rows = max(self.stats.max_live_rows, len(live))
        return logits.float()

    def _sample_and_retire(self, live: _Live, logits: Tensor, run: _Run) -> None:
        """Draw each row's next token from its own stream; finished rows leave `live` for run.outbox."""
        params = run.params
        scaled = logits / params.temperature if params.temperature != 1.0 else logits
        probs = torch.softmax(filter_logits(scaled, params.top_k, params.top_p), dim=-1)
        tokens = sample_tokens(probs, stream_uniforms(live.keys, live.drawn))
        # a row of NaN logits (NaN/inf weights, an overflow) draws the id one past the vocabulary: gathered in range
        # here, and said below once the ids are on the host, rather than an index error in the next forward
        vocab = probs.shape[-1]
        in_range = tokens.clamp(max=vocab - 1)
        # the drawn token's log-prob, not all (rows, vocabulary) of log_softmax's: 0.5 against 1.1 ms at 16 x 49152
        token_logp = scaled.gather(1, in_range[:, None]).squeeze(1) - torch.logsumexp(scaled, dim=-1)
        live.last, live.drawn = in_range, live.drawn + 1
        # note: one device-to-host sync per step, to decide which rows retire (token ids < 2**24 are exact in float32)
        tok_list, lp_list = torch.stack([tokens.to(token_logp.dtype), token_logp]).tolist()
        if max(tok_list, default=0) >= vocab or any(lp != lp for lp in lp_list):  # lp != lp: a NaN log-prob
            self._refuse_nonfinite(live, tok_list, lp_list, vocab)
        keep = []
        for i, row in enumerate(live.rows):
            row["tokens"].append(int(tok_list[i]))
            row["logprobs"].append(lp_list[i])
            reason = self._finish_reason(row["tokens"], params, row["limit"], row["start"])
            if reason and self._keep_kv:
                self._keep_row_kv(live, i, row)
            if reason:
                run.outbox.append(Sample(row["pid"], row["j"], list(row["prompt"]), row["tokens"],
                                         torch.tensor(row["logprobs"]), reason))
            else:
                keep.append(i)
        if len(keep) < len(live):
            live.select(keep)

    def _keep_row_kv(self, live: _Live, i: int, row: dict) -> None:
        """Keep a finishing row's cache: its prompt and tokens but the last, which no forward has read yet."""
        held = row["prompt"] + row["tokens"][:-1]
        kv = live.kv.row(i, len(held))
        if kv is not None:
            self._kept[(row["pid"], row["j"])] = (held, kv)

    def _refuse_nonfinite(self, live: _Live, tok_list: list, lp_list: list, vocab: int) -> None:
        """The one line for a step whose logits are not finite: which weight holds NaN/inf, or that the weights are
        finite and the forward overflowed."""
        i = next(i for i, (t, lp) in enumerate(zip(tok_list, lp_list)) if t >= vocab or lp != lp)
        row = live.rows[i]
        bad = first_nonfinite_weight(self.model)
        where = (f"the model's logits are not finite at step {len(row['tokens']) + 1} of sample {row['j']} of prompt "
                 f"{row['pid']}")
        if bad is not None:
            raise UserError(f"{where}: its weights hold NaN/inf (first: {bad}); load a model folder whose weights "
                            "are finite (a diverged training run: lower the learning rate and train again)")
        raise UserError(f"{where}, though its weights are finite ({self.dtype}): the forward overflowed; decode in "
                        "float32 (rollout.generator_dtype=fp32, run.precision=fp32), or check the prompt")

    def _finish_reason(self, tokens: list[int], params: SamplingParams, limit: int, start: int = 0) -> str | None:
        if tokens[-1] == self.eos or tokens[-1] in params.stop_token_ids:
            return "eos"
        if params.stop_strings:
            tail = self.tokenizer.decode(tokens[max(start, len(tokens) - 8):])
            if any(s in tail for s in params.stop_strings):
                return "stop"
        if len(tokens) >= limit:
            return "length"
        return None
