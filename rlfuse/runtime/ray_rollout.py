"""Rollout on several generation workers (Ray actors), with RLHFuse's tail migration.

Each `GenerationWorker` is one process with its own generator (a DecodeEngine) and a Scorer (reference, reward,
critic). The driver (`MultiWorkerRollout`) deals the iteration's prompts by global prompt id, so a sample is the same
whichever worker decodes it (per-sample random streams, rollout/streams.py). Workers decode in chunks. Without
migration each scores its own finished samples as it goes (fusion, as generate_rollouts does in one process). With
migration, decoding workers only decode and send finished samples back unscored; when rollout/migration.py says so,
the exporting workers hand their unfinished rows over (DecodeEngine.export_state), the keepers continue them (resume:
re-prefill of prompt + tokens so far), and every idle worker (the freed ones, later any done decoding) scores the
waiting samples. The result is the Experience generate_rollouts returns, with the same samples and scores.

Every decision is taken from counts, never from timing: a chunk ends after a number of finished samples, the
migration happens once every decoding worker has reached the pause point it was given (migration.pause_points), and
each waiting chunk is cut into one share per scorer by count (fusion.scoring_shares), each share scored as one
batch by whichever scorer is idle. So whichever worker replies first, each sample is scored in the same
batch and the migrated rows are the same: two runs with the same seed and placement give bit-identical weights.

Every worker computes as the single process does: its generator in rollout.generator_dtype (a bf16 copy where the
single process decodes one), its scoring passes under run.precision's autocast (RolloutSettings, from the config
plan/resolve.py resolved before the run); GenerationWorker.arithmetic tells the driver which.

Nothing here is imported by the single-process path; ray is imported inside the functions that need it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import ray
import torch

from rlfuse.config import RunConfig
from rlfuse.data.chat import set_chat_template
from rlfuse.metrics.tracker import peak_rss_mb
from rlfuse.models.build import frozen, load_policy, reward_function, stage_folders, value_model, with_dtype
from rlfuse.models.device import autocast_dtype, decode_dtype, dtype_name, pick_device
from rlfuse.models.load import apply_lora, load_tokenizer
from rlfuse.models.rewards import metrics_of_sums, take_reward_sums
from rlfuse.models.weights import merged_weights
from rlfuse.plan.resolve import decoded_in, engine_choice, rl_autocasts
from rlfuse.plan.roles import derive_roles
from rlfuse.plan.strategies import spec_from_config
from rlfuse.rollout.engine import DecodeEngine, Sample, SamplingParams
from rlfuse.rollout.episodes import EpisodeGenerator, Episodes
from rlfuse.rollout.fusion import (ENGINE_COUNTS, Experience, FusionPolicy, ScoringLoop, build_experience,
                                   scoring_shares)
from rlfuse.rollout.generator import generate_from_rows
from rlfuse.rollout.migration import pause_points, plan_migration
from rlfuse.rollout.score import ScoredSample, Scorer
from rlfuse.rollout.state import EngineState, RolloutRequest
from rlfuse.rollout.vllm_engine import VllmEngine
from rlfuse.rollout.weights import copy_weights, weight_buckets
from rlfuse.runtime import process
from rlfuse.runtime.process import pin_threads
from rlfuse.runtime.ray_common import put_tensors, start_actors, tensors_of

# ------------------------------------------------------------------------------------------- what a worker holds


@dataclass(frozen=True)
class WorkerModels:
    """Where a generation worker loads its roles from: folders and names only, so the spec crosses processes.
    A worker that only decodes has reference = reward = critic = None; one that only scores has generator = None."""
    generator: str | None
    """Causal LM folder of the policy (an SFT stage's model/); its weights are then synced with load_weights."""
    reference: str | None
    """Causal LM folder of the reference policy (with LoRA: the SFT model, i.e. the actor with adapters off)."""
    reward: str | None
    """Reward-model folder, or "function:module:name" for a Python reward function of texts."""
    critic: str | None = None
    """Folder the critic starts from (None: no critic); its weights are then synced with load_weights("critic")."""
    critic_source: str = "rm"
    """rm: the reward model's body and scalar head; sft or actor: a causal LM's body with a zero head."""
    adapter: object = None
    """The actor's LoRA settings (its config.ModelConfig) where the weight sync sends only the adapters
    (rollout.weight_sync): a decoding worker holds the SFT model with that adapter beside its generator, loads what
    it is sent into the adapter and merges it into the generator itself. None: merged weights are sent."""

    @classmethod
    def from_config(cls, cfg, run_dir: Path) -> "WorkerModels":
        """The folders build_models(cfg, run_dir) loads, for a generation worker. The critic's initial head is
        replaced by the first load_weights("critic", ...) from the trainer."""
        roles = derive_roles(cfg)
        sft, rm = stage_folders(cfg, run_dir, roles)
        critic_source = roles["critic"].source if "critic" in roles else "rm"
        critic = (rm if critic_source == "rm" else sft) if "critic" in roles else None
        reward = rm if roles["reward"].has_model else roles["reward"].source
        return cls(sft, sft, reward, critic, critic_source, cfg.model if cfg.rollout.syncs_adapters(cfg.model) else None)

    def holding(self, decodes: bool, scores: bool, reference: bool = False) -> "WorkerModels":
        """The folders of a worker that decodes and/or scores (reference, reward and critic values go together):
        a worker loads only the models it runs. reference: a decoding worker that also takes the reference's
        log-probs of its samples (RolloutSettings.reference_on_decoders)."""
        return dataclasses.replace(self, generator=self.generator if decodes else None,
                                   adapter=self.adapter if decodes else None,
                                   **({} if scores else {"reference": self.reference if reference else None,
                                                         "reward": None, "critic": None}))

    @property
    def decodes(self) -> bool:
        return self.generator is not None

    @property
    def scores(self) -> bool:
        return self.reward is not None


@dataclass(frozen=True)
class RolloutSettings:
    """The rollout section's knobs a worker and the driver need (rollout.* and rl.* fields)."""
    max_rows: int = 256
    micro_batch_size: int = 16
    temperature: float = 1.0
    unfinished_penalty: float = 0.0
    score_every: int = 16
    live_below: int = 8
    migrate_below: float = 0.2
    rows_per_worker: int = 16
    defer_scoring: bool = False
    """With migration: decoding workers never score (RLHFuse's order); default: they score their own until the
    migration, as without it."""
    eos_token_id: int | None = None
    """None: the tokenizer's EOS ends a row; -1: only the length limit does (benchmarks that set the lengths)."""
    device: str = "cpu"
    """run.device: auto (a GPU when the worker was given one), cpu or cuda."""
    reward_weights: tuple[float, ...] | None = None
    """rl.reward_weights: the weights of several reward functions."""
    share_prompt: bool = True
    """rl.share_prompt: a prompt's samples share its forward in the scoring passes (rlfuse/models/prefix.py)."""
    reference_on_decoders: bool = False
    """Asynchronous RL on the separated placement: the generation workers take the reference's log-probs of the
    samples they decode (Sample.ref_logprobs), in the time they would wait for the trainer, so the training workers'
    scoring leaves that pass out."""
    reward_rows: dict | None = None
    """Each prompt's data row by its token ids (rewards.attach_rows): the columns reward functions read."""
    precision: str = "fp32"
    """run.precision of the scoring passes (autocast_dtype with rl=True on the worker's device), as the training
    workers' Models.compute_dtype: fp32 where the RL stage does not autocast (plan/resolve.py rl_autocasts)."""
    engine: str = "rlfuse"
    """rollout.engine as plan/resolve.py engine_choice resolves it: the decoding workers' engine (rollout/generator.py);
    vllm: each builds vLLM on its generator folder (placement.strategy=separated: they do not train)."""
    vllm_kv_cache_gb: float = 1.0
    vllm_eager: bool = True
    max_model_len: int | None = None
    """vllm: prompt + response tokens a request may hold (the longest prompt + rl.max_new_tokens); None: the
    model's context."""
    episodes: object = None
    """Multi-turn episodes: the run's RLConfig (rl.tools, rl.environment and their limits, rollout/episodes.py
    Episodes.from_config), with the prompts' rows from reward_rows; None: single-turn samples."""
    chat_template: str | None = None
    """data.chat_template, which episodes render their answers with (the worker's tokenizer gets it)."""
    generator_dtype: str = "fp32"
    """The decoding worker's generator dtype (models/device.py decode_dtype): bf16 | fp32 as plan/resolve.py
    decoded_in gives rollout.generator_dtype, or auto where that waits for the worker's device (bf16 where native)."""

    @classmethod
    def from_config(cls, cfg, reward_rows: dict | None = None) -> "RolloutSettings":
        ro, rl = cfg.rollout, cfg.rl
        # unresolved auto (a GPU, a cluster's CPU): what it becomes on a device with native bf16, decided there
        decode = decoded_in(cfg, True) if ro.generator_dtype != "auto" or decoded_in(cfg, True) == "fp32" else "auto"
        return cls(ro.max_rows, ro.micro_batch_size, rl.temperature, rl.unfinished_penalty, ro.score_every,
                   ro.live_below, ro.migrate_below, ro.rows_per_worker, device=cfg.run.device,
                   reward_weights=tuple(rl.reward_weights) if rl.reward_weights else None, share_prompt=rl.share_prompt,
                   reference_on_decoders=rl.max_staleness > 0 and spec_from_config(cfg).strategy == "separated",
                   reward_rows=reward_rows, precision=cfg.run.precision if rl_autocasts(cfg) else "fp32",
                   engine=engine_choice(cfg, cfg.placement.gpus_per_worker > 0)[0],
                   vllm_kv_cache_gb=ro.vllm_kv_cache_gb,
                   vllm_eager=ro.vllm_eager if ro.vllm_eager is not None else cfg.placement.gpus_per_worker == 0,
                   episodes=rl if rl.tools or rl.environment else None, chat_template=cfg.data.chat_template,
                   generator_dtype=decode)


def build_worker_roles(models: WorkerModels, settings: RolloutSettings
                       ) -> tuple[DecodeEngine | None, Scorer | None, Scorer | None]:
    """A generator engine, a scorer and a decoding worker's reference pass (a Scorer used only for
    reference_logprobs) from folders, with models/build.py's loaders (frozen, eval); None for those the worker does
    not hold (WorkerModels.holding). The generator in settings.generator_dtype (a bf16 copy where the single process
    decodes one: loaded weights are rounded into it alike), the passes under settings.precision's autocast (the
    training workers' Models.compute_dtype)."""
    if not (models.decodes or models.scores):
        return None, None, None
    tok = load_tokenizer(models.generator or models.reference)

    device = pick_device(RunConfig(device=settings.device))  # Ray shows a worker only the GPUs it reserved
    compute = autocast_dtype(device, settings.precision, rl=True)
    eos = tok.eos_token_id if settings.eos_token_id is None else settings.eos_token_id
    engine = None
    if models.decodes and settings.engine == "vllm":
        # its threads are this worker's (pinned to its share), not every core vLLM would bind otherwise
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        engine = VllmEngine(models.generator, eos, decode_dtype(settings.generator_dtype, device), settings.max_rows,
                            settings.max_model_len, settings.vllm_kv_cache_gb, settings.vllm_eager)
    elif models.decodes:
        generator = with_dtype(frozen(load_policy(models.generator), device), decode_dtype(settings.generator_dtype,
                                                                                          device))
        engine = DecodeEngine(generator, eos, max_rows=settings.max_rows, tokenizer=tok)
    engine = with_episodes(engine, tok, settings)
    ref = frozen(load_policy(models.reference), device) if models.reference is not None else None
    if not models.scores:
        reference = None if ref is None else Scorer(None, tok.pad_token_id, ref=ref,
                                                    micro_batch_size=settings.micro_batch_size,
                                                    share_prompt=settings.share_prompt, compute_dtype=compute)
        return engine, None, reference
    reward_fn = reward_function(models.reward, tok, device, settings.reward_weights and list(settings.reward_weights))
    critic = None
    if models.critic is not None:
        critic = frozen(value_model(models.critic_source, models.critic, tok.pad_token_id), device)
    scorer = Scorer(reward_fn, tok.pad_token_id, ref=ref, critic=critic, temperature=settings.temperature,
                    micro_batch_size=settings.micro_batch_size, unfinished_penalty=settings.unfinished_penalty,
                    share_prompt=settings.share_prompt, compute_dtype=compute,
                    environment_weight=settings.episodes.environment_reward_weight if settings.episodes else 1.0)
    return engine, scorer, None


def with_episodes(engine, tokenizer, settings: RolloutSettings):
    """The worker's engine as an episode generator (rollout/episodes.py) where the run has tools or an environment;
    as it is otherwise (and where the worker does not decode)."""
    if engine is None or settings.episodes is None:
        return engine
    set_chat_template(tokenizer, settings.chat_template)
    episodes = Episodes.from_config(settings.episodes, tokenizer)
    episodes.rows = dict(settings.reward_rows or {})
    return EpisodeGenerator(engine, episodes)


def adapted_copy(models: WorkerModels, settings: RolloutSettings):
    """A decoding worker's SFT model with the actor's LoRA adapter (WorkerModels.adapter), frozen: the base the
    adapters it is sent are merged on. None where merged weights are sent."""
    if models.adapter is None or not models.decodes:
        return None
    device = pick_device(RunConfig(device=settings.device))
    return frozen(apply_lora(load_policy(models.generator), models.adapter), device)


# ------------------------------------------------------------------------------------------- the worker


@dataclass
class Chunk:
    """What one worker call returns to the driver (through Ray's object store)."""
    scored: list[ScoredSample] = field(default_factory=list)
    batches: list[int] = field(default_factory=list)
    """How many of `scored`, in order, each Scorer.score call scored together (its micro-batches are cut from
    them): a pass of another worker over the same samples cuts the same micro-batches (RayRollout's proximal pass)."""
    unscored: list[Sample] = field(default_factory=list)
    """Finished samples for any idle worker to score (a keeper after migration does not score its own)."""
    unfinished: int = 0
    """Samples this worker still has to finish (live rows, waiting prompts' samples)."""
    done: bool = False
    busy_s: float = 0.0
    score_s: float = 0.0
    prefill_s: float = 0.0
    """Prefill seconds since the last import_rows (the re-prefill of the migrated and the keeper's own rows)."""
    decode_rows: int = 0
    prefill_tokens: int = 0
    """Tokens this worker's engine prefilled for the batch so far (the re-prefill of migrated rows included)."""
    proximal_s: float = 0.0
    """score(proximal=True): the seconds of the actor's pass among score_s."""
    reference_s: float = 0.0
    """A decoding worker's reference pass over the samples it finished (RolloutSettings.reference_on_decoders),
    among busy_s."""
    rss_mb: tuple[float, float] | None = None
    """decode_batch: the worker's memory now and at its peak, in MiB (asked while it is free, not queued behind)."""


class GenerationWorker:
    """One generation worker: a DecodeEngine on its own generator and a Scorer, in one process with its torch threads
    pinned to its CPU share. Made a Ray actor by start_generation_workers; usable in-process too (tests, debugging).

    Chunked decoding: start() opens a generate() iterator and leaves it suspended; advance() pulls finished samples
    from it until `max_finished` have come or the worker reaches its migration pause point, then reports back. So
    export_state() always finds the iterator suspended at a yield (the engine can hand its state out only between
    two yields), and a chunk that ends on a count rather than on decode steps needs no change to the engine."""

    def __init__(self, models: WorkerModels, settings: RolloutSettings, threads: int = 1):
        pin_threads(threads)
        engine, scorer, reference = build_worker_roles(models, settings)
        self.adapted = adapted_copy(models, settings)
        self._setup(engine, scorer, settings, reference)

    def _setup(self, engine: DecodeEngine | None, scorer: Scorer | None, settings: RolloutSettings,
               reference: Scorer | None = None) -> None:
        """Hold this engine and scorer (either may be None), and a decoding worker's reference pass; a worker that
        also trains builds them from its own models (runtime/ray_worker.py)."""
        self.settings, self.engine, self.scorer, self.reference = settings, engine, scorer, reference
        if scorer is not None and settings.reward_rows is not None and hasattr(scorer.reward_fn, "rows"):
            scorer.reward_fn.rows = settings.reward_rows  # reward functions' columns (rewards.attach_rows)
        self.fusion = FusionPolicy(True, settings.score_every, settings.live_below)
        self._prefill_s = 0.0
        if self.engine is not None and self.engine.capabilities.migrates_rows:
            self._prefill = self.engine._prefill  # timed: re-prefill seconds are a migration cost we report

            def timed_prefill(*args):
                t = time.perf_counter()
                try:
                    return self._prefill(*args)
                finally:
                    self._prefill_s += time.perf_counter() - t

            self.engine._prefill = timed_prefill
        self._loop: ScoringLoop | None = None
        """The generate-and-score loop over the engine's open iterator (rollout/fusion.py), None when none is open."""
        self._unfinished, self._decode_rows, self._prefill_tokens = 0, 0, 0
        self._parked: dict[int, EngineState] = {}
        """Partial rollouts: the unfinished rest of a batch (by iteration), waiting for the next weights."""

    def ready(self) -> bool:
        """Returns once the actor is built (its models loaded): Ray runs __init__ before any other call."""
        return True

    def load_weights(self, role: str, tensors) -> tuple[int, float]:
        """Copy named tensors into the generator ("generator") or the critic ("critic"). -> (bytes, seconds)."""
        t, tensors = time.perf_counter(), tensors_of(tensors)  # read-only views on the store's pages: copied below
        if role == "generator" and self.engine is not None:
            n = self.engine.load_weights(tensors)
        elif role == "adapter" and getattr(self, "adapted", None) is not None:
            n = copy_weights(self.adapted, tensors)  # merged into the generator by merge_adapter, once all are in
        elif role == "critic" and self.scorer is not None and self.scorer.critic is not None:
            n = copy_weights(self.scorer.critic, tensors)
        else:
            raise ValueError(f"load_weights: this worker has no {role!r} (generator, adapter where the sync sends "
                             "adapters, or critic where it has one)")
        return n, time.perf_counter() - t

    def merge_adapter(self) -> tuple[int, float]:
        """The adapter load_weights("adapter", ...) received, folded into the generator: the merged weights are
        merged_weights (made one at a time) of the same base and adapter tensors as the trainer's actor, so the
        generator gets the same bits a merged sync would send. -> (bytes written into the generator, seconds)."""
        t = time.perf_counter()
        return self.engine.load_weights(merged_weights(self.adapted, deferred=True)), time.perf_counter() - t

    def set_temperature(self, temperature: float) -> None:
        """The iteration's temperature for the reference (and sampling) log-probs (rl.temperature_schedule)."""
        if self.scorer is not None:
            self.scorer.temperature = temperature

    def pid(self) -> int:
        return os.getpid()

    def arithmetic(self) -> dict:
        """What this worker computes in, for the driver to check that every worker resolved run.precision and
        rollout.generator_dtype alike: {"compute": the scoring (and training) passes' autocast dtype ("float32":
        none), None where it neither scores nor trains; "decode": the engine's dtype, None where it does not decode;
        "behaviour_differs": whether its samples' log-probs are not the trained policy's as the update computes them
        (the single process's LocalRollout.behaviour_differs: a sampler or passes in other arithmetic than fp32)}."""
        scorer = self.scorer or self.reference
        compute = None if scorer is None else dtype_name(scorer.compute_dtype or torch.float32)
        decode = None if self.engine is None else dtype_name(self.engine.dtype)
        other_kernels = self.engine is not None and not self.engine.capabilities.trainer_logprobs  # vLLM
        return {"compute": compute, "decode": decode, "behaviour_differs": compute not in (None, "float32") or
                decode not in (None, "float32") or other_kernels}

    def cores(self) -> list[int]:
        """The cores placement.pin_cores pinned this worker's threads to ([]: not pinned)."""
        return process.PINNED

    def reward_sums(self) -> dict | None:
        """This worker's reward-function tallies since the last call (rewards.FunctionReward.take_sums), then
        reset; None where it does not score or scores with a reward model."""
        return take_reward_sums(self.scorer.reward_fn) if self.scorer is not None else None

    def rss_mb(self) -> tuple[float, float]:
        """This worker process's resident memory now and its peak so far, in MiB (the report's per-worker memory;
        the peak includes training on a worker that trains)."""
        return psutil.Process().memory_info().rss / 2**20, peak_rss_mb()

    def start(self, prompts: list[list[int]], prompt_ids: list[int], k: int, params: SamplingParams, seed: int,
              lengths=None, rows: list | None = None) -> None:
        self._open(generate_from_rows(self.engine, prompts, k, params, seed, lengths, prompt_ids, rows))
        self._unfinished, self._decode_rows, self._prefill_tokens, self._prefill_s = len(prompts) * k, 0, 0, 0.0

    def _open(self, samples) -> None:
        """The loop over a new iterator of the engine (advance sets whether it scores the proximal log-probs)."""
        self._loop = ScoringLoop(self.engine, samples, self.scorer, self.fusion)

    def advance(self, max_finished: int, score_own: bool, pause_at: int = 0, proximal: bool = False) -> Chunk:
        """Decode until max_finished samples finish, only pause_at are left unfinished (the migration's pause point;
        0: none), or nothing is left. score_own: score them here (fusion policy: every score_every, or when the live
        batch is under live_below); else return them unscored. proximal: score with the actor's own log-probs too
        (Scorer.score; a worker that trains the actor, whose sampler computes in other arithmetic)."""
        t0, out, loop = time.perf_counter(), Chunk(), self._loop
        if loop is not None:
            loop.proximal = proximal
            allowed = max(0, self._unfinished - pause_at) if pause_at else max_finished
            self._unfinished -= loop.run(min(max_finished, allowed), score=score_own)
            if loop.done:
                self._loop = None
            if score_own and loop.done and loop.pending:
                loop.score_pending()
            elif not score_own:
                out.unscored = loop.take_pending()
            out.scored, out.batches, out.score_s = loop.take_scored()
        out.done = self._loop is None
        out.unfinished, out.prefill_s = self._unfinished, self._prefill_s
        out.decode_rows = self._decode_rows + self.engine.stats.decode_rows
        out.prefill_tokens = self._prefill_tokens + self.engine.stats.prefill_tokens
        out.busy_s = time.perf_counter() - t0
        return out

    def decode_batch(self, prompts: list[list[int]], prompt_ids: list[int], k: int, params: SamplingParams,
                     seed: int, rows: list | None = None) -> Chunk:
        """Decode every sample of these prompts in one call and return them unscored, with this process's memory
        (an asynchronous rollout queues these behind weight loads: Ray runs an actor's calls in order, so which
        weights decode which batch is fixed by the order of the calls, never by timing)."""
        t0 = time.perf_counter()
        samples = list(generate_from_rows(self.engine, prompts, k, params, seed, None, prompt_ids, rows))
        out = Chunk(unscored=samples, done=True, decode_rows=self.engine.stats.decode_rows,
                    prefill_tokens=self.engine.stats.prefill_tokens)
        self._take_reference(out, params.temperature)
        out.busy_s, out.rss_mb = time.perf_counter() - t0, self.rss_mb()
        return out

    def _take_reference(self, chunk: Chunk, temperature: float) -> None:
        """The reference's log-probs of the chunk's finished samples, where this worker holds the reference."""
        if self.reference is not None and chunk.unscored:
            chunk.reference_s += self.reference.reference_logprobs(chunk.unscored, temperature)

    def decode_until(self, batch: int, prompts: list[list[int]], prompt_ids: list[int], k: int,
                     params: SamplingParams, seed: int, finished: int, rows: list | None = None) -> Chunk:
        """A partial rollout's first part: decode under the weights loaded now until `finished` samples have
        finished, then park the rest (exported: rows with their tokens so far, prompts not yet started) for
        continue_batch under the next weights. Returns the finished samples, unscored."""
        t0 = time.perf_counter()
        self.start(prompts, prompt_ids, k, params, seed, rows=rows)
        out = self.advance(finished, score_own=False)
        if not out.done:
            state, pending, _ = self.export()
            out.unscored += pending
            self._parked[batch] = state
        self._take_reference(out, params.temperature)
        out.busy_s, out.rss_mb = time.perf_counter() - t0, self.rss_mb()
        return out

    def continue_batch(self, batch: int) -> Chunk:
        """The parked rest of `batch` under the weights loaded since decode_until (its rows re-prefilled, their
        random streams going on): each sample records from which token the new weights sampled it (Sample.switch_at:
        0 for a sample that had not started)."""
        t0, state = time.perf_counter(), self._parked.pop(batch, None)
        if state is None:  # every sample of this worker's share had finished before the switch
            return Chunk(done=True, rss_mb=self.rss_mb())
        drawn = {(r.prompt_id, r.sample_index): len(r.token_ids) for r in state.rows}
        before = {(x.prompt_id, x.sample_index) for x in state.finished}
        self._open(self.engine.resume(state))
        self._unfinished, self._decode_rows, self._prefill_tokens = unfinished_in(state), 0, 0  # this part's counts
        out = self.advance(2**62, score_own=False)  # to the end
        for x in out.unscored:
            if (x.prompt_id, x.sample_index) not in before:
                x.switch_at = drawn.get((x.prompt_id, x.sample_index), 0)
        self._take_reference(out, state.params.temperature)
        out.busy_s, out.rss_mb = time.perf_counter() - t0, self.rss_mb()
        return out

    def parked(self, batch: int) -> EngineState | None:
        """The parked rest of `batch` (a checkpoint writes it down), or None."""
        return self._parked.get(batch)

    def park(self, batch: int, state: EngineState | None) -> None:
        """Take back a parked rest from a checkpoint (a resumed run continues it as the uninterrupted one would)."""
        if state is not None:
            self._parked[batch] = state

    def _count_engine_calls(self) -> None:
        """The engine's counts restart with each generate/resume call: keep what the closing one did."""
        self._decode_rows += self.engine.stats.decode_rows
        self._prefill_tokens += self.engine.stats.prefill_tokens

    def export(self) -> tuple[EngineState, list[Sample], float]:
        """Hand out every unfinished row and waiting prompt (this worker then only scores), plus its finished samples
        not yet scored. -> (state, unscored samples, seconds)."""
        t = time.perf_counter()
        state = self.engine.export_state()
        self._count_engine_calls()
        pending = self._loop.take_pending() if self._loop is not None else []
        self._loop, self._unfinished = None, 0
        return state, pending, time.perf_counter() - t

    def import_rows(self, state: EngineState) -> float:
        """Continue `state` as well as this worker's own unfinished rows: the imported rows join the running decode
        (DecodeEngine.extend: they are re-prefilled as they are admitted, this worker's own rows keep their KV
        cache), or start one if this worker had finished. -> seconds."""
        t = time.perf_counter()
        if self._loop is not None:
            self.engine.extend(state)
        else:
            self._count_engine_calls()
            self._open(self.engine.resume(state))
        self._unfinished += unfinished_in(state)
        self._prefill_s = 0.0
        return time.perf_counter() - t

    def score(self, samples: list[Sample], proximal: bool = False) -> Chunk:
        """Reference, reward and critic passes on finished samples (a freed or finished worker's job); proximal: the
        actor's own log-probs too (a worker that trains it, scoring a stale batch just before its update)."""
        t0, out, before = time.perf_counter(), Chunk(done=True), self.scorer.times["proximal"]
        out.scored = self.scorer.score(samples, proximal)
        out.batches = [len(out.scored)]
        out.score_s = out.busy_s = time.perf_counter() - t0
        out.proximal_s = self.scorer.times["proximal"] - before
        return out


def unfinished_in(state: EngineState) -> int:
    """Samples an exported state still owes: live rows, waiting prompts' samples, finished but not handed out."""
    return len(state.rows) + sum(w.k for w in state.waiting) + len(state.finished)


def start_generation_workers(n: int, models: WorkerModels, settings: RolloutSettings, cpus_per_worker: int = 1,
                             placement_group=None, first_bundle: int = 0) -> list:
    """n GenerationWorker actors, one process each, `cpus_per_worker` CPUs reserved and as many torch threads
    (ray_common.start_actors: worker i in bundle first_bundle + i of placement_group, if given)."""
    threads = max(1, int(cpus_per_worker))
    return start_actors(GenerationWorker, n, lambda i: (models, settings, threads), cpus_per_worker, 0,
                        placement_group, first_bundle)


# ------------------------------------------------------------------------------------------- the driver


@dataclass
class _Tally:
    """Per-iteration bookkeeping of the driver."""
    n_workers: int
    busy_s: list[float] = field(default_factory=list)
    scored: list[ScoredSample] = field(default_factory=list)
    unscored: list[list[Sample]] = field(default_factory=list)
    """Finished samples waiting for a scorer, as they came, each chunk cut into one share per scorer
    (fusion.scoring_shares): each list is scored as one batch, whoever scores it."""
    stats: dict = field(default_factory=dict)

    def __post_init__(self):
        self.busy_s = [0.0] * self.n_workers
        self.stats = {"rows_moved": 0, "tokens_moved": 0, "reprefill_s": 0.0, "scoring_on_freed_s": 0.0,
                      "scoring_s": 0.0, "migrated_at_unfinished": 0, "decode_rows": 0, "prefill_tokens": 0}


class MultiWorkerRollout:
    """The driver side: deals prompts, polls chunks, migrates the tail once, hands unscored samples to idle workers.

    Call sync_weights(merged_state_dict(actor)) (and role="critic" where the critic trains) before each generate().
    decoders / scorers: indices of the workers that decode (hold a generator) and that score (reference, reward,
    critic); default all of them (placement.strategy=flattened). Separate sets give the separated and interleaved
    layouts: decoders return finished samples unscored and the scorers score them while decoding goes on."""

    def __init__(self, workers: list, settings: RolloutSettings, bucket_bytes: int = 32 * 2**20,
                 decoders: list[int] | None = None, scorers: list[int] | None = None):
        self.workers, self.settings, self.bucket_bytes = workers, settings, bucket_bytes
        self.decoders = list(range(len(workers))) if decoders is None else list(decoders)
        self.scorers = list(range(len(workers))) if scorers is None else list(scorers)
        if not self.decoders or not self.scorers:
            raise ValueError("MultiWorkerRollout needs at least one decoding and one scoring worker")
        self.behaviour_differs = False
        """The workers sample in other arithmetic than the update computes in (a bf16 generator, or passes under
        bf16 autocast: GenerationWorker.arithmetic), so every batch is scored with the proximal log-probs."""
        self.last_batches: list[list[tuple[int, int]]] = []
        """The samples the last generate() scored together, one list per Scorer.score call, as (prompt id, sample
        index) (Chunk.batches)."""

    def sync_weights(self, named_tensors, role: str = "generator") -> dict:
        """Push the weights to the workers holding `role` in buckets (one object-store put per bucket, shared)."""
        holders = [self.workers[w] for w in (self.decoders if role == "generator" else self.scorers)]
        t, nbytes = time.perf_counter(), 0
        for bucket in weight_buckets(named_tensors, self.bucket_bytes):
            ref = put_tensors(bucket)
            nbytes = nbytes + ray.get([w.load_weights.remote(role, ref) for w in holders])[0][0]
        return {"time/weight_sync": time.perf_counter() - t, "sync/bytes": nbytes}

    def rss_mb(self) -> list[tuple[float, float]]:
        """Each worker's resident memory now and at its peak, in MiB."""
        return ray.get([w.rss_mb.remote() for w in self.workers])

    def reward_metrics(self) -> dict[str, float]:
        """The scoring workers' reward-function means since the last call, pooled (rewards.metrics_of_sums)."""
        return metrics_of_sums(ray.get([self.workers[w].reward_sums.remote() for w in self.scorers]))

    def submit_decode(self, request: RolloutRequest, switch_after: int = 0) -> list:
        """Queue the request's decoding on the decoding workers (prompts dealt by position, global ids keeping each
        sample's stream), returning at once: one object ref per decoder, of a Chunk of unscored samples.
        switch_after > 0: a partial rollout's first part (GenerationWorker.decode_until), to be continued by
        submit_continue once the next weights are loaded."""
        D, n = len(self.decoders), len(request.prompts)
        out = []
        for j, w in enumerate(self.decoders):
            mine = list(range(j, n, D))
            args = ([request.prompts[i] for i in mine], mine, request.k, request.params, request.seed)
            rows = None if request.rows is None else [request.rows[i] for i in mine]
            out.append(self.workers[w].decode_until.remote(request.iteration, *args, switch_after, rows)
                       if switch_after else self.workers[w].decode_batch.remote(*args, rows))
        return out

    def submit_continue(self, batch: int, states: list | None = None) -> list:
        """Queue the rest of a partial rollout on each decoding worker (behind the weights queued before it); states:
        the parked rests read back from a checkpoint, one per decoder, handed over first."""
        if states is not None:
            for w, state in zip(self.decoders, states):
                self.workers[w].park.remote(batch, state)
        return [self.workers[w].continue_batch.remote(batch) for w in self.decoders]

    def parked_states(self, batch: int) -> list:
        """Each decoding worker's parked rest of `batch` (behind its queued calls)."""
        return ray.get([self.workers[w].parked.remote(batch) for w in self.decoders])

    def score_in_order(self, samples: list[Sample], temperature: float, proximal: bool = False
                       ) -> tuple[list[ScoredSample], dict[int, Chunk]]:
        """Score finished samples on the scoring workers, in (prompt, sample index) order cut into one contiguous
        share per scorer: each sample is scored in the same batch whoever finished it when; proximal: with the
        actor's own log-probs (Scorer.score), always where the workers' sampler computes in other arithmetic than
        the update (behaviour_differs: the asynchronous loop's fresh batches are then off-policy too, corrected as
        the single process corrects them). -> (scored, {worker: its Chunk, for the seconds})."""
        proximal = proximal or self.behaviour_differs
        samples = sorted(samples, key=lambda x: (x.prompt_id, x.sample_index))
        ray.get([self.workers[w].set_temperature.remote(temperature) for w in self.scorers])
        refs = {w: self.workers[w].score.remote(share, proximal)
                for w, share in zip(self.scorers, scoring_shares(samples, len(self.scorers)))}
        chunks: dict[int, Chunk] = dict(zip(refs, ray.get(list(refs.values()))))
        return [x for c in chunks.values() for x in c.scored], chunks

    def generate(self, prompts: list[list[int]], k: int, params: SamplingParams, seed: int, lengths=None,
                 prompt_ids: list[int] | None = None, migrate: bool = True, proximal: bool = False,
                 rows: list | None = None) -> Experience:
        """generate_rollouts on the workers: the same samples and scores (to float tolerance), plus in exp.timing
        rollout seconds, scoring seconds, busy seconds per worker and the migration's cost (rows and tokens moved,
        re-prefill seconds, scoring seconds on freed workers). proximal: scored with the actor's own log-probs too
        (every scorer holds the actor: it trains)."""
        s, W = self.settings, len(self.workers)
        ids = list(range(len(prompts))) if prompt_ids is None else list(prompt_ids)
        t0, tally, total = time.perf_counter(), _Tally(W), len(prompts) * k
        # a worker that decodes and scores scores its own finished samples as it goes (fusion, as in one process)
        # until a migration; then the keepers only decode and the freed workers score what the others finish.
        # (settings.defer_scoring: RLHFuse's order, decoding workers never score and finished samples wait for an
        # idle worker. On CPU it loses: scoring then starts only at the migration, on the freed workers alone.)
        unfinished, self.last_batches = [0] * W, []
        scoring_owner = [w in self.scorers and not (migrate and s.defer_scoring) for w in range(W)]
        ray.get([self.workers[w].set_temperature.remote(params.temperature) for w in self.scorers])
        D = len(self.decoders)
        for j, w in enumerate(self.decoders):  # deal by position: global ids keep every sample's stream
            mine = list(range(j, len(prompts), D))
            self.workers[w].start.remote([prompts[i] for i in mine], [ids[i] for i in mine], k, params, seed, lengths,
                                         None if rows is None else [rows[i] for i in mine])
            unfinished[w] = len(mine) * k
        # each decoding worker stops at its pause point; once all have, the migration is planned on their counts
        pause = pause_points(unfinished, s.migrate_below, s.rows_per_worker) if migrate else None
        inflight: dict = {}  # object ref -> (worker, "advance" | "score")
        freed, keepers, reprefill, last_rows, last_prefilled = set(), set(), {}, [0] * W, [0] * W

        def paused(w) -> bool:
            return pause is not None and unfinished[w] <= pause[w]

        def advance(w):
            ref = self.workers[w].advance.remote(s.score_every, scoring_owner[w], pause[w] if pause else 0, proximal)
            inflight[ref] = (w, "advance")

        def take(ref) -> None:
            w, kind = inflight.pop(ref)
            chunk: Chunk = ray.get(ref)
            tally.busy_s[w] += chunk.busy_s
            tally.scored += chunk.scored
            at = 0
            for n in chunk.batches:
                scored_together = chunk.scored[at: at + n]
                self.last_batches.append([(x.sample.prompt_id, x.sample.sample_index) for x in scored_together])
                at += n
            tally.unscored += scoring_shares(chunk.unscored, len(self.scorers))
            tally.stats["scoring_s"] += chunk.score_s
            if kind == "score" and w in freed:
                tally.stats["scoring_on_freed_s"] += chunk.score_s
            if kind == "advance":
                unfinished[w] = chunk.unfinished
                tally.stats["decode_rows"] += chunk.decode_rows - last_rows[w]
                last_rows[w] = chunk.decode_rows
                tally.stats["prefill_tokens"] += chunk.prefill_tokens - last_prefilled[w]
                last_prefilled[w] = chunk.prefill_tokens
                if w in keepers:
                    reprefill[w] = chunk.prefill_s
                if not chunk.done and not paused(w):
                    advance(w)

        for w in self.decoders:
            advance(w)
        while inflight or tally.unscored:
            if inflight:
                ready, _ = ray.wait(list(inflight), num_returns=1)
                take(ready[0])
            if pause is not None and not any(kind == "advance" for _, kind in inflight.values()):
                # every decoding worker is at its pause point (or done): the same counts in every run
                plan, pause = plan_migration(unfinished, total, s.migrate_below, s.rows_per_worker), None
                if plan is not None:
                    self._migrate(plan, tally, unfinished)
                    freed, keepers = set(plan.export), set(plan.keep)
                    for w in keepers:  # the tail's critical path: its finished samples go to the freed workers
                        scoring_owner[w] = False
                for w in range(W):
                    if unfinished[w] > 0 and w not in freed:
                        advance(w)
            busy = {w for w, _ in inflight.values()}
            for w in self.scorers:  # idle scorers (freed, done decoding, or scoring only) score what was finished
                if w not in busy and tally.unscored:
                    inflight[self.workers[w].score.remote(tally.unscored.pop(0), proximal)] = (w, "score")
                    busy.add(w)
        tally.stats["reprefill_s"] = sum(reprefill.values())
        exp = build_experience(tally.scored)
        wall = time.perf_counter() - t0
        exp.timing = {"rollout": wall, "scoring": tally.stats["scoring_s"], "migrated": float(bool(freed)),
                      **{f"migration/{k}": v for k, v in tally.stats.items() if k not in ("scoring_s", *ENGINE_COUNTS)},
                      **{f"busy/worker{w}": b for w, b in enumerate(tally.busy_s)},
                      **{k: v for k, v in tally.stats.items() if k in ENGINE_COUNTS}}
        if len(exp) != total:
            raise RuntimeError(f"multi-worker rollout returned {len(exp)} samples, expected {total}")
        return exp

    def _migrate(self, plan, tally: _Tally, unfinished: list[int]) -> None:
        """Exporters hand their rows over; the keepers import them (split evenly) and re-prefill."""
        exported = ray.get([self.workers[w].export.remote() for w in plan.export])
        states = []
        for w, (state, pending, secs) in zip(plan.export, exported):
            states.append(state)
            tally.unscored += scoring_shares(pending, len(self.scorers))
            tally.busy_s[w] += secs
            unfinished[w] = 0
        moved = EngineState.combine(states)
        tally.stats["migrated_at_unfinished"] = sum(unfinished) + unfinished_in(moved)
        tally.stats["rows_moved"] = unfinished_in(moved)
        tally.stats["tokens_moved"] = sum(len(r.prompt_ids) + len(r.token_ids) for r in moved.rows)
        parts = moved.split(len(plan.keep))
        seconds = ray.get([self.workers[w].import_rows.remote(p) for w, p in zip(plan.keep, parts)])
        for w, p, secs in zip(plan.keep, parts, seconds):
            tally.busy_s[w] += secs
            unfinished[w] += unfinished_in(p)
