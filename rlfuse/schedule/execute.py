"""Execute a fused actor/critic schedule on real GPT-2 stages with torch.distributed point-to-point.

One process per device (gloo, on CPU; tested). Each device runs its program from comm.programs: its tasks in the
schedule's order, with every send and receive posted in one global order all ranks agree on, so the i-th send on a
channel meets the i-th receive there without tags (as NCCL requires: it matches by issue order only). A forward
waits for its input (a receive posted earlier), runs its stage, and sends the output on with a non-blocking send;
a backward waits for the output's gradient, back-propagates, and sends the input's gradient back. The actor's
last stage computes the PPO policy loss, the critic's the value loss. After the schedule: tied embedding gradients
are summed between the actor's first and last stages, critic replicas all-reduce, and each stage's optimiser steps.
A schedule the checker rejects is never run.
"""

from __future__ import annotations

import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlfuse.algos.losses import ppo_policy_loss, value_loss
from rlfuse.schedule.comm import Op, Recv, Send, input_of, message_of, programs, verify
from rlfuse.schedule.model import Problem, Schedule, Task, check


@dataclass(frozen=True)
class ExecSpec:
    model_dir: str
    micro_batch_size: int = 2
    seq_len: int = 12
    seed: int = 0
    lr: float = 1e-3
    backend: str = "gloo"


def micro_batch_data(spec: ExecSpec, prob: Problem, model: int, index: int, vocab: int) -> dict:
    """Deterministic inputs of one micro-batch (index counts across replicas for the critic)."""
    g = torch.Generator().manual_seed(spec.seed * 100_003 + model * 10_007 + index)
    B, T = spec.micro_batch_size, spec.seq_len
    data = {"tokens": torch.randint(0, vocab, (B, T), generator=g), "mask": torch.ones(B, T - 1)}
    if model == 0:
        data["old_logprobs"] = -3.0 + 0.5 * torch.randn(B, T - 1, generator=g)
        data["advantages"] = torch.randn(B, T - 1, generator=g)
    else:
        data["old_values"] = 0.1 * torch.randn(B, T - 1, generator=g)
        data["returns"] = torch.randn(B, T - 1, generator=g)
    return data


def build_models(spec: ExecSpec):
    from rlfuse.models.heads import ValueModel
    from rlfuse.models.load import load_causal_lm

    actor = load_causal_lm(spec.model_dir)
    torch.manual_seed(spec.seed)
    critic = ValueModel.from_causal_lm(load_causal_lm(spec.model_dir))
    torch.nn.init.normal_(critic.head.weight, std=0.02)  # non-zero, so every critic parameter gets a gradient
    return actor, critic


def stage_loss(prob: Problem, model: int, out: torch.Tensor, data: dict) -> torch.Tensor:
    """Per-micro-batch loss, scaled so that summing over all micro-batches (and replicas) gives the mean."""
    pm = prob.models[model]
    if model == 0:
        loss, _ = ppo_policy_loss(out, data["old_logprobs"], data["advantages"], data["mask"], clip_eps=0.2)
        return loss / pm.micro_batches
    loss, _ = value_loss(out, data["old_values"], data["returns"], data["mask"], clip_eps=0.2)
    return loss / (pm.micro_batches * pm.replicas)


