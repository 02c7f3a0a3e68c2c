"""Pure model of a fused actor/critic pipeline schedule: layout, tasks, checker, simulator, lower bound.

Layout (RLHFuse): the big model has N stages, stage s on device s. The small model has N/K stages per replica and K
replicas; replica i runs on devices (i+1)*N/K - 1 down to i*N/K (reverse direction). A schedule is, per device, an
ordered list of tasks (model, replica, stage, F|B, micro-batch). No torch here: everything is plain Python.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PipeModel:
    """One model's pipeline: stages per replica, replicas, micro-batches per replica, forward/backward time, activation
    memory per in-flight micro-batch."""
    stages: int
    replicas: int
    micro_batches: int
    fwd: float
    bwd: float
    mem: float = 1.0


@dataclass(frozen=True)
class Problem:
    devices: int
    models: tuple[PipeModel, ...]
    comm: float = 0.0
    """Time to send activations/gradients between devices."""

    @staticmethod
    def fused(pp: int, pp_small: int, m: int, m_small: int, f: float, f_small: float, bwd_ratio: float = 2.0,
              mem: float = 1.0, mem_small: float = 1.0, comm: float = 0.0) -> "Problem":
        if pp % pp_small:
            raise ValueError(f"--pp-small {pp_small} must divide --pp {pp}")
        return Problem(pp, (PipeModel(pp, 1, m, f, f * bwd_ratio, mem),
                            PipeModel(pp_small, pp // pp_small, m_small, f_small, f_small * bwd_ratio, mem_small)), comm)

    @property
    def work(self) -> float:
        """Total compute time of both models' tasks (all replicas, stages, micro-batches, forward and backward)."""
        return sum(pm.micro_batches * pm.stages * pm.replicas * (pm.fwd + pm.bwd) for pm in self.models)

    def device_of(self, model: int, replica: int, stage: int) -> int:
        pm = self.models[model]
        if model == 0:
            return replica * pm.stages + stage
        return (replica + 1) * pm.stages - 1 - stage  # the other direction

    def stage_on(self, model: int, device: int) -> tuple[int, int]:
        """(replica, stage) of `model` on `device`."""
        pm = self.models[model]
        replica, offset = divmod(device, pm.stages)
        return replica, (offset if model == 0 else pm.stages - 1 - offset)


@dataclass(frozen=True, order=True)
class Task:
    model: int
    replica: int
    stage: int
    kind: str  # "F" | "B"
    mb: int

    def duration(self, prob: Problem) -> float:
        pm = prob.models[self.model]
        return pm.fwd if self.kind == "F" else pm.bwd


@dataclass
class Schedule:
    """Per-device task order. barrier: model 1 starts only after model 0 has finished everywhere (serial)."""
    orders: list[list[Task]]
    barrier: bool = False


@dataclass
class SimResult:
    makespan: float
    busy: list[float]
    bubble_ratio: float
    peak_memory: list[float]
    start: dict = field(repr=False, default_factory=dict)
    end: dict = field(repr=False, default_factory=dict)


class ScheduleError(ValueError):
    pass


def all_tasks(prob: Problem, models=None) -> list[Task]:
    out = []
    for mi, pm in enumerate(prob.models):
        if models is not None and mi not in models:
            continue
        for r in range(pm.replicas):
            for s in range(pm.stages):
                for mb in range(pm.micro_batches):
                    out += [Task(mi, r, s, "F", mb), Task(mi, r, s, "B", mb)]
    return out


def dependencies(prob: Problem, t: Task) -> list[Task]:
    """Cross-stage data dependencies of a task (the same-device order is the schedule's business)."""
    last = prob.models[t.model].stages - 1
    if t.kind == "F":
        return [Task(t.model, t.replica, t.stage - 1, "F", t.mb)] if t.stage > 0 else []
    deps = [Task(t.model, t.replica, t.stage, "F", t.mb)]
    if t.stage < last:
        deps.append(Task(t.model, t.replica, t.stage + 1, "B", t.mb))
    return deps


def check(prob: Problem, sched: Schedule) -> None:
    """Raise ScheduleError unless: every task once, on its own device; FIFO micro-batch order per model and kind on
    each device; every backward after its forward on that device; no deadlock (checked by simulating)."""
    if len(sched.orders) != prob.devices:
        raise ScheduleError(f"schedule has {len(sched.orders)} devices, problem has {prob.devices}")
    seen = set()
    for d, order in enumerate(sched.orders):
        last_mb: dict[tuple, int] = {}
        forwards_done = set()
        for t in order:
            if t in seen:
                raise ScheduleError(f"{t} scheduled twice")
            seen.add(t)
            if prob.device_of(t.model, t.replica, t.stage) != d:
                raise ScheduleError(f"{t} placed on device {d}, belongs on {prob.device_of(t.model, t.replica, t.stage)}")
            key = (t.model, t.replica, t.stage, t.kind)
            if last_mb.get(key, -1) >= t.mb:
                raise ScheduleError(f"device {d}: {t} breaks FIFO micro-batch order")
            last_mb[key] = t.mb
            if t.kind == "F":
                forwards_done.add((t.model, t.replica, t.stage, t.mb))
            elif (t.model, t.replica, t.stage, t.mb) not in forwards_done:
                raise ScheduleError(f"device {d}: {t} before its forward")
    missing = set(all_tasks(prob)) - seen
    if missing:
        raise ScheduleError(f"{len(missing)} tasks missing, e.g. {min(missing)}")
    simulate(prob, sched)  # raises on deadlock


