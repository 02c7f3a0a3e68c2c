"""Pipelined PPO update: the actor and the critic each cut into P stages over the P ranks of a process group, the
critic reversed (rank r holds actor stage r and critic stage P-1-r), trained on the iteration's real experience.

For each mini-batch of every PPO epoch (learn/batches.py minibatches' list, as update() walks it) one schedule runs over the
mini-batch's micro-batches (learn/batches.py micro_batches: the indices and loss shares of the single-process update):
`pipeline_serial` is the actor's 1F1B then the critic's (build.serial), `pipeline_fused` one fused schedule
(build.fused, searched once per (P, micro-batch count) on rank 0 and broadcast, so every rank runs the same one).
Messages go in comm.programs' one global order (no tags). The actor's last stage computes rl.micro_policy_loss and
the critic's last stage rl.micro_value_loss (the functions themselves, handed a view of the stage that looks like the
unsplit model to them), scaled by the same shares. After the schedule, per model: the tied embedding's gradient
summed between the actor's first and last stages, the gradient norm over all its stages (one all-reduce of squared
norms) clipped to rl.grad_clip as clip_grad_norm_ does, then its AdamW step. Every task's start and end are recorded.

Departures from learn/update.py's update, on purpose:
- micro-batches run full rows, never prefix-shared (the same numbers, more token-forwards): a stage boundary would
  have to carry the shared prompt's states and the continuations' separately;
- a non-finite loss is seen as a non-finite gradient norm after the all-reduce, so every rank skips that model's step
  together (update() skips it on the loss; the same steps are skipped);
- a separate critic only (rl.critic_init sft or reward), no LoRA or shared base: stages hold plain modules.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlfuse.config import RLConfig
from rlfuse.learn.batches import micro_batches
from rlfuse.learn.checkpoint import keep_learning_rates
from rlfuse.learn.losses import micro_policy_loss, micro_value_loss
from rlfuse.learn.optim import build_constant_optimizer
from rlfuse.learn.update import BadSteps, add_stats
from rlfuse.models.forward import collate
from rlfuse.models.pipeline_stages import Stage, split_actor, split_critic
from rlfuse.models.quantize import trim_cpu_heap, update_heap
from rlfuse.rollout.fusion import Experience
from rlfuse.runtime.process import free_port, pin_threads, pin_to_cores
from rlfuse.schedule.build import fused, serial
from rlfuse.schedule.comm import Op, Recv, Send, input_of, message_of, programs, verify
from rlfuse.schedule.model import PipeModel, Problem, Schedule, Task, check, simulate

ACTOR, CRITIC = 0, 1
MODES = ("pipeline_serial", "pipeline_fused")
FUSED_SEARCH_SECONDS = 2.0
"""Time limit of the fused search, paid once per micro-batch count (the schedules are cached); it stops earlier
at the lower bound, which small problems reach in milliseconds."""


@dataclass
class StagePart:
    """One model's stage on this rank, with its optimiser."""
    stage: Stage
    index: int
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    norm_params: list
    """Parameters whose gradients count in the model's norm here: the tied LM head counts once, on the first stage."""
    tied: torch.nn.Parameter | None = None
    """The tied embedding / LM head weight on the actor's first or last stage (P > 1), summed between them."""


class _LastStageView:
    """The last stage as the unsplit model looks to learn/losses.py's loss functions: backbone_and_head finds `body` and the
    LM head (actor); calling it gives values (critic). The body continues from `x`, the previous stage's hidden
    states (the token ids it is given are those same rows: it reads them only on a single stage). No `config`, so
    models/forward.py can_share says no and the micro-batch is collated in full rows, as on the other stages."""
    base_model_prefix = "body"

    def __init__(self, stage: Stage, x: torch.Tensor):
        self.stage, self.x = stage, x

    def parameters(self):
        return self.stage.parameters()

    def body(self, input_ids, attention_mask):
        return SimpleNamespace(last_hidden_state=self.stage(input_ids if self.stage.first else self.x, attention_mask))

    def get_output_embeddings(self):
        return self.stage.head

    def __call__(self, input_ids, attention_mask):  # as ValueModel.forward
        return self.stage.head(self.body(input_ids, attention_mask).last_hidden_state).squeeze(-1).float()


