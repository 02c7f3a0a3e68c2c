"""At scale, on paper: the planner's predictions from published GPU figures (rlfuse/plan/cost.py `DEVICES`)
instead of a measured profile, for the cases of issue 13. `rlfuse plan --paper` prints them; docs/benchmarks/plan.md
keeps the output and compares the one-GPU QLoRA row with that pipeline's published table.

These are predictions of the model, not measurements: nothing here has run on these GPUs. The big cases shard
weights, gradients and optimiser states over each group (rlfuse runs that as rl.train_parallel=fsdp, tested on CPU
only) and go beyond what rlfuse runs today, marked in the output, in two ways: they decode with tensor-parallel
generators (up to 8 GPUs, vLLM-style), and they train in bf16 with fp32 master weights and AdamW (16 bytes per
trained parameter).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rlfuse.config import Config
from rlfuse.plan.cost import KNOWN_SHAPES, GiB, device_profile
from rlfuse.plan.memory import MemoryInputs
from rlfuse.plan.planner import Problem, Workload, plan, plan_memory_table, plan_table
from rlfuse.plan.roles import derive_roles
from rlfuse.plan.spec import WorkerResources

INTER_NODE_BYTES_S = 25e9
"""Per-GPU bandwidth between nodes (8 x 200 Gb/s InfiniBand per 8-GPU node, the DGX A100/H100 layout)."""


@dataclass(frozen=True)
class PaperCase:
    title: str
    problem: Problem
    note: str


def _roles(lora: bool, critic_init: str = "rm"):
    cfg = Config()
    cfg.model.lora, cfg.rl.critic_init = lora, critic_init
    return derive_roles(cfg)


def qlora_7b_one_gpu(device: str = "rtx4090") -> PaperCase:
    """Llama-2-7B, one 4-bit NF4 (double-quantised) base shared by every role as adapters (LoRA r=64 on every
    linear: actor, critic and reward adapters; the reference is the base with adapters off), paged 8-bit AdamW,
    bf16 activations; 16 samples per iteration of 256 prompt + up to 256 response tokens."""
    shape = KNOWN_SHAPES["llama-2-7b"]
    mem = MemoryInputs(shape, critic=shape, reward=shape, weight_dtype="nf4-dq", train_dtype="fp32", act_bytes=2,
                       lora_rank=64, optimizer="adamw8bit", shared_base=True)
    work = Workload(samples=16, prompt_tokens=256, response_mean=200, response_max=256, epochs=1, mini_batch=8,
                    score_micro_batch=4, max_rows=16)
    prob = Problem(_roles(True), work, mem, device_profile(device), 1, WorkerResources(4, 1), 24 * 1e9)
    return PaperCase(f"Llama-2-7B, 4-bit base + LoRA, one {device_profile(device).name} (24 GB)", prob,
                     "one process: every role time-shares the GPU; the published pipeline's layout, the generator "
                     "decoding on the shared base as rlfuse's engine does")


def distilgpt2_two_gpus(device: str = "rtx4090") -> PaperCase:
    """configs/imdb_distilgpt2.yaml as rlfuse runs it (fp32, LoRA r=16 actor, full critic from the reward model),
    on 2 GPUs: 32 prompts of ~14 tokens, 32 new tokens."""
    shape = KNOWN_SHAPES["distilgpt2"]
    mem = MemoryInputs(shape, critic=shape, reward=shape, lora_rank=16)
    work = Workload(samples=32, prompt_tokens=14, response_mean=32, response_max=32, epochs=4, mini_batch=16,
                    score_micro_batch=16, max_rows=256)
    prob = Problem(_roles(True), work, mem, device_profile(device), 2, WorkerResources(4, 1), 24 * 1e9)
    return PaperCase(f"DistilGPT2 (imdb_distilgpt2.yaml), 2 x {device_profile(device).name}", prob,
                     "as rlfuse runs it today: fp32, replicated (DDP)")


def actor_critic(size: str, gpus: int, device: str = "h100-80gb") -> PaperCase:
    """Full fine-tuning of a Llama actor and a critic of the same size (reference and reward model too), bf16 with
    fp32 master weights, sharded over each group; 512 samples of 512 prompt + long-tailed responses (mean 256, up
    to 1024 tokens), one PPO epoch in 4 mini-batches; at most 32 rows decode at once per generator replica."""
    shape = KNOWN_SHAPES[size]
    mem = MemoryInputs(shape, critic=shape, reward=shape, weight_dtype="bf16", train_dtype="bf16", act_bytes=2,
                       master_weights=True)
    work = Workload(samples=512, prompt_tokens=512, response_mean=256, response_max=1024, epochs=1, mini_batch=128,
                    score_micro_batch=16, max_rows=32)
    profile = device_profile(device)
    if gpus > 8:  # collectives and syncs cross nodes
        profile = replace(profile, allreduce_bytes_s=INTER_NODE_BYTES_S * 0.7, sync_bytes_s=INTER_NODE_BYTES_S * 0.7)
    prob = Problem(_roles(False), work, mem, profile, gpus, WorkerResources(8, 1), profile.memory_bytes,
                   micro_batches=(1, 2, 4, 8), shard=True)
    return PaperCase(f"{shape.name} actor + critic (+ reference, reward), {gpus} x {profile.name}", prob,
                     "sharded over each group (FSDP: rl.train_parallel=fsdp) with tensor-parallel generators (not run by rlfuse yet)")


def paper_cases() -> list[PaperCase]:
    return [qlora_7b_one_gpu(), distilgpt2_two_gpus(), actor_critic("llama-2-7b", 8),
            actor_critic("llama-2-13b", 16), actor_critic("llama-33b", 32)]


def paper_report(top: int = 3) -> str:
    out = []
    for case in paper_cases():
        plans = plan(case.problem)
        best = plans[0]
        fits = sum(p.fits for p in plans)
        out += [f"### {case.title}", "", f"{case.note}; {fits} of {len(plans)} candidates fit "
                f"({case.problem.memory_budget / GiB:.1f} GiB per GPU). Top {top}:", "",
                plan_table(plans, top), "", f"Memory per GPU of the best ({best.label()}):", "",
                plan_memory_table(best), ""]
    return "\n".join(out)
