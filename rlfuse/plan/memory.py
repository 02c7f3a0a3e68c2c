"""Memory model: bytes per component for one worker, from the roles it holds, the model shapes and the batch shapes.

Pure (no torch). Components, the same names as the measured table of issue 14 (`bench/` per-component memory):
base (model weights, by dtype: fp32, bf16, int8 or 4-bit NF4 with or without double quantisation), adapters (LoRA),
gradients, optimizer (AdamW fp32 moments or 8-bit blockwise), activations (training micro-batch, with or without
gradient checkpointing; or a scoring forward's transient, whichever is larger), kv_cache (rows x length), slack (the
process's fixed runtime plus allocator slack), total.

Which copies of the weights a worker holds follows rlfuse/models/build.py: the generator is the actor itself where a
worker holds both and trains all the weights, else its own plain copy of the policy (LoRA merged); the reference is
a copy unless LoRA makes it the actor with adapters off; a critic from the reward model or the SFT model is its own
full model (trained whole even under LoRA); the reward model is a frozen copy. With `shared_base` (the one-GPU QLoRA
pipeline) every policy role uses one frozen base and its own adapters.
A group that scores (reference or reward) but has no critic holds a frozen copy of the critic for the values, as
the Ray rollout syncs it there. On a CPU the weights a sync passes through Ray's object store stay in the RSS of the
worker that sent them and of the one that loaded them (object_store_bytes), counted under base.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from rlfuse.plan.cost import GiB, MachineProfile, ModelShape

COMPONENTS = ("base", "adapters", "gradients", "optimizer", "activations", "kv_cache", "slack", "total")

NF4_BLOCK = 64
"""QLoRA (Dettmers et al. 2023): 4-bit weights in blocks of 64, one fp32 absmax per block (0.5 bits per weight)..."""
NF4_DQ_BLOCK = 256
"""...double quantisation stores those absmax in 8 bits with one fp32 constant per 256 of them (0.127 bits)."""
ADAM8_BLOCK = 2048
"""bitsandbytes' 8-bit AdamW: each moment in 8 bits, one fp32 scale per block of 2048 values."""


def bytes_per_param(dtype: str) -> float:
    """Weight storage per parameter: fp32 4, bf16/fp16 2, int8 1 (+ a scale per row, ignored), nf4 0.5625,
    nf4-dq 0.5159 (4 bits + absmax 32/64 bits, or 8/64 + 32/(64 x 256) bits double-quantised)."""
    if dtype == "nf4":
        return (4 + 32 / NF4_BLOCK) / 8
    if dtype == "nf4-dq":
        return (4 + 8 / NF4_BLOCK + 32 / (NF4_BLOCK * NF4_DQ_BLOCK)) / 8
    return {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0}[dtype]


QUANTISED = ("int8", "nf4", "nf4-dq")
"""Weight dtypes of a bitsandbytes base."""


def weight_bytes(shape: ModelShape, dtype: str) -> float:
    """A model's weights. Quantised formats (bitsandbytes' Linear4bit/8bit) replace only the blocks' linear layers:
    embeddings, output head and norms stay 16-bit."""
    if dtype in QUANTISED:
        linear = shape.layers * shape.layer_linear_params
        return linear * bytes_per_param(dtype) + (shape.params - linear) * 2.0
    return shape.params * bytes_per_param(dtype)


def optimizer_bytes_per_param(optimizer: str) -> float:
    """AdamW: two fp32 moments (8 bytes); adamw8bit: two 8-bit moments plus their block scales."""
    if optimizer == "adamw8bit":
        return 2 * (1 + 4 / ADAM8_BLOCK)
    return 8.0


def activation_elems_per_token(shape: ModelShape, lean: bool = False, down_apart: bool = False) -> float:
    """Values one layer keeps for the backward per token with fused (SDPA/flash) attention and no dropout:
    attention 5h (the q/k/v projection's input, q, k, v, the output projection's input), two norms' inputs 2h,
    MLP h + 2 ffn (GPT-2: input, up-projection output, GELU output) or h + 4 ffn (SwiGLU: gate, up, act, product).
    Korthikanti et al. 2022's 34 s b h bytes (16-bit, with dropout masks and ffn = 4h) counts the same tensors.
    `lean` (model.lean_activations): a SwiGLU MLP keeps gate and up alone (2 ffn), or 3 ffn where its down
    projection runs as itself and keeps the product (`down_apart`: LoRA over a quantised base); its norms' normalised
    inputs, which this count leaves out, are gone too."""
    swiglu = (3 if down_apart else 2) if lean else 4
    mlp = shape.hidden + (swiglu if shape.gated else 2) * shape.ffn
    return 7 * shape.hidden + mlp