class Compiled:
    """A problem as integer arrays: task index -> device, duration, dependencies (index, crosses devices), the
    devices its successors run on, and per-device FIFO queues. Built once per problem."""

    def __init__(self, prob: Problem):
        self.prob = prob
        self.tasks = all_tasks(prob)
        self.index = {t: i for i, t in enumerate(self.tasks)}
        self.device = [prob.device_of(t.model, t.replica, t.stage) for t in self.tasks]
        self.duration = [t.duration(prob) for t in self.tasks]
        self.model = [t.model for t in self.tasks]
        self.deps = [[(self.index[d], self.device[self.index[d]] != self.device[i]) for d in dependencies(prob, t)]
                     for i, t in enumerate(self.tasks)]
        self.queues: list[list[list[int]]] = [[] for _ in range(prob.devices)]
        for mi, pm in enumerate(prob.models):
            for r in range(pm.replicas):
                for st in range(pm.stages):
                    d = prob.device_of(mi, r, st)
                    for kind in ("F", "B"):
                        self.queues[d].append([self.index[Task(mi, r, st, kind, m)] for m in range(pm.micro_batches)])
        self.graph: tuple | None = None  # filled by task_graph()
        self.heads_tails: tuple[list[float], list[float]] | None = None  # filled by heads_and_tails()

    def ready_time(self, i: int, free: float, end: list[float]) -> float | None:
        """Earliest start of task i on a device free at `free`, or None while an input is not computed yet."""
        ready = free
        for j, cross in self.deps[i]:
            e = end[j]
            if e < 0:
                return None
            e = e + self.prob.comm if cross else e
            if e > ready:
                ready = e
        return ready


_COMPILED: dict[Problem, Compiled] = {}


def compiled(prob: Problem) -> Compiled:
    if prob not in _COMPILED:
        _COMPILED[prob] = Compiled(prob)
    return _COMPILED[prob]


def list_schedule(c: Compiled, orders: list[list[int]], barrier: bool = False) -> tuple[list[float], list[float]] | None:
    """Start and end time of every task under fixed per-device orders (index lists): a task starts when its device
    is free and its inputs have arrived. With barrier, model 1 waits for all of model 0. None on deadlock."""
    P = len(orders)
    pos, free = [0] * P, [0.0] * P
    start, end = [-1.0] * len(c.tasks), [-1.0] * len(c.tasks)
    left = sum(map(len, orders))
    n0 = sum(1 for o in orders for i in o if c.model[i] == 0)
    done0, barrier_time = 0, 0.0
    progress = True
    while left and progress:
        progress = False
        for d in range(P):
            o = orders[d]
            while pos[d] < len(o):
                i = o[pos[d]]
                if barrier and c.model[i] == 1 and done0 < n0:
                    break
                ready = c.ready_time(i, free[d], end)
                if ready is None:
                    break
                if barrier and c.model[i] == 1:
                    ready = max(ready, barrier_time)
                start[i], end[i] = ready, ready + c.duration[i]
                free[d] = end[i]
                pos[d] += 1
                left -= 1
                progress = True
                if c.model[i] == 0:
                    done0 += 1
                    barrier_time = max(barrier_time, end[i])
    return None if left else (start, end)


def simulate(prob: Problem, sched: Schedule) -> SimResult:
    """List scheduling over the schedule's per-device orders (see list_schedule). Raises ScheduleError on deadlock
    (a cycle of waits)."""
    c = compiled(prob)
    orders = [[c.index[t] for t in o] for o in sched.orders]
    times = list_schedule(c, orders, sched.barrier)
    if times is None:
        raise ScheduleError(f"deadlock: the per-device orders wait on each other in a cycle (e.g. device 0 starts "
                            f"with {sched.orders[0][0] if sched.orders[0] else 'nothing'})")
    start, end = times
    scheduled = [i for o in orders for i in o]
    makespan = max((end[i] for i in scheduled), default=0.0)
    busy = [sum(c.duration[i] for i in o) for o in orders]
    work = sum(busy)  # the work this schedule holds (a single model's 1F1B holds only that model's)
    return SimResult(makespan, busy, 1 - work / (prob.devices * makespan) if makespan else 0.0,
                     peak_memory(prob, sched), {c.tasks[i]: start[i] for i in scheduled},
                     {c.tasks[i]: end[i] for i in scheduled})


def peak_memory(prob: Problem, sched: Schedule) -> list[float]:
    """Per device: max over time of sum_models mem * (forwards done - backwards done)."""
    peaks = []
    for order in sched.orders:
        cur = peak = 0.0
        for t in order:
            cur += prob.models[t.model].mem * (1 if t.kind == "F" else -1)
            peak = max(peak, cur)
        peaks.append(peak)
    return peaks