@dataclass
class PipelineTrainer:
    """This rank's actor and critic stages and the update that trains them (every rank of the group calls update
    with the same arguments)."""
    mode: str
    rl: RLConfig
    pad_id: int
    rank: int
    world: int
    parts: dict[int, StagePart]
    tied_group: object | None
    task_costs: tuple[float, float, float, float] = (1.0, 2.0, 1.0, 2.0)
    """(actor forward, actor backward, critic forward, critic backward) per stage, relative: what the fused search
    plans with; measured after the first update."""
    costs_measured: bool = False
    owners: list = field(default_factory=list)
    """(parameter of the whole actor or critic, rank whose stage trains it): what sync_whole_models broadcasts."""
    plans: dict = field(default_factory=dict)
    spans: list = field(default_factory=list)
    """(mini-batch number, rank, Task, start, end) of every task this rank ran in the current update, perf_counter
    seconds (one clock per host)."""
    last_spans: list = field(default_factory=list)
    """Every rank's spans of the last update (gathered at its end)."""
    last_schedules: dict = field(default_factory=dict)
    """Mini-batch number -> the schedule it ran, in the last update."""

    # ----------------------------------------------------------------------------------------- schedules

    def problem(self, n: int) -> Problem:
        fa, ba, fc, bc = self.task_costs
        P = self.world
        return Problem(P, (PipeModel(P, 1, n, fa, ba), PipeModel(P, 1, n, fc, bc)))

    def plan(self, n: int) -> tuple[Problem, Schedule, list[Op]]:
        """(problem, schedule, this rank's program) for a mini-batch of n micro-batches: built once per n (the fused
        search costs up to FUSED_SEARCH_SECONDS) and checked before it is ever run."""
        if n not in self.plans:
            prob = self.problem(n)
            if self.mode == "pipeline_serial":
                sched = serial(prob)
            else:  # the search is timed, so it could differ between ranks: rank 0's is everyone's
                box = [fused(prob, seed=0, time_limit=FUSED_SEARCH_SECONDS).schedule if self.rank == 0 else None]
                dist.broadcast_object_list(box, src=0)
                sched = box[0]
            check(prob, sched)
            progs = programs(prob, sched)
            verify(prob, progs)
            self.plans[n] = (prob, sched, progs[self.rank])
        return self.plans[n]

    # ----------------------------------------------------------------------------------------- the update

    def adopt_measured_costs(self) -> None:
        """Once, after the first update: its measured task times replace the guessed ones and the schedules are
        planned again on them (every rank holds the same gathered spans, so the same costs and schedules)."""
        if not self.costs_measured and self.last_spans:
            self.task_costs, self.plans, self.costs_measured = task_times(self.last_spans), {}, True

    def update(self, exp: Experience, adv, returns, kl_coef: float, batches: list[list[int]], bad: BadSteps,
               temperature: float | None = None) -> dict:
        """All PPO epochs and mini-batches (`batches`, learn/batches.py minibatches) on this rank's stages; returns the same
        train/ stats as learn/update.py's update (gathered from the last stages' ranks) and the time."""
        rl, t0 = self.rl, time.perf_counter()
        self.adopt_measured_costs()
        temperature = rl.temperature if temperature is None else temperature

        def actor_loss(view, idx, share):
            loss, stats = micro_policy_loss(view, exp, idx, adv, rl, kl_coef, self.pad_id, temperature)
            return loss * share[rl.loss_share], stats

        def critic_loss(view, idx, share):
            loss, stats = micro_value_loss(view, exp, idx, returns, rl, self.pad_id)
            return loss * share["token"], stats

        sums: dict = {ACTOR: {}, CRITIC: {}}
        counts = {ACTOR: 0, CRITIC: 0}
        norms, steps, schedules, self.spans = [0.0, 0.0], [0, 0], {}, []
        with update_heap():  # run.cpu_heap=update, as learn/update.py optimise
            for n, mini in enumerate(batches):
                mbs = list(micro_batches(exp, mini, rl.micro_batch_size, 0, 1, rl.micro_batch_tokens,
                                         rl.share_prompt))
                trim_cpu_heap()  # as learn/update.py before each micro-batch: here the schedule holds several at once
                prob, schedules[n], program = self.plan(len(mbs))
                counts = self._run(n, prob, program, exp, mbs, (actor_loss, critic_loss), sums, counts)
                for m, norm in enumerate(self._step(bad)):
                    if norm is not None:
                        norms[m], steps[m] = norms[m] + norm, steps[m] + 1
        mine = {k: float(v) / max(1, int(counts[m])) for m in (ACTOR, CRITIC) for k, v in sums[m].items()}
        everyone = [None] * self.world
        # once per update: the actor's stats live on rank P-1, the critic's on rank 0, the spans everywhere
        dist.all_gather_object(everyone, (mine, self.spans))
        stats = {k: v for part, _ in everyone for k, v in part.items()}
        self.last_spans, self.last_schedules = [span for _, spans in everyone for span in spans], schedules
        times = schedule_summary(self.last_spans, schedules, task_times(self.last_spans), self.world)
        return stats | {"train/grad_norm": norms[ACTOR] / max(1, steps[ACTOR]),
                        "train/critic_grad_norm": norms[CRITIC] / max(1, steps[CRITIC]),
                        "train/pipeline_bubble": 1 - times["busy"] / (self.world * times["executed"]),
                        "train/pipeline_bubble_simulated": 1 - times["sim_busy"] / (self.world * times["simulated"]),
                        "time/train_pipeline": time.perf_counter() - t0}

    def _run(self, n: int, prob: Problem, program: list[Op], exp: Experience, mbs: list, loss_fns, sums, counts):
        """One mini-batch's schedule on this rank: its receives, tasks and sends in the agreed order."""
        device = next(self.parts[ACTOR].stage.parameters()).device
        rows = [collate([exp.prompt_ids[i] for i in idx], [exp.response_ids[i] for i in idx], self.pad_id, device)
                for idx, _ in mbs]
        # the critic may be another model than the actor (a reward model's body): its own width and dtype
        width = {m: (part.stage.body_config.hidden_size, next(part.stage.parameters()).dtype)
                 for m, part in self.parts.items()}
        inbox, outbox, ctx, pending = {}, {}, {}, []
        for op in program:
            if isinstance(op, Recv):  # activations and their gradients alike: (rows, length, hidden) of its micro-batch
                hidden, dtype = width[op.message.task.model]
                buf = torch.empty((*rows[op.message.task.mb].input_ids.shape, hidden), dtype=dtype, device=device)
                inbox[op.message] = (buf, dist.irecv(buf, op.message.src))
                continue
            if isinstance(op, Send):
                pending.append(dist.isend(outbox.pop(op.message), op.message.dst))
                continue
            t, start = op.task, time.perf_counter()
            part, mb = self.parts[t.model], rows[op.task.mb]
            if t.kind == "F":
                x = mb.input_ids if part.stage.first else _received(inbox, prob, t).requires_grad_(True)
                start = time.perf_counter()  # the wait for the input is a bubble, not compute
                if part.stage.last:
                    idx, share = mbs[t.mb]
                    y, stats = loss_fns[t.model](_LastStageView(part.stage, x), idx, share)
                    counts[t.model] = add_stats(sums[t.model], stats, counts[t.model], torch.isfinite(y.detach()))
                else:
                    y = part.stage(x, mb.attention_mask)
                    outbox[message_of(prob, t)] = y.detach().contiguous()
                ctx[(t.model, t.mb)] = (x, y)
            else:
                x, y = ctx.pop((t.model, t.mb))
                if part.stage.last:
                    y.backward()
                else:
                    grad = _received(inbox, prob, t)
                    start = time.perf_counter()  # the wait for the gradient is a bubble, not compute
                    torch.autograd.backward(y, grad)
                if not part.stage.first:
                    outbox[message_of(prob, t)] = x.grad.contiguous()
            self.spans.append((n, self.rank, t, start, time.perf_counter()))
        for w in pending:
            w.wait()
        return counts

    def _step(self, bad: BadSteps) -> list[float | None]:
        """Per model: sum the tied embedding, clip by the norm over all stages, step (or skip a non-finite one).
        Returns each model's norm before clipping (None: skipped)."""
        for part in self.parts.values():
            if part.tied is not None:
                if part.tied.grad is None:  # both ends must join the all-reduce
                    part.tied.grad = torch.zeros_like(part.tied)
                dist.all_reduce(part.tied.grad, group=self.tied_group)
        device = next(self.parts[ACTOR].stage.parameters()).device  # NCCL reduces device tensors only
        squares = torch.zeros(2, dtype=torch.float64, device=device)
        for m, part in self.parts.items():
            grads = [p.grad for p in part.norm_params if p.grad is not None]
            if grads:
                squares[m] = sum(torch.linalg.vector_norm(g.float()).double() ** 2 for g in grads)
        dist.all_reduce(squares)  # every rank holds one stage of each model: the whole group
        out: list[float | None] = []
        for m, part in sorted(self.parts.items()):
            norm = float(squares[m].sqrt())
            params = [p for group in part.opt.param_groups for p in group["params"]]
            if not math.isfinite(norm):
                part.opt.zero_grad(set_to_none=True)
                bad.count("a NaN/inf loss", self.rl.max_bad_steps)
                out.append(None)
                continue
            if self.rl.grad_clip > 0:  # as clip_grad_norm_: the same coefficient on every stage
                coef = min(1.0, self.rl.grad_clip / (norm + 1e-6))
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
            part.opt.step()
            part.sched.step()
            part.opt.zero_grad(set_to_none=True)
            out.append(norm)
        # a run of bad steps ends only where every model stepped: a finite critic must not hide a diverging actor
        # from rl.max_bad_steps (BadSteps.stop_if_diverged)
        if all(n is not None for n in out):
            bad.consecutive = 0
        return out

    def sync_whole_models(self) -> None:
        """Every stage's weights, from the rank that trains it, into every rank's whole actor and critic (a collective),
        so that any rank can hand out, evaluate or save the whole models (Ray's rank 0 does)."""
        for p, owner in self.owners:
            dist.broadcast(p.data, src=owner)

    def optimizer_state(self) -> dict:
        """This rank's stages' optimiser and schedule states (a checkpoint holds one per rank)."""
        return {m: {"opt": part.opt.state_dict(), "sched": part.sched.state_dict()} for m, part in self.parts.items()}

    def load_optimizer_state(self, state: dict) -> None:
        """Restore what optimizer_state saved; the configured learning rates stay (one changed on resume applies)."""
        for m, part in self.parts.items():
            configured = [g["lr"] for g in part.opt.param_groups]
            part.opt.load_state_dict(state[m]["opt"])
            part.sched.load_state_dict(state[m]["sched"])
            keep_learning_rates(part.opt, part.sched, configured)