LOGIT_CHUNK_TOKENS = 256
"""Tokens whose (tokens, V) fp32 logits exist at once in a log-prob pass (rlfuse/models/forward.py runs the LM head
chunk by chunk; the training pass keeps each token's log-sum-exp and recomputes its chunk's logits in the backward)."""


def logit_bytes(tokens: float, vocab: int) -> float:
    """A log-prob pass's LM-head transient: one chunk's fp32 logits and logsumexp's buffer of the same size."""
    return min(tokens, LOGIT_CHUNK_TOKENS) * vocab * 8


def train_activation_bytes(shape: ModelShape, tokens: float, elem_bytes: float, checkpointing: bool,
                           lm_head: bool, lean: bool = False, down_apart: bool = False) -> float:
    """Activations of one micro-batch's forward kept for its backward. Checkpointing keeps each layer's input only
    and recomputes one layer at a time. The LM loss's logits: logit_bytes; a value model's scalar head keeps nothing
    of note. lean, down_apart: as activation_elems_per_token."""
    per_layer = activation_elems_per_token(shape, lean, down_apart) * tokens * elem_bytes
    body = (shape.layers * shape.hidden * tokens * elem_bytes + per_layer) if checkpointing else shape.layers * per_layer
    return body + (logit_bytes(tokens, shape.vocab) if lm_head else 0.0)


def inference_activation_bytes(shape: ModelShape, tokens: float, elem_bytes: float, lm_head: bool) -> float:
    """A no-grad forward: one layer's tensors at a time, plus a log-prob pass's logits (logit_bytes)."""
    return activation_elems_per_token(shape) * tokens * elem_bytes + (logit_bytes(tokens, shape.vocab) if lm_head else 0.0)