def task_graph(prob: Problem) -> tuple[list[list[tuple[int, float]]], list[list[tuple[int, float]]]]:
    """Predecessors and successors of every task (index of compiled(prob).tasks) as (task, lag) pairs: the data
    dependencies (lag = comm across devices) and the FIFO order within each queue (lag 0). Built once per problem."""
    c = compiled(prob)
    if c.graph is None:
        preds = [[(j, prob.comm if cross else 0.0) for j, cross in deps] for deps in c.deps]
        for queues in c.queues:
            for q in queues:
                for a, b in zip(q, q[1:]):
                    preds[b].append((a, 0.0))
        succs: list[list[tuple[int, float]]] = [[] for _ in c.tasks]
        for i, ps in enumerate(preds):
            for j, lag in ps:
                succs[j].append((i, lag))
        c.graph = (preds, succs)
    return c.graph


def heads_and_tails(prob: Problem) -> tuple[list[float], list[float]]:
    """Per task (index of compiled(prob).tasks): its head, the longest path of work (and comm) that must finish before
    it can start, and its tail, the longest path that must still run after it ends. The paths follow the data
    dependencies and the FIFO micro-batch order of each (model, replica, stage, kind) queue, which every schedule
    keeps (check() enforces it), so head + duration + tail <= makespan for every task of every valid schedule."""
    c = compiled(prob)
    if c.heads_tails is None:
        n = len(c.tasks)
        preds, succs = task_graph(prob)
        missing = [len(ps) for ps in preds]
        order = [i for i in range(n) if not missing[i]]
        for i in order:  # Kahn's topological order (grows while iterating)
            for j, _ in succs[i]:
                missing[j] -= 1
                if not missing[j]:
                    order.append(j)
        head, tail = [0.0] * n, [0.0] * n
        for i in order:
            head[i] = max((head[j] + c.duration[j] + lag for j, lag in preds[i]), default=0.0)
        for i in reversed(order):
            tail[i] = max((lag + c.duration[j] + tail[j] for j, lag in succs[i]), default=0.0)
        c.heads_tails = (head, tail)
    return c.heads_tails


def preemptive_one_device_bound(jobs: list[tuple[float, float, float]]) -> float:
    """max_j (end_j + tail_j) of the preemptive Jackson schedule of (head, duration, tail) jobs on one device: at every
    moment run the released job with the longest tail, switching when a job with a longer tail is released.

    Why it is a lower bound: dropping the other devices (their tasks only enter through heads and tails) and allowing
    preemption only relaxes the problem, and on one device with heads and tails the preemptive longest-tail-first rule
    is optimal (Jackson 1955; Carlier 1982, "The one-machine sequencing problem"). Its value equals
    max over subsets S of min_S head + sum_S duration + min_S tail, so it is never below the per-device bounds."""
    jobs = sorted(jobs)
    ready: list[list[float]] = []  # heap of [-tail, remaining duration]
    t, k, worst = 0.0, 0, 0.0
    while k < len(jobs) or ready:
        if not ready:
            t = max(t, jobs[k][0])
        while k < len(jobs) and jobs[k][0] <= t:
            heapq.heappush(ready, [-jobs[k][2], jobs[k][1]])
            k += 1
        job = ready[0]
        run = min(job[1], (jobs[k][0] - t) if k < len(jobs) else job[1])
        t, job[1] = t + run, job[1] - run
        if job[1] <= 1e-12:
            heapq.heappop(ready)
            worst = max(worst, t - job[0])
    return worst


def lower_bound(prob: Problem) -> float:
    """A makespan no schedule can beat: the larger of each model's critical path (M + S - 1)(f + b); total work / P;
    for every device its own work plus the idle start before any input can reach it and the tail its last backward
    still has to travel; and, tighter where micro-batches are few, the preemptive one-device bound of every device
    with per-task heads and tails (see preemptive_one_device_bound: valid because it relaxes the problem)."""
    bounds = [(pm.micro_batches + pm.stages - 1) * (pm.fwd + pm.bwd) for pm in prob.models]
    bounds.append(prob.work / prob.devices)
    for d in range(prob.devices):
        own = sum(pm.micro_batches * (pm.fwd + pm.bwd) for pm in prob.models)
        head = min(prob.stage_on(mi, d)[1] * (pm.fwd + prob.comm) for mi, pm in enumerate(prob.models))
        tail = min(prob.stage_on(mi, d)[1] * (pm.bwd + prob.comm) for mi, pm in enumerate(prob.models))
        bounds.append(own + head + tail)
    c = compiled(prob)
    head, tail = heads_and_tails(prob)
    for d in range(prob.devices):
        jobs = [(head[i], c.duration[i], tail[i]) for i in range(len(c.tasks)) if c.device[i] == d]
        bounds.append(preemptive_one_device_bound(jobs))
    return max(bounds)