def schedule_record(spans: list, schedules: dict[int, Schedule], devices: int, mode: str) -> dict:
    """The first mini-batch of an update as executed (seconds from its first task's start) and as the simulator
    runs the same schedule with the update's mean task times, with both bubble ratios: what a run saves
    (rl/pipeline_schedule.json) and its report draws side by side (metrics/schedule_chart.py draw_record)."""
    mine = [s for s in spans if s[0] == 0]
    t0 = min(s[3] for s in mine)
    executed = [(rank, t, start - t0, end - t0) for _, rank, t, start, end in mine]
    fa, ba, fc, bc = task_times(spans)
    sched = schedules[0]
    M = sum(1 for t in sched.orders[0] if t.model == ACTOR and t.kind == "F")
    prob = Problem(devices, (PipeModel(devices, 1, M, fa, ba), PipeModel(devices, 1, M, fc, bc)))
    sim = simulate(prob, sched)
    simulated = [(prob.device_of(t.model, t.replica, t.stage), t, sim.start[t], sim.end[t]) for t in sim.start]
    bubble = lambda xs: 1 - sum(e - s for *_, s, e in xs) / (devices * max(e for *_, e in xs))
    row = lambda d, t, s, e: [d, t.model, t.replica, t.stage, t.kind, t.mb, s, e]
    return {"mode": mode, "devices": devices, "micro_batches": M, "bubble_executed": bubble(executed),
            "bubble_simulated": bubble(simulated), "executed": [row(*x) for x in executed],
            "simulated": [row(*x) for x in simulated]}