@dataclass(frozen=True)
class MemoryInputs:
    """What the memory of a worker depends on, besides which roles it holds."""
    policy: ModelShape
    critic: ModelShape | None = None
    """A critic with its own body (rl.critic_init=rm|sft); None: no critic, or a value head on the actor."""
    reward: ModelShape | None = None
    """The reward model; None: a Python reward function."""
    weight_dtype: str = "fp32"
    """Frozen weights: fp32 | bf16 | fp16 | int8 | nf4 | nf4-dq."""
    train_dtype: str = "fp32"
    """Trained weights, their gradients (and LoRA adapters): fp32 | bf16."""
    act_bytes: float = 4.0
    """Bytes per activation and KV element (4 in fp32, 2 under bf16 autocast)."""
    lora_rank: int = 0
    """0: the actor trains all its weights."""
    optimizer: str = "adamw"
    """adamw (fp32 moments) | adamw8bit."""
    shared_base: bool = False
    """One frozen base for every policy role (generator and reference as adapters on/off), as the 4-bit pipeline."""
    generator_copy: bool = False
    """With shared_base: the generator is its own full-precision copy synced from the actor's merged weights (a
    layout rlfuse ran before its engine decoded the shared base; kept to price that choice), not adapters on it."""
    checkpointing: bool = False
    lean_activations: bool = False
    """model.lean_activations: SwiGLU MLPs keep 2 of their 4 ffn-wide activations (3 with LoRA on a quantised base)
    for the backward."""
    sync_adapters: bool = False
    """LoRA with rollout.weight_sync sending the adapters alone: a decoding worker without the actor holds the SFT
    model with the adapter beside its generator (one more frozen copy, kept) and receives only the adapters, instead
    of the whole merged policy passing through it at each sync."""
    train_rows: int = 16
    """Sequences per training micro-batch."""
    seq: int = 64
    """Tokens per sequence (prompt + response)."""
    train_seq: float = 0.0
    """Tokens a sequence costs in a training pass, its prompt shared by its group's samples (rl.share_prompt); 0:
    seq."""
    score_seq: float = 0.0
    """The same in a scoring pass; 0: seq."""
    score_rows: int = 16
    """Sequences per scoring forward."""
    kv_rows: int = 32
    """Rows the generator decodes at once on one worker."""
    release_reference: bool = False
    """rl.release_reference on a CPU (full fine-tuning, not FSDP): a worker that trains maps the reference and hands
    its pages back at each update (models/mapped.py), so the reference is resident in the scoring phase, not in the
    update's."""
    master_weights: bool = False
    """Mixed precision: bf16 trained weights with an fp32 master copy in the optimiser (4 more bytes per parameter,
    counted under optimizer; ZeRO's 16 bytes per parameter in all)."""
    shard: int = 1
    """FSDP/ZeRO-3-style sharding degree of weights, gradients and optimiser states over a group (1: replicated, as
    rlfuse's DDP trains today; the at-scale predictions shard)."""
    generator_shard: int = 0
    """Tensor-parallel degree of the generator's weights and KV cache (0: `shard`)."""
    fsdp: int = 1
    """rl.train_parallel=fsdp over this many training ranks (runtime/fsdp.py): the trained roles' weights, gradients
    and optimiser states in shards; the whole weights gathered for the rollout, one block (and the root's embeddings
    and heads) at a time in training. 1: DDP replicas."""
    store_bytes: float = 0.0
    """Bytes of Ray's object store the worker's process maps at each weight sync and keeps counting in its RSS
    (object_store_bytes); charged to the weights (base)."""

    @property
    def decodes_adapters(self) -> bool:
        """The engine decodes the shared base with the actor's LoRA adapters unmerged (no generator copy)."""
        return self.shared_base and self.lora_rank > 0 and not self.generator_copy

    @property
    def adapter_roles(self) -> frozenset[str]:
        """The roles whose forwards run LoRA adapters unmerged: the actor (and a value head on its body) under LoRA;
        the reward model and the critic too where they are adapters on the shared base."""
        if not self.lora_rank:
            return frozenset()
        return frozenset({"actor", "reward", "critic"} if self.shared_base else
                         {"actor"} | ({"critic"} if self.critic is None else set()))


def lora_train_resident(m: MemoryInputs, p: MachineProfile, counted: float) -> float:
    """What a LoRA training micro-batch whose activations are counted as `counted` holds resident: the profile's
    measured line (lora_train_resident_bytes + lora_train_ratio x counted, never under the count) where the
    micro-batch is like the ones it was measured on (the profiled model's shape, full-precision weights and
    activations, lean activations, no checkpointing), else the count (a line from a small model's fixed bytes, or
    from a 4-bit base's other temporaries, says nothing there)."""
    like = (p.lora_train_ratio and p.shape == m.policy.key and m.weight_dtype == "fp32" and m.act_bytes == 4.0
            and m.lean_activations and not m.checkpointing)
    return max(counted, p.lora_train_resident_bytes + p.lora_train_ratio * counted) if like else counted


def sent_bytes(m: MemoryInputs, role: str) -> float:
    """What one weight sync puts into the object store for `role` (runtime/ray_train.actor_weights): the actor's
    merged weights in the trained dtype, or its adapters alone (rollout.weight_sync=adapters); the critic's whole
    (its own body, or the actor's with a value head: rl.critic_init=actor)."""
    train_b = 4.0 if m.train_dtype == "fp32" else 2.0
    if role == "critic":
        return (m.critic or m.policy).params * train_b
    if m.lora_rank and m.sync_adapters:
        return m.policy.lora_params(m.lora_rank) * train_b
    return m.policy.params * train_b