def head_output(stage, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The last stage's head on its hidden states (B, T, H): the actor's log-probs of the next tokens, the critic's
    values, both (B, T-1)."""
    if stage.kind == "actor":
        logp = torch.log_softmax(stage.head(h[:, :-1]).float(), dim=-1)
        return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return stage.head(h[:, :-1]).squeeze(-1).float()


def _received(inbox: dict, prob: Problem, t: Task) -> torch.Tensor:
    """The input of `t`, waiting for its receive (posted earlier, in the agreed order)."""
    buf, handle = inbox.pop(input_of(prob, t))
    handle.wait()
    return buf


def _named(module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters()}


def _worker(rank: int, prob: Problem, progs: list[list[Op]], spec: ExecSpec, port: int, out_dir: str) -> None:
    from rlfuse.schedule.stages import split_actor, split_critic

    torch.set_num_threads(1)
    dist.init_process_group(spec.backend, rank=rank, world_size=prob.devices, init_method=f"tcp://127.0.0.1:{port}")
    program = progs[rank]
    actor, critic = build_models(spec)
    names = {0: _named(actor), 1: _named(critic)}
    vocab = actor.config.vocab_size
    stages = {0: split_actor(actor, prob.models[0].stages), 1: split_critic(critic, prob.models[1].stages)}
    mine = {}  # (model, replica, stage) -> Stage module on this device
    for m in (0, 1):
        replica, stage = prob.stage_on(m, rank)
        mine[(m, replica, stage)] = stages[m][stage]
    # process groups are created by every rank in the same order
    pm1 = prob.models[1]
    replica_groups = [dist.new_group([prob.device_of(1, r, s) for r in range(pm1.replicas)]) for s in range(pm1.stages)]
    tied_group = dist.new_group(sorted({0, prob.models[0].stages - 1}))
    ctx, pending, spans = {}, [], []
    inbox, outbox = {}, {}  # Message -> (buffer, receive handle); Message -> tensor to send
    shape = (spec.micro_batch_size, spec.seq_len, actor.config.n_embd)  # every message is a stage's hidden states
    dist.barrier()
    t0 = time.perf_counter()
    for op in program:  # receives and sends in the one global order (comm.programs), so no tags are needed
        if isinstance(op, Recv):
            buf = torch.empty(shape)
            inbox[op.message] = (buf, dist.irecv(buf, op.message.src))
            continue
        if isinstance(op, Send):
            pending.append(dist.isend(outbox.pop(op.message), op.message.dst))
            continue
        t = op.task
        pm = prob.models[t.model]
        stage = mine[(t.model, t.replica, t.stage)]
        key = (t.model, t.replica, t.stage, t.mb)
        last = t.stage == pm.stages - 1
        if t.kind == "F":
            data = micro_batch_data(spec, prob, t.model, t.replica * pm.micro_batches + t.mb, vocab)
            x = data["tokens"] if t.stage == 0 else _received(inbox, prob, t).requires_grad_(True)
            start = time.perf_counter()
            y = stage(x)
            if last:
                y = head_output(stage, y, data["tokens"])
                y = stage_loss(prob, t.model, y, data)
            else:
                outbox[message_of(prob, t)] = y.detach().contiguous()
            ctx[key] = (x, y)
        else:
            x, y = ctx.pop(key)
            if last:
                start = time.perf_counter()
                y.backward()
            else:
                grad = _received(inbox, prob, t)
                start = time.perf_counter()
                torch.autograd.backward(y, grad)
            if t.stage > 0:
                outbox[message_of(prob, t)] = x.grad.contiguous()
        spans.append((rank, t, start - t0, time.perf_counter() - t0))
    for w in pending:
        w.wait()
    # after the schedule: sum the tied embedding between the actor's first and last stage, all-reduce critic replicas
    if actor.config.tie_word_embeddings and rank in (0, prob.models[0].stages - 1) and prob.models[0].stages > 1:
        dist.all_reduce(actor.lm_head.weight.grad, group=tied_group)
    critic_replica, critic_stage = prob.stage_on(1, rank)
    if pm1.replicas > 1:
        for p in mine[(1, critic_replica, critic_stage)].parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=replica_groups[critic_stage])
    grads = {}
    for (m, _, _), stage in mine.items():
        for p in stage.parameters():
            if p.grad is not None:
                grads[f"{'actor' if m == 0 else 'critic'}.{names[m][id(p)]}"] = p.grad.clone()
    for (m, _, _), stage in mine.items():  # optimiser steps after the schedule
        torch.optim.SGD([p for p in stage.parameters() if p.grad is not None], lr=spec.lr).step()
    torch.save({"grads": grads, "spans": spans}, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def execute(prob: Problem, sched: Schedule, spec: ExecSpec) -> tuple[dict, list]:
    """Run the schedule on prob.devices processes; returns (gradients by parameter name, [(device, task, start, end)])."""
    check(prob, sched)  # raises before anything runs
    progs = programs(prob, sched)
    verify(prob, progs)  # the order every rank posts its sends and receives in agrees on every channel
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(prob, progs, spec, _free_port(), out_dir), nprocs=prob.devices, join=True)
        grads, spans = {}, []
        for r in range(prob.devices):
            part = torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
            for name, g in part["grads"].items():
                grads.setdefault(name, g)  # the tied embedding appears on two ranks, equal after the all-reduce
            spans += part["spans"]
    return grads, spans


def reference_grads(prob: Problem, spec: ExecSpec) -> dict:
    """Each model trained alone, unsplit, on the same micro-batches: the gradients the pipeline must reproduce."""
    actor, critic = build_models(spec)
    vocab = actor.config.vocab_size
    for m, model in ((0, actor), (1, critic)):
        pm = prob.models[m]
        for i in range(pm.micro_batches * pm.replicas):
            data = micro_batch_data(spec, prob, m, i, vocab)
            tok = data["tokens"]
            if m == 0:
                out = torch.log_softmax(model(tok).logits[:, :-1].float(), -1).gather(-1, tok[:, 1:, None]).squeeze(-1)
            else:
                out = model(tok, torch.ones_like(tok))[:, :-1]
            stage_loss(prob, m, out, data).backward()
    return {f"{n_}.{name}": p.grad.clone() for n_, model in (("actor", actor), ("critic", critic))
            for name, p in model.named_parameters() if p.grad is not None}


def measured_bubble_ratio(spans: list, devices: int) -> tuple[float, float]:
    """(makespan, 1 - busy / (P * makespan)) from recorded compute spans."""
    makespan = max(e for *_, e in spans) - min(s for _, _, s, _ in spans)
    busy = sum(e - s for _, _, s, e in spans)
    return makespan, 1 - busy / (devices * makespan)
