"""Point-to-point message order for executing a schedule: one agreed order, derived from the schedule alone.

NCCL matches a send with a receive between two ranks purely by the order in which they were issued (tags are
ignored), and in the fused schedule both pipelines share every link in both directions (the actor's activations go
up where the critic's gradients go up too). So each rank gets a program built from one global order of all tasks
(a topological order of the schedule): every message is keyed by its producer's position in that order, its send
is posted right after the producer runs, and its receive is posted (non-blocking) before the receiver's first task
later in that order. Every rank then posts its sends and receives in the same global order, so the i-th send on a
channel is the i-th receive on it, and even with blocking sends (rendezvous) the programs cannot deadlock:
message k is the next operation of both its ends once messages 0..k-1 are done. `verify` checks both for any
programs by replaying them. Pure: no torch.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from rlfuse.schedule.model import Problem, Schedule, ScheduleError, Task, dependencies, simulate


@dataclass(frozen=True, order=True)
class Message:
    """The tensor `task` passes on: a forward's output (to the next stage) or a backward's input gradient (to the
    previous stage), from device src to device dst."""
    task: Task
    src: int
    dst: int


@dataclass(frozen=True)
class Recv:
    """Post a non-blocking receive of `message` (waited for by the task that consumes it)."""
    message: Message


@dataclass(frozen=True)
class Run:
    task: Task


@dataclass(frozen=True)
class Send:
    message: Message


Op = Recv | Run | Send


def message_of(prob: Problem, t: Task) -> Message | None:
    """The message `t` sends, if any: a forward not on the last stage, a backward not on the first."""
    last = prob.models[t.model].stages - 1
    if (t.kind == "F" and t.stage == last) or (t.kind == "B" and t.stage == 0):
        return None
    nxt = t.stage + 1 if t.kind == "F" else t.stage - 1
    return Message(t, prob.device_of(t.model, t.replica, t.stage), prob.device_of(t.model, t.replica, nxt))


def input_of(prob: Problem, t: Task) -> Message | None:
    """The message `t` consumes, if any: what the previous stage's forward or the next stage's backward sent."""
    last = prob.models[t.model].stages - 1
    if t.kind == "F":
        return message_of(prob, Task(t.model, t.replica, t.stage - 1, "F", t.mb)) if t.stage > 0 else None
    return message_of(prob, Task(t.model, t.replica, t.stage + 1, "B", t.mb)) if t.stage < last else None


def global_order(prob: Problem, sched: Schedule) -> list[Task]:
    """All tasks in one order that respects every device's order and every data dependency (Kahn's algorithm,
    earliest simulated start first, so receives are posted about when their data is produced)."""
    start = simulate(prob, sched).start  # raises ScheduleError on deadlock
    pos = [0] * prob.devices
    offered = [False] * prob.devices  # whether the device's next task is in the heap
    done: set[Task] = set()
    heap: list[tuple[float, int]] = []
    out: list[Task] = []
    while True:
        for d, o in enumerate(sched.orders):  # a finished task may unblock any device's next task
            if not offered[d] and pos[d] < len(o) and all(dep in done for dep in dependencies(prob, o[pos[d]])):
                heapq.heappush(heap, (start[o[pos[d]]], d))
                offered[d] = True
        if not heap:
            break
        _, d = heapq.heappop(heap)
        t = sched.orders[d][pos[d]]
        out.append(t)
        done.add(t)
        pos[d] += 1
        offered[d] = False
    if len(out) != sum(map(len, sched.orders)):
        raise ScheduleError("no order of the schedule's tasks respects its dependencies (deadlock)")
    return out


def programs(prob: Problem, sched: Schedule) -> list[list[Op]]:
    """Per device, its receives, tasks and sends in the one global order (see the module docstring)."""
    keyed: list[list[tuple[tuple[int, int], Op]]] = [[] for _ in range(prob.devices)]
    for k, t in enumerate(global_order(prob, sched)):
        d = prob.device_of(t.model, t.replica, t.stage)
        keyed[d].append(((k, 0), Run(t)))
        m = message_of(prob, t)
        if m is not None:
            keyed[m.src].append(((k, 1), Send(m)))
            keyed[m.dst].append(((k, 1), Recv(m)))  # before the receiver's first task after position k
    return [[op for _, op in sorted(ops, key=lambda x: x[0])] for ops in keyed]


def verify(prob: Problem, progs: list[list[Op]]) -> None:
    """Raise ScheduleError unless: on every channel (src -> dst) the i-th send is the i-th receive (same model,
    replica, stage, micro-batch and direction); each task's input is received before it runs and each message is
    sent after its producer ran; and the programs finish when every operation blocks until it completes, a send
    until its receive is posted (a rendezvous: stricter than NCCL, so no deadlock there either)."""
    sends: dict[tuple[int, int], list[Message]] = {}
    recvs: dict[tuple[int, int], list[Message]] = {}
    for d, prog in enumerate(progs):
        received, ran = set(), set()
        for op in prog:
            if isinstance(op, Recv):
                if op.message.dst != d:
                    raise ScheduleError(f"device {d} receives {op.message}, addressed to device {op.message.dst}")
                recvs.setdefault((op.message.src, d), []).append(op.message)
                received.add(op.message)
            elif isinstance(op, Send):
                if op.message.src != d or op.message.task not in ran:
                    raise ScheduleError(f"device {d} sends {op.message} before (or without) running its producer")
                sends.setdefault((d, op.message.dst), []).append(op.message)
            else:
                needed = input_of(prob, op.task)
                if needed is not None and needed not in received:
                    raise ScheduleError(f"device {d} runs {op.task} before posting the receive of its input")
                ran.add(op.task)
    for ch in sorted(set(sends) | set(recvs)):
        s, r = sends.get(ch, []), recvs.get(ch, [])
        for i in range(max(len(s), len(r))):
            a = s[i] if i < len(s) else None
            b = r[i] if i < len(r) else None
            if a != b:
                raise ScheduleError(f"channel {ch[0]}->{ch[1]}: send #{i} is {_name(a)} but receive #{i} is {_name(b)}")
    _replay_rendezvous(progs)


def _replay_rendezvous(progs: list[list[Op]]) -> None:
    """Each device blocks on its next operation; a send and its receive complete together, once both are next.
    (Receives are waited for when posted, the strictest reading: it covers a posted receive that holds the
    stream of its peer pair until matched.)"""
    pos = [0] * len(progs)
    progress = True
    while progress:
        progress = False
        for d, prog in enumerate(progs):
            while pos[d] < len(prog):
                op = prog[pos[d]]
                if isinstance(op, Run):
                    pos[d] += 1
                    progress = True
                    continue
                peer = op.message.dst if isinstance(op, Send) else op.message.src
                want = Recv(op.message) if isinstance(op, Send) else Send(op.message)
                if pos[peer] < len(progs[peer]) and progs[peer][pos[peer]] == want:
                    pos[d] += 1
                    pos[peer] += 1
                    progress = True
                    continue
                break
    stuck = [(d, progs[d][pos[d]]) for d in range(len(progs)) if pos[d] < len(progs[d])]
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(f"device {d} waits on {_name(op)}" for d, op in stuck[:4]))


def _name(x) -> str:
    if x is None:
        return "nothing"
    if isinstance(x, (Recv, Send)):
        return f"{type(x).__name__.lower()} {_name(x.message)}"
    t = x.task
    what = "activation" if t.kind == "F" else "gradient"
    return (f"{'actor' if t.model == 0 else 'critic'} replica {t.replica} stage {t.stage} {what} of micro-batch "
            f"{t.mb} ({x.src}->{x.dst})")