def object_store_bytes(roles: set[str] | tuple[str, ...], groups: list, m: MemoryInputs, device: str) -> float:
    """Bytes of Ray's object store a worker holding `roles` maps at each weight sync, its RSS counting them for the
    rest of the run (the store's shared pages stay mapped once touched: on SmolLM2 on the separated placement the
    sending and the decoding worker each held 513 MiB of RssShmem, one copy of the policy, from the first sync to
    the end). `groups`: every group's roles. The actor's group puts the actor's weights (sent_bytes) when a
    generator sits in a group without the actor, and a separate critic's when a scoring group lacks the critic
    (runtime/ray_driver.sync_weights; rank 0 puts them, and each rank of the group is charged: the group's peak);
    the receivers load views of the same pages: one copy in the machine's memory, counted in each RSS. `device`: the
    worker's (cuda: 0, the store is host memory and the budget device memory)."""
    if device != "cpu":
        return 0.0
    roles, groups = set(roles), [set(g) for g in groups]
    decoders_apart = any("generator" in g and "actor" not in g for g in groups)
    critic_apart = any("critic" in g for g in groups) and any(
        "critic" not in g and g & {"reference", "reward"} for g in groups)
    if "actor" in roles:
        return decoders_apart * sent_bytes(m, "actor") + (critic_apart and "critic" in roles) * sent_bytes(m, "critic")
    received = sent_bytes(m, "actor") if "generator" in roles else 0.0
    if critic_apart and "critic" not in roles and roles & {"reference", "reward"}:
        received += sent_bytes(m, "critic")
    return received


def worker_memory(roles: set[str] | tuple[str, ...], m: MemoryInputs, p: MachineProfile) -> dict[str, float]:
    """Bytes per component (COMPONENTS) of one worker holding `roles` (the policy roles: actor, generator,
    reference; critic; reward)."""
    roles = set(roles)
    if m.fsdp > 1 and "actor" in roles:
        return fsdp_worker_memory(roles, m, p)
    lora = m.lora_rank > 0
    quantised = m.weight_dtype in QUANTISED  # a bitsandbytes base: its LoRA layers run apart from the lean MLP
    policy_frozen = weight_bytes(m.policy, m.weight_dtype)
    train_b = 4.0 if m.train_dtype == "fp32" else 2.0
    out = dict.fromkeys(COMPONENTS, 0.0)
    # (activations the model counts, bytes resident for them): the two differ where the profile measured the line
    trainable, acts = 0.0, [(0.0, 0.0)]
    train_seq, score_seq = m.train_seq or m.seq, m.score_seq or m.seq
    policy_roles = roles & {"actor", "generator", "reference"}
    # full fine-tuning: a worker holding the actor decodes it in place (runtime/local.decode_engine), no copy
    in_place = not m.shared_base and not lora and {"actor", "generator"} <= roles and m.shard == 1
    if m.shared_base:  # one frozen base; the actor's adapters serve the generator too, unless it has its own copy
        copies = 1 if policy_roles else 0
        if m.generator_copy and "generator" in roles:
            out["base"] += weight_bytes(m.policy, m.train_dtype)
    else:
        copies = (("actor" in roles and lora) + ("generator" in roles and not in_place)
                  + ("reference" in roles and not (lora and "actor" in roles)))
    # rl.release_reference: a separate reference beside the actor it scores for is resident in scoring alone
    released = m.release_reference and not lora and not m.shared_base and {"actor", "reference"} <= roles
    out["base"] += (copies - released) * policy_frozen
    if lora and roles & {"actor", "generator"} and (m.shared_base or "actor" in roles):
        out["adapters"] += m.policy.lora_params(m.lora_rank) * train_b
    if "actor" in roles:
        if lora:
            trainable += m.policy.lora_params(m.lora_rank)
        else:
            out["base"] += m.policy.params * train_b
            trainable += m.policy.params
        counted = train_activation_bytes(m.policy, m.train_rows * train_seq, m.act_bytes, m.checkpointing, True,
                                         m.lean_activations, lora and quantised)
        # under LoRA the profile's measured line: what such a micro-batch holds resident, the heap's share included
        acts.append((counted, lora_train_resident(m, p, counted) if lora else counted))
    if "generator" in roles:
        out["kv_cache"] += m.kv_rows * m.seq * m.policy.kv_bytes_per_token(m.act_bytes)
        if "actor" not in roles and not m.shared_base and lora and m.sync_adapters:  # the base the adapters merge on
            out["base"] += policy_frozen
            out["adapters"] += m.policy.lora_params(m.lora_rank) * train_b
    if roles & {"actor", "reference"}:  # log-prob passes over scored samples (the generator keeps only the last logits)
        scoring = (inference_activation_bytes(m.policy, m.score_rows * score_seq, m.act_bytes, True)
                   + released * policy_frozen)
        acts.append((scoring, scoring))
    on_base = m.shared_base and lora  # critic and reward as adapters on the shared base (same shape as the policy)
    if m.critic is not None and "critic" in roles:
        if on_base:
            out["adapters"] += m.critic.lora_params(m.lora_rank) * train_b
            trainable += m.critic.lora_params(m.lora_rank)
        else:
            out["base"] += m.critic.params * train_b
            trainable += m.critic.params
        counted = train_activation_bytes(m.critic, m.train_rows * train_seq, m.act_bytes, m.checkpointing, False,
                                         m.lean_activations, on_base and quantised)
        acts.append((counted, lora_train_resident(m, p, counted) if on_base else counted))
    elif m.critic is not None and roles & {"reference", "reward"}:  # values for scoring: a frozen copy
        out["base"] += weight_bytes(m.critic, m.weight_dtype)
    if m.reward is not None and "reward" in roles:
        if on_base:
            out["adapters"] += m.reward.lora_params(m.lora_rank) * train_b
        else:
            out["base"] += weight_bytes(m.reward, m.weight_dtype)
        scoring = inference_activation_bytes(m.reward, m.score_rows * score_seq, m.act_bytes, False)
        acts.append((scoring, scoring))
    out["gradients"] = trainable * train_b
    out["optimizer"] = trainable * (optimizer_bytes_per_param(m.optimizer) + (4.0 if m.master_weights else 0.0))
    if "generator" in roles and m.shard > 1:  # the generator's copy and cache shard by its own (tensor-parallel) degree
        gen_shard = m.generator_shard or m.shard
        gen_copy = (weight_bytes(m.policy, m.train_dtype) if m.generator_copy else 0.0) if m.shared_base else policy_frozen
        out["base"] += gen_copy * (m.shard / gen_shard - 1)
        out["kv_cache"] *= m.shard / gen_shard
    for k in ("base", "adapters", "gradients", "optimizer", "kv_cache"):
        out[k] /= m.shard
    counted, out["activations"] = max(acts, key=lambda a: a[1])
    # the measured line has the heap's slack on those activations in it already: the fraction applies to the count;
    # the object store's pages (the weight sync's, sent or received) are whole pages, no allocator's
    tensors = sum(out[k] for k in COMPONENTS[:6])
    out["base"] += m.store_bytes
    out["slack"] = p.runtime_bytes + p.slack_fraction * (tensors - out["activations"] + counted)
    tensors += m.store_bytes
    out["total"] = tensors + out["slack"]
    return out


