"""Steps 1 and 4 of the RL loop in this process (placement.strategy=single): LocalRollout (weight sync into the
engine's own generator, then generate and score) and LocalTrainer (the update and its checkpoints on this process's
learners), the two objects of runtime/protocols.py; and the engine and scorer a process holding the roles itself
builds (this one, or a Ray worker that also trains)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rlfuse.config import Config, RLConfig
from rlfuse.learn.checkpoint import CHECKPOINT_KEYS, checkpoint_parts, load_checkpoint, save_checkpoint
from rlfuse.learn.learners import Learners
from rlfuse.learn.update import BadSteps, update
from rlfuse.models.build import Models
from rlfuse.models.device import decode_dtype, native_bf16
from rlfuse.models.shared import actor_decoding, eval_for_decoding
from rlfuse.models.weights import merged_weights
from rlfuse.plan.resolve import decoded_in, engine_choice
from rlfuse.rollout.engine import DecodeEngine
from rlfuse.rollout.fusion import ENGINE_COUNTS, Experience, FusionPolicy, generate_rollouts, scores_proximal
from rlfuse.rollout.generator import Generator
from rlfuse.rollout.score import Scorer
from rlfuse.rollout.state import RolloutRequest
from rlfuse.rollout.vllm_engine import VllmEngine


def sync_weights(engine: Generator, actor: torch.nn.Module) -> dict:
    """The actor's current weights into the generator, by an explicit copy; none when the engine decodes the actor's
    own shared base (model.shared_base), which reports 0 bytes."""
    if engine.shares_weights:
        return {"time/weight_sync": 0.0, "sync/bytes": 0}
    t = time.perf_counter()
    n = engine.load_weights(merged_weights(actor, deferred=True))  # one merged weight alive at a time
    return {"time/weight_sync": time.perf_counter() - t, "sync/bytes": n}


@dataclass
class LocalRollout:
    """Step 1 of the loop in this process: weight sync, then generate and score (fusion). With placement on Ray the
    loop gets rlfuse/runtime/ray_driver.py's RayRollout instead, with the same methods."""
    engine: Generator
    scorer: Scorer
    fusion: FusionPolicy
    rl: RLConfig

    @property
    def behaviour_differs(self) -> bool:
        """The engine samples in other arithmetic than the update computes in (a bf16 generator copy, or an update
        under bf16 autocast): its log-probs are a behaviour policy's, and the update runs the decoupled objective
        around the trained policy's own (proximal)."""
        return self.scorer.actor is not None and behaviour_differs(self.engine, self.scorer.actor,
                                                                          self.scorer.compute_dtype)

    def sync_weights(self, models: Models) -> dict:
        return sync_weights(self.engine, models.actor)  # the critic is this process's own module: nothing to copy

    def generate(self, request: RolloutRequest) -> Experience:
        before, self.scorer.temperature = dict(self.scorer.times), request.params.temperature
        one_step = self.rl.optimiser_steps(len(request.prompts) * request.k) == 1
        # an engine whose log-probs are not the trainer's own forward (vLLM): always beside them, for the mismatch
        # metrics (observe.py) as well as the correction
        proximal = scores_proximal(self.behaviour_differs, one_step, self.rl.kl_coef) or \
            not self.engine.capabilities.trainer_logprobs
        exp = generate_rollouts(self.engine, self.scorer, request.prompts, request.k, request.params, request.seed,
                                self.fusion, rows=request.rows, proximal=proximal)
        exp.proximal_from_update = self.behaviour_differs and not proximal
        if not self.rl.dynamic_sampling:  # its further draws decode with the same copy; the next sync replaces it
            release_decode_copy(self.engine)  # not needed until the next sync: the update's peak is without it
        exp.timing |= {f"score_{role}": t - before.get(role, 0.0) for role, t in self.scorer.times.items()}
        return exp

    def metrics(self, exp: Experience) -> dict:
        return {f"time/{k}": v for k, v in exp.timing.items() if k not in ENGINE_COUNTS}

    def save_in_flight(self, path: Path, iteration: int) -> None:
        """Nothing is in flight between two iterations of the synchronous loop."""

    def begin_at(self, path: Path, iteration: int) -> None:
        """The synchronous loop keeps nothing between iterations but the trainer's checkpoint."""


def local_scorer(models: Models, cfg: Config) -> Scorer:
    """The scorer of a process holding the roles itself (this one, or a Ray worker that also trains): reference
    (the actor with adapters off where it has no model of its own), reward, and the critic being trained."""
    rl = cfg.rl
    return Scorer(models.reward_fn, models.tokenizer.pad_token_id, ref=models.ref, actor=models.actor,
                  critic=models.critic, temperature=rl.temperature, micro_batch_size=cfg.rollout.micro_batch_size,
                  unfinished_penalty=rl.unfinished_penalty, share_prompt=rl.share_prompt,
                  compute_dtype=models.compute_dtype, environment_weight=rl.environment_reward_weight)