def task_times(spans: list) -> tuple[float, float, float, float]:
    """Mean (actor forward, actor backward, critic forward, critic backward) seconds of recorded spans
    (PipelineTrainer.spans): the task costs to plan or simulate a schedule with."""
    def mean(model, kind):
        d = [e - s for *_, t, s, e in spans if t.model == model and t.kind == kind]
        return sum(d) / len(d)
    return mean(ACTOR, "F"), mean(ACTOR, "B"), mean(CRITIC, "F"), mean(CRITIC, "B")


def schedule_summary(spans: list, schedules: dict[int, Schedule], costs: tuple, devices: int) -> dict:
    """Summed over mini-batches (schedules: mini-batch number -> the schedule it ran): each executed schedule's
    makespan (first start to last end) and busy time, and the simulator's makespan and busy time for the same
    schedule given `costs` (task_times)."""
    out = {"executed": 0.0, "busy": 0.0, "simulated": 0.0, "sim_busy": 0.0}
    fa, ba, fc, bc = costs
    for n, sched in schedules.items():
        mine = [s for s in spans if s[0] == n]
        out["executed"] += max(s[4] for s in mine) - min(s[3] for s in mine)
        out["busy"] += sum(s[4] - s[3] for s in mine)
        M = sum(1 for t in sched.orders[0] if t.model == ACTOR and t.kind == "F")  # micro-batches
        sim = simulate(Problem(devices, (PipeModel(devices, 1, M, fa, ba), PipeModel(devices, 1, M, fc, bc))), sched)
        out["simulated"] += sim.makespan
        out["sim_busy"] += sum(sim.busy)
    return out