def fsdp_worker_memory(roles: set[str], m: MemoryInputs, p: MachineProfile) -> dict[str, float]:
    """A training rank of rl.train_parallel=fsdp (runtime/fsdp.py) over m.fsdp ranks, at the larger of its two
    phases. Rollout: the trained roles' whole weights gathered beside their shards and the AdamW shards, decoding
    (KV cache) and scoring; no gradients. Update: the shards of weights, gradients and AdamW states, one block of each
    trained model gathered (a block's all-gather output; the next block's prefetch is not counted) with the root
    group's (embeddings, final norm, LM head) kept from its forward to its backward, and a micro-batch's training
    activations. The frozen reference is sharded too, a frozen reward model whole throughout. A rank that scores
    gathers the actor alone for the rollout, then the reference and a separate critic, one at a time, each in a
    phase of its own."""
    # rl.release_reference maps a replicated reference (models/mapped.py); FSDP shards it instead, as counted below
    whole = worker_memory(roles, replace(m, fsdp=1, release_reference=False), p)
    W, train_b = m.fsdp, (4.0 if m.train_dtype == "fp32" else 2.0)
    lora = m.lora_rank > 0
    sharded = [m.policy] + ([m.critic] if m.critic is not None and "critic" in roles else [])
    # the sharded modules hold every weight of their model: under LoRA the frozen base weights too, plus adapters
    base_b = lambda s: (weight_bytes(s, m.weight_dtype) + s.lora_params(m.lora_rank) * train_b
                        if lora and s is m.policy else s.params * train_b)
    gathered = sum(base_b(s) for s in sharded)
    root = sum(base_b(s) * (s.params - s.layers * s.layer_params) / s.params for s in sharded)
    block = sum(base_b(s) * s.layer_params / s.params for s in sharded)
    # the frozen reference (full fine-tuning; under LoRA it is the actor with adapters off) sharded as well, gathered
    # with the actor for the rollout's scoring; other frozen copies (a reward model) whole throughout
    ref = weight_bytes(m.policy, m.weight_dtype) if "reference" in roles and not lora else 0.0
    frozen = whole["base"] + whole["adapters"] - gathered - ref
    train_seq, score_seq = m.train_seq or m.seq, m.score_seq or m.seq
    train_acts = [train_activation_bytes(s, m.train_rows * train_seq, m.act_bytes, m.checkpointing, s is m.policy,
                                         m.lean_activations, lora and m.weight_dtype in QUANTISED) for s in sharded]
    counted_train = max(train_acts)
    train_acts[0] = lora_train_resident(m, p, train_acts[0]) if lora else train_acts[0]  # as worker_memory's
    score_acts = [inference_activation_bytes(m.policy, m.score_rows * score_seq, m.act_bytes, True)]
    if m.reward is not None and "reward" in roles:
        score_acts.append(inference_activation_bytes(m.reward, m.score_rows * score_seq, m.act_bytes, False))
    # a rank that scores gathers the actor alone for the rollout (to decode, or as the reference under LoRA), then
    # the reference and a separate critic one at a time for a pass each; a rank that needs no whole actor (it
    # neither decodes nor scores with it) gathers nothing whole: the weights leave it a tensor at a time
    # (runtime/fsdp.py)
    deferred = bool(roles & {"reference", "reward"})
    actor_whole = "generator" in roles or (deferred and lora)
    shards = (gathered + ref) / W
    whole_in_rollout = (base_b(m.policy) if deferred else gathered + ref) if actor_whole else 0.0
    rollout = {"base": frozen + whole_in_rollout + shards, "adapters": 0.0,
               "gradients": 0.0, "optimizer": whole["optimizer"] / W,
               # deferred: the policy's scoring passes run in the phases below; decoding keeps the last logits only
               "activations": max(score_acts[1:] if deferred else score_acts, default=0.0),
               "kv_cache": whole["kv_cache"]}
    update = {"base": frozen + shards + root + block, "adapters": 0.0, "gradients": whole["gradients"] / W,
              "optimizer": whole["optimizer"] / W, "activations": max(train_acts), "kv_cache": 0.0}
    phases = [rollout, update]
    later = [(ref, m.policy, True)] if deferred and ref else []
    later += [(base_b(m.critic), m.critic, False)] if deferred and len(sharded) > 1 else []
    rows = min(m.score_rows, m.kv_rows)  # a deferred pass scores this rank's share of the samples (kv_rows: the
    # rows it decodes, the iteration's samples over the ranks)
    for whole_b, spec, lm in later:
        phases.append({"base": frozen + whole_b + shards, "adapters": 0.0, "gradients": 0.0, "kv_cache": 0.0,
                       "optimizer": whole["optimizer"] / W, "activations": inference_activation_bytes(
                           spec, rows * score_seq, m.act_bytes, lm)})
    out = max(phases, key=lambda c: sum(c.values()))
    counted = counted_train if out is update else out["activations"]  # the slack on the count, as worker_memory's
    out["slack"] = p.runtime_bytes + p.slack_fraction * (sum(out.values()) - out["activations"] + counted)
    out["total"] = sum(out[k] for k in COMPONENTS[:6]) + out["slack"]
    return out