@dataclass
class LocalTrainer:
    """Step 4 of the loop and its checkpoints in this process (placement.strategy=single); on Ray,
    rlfuse/runtime/ray_driver.py's RayTrainer has the same methods."""
    models: Models
    learners: Learners
    rl: RLConfig

    def update(self, exp: Experience, adv, returns, kl_coef: float, batches: list[list[int]], bad: BadSteps,
               temperature: float | None = None) -> dict:
        return update(self.models, self.learners, exp, adv, returns, self.rl, kl_coef, batches, bad, temperature)

    def learning_rates(self) -> dict:
        out = {"train/lr": self.learners.actor.sched.get_last_lr()[0]}
        critic = self.learners.critic
        return out | ({"train/critic_lr": critic.sched.get_last_lr()[0]} if critic is not None else {})

    def save_checkpoint(self, path: Path, iteration: int, kl_coef: float, counters: dict) -> None:
        save_checkpoint(path, **dict(zip(CHECKPOINT_KEYS, checkpoint_parts(self.models, self.learners))),
                        iteration=iteration, kl_coef=kl_coef, counters=counters)

    def load_checkpoint(self, path: Path) -> dict:
        return load_checkpoint(path, *checkpoint_parts(self.models, self.learners))

    def pull_into(self, models: Models) -> None:
        """The trained modules are `models`' own: nothing to copy."""


def release_decode_copy(engine: Generator) -> None:
    """Free the engine's copy where it lives only while decoding (transient_weights: full fine-tuning's bf16 copy),
    once a rollout or an evaluation is done with it; the next sync_weights makes it again."""
    if engine.transient_weights:
        engine.release_weights()


def behaviour_differs(engine: Generator, actor: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> bool:
    """Whether the engine's samples' log-probs are not the trained policy's as the update computes them: another
    engine's kernels (vLLM), a copy of the actor in another dtype (rollout.generator_dtype), or an update under
    autocast (compute_dtype, run.precision) where the engine decodes in its weights' own dtype."""
    return (compute_dtype is not None or not engine.capabilities.trainer_logprobs
            or (not engine.shares_weights and engine.dtype != next(actor.parameters()).dtype))


def build_generator(cfg: Config, models: Models, max_model_len: int, log=print) -> Generator:
    """The run's engine (rollout.engine, auto resolved: plan/resolve.py engine_choice), said once: our own on the
    process's models (decode_engine), or vLLM on the policy's folder, its weights synced from the actor like a
    generator copy's."""
    device = next(models.actor.parameters()).device
    name, why = engine_choice(cfg, device.type == "cuda")
    log(f"[rl] generating with {name} ({why})")
    if name != "vllm":
        return decode_engine(models, cfg.rollout.max_rows)
    ro = cfg.rollout
    eager = ro.vllm_eager if ro.vllm_eager is not None else device.type != "cuda"
    dtype = decode_dtype(decoded_in(cfg, native_bf16(device)), device)
    return VllmEngine(models.policy_source, models.tokenizer.eos_token_id, dtype, ro.max_rows, max_model_len,
                      ro.vllm_kv_cache_gb, eager, cfg.run.seed)


def decode_engine(models: Models, max_rows: int, eos_token_id: int | None = None) -> DecodeEngine:
    """The rollout engine of a process holding the actor: on the generator (LoRA: the merged copy; full fine-tuning:
    a bf16 copy, released after each rollout), otherwise in full fine-tuning on the actor itself, in eval mode per
    forward (shared.eval_for_decoding); with a shared base on that base, running the actor's adapter
    (shared.actor_decoding). The last two copy no weights and need no sync. With a
    shared base the engine gets the transformers model under the peft wrapper, whose LoRA layers run the active
    adapter, so the lean Llama decode step (rollout/kv.py) applies to it as to a plain model."""
    tok = models.tokenizer
    eos = tok.eos_token_id if eos_token_id is None else eos_token_id
    if models.generator is not None:
        engine = DecodeEngine(models.generator, eos, max_rows=max_rows, tokenizer=tok,
                              transient_weights=models.generator_transient)
        release_decode_copy(engine)  # made at the first sync
        return engine
    if models.shared_base is None:
        actor = models.actor
        return DecodeEngine(actor, eos, max_rows=max_rows, tokenizer=tok,
                            decode_context=lambda: eval_for_decoding(actor))
    base = models.shared_base
    return DecodeEngine(base.get_base_model(), eos, max_rows=max_rows, tokenizer=tok,
                        decode_context=lambda: actor_decoding(base))
