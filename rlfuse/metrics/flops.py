"""The fraction of the compute limit (`perf/compute_fraction`, like veRL's MFU): FLOPs of the work an RL iteration
did, counted from the model's shape and the tokens actually processed, over the seconds it took times the bare
matmul rate of this device.

What counts as work (model FLOPs, as MFU counts them: no padding, no recomputation):
- generation: one prefill per prompt (the engine shares it among the prompt's k samples), then one single-token
  forward per response token after the first, each attending to everything before it;
- scoring: one forward over prompt + response per sample for each scoring pass (reference, reward model, critic);
- training: forward + backward (backward = 2x the forward with full weights, 1x with a frozen base: only the
  activations' gradients) over prompt + response, per sample, per epoch, per trained model (actor, separate critic).
Gradient checkpointing's second forward is not counted: it is overhead, not work.

A forward's FLOPs are `ModelShape.forward_flops` (rlfuse/plan/cost.py, the planner's own count). Everything here
but `measure_matmul_rate` is pure; that one imports torch when called.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from rlfuse.plan.cost import ModelShape, shape_from_hf_config
from rlfuse.plan.strategies import spec_from_config


def prefill_flops(shape: ModelShape, prompt_len: int) -> float:
    """A causal forward over a prompt: token i (0-based) attends to i + 1 positions, (P + 1) / 2 on average."""
    return shape.forward_flops(prompt_len, (prompt_len + 1) / 2)


def decode_flops(shape: ModelShape, prompt_len: int, response_len: int) -> float:
    """The single-token forwards after the prefill: the prefill's logits give response token 1, and token j + 1
    (j = 1 .. L - 1) needs a forward of token j, which attends to P + j positions."""
    steps = max(0, response_len - 1)
    return shape.forward_flops(steps, prompt_len + (steps + 1) / 2)  # the mean of P + j over j = 1 .. steps


def sequence_flops(shape: ModelShape, prompt_len: int, response_len: int) -> float:
    """One causal forward over prompt + response (a scoring pass, or a training pass's forward)."""
    n = prompt_len + response_len
    return shape.forward_flops(n, (n + 1) / 2)


@dataclass(frozen=True)
class Passes:
    """How many full-sequence passes an iteration makes per sample, besides generation."""
    scoring: int
    """Forwards in scoring: the reference, plus a reward model, a critic, recomputed old log-probs where present."""
    trained: int
    """Models trained forward + backward: the actor, plus a separate critic."""
    epochs: int = 1
    backward_ratio: float = 2.0
    """A backward's FLOPs over its forward's: 2 with the weights' gradients, 1 with a frozen (LoRA) base."""


def iteration_flops(shape: ModelShape, prompt_lens: Sequence[int], response_lens: Sequence[int], k: int,
                    passes: Passes) -> dict[str, float]:
    """FLOPs of one iteration by stage. prompt_lens, response_lens: per sample (N = prompts x k), a prompt's k
    samples consecutive (Experience's order); its prefill is counted once. -> {generation, scoring, training, total}."""
    if len(prompt_lens) != len(response_lens) or len(prompt_lens) % k:
        raise ValueError(f"{len(prompt_lens)} prompt and {len(response_lens)} response lengths for k={k}")
    prefill = sum(prefill_flops(shape, p) for p in prompt_lens[::k])
    gen = prefill + sum(decode_flops(shape, p, r) for p, r in zip(prompt_lens, response_lens))
    seq = sum(sequence_flops(shape, p, r) for p, r in zip(prompt_lens, response_lens))
    train = seq * passes.trained * passes.epochs * (1 + passes.backward_ratio)
    score = seq * passes.scoring
    return {"generation": gen, "scoring": score, "training": train, "total": gen + score + train}


def compute_fraction(flops: float, seconds: float, matmul_flops_s: float) -> float:
    """The work's FLOPs over what the bare matmul rate would do in the same seconds (0 for an empty interval)."""
    return flops / (seconds * matmul_flops_s) if seconds > 0 and matmul_flops_s > 0 else 0.0


def fastest_seconds(fn, repeats: int, sync) -> float:
    """Fastest of `repeats` calls after a warm-up: on a shared machine other processes only ever add time, and the
    rates are fitted from differences of timings, which the added time would swamp."""
    fn()
    sync()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return min(out)


def measure_matmul_rate(device: str = "cpu", dtype=None, n: int | None = None, repeats: int = 5) -> float:
    """FLOP/s of a bare n x n x n matmul in `dtype` (default float32) on `device`, with this process's torch threads:
    the fastest of `repeats` after a warm-up (fastest_seconds). n defaults to 1024 on CPU (about
    0.2 s in all on 2 cores) and 4096 on CUDA."""
    dev = torch.device(device)
    n = n or (4096 if dev.type == "cuda" else 1024)
    a = torch.randn(n, n, device=dev, dtype=dtype or torch.float32)
    b = torch.randn(n, n, device=dev, dtype=dtype or torch.float32)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with torch.no_grad():
        return 2.0 * n ** 3 / fastest_seconds(lambda: a @ b, repeats, sync)


@dataclass(frozen=True)
class ComputeMeter:
    """perf/ metrics of an RL run's iterations: the counted FLOPs and their fraction of the compute limit."""
    shape: ModelShape
    passes: Passes
    k: int
    matmul_flops_s: float
    """The limit: the bare matmul rate of the devices the run uses (measured once at the start)."""

    def metrics(self, prompt_lens: Sequence[int], response_lens: Sequence[int], seconds: float,
                trained: bool = True) -> dict[str, float]:
        """trained=False: the update was skipped (non-finite rewards), so no training FLOPs were done."""
        f = iteration_flops(self.shape, prompt_lens, response_lens, self.k, self.passes)
        if not trained:
            f["total"], f["training"] = f["total"] - f["training"], 0.0
        return {"perf/flops": f["total"], "perf/flops_generation": f["generation"], "perf/flops_scoring": f["scoring"],
                "perf/flops_training": f["training"], "perf/matmul_flops_s": self.matmul_flops_s,
                "perf/compute_fraction": compute_fraction(f["total"], seconds, self.matmul_flops_s)}


def compute_meter_for_run(cfg, models, device) -> ComputeMeter:
    """The meter of an RL run: the policy's shape from its generator's config, the passes its roles make, and the
    matmul rate measured here (< 1 s). With placement on Ray workers the limit is this process's rate scaled to the
    placement's CPUs (per torch thread here) or GPUs: the devices that do the work."""
    policy = models.generator if models.generator is not None else models.actor  # None: decoding the shared base
    shape = shape_from_hf_config("policy", policy.config.to_dict())
    critic_on_actor = models.critic is not None and models.roles["critic"].source == "actor"
    passes = Passes(scoring=1 + (models.critic is not None) + (cfg.rl.reward == "rm"),
                    trained=1 + (models.critic is not None and not critic_on_actor), epochs=cfg.rl.epochs,
                    backward_ratio=1.0 if cfg.model.lora else 2.0)
    # the dtype the update computes in (its autocast's, else the trained policy's): a bf16 generator copy
    # (rollout.generator_dtype) decodes faster than the fp32 limit, which would read as above 1.0
    dtype = models.compute_dtype or next(models.actor.parameters()).dtype
    rate = measure_matmul_rate(str(device), dtype if dtype.is_floating_point else None)
    spec = spec_from_config(cfg)
    if spec.uses_ray and getattr(device, "type", str(device)) == "cuda":
        rate *= max(1.0, spec.gpus)
    elif spec.uses_ray:
        rate *= spec.cpus / torch.get_num_threads()
    return ComputeMeter(shape, passes, cfg.rl.k, rate)