def memory_table(rows: dict[str, dict[str, float]], unit: float = GiB, unit_name: str = "GiB") -> str:
    """A markdown table: one row per worker (or group), one column per component."""
    head = "| worker | " + " | ".join(COMPONENTS) + " |"
    lines = [head, "|---" * (len(COMPONENTS) + 1) + "|"]
    digits = 3 if unit >= GiB else 1
    for name, mem in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{mem[k] / unit:.{digits}f}" for k in COMPONENTS) + " |")
    return f"({unit_name})\n" + "\n".join(lines)


def group_store_bytes(group, spec, m: MemoryInputs) -> float:
    """object_store_bytes of one worker of `group` in `spec` (on Ray; its own device: a GPU worker's budget is
    device memory)."""
    if not spec.uses_ray:
        return 0.0
    return object_store_bytes(group.roles, [g.roles for g in spec.groups], m,
                              "cuda" if group.gpus_per_worker else "cpu")


def memory_model(m: MemoryInputs, p: MachineProfile, samples: int, max_rows: int,
                 shard_groups: bool = False, fsdp: bool = False) -> Callable:
    """A `memory_of` for rlfuse.plan.check: predicted peak bytes of one worker of a WorkerGroup of a
    PlacementSpec. A group that decodes splits the iteration's `samples` over its workers (at most `max_rows` at
    once each). fsdp: the training group shards its roles over its workers (rl.train_parallel=fsdp)."""
    def memory_of(group, spec) -> int:
        kv_rows = min(max_rows, math.ceil(samples / group.workers))
        shard = group.workers if shard_groups else 1
        mi = replace(m, kv_rows=kv_rows, shard=shard, fsdp=group.workers if fsdp else 1,
                     store_bytes=group_store_bytes(group, spec, m))
        return int(worker_memory(group.roles, mi, p)["total"])

    return memory_of