def _received(inbox: dict, prob: Problem, t: Task) -> torch.Tensor:
    """The input of `t`, waiting for its receive (posted earlier, in the agreed order)."""
    buf, handle = inbox.pop(input_of(prob, t))
    handle.wait()
    return buf


def build_pipeline(actor, critic, rl: RLConfig, mode: str, pad_id: int) -> PipelineTrainer:
    """This rank's stages of `actor` (a causal LM) and `critic` (a ValueModel), each with its own AdamW (rl.lr,
    rl.critic_lr). Call on every rank of the initialised default process group, in the same order (it makes a group)."""
    if mode not in MODES:
        raise ValueError(f"pipeline mode {mode!r}: one of {', '.join(MODES)}")
    rank, world = dist.get_rank(), dist.get_world_size()
    actor_stages, critic_stages = split_actor(actor, world), split_critic(critic, world)
    a_stage, c_index = actor_stages[rank], world - 1 - rank
    c_stage = critic_stages[c_index]
    owners, seen = [], set()
    for stages, owner_of in ((actor_stages, lambda s: s), (critic_stages, lambda s: world - 1 - s)):
        for s, stage in enumerate(stages):
            for p in stage.parameters():
                if id(p) not in seen:  # the tied LM head: trained on both ends, the same tensor after each step
                    seen.add(id(p))
                    owners.append((p, owner_of(s)))
    tied = bool(getattr(actor.config, "tie_word_embeddings", False)) and world > 1
    tied_group = dist.new_group([0, world - 1]) if tied else None  # every rank creates it
    parts = {}
    for m, stage, index, lr in ((ACTOR, a_stage, rank, rl.lr), (CRITIC, c_stage, c_index, rl.critic_lr)):
        opt, sched = build_constant_optimizer(stage, lr, rl.optimizer)
        params = [p for p in stage.parameters() if p.requires_grad]
        shared = None
        if m == ACTOR and tied and (stage.first or stage.last):
            shared = stage.embed.weight if stage.first else stage.head.weight
        counted = [p for p in params if not (shared is not None and stage.last and not stage.first and p is shared)]
        parts[m] = StagePart(stage, index, opt, sched, counted, shared)
    return PipelineTrainer(mode, rl, pad_id, rank, world, parts, tied_group, owners=owners)


def stage_state(pipe: PipelineTrainer, actor, critic) -> dict:
    """{'actor': {name: tensor}, 'critic': {...}} of the parameters this rank trains, named as in the unsplit models."""
    out = {}
    for m, role, model in ((ACTOR, "actor", actor), (CRITIC, "critic", critic)):
        names = {id(p): n for n, p in model.named_parameters()}
        out[role] = {names[id(p)]: p.detach().clone() for p in pipe.parts[m].stage.parameters()}
    return out


# ------------------------------------------------------------------------------------------- launching on one host


def _init_then(rank: int, world: int, port: int, fn, args: tuple) -> None:
    pin_threads(1)  # one core per rank: the pipeline is the parallelism
    if os.environ.get("RLFUSE_PIN_CORES"):
        pin_to_cores(rank, 1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def spawn(world: int, fn, *args) -> None:
    """Run fn(rank, *args) in `world` processes of one gloo group on this host (fn must be importable by name)."""
    mp.spawn(_init_then, args=(world, free_port(), fn, args), nprocs=world, join=True)