EVAL_SCORE_ROWS = 32
"""Sequences per log-prob pass of the held-out evaluation's scorer (rlfuse/evaluation.py)."""


def pulled_bytes(m: MemoryInputs) -> float:
    """What the driver of a Ray run pulls through the object store at the end (runtime/ray_train.pull_into): the
    actor's trained parameters (its adapters under LoRA)."""
    train_b = 4.0 if m.train_dtype == "fp32" else 2.0
    return (m.policy.lora_params(m.lora_rank) if m.lora_rank else m.policy.params) * train_b


def driver_memory(m: MemoryInputs, eval_rows: int) -> float:
    """What the driver of a Ray run (trainers/rl.py: it holds the models its evaluations and the saved model use)
    adds to the machine after the plan is checked, in pages nothing else holds: what it writes over its file-mapped
    weights (the trained actor pulled back at the end, pulled_bytes; under LoRA without a shared base the
    generator's full-precision copy, written at the first evaluation, and the merged weights models/weights.
    merged_state_dict builds beside it for that copy: twice the policy at the sync; on a shared base the adapters
    alone) and an evaluation's KV cache for `eval_rows` rows with its log-prob pass (EVAL_SCORE_ROWS at a time).
    Its frozen weights stay mapped from the model files (page cache, which the machine's available memory counts as
    free to reclaim), the object store's pages are the machine's once (machine_memory), and its imports are loaded
    when the check runs. Measured on SmolLM2's math config on the separated placement (bench.rss_trace): 566 MiB
    of anonymous memory from the check to its peak, 513 of them the pulled actor."""
    written = pulled_bytes(m)
    if m.lora_rank and not m.shared_base:
        written += 2 * weight_bytes(m.policy, m.train_dtype)
    decoding = eval_rows * m.seq * m.policy.kv_bytes_per_token(m.act_bytes)
    rows = min(eval_rows, EVAL_SCORE_ROWS)
    scoring = inference_activation_bytes(m.policy, rows * (m.score_seq or m.seq), m.act_bytes, True)
    return written + (decoding + scoring if eval_rows else 0.0)


def machine_bytes(spec, memory_of: Callable, m: MemoryInputs, pulled: float = 0.0) -> float:
    """Predicted bytes of every worker of `spec` on one machine: each worker's peak (memory_of), the object store's
    pages once (every worker that touches them counts them in its RSS; the machine holds them once: the actor
    group's, which hold everything a sync sends, or the `pulled` bytes of the driver's final pull where those are
    more: the store reuses the syncs' pages for it)."""
    per_worker = sum(g.workers * (memory_of(g, spec) - group_store_bytes(g, spec, m)) for g in spec.groups)
    senders = [g for g in spec.groups if "actor" in g.roles]
    return per_worker + max(group_store_bytes(senders[0], spec, m) if senders else 0.0, pulled)
