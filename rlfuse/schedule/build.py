"""Schedule generators: 1F1B for one model, serial (one model after the other, each 1F1B), and the fused schedule
(priority rules, a search aimed at the lower bound, local search on makespan, then a pass that lowers peak memory at
the same makespan).

The fused search builds active schedules (Giffler-Thompson): repeatedly take the task that could finish first, and
among the tasks on that device that could start before it finishes, run the one with the highest priority. One
priority per task thus defines a schedule. The main search (_reach) branches over those choices depth-first and
prunes with the same heads and tails as the lower bound, so a schedule at the bound is found or ruled out fast where
the rules alone miss it by a few units; annealing of priorities and of swaps is the fallback.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

from rlfuse.schedule.model import (
    Compiled,
    Problem,
    Schedule,
    SimResult,
    Task,
    compiled,
    heads_and_tails,
    list_schedule,
    lower_bound,
    peak_memory,
    simulate,
    task_graph,
)


def one_f_one_b_order(prob: Problem, model: int, replica: int, stage: int) -> list[Task]:
    """1F1B on one stage: warm-up forwards, then one forward one backward, then the remaining backwards."""
    pm = prob.models[model]
    warm = min(pm.stages - stage - 1, pm.micro_batches)
    F = lambda m: Task(model, replica, stage, "F", m)
    B = lambda m: Task(model, replica, stage, "B", m)
    order = [F(m) for m in range(warm)]
    for i in range(pm.micro_batches - warm):
        order += [F(warm + i), B(i)]
    order += [B(m) for m in range(pm.micro_batches - warm, pm.micro_batches)]
    return order


def one_f_one_b(prob: Problem, model: int) -> Schedule:
    """Only `model`, 1F1B on its devices (the other model's tasks left out)."""
    orders: list[list[Task]] = [[] for _ in range(prob.devices)]
    pm = prob.models[model]
    for r in range(pm.replicas):
        for s in range(pm.stages):
            orders[prob.device_of(model, r, s)] += one_f_one_b_order(prob, model, r, s)
    return Schedule(orders)


def serial(prob: Problem) -> Schedule:
    """Big model 1F1B, then (after a barrier) small model 1F1B: the baseline without intra-stage fusion."""
    a, b = one_f_one_b(prob, 0), one_f_one_b(prob, 1)
    return Schedule([x + y for x, y in zip(a.orders, b.orders)], barrier=True)


# ------------------------------------------------------------------------------------------- fused


def base_priority(prob: Problem, t: Task, backward_first: bool = True) -> float:
    """Greedy fill: the big model's tasks first, a ready backward before a forward (1F1B-like, so activations are
    freed early), then the longest path to the end of the model (critical path first)."""
    pm = prob.models[t.model]
    rest = (pm.stages - t.stage) * pm.fwd + pm.stages * pm.bwd if t.kind == "F" else (t.stage + 1) * pm.bwd
    return rest + (1e3 if t.model == 0 else 0.0) + (500.0 if t.kind == "B" and backward_first else 0.0)


def _schedule(c: Compiled, orders: list[list[int]]) -> Schedule:
    return Schedule([[c.tasks[i] for i in o] for o in orders])


def _active(prob: Problem, prio: list[float], reverse: bool = False) -> tuple[list[list[int]], list[float], float]:
    """Giffler-Thompson construction: a task is a candidate once its dependencies and its FIFO predecessor are placed;
    take the device whose candidate could finish first and run there, among the candidates that could start before
    that, the one with the highest priority (then the earliest). With reverse, the same on the reversed graph (time
    runs backwards from the end: used by the forward-backward pass). Returns the per-device index orders (in the
    direction built), every task's end time in that direction, and the makespan."""
    c = compiled(prob)
    preds, succs = task_graph(prob)
    if reverse:
        preds, succs = succs, preds
    P, dur, dev = prob.devices, c.duration, c.device
    missing = [len(ps) for ps in preds]
    ready = [0.0] * len(c.tasks)  # when the inputs of a task have arrived (so far)
    candidates: list[list[int]] = [[] for _ in range(P)]
    for i, m in enumerate(missing):
        if not m:
            candidates[dev[i]].append(i)
    free, end = [0.0] * P, [0.0] * len(c.tasks)
    orders: list[list[int]] = [[] for _ in range(P)]
    best_c = [math.inf] * P
    dirty = set(range(P))
    for _ in range(len(c.tasks)):
        for d in dirty:  # only devices whose state changed are re-examined
            fd = free[d]
            best_c[d] = min((max(ready[i], fd) + dur[i] for i in candidates[d]), default=math.inf)
        dirty = set()
        d = min(range(P), key=best_c.__getitem__)
        cmax, fd = best_c[d], free[d]
        i = max((i for i in candidates[d] if max(ready[i], fd) < cmax - 1e-9),
                key=lambda i: (prio[i], -max(ready[i], fd)))
        end[i] = free[d] = max(ready[i], fd) + dur[i]
        candidates[d].remove(i)
        orders[d].append(i)
        dirty.add(d)
        for j, lag in succs[i]:
            ready[j] = max(ready[j], end[i] + lag)
            missing[j] -= 1
            if not missing[j]:
                candidates[dev[j]].append(j)
                dirty.add(dev[j])
    return orders, end, max(free)


def _reach(prob: Problem, target: float, prio: list[float], max_nodes: int, deadline: float,
           memory_cap: float = math.inf) -> list[list[int]] | None:
    """Depth-first search over the Giffler-Thompson choices (children in priority order) for a schedule of makespan
    <= target, pruning a partial schedule as soon as a device's remaining work, started no earlier than that device is
    free and than its remaining tasks' heads, plus the least tail among them passes the target, or a candidate's
    earliest end plus its tail does. Active schedules contain an optimal one, so with unlimited nodes this is exact;
    with `max_nodes` it is one restart of a randomised search. With memory_cap, a forward waits while it would take
    its device's activation memory above the cap. Returns the per-device index orders, or None."""
    c = compiled(prob)
    head, tail = heads_and_tails(prob)
    P, dur, n, queues, eps = prob.devices, c.duration, len(c.tasks), c.queues, 1e-9
    pos = [[0] * len(q) for q in queues]
    free, end = [0.0] * P, [-1.0] * n
    left = [sum(dur[i] for q in queues[d] for i in q) for d in range(P)]
    last_tail = [[tail[q[-1]] for q in queues[d]] for d in range(P)]  # tails shrink along a queue
    held = [0.0] * P  # activation memory per device
    mem = [prob.models[t.model].mem * (1 if t.kind == "F" else -1) for t in c.tasks]

    def children():
        best_c, dstar, cand = math.inf, -1, []
        for d in range(P):
            fd, least_tail, first = free[d], math.inf, math.inf
            for qi, q in enumerate(queues[d]):
                if pos[d][qi] == len(q):
                    continue
                i = q[pos[d][qi]]
                least_tail, first = min(least_tail, last_tail[d][qi]), min(first, head[i])
                r = c.ready_time(i, fd, end)
                if r is None or held[d] + mem[i] > memory_cap + eps:
                    continue
                if r + dur[i] + tail[i] > target + eps:
                    return None
                cand.append((r, d, qi, i))
                if r + dur[i] < best_c:
                    best_c, dstar = r + dur[i], d
            if left[d] and max(first, fd) + left[d] + least_tail > target + eps:
                return None
        kids = [(r, qi, i) for r, d, qi, i in cand if d == dstar and r < best_c - eps]
        kids.sort(key=lambda k: (prio[k[2]], -k[0]))  # popped from the end: best first
        return dstar, kids

    def undo():
        d, qi, i, was_free = placed.pop()
        pos[d][qi] -= 1
        free[d], end[i] = was_free, -1.0
        left[d] += dur[i]
        held[d] -= mem[i]

    stack, placed, nodes = [children()], [], 0
    while stack and stack[-1] is not None:
        d, kids = stack[-1]
        if not kids:
            stack.pop()
            if placed:
                undo()
            continue
        nodes += 1
        if nodes > max_nodes or (nodes % 512 == 0 and time.perf_counter() > deadline):
            return None
        r, qi, i = kids.pop()
        placed.append((d, qi, i, free[d]))
        end[i] = free[d] = r + dur[i]
        pos[d][qi] += 1
        left[d] -= dur[i]
        held[d] += mem[i]
        if len(placed) == n:
            orders: list[list[int]] = [[] for _ in range(P)]
            for d, _, i, _ in placed:
                orders[d].append(i)
            return orders
        kid = children()
        if kid is None:
            undo()
        else:
            stack.append(kid)
    return None


@dataclass
class SearchResult:
    schedule: Schedule
    result: SimResult
    lower_bound: float
    seconds: float
    evaluations: int


class _Best:
    """The best schedule so far (index orders) and, where it came from priorities, those priorities."""

    def __init__(self):
        self.span, self.orders, self.prio = math.inf, None, None

    def offer(self, span: float, orders, prio=None) -> None:
        if span < self.span - 1e-9:
            self.span, self.orders, self.prio = span, orders, prio


def fused(prob: Problem, seed: int = 0, time_limit: float = 60.0, memory_pass: bool = True,
          max_evals: int | None = None, tolerance: float = 0.0) -> SearchResult:
    """The fused schedule, makespan first, stopping as soon as it is within `tolerance` (a fraction) of the lower
    bound, at the time limit or after `max_evals` schedules (each priority-rule schedule, forward-backward pass,
    search restart and swap counts as one). In order:
    1. priority rules (critical path, 1F1B-like greedy, longest tail) and forward-backward improvement of the best;
    2. a depth-first search for a schedule at the bound or halfway to it, restarted with noisy and guided priorities
       (until 50% of the time);
    3. annealing of the best rule's priorities (until 65%), then of adjacent swaps; then the memory pass.
    With max_evals (and a time limit that does not bind) the result depends only on the seed."""
    budget = max_evals if max_evals is not None else 10**12
    t0 = time.perf_counter()
    rng = random.Random(seed)
    c = compiled(prob)
    tasks, n = c.tasks, len(c.tasks)
    lb = lower_bound(prob)
    goal = lb * (1 + tolerance) + 1e-9
    search_limit = 0.85 * time_limit if memory_pass else time_limit
    deadline = lambda share: t0 + share * search_limit
    best, evals = _Best(), 0
    _, tails = heads_and_tails(prob)
    rules = [[base_priority(prob, t, backward_first=False) for t in tasks], [base_priority(prob, t) for t in tasks],
             list(tails)]
    rule = _Best()
    for prio in rules:
        orders, _, span = _active(prob, prio)
        rule.offer(span, orders, prio)
        best.offer(span, orders, prio)
        evals += 1
    if evals < budget:
        evals += _forward_backward(prob, best, goal, rounds=min(20, (budget - evals) // 2), deadline=deadline(0.25))
    unit = min(pm.fwd for pm in prob.models)
    # restarts alternate between the tails and the tails less the best schedule's start times (follow what already
    # works, repair where the bound needs it), and between the bound, halfway to it and one step below the best
    # (each gain there guides the next restarts), with ties and near-ties broken at random from the third restart on
    guided, guide_span, restart = None, None, 0
    while best.span > goal and evals < budget and time.perf_counter() < deadline(0.5):
        if guide_span != best.span:
            guide_span = best.span
            guided = [q - s for q, s in zip(tails, _list_times(prob, best.orders, start=True))]
        base = guided if restart % 2 else tails
        prio = [q + rng.gauss(0, unit) for q in base] if restart > 1 else list(base)
        target = (lb, lb, (lb + best.span) / 2, best.span - unit)[restart % 4]
        orders = _reach(prob, max(goal, target), prio, 2 * n, deadline(0.5))
        evals, restart = evals + 1, restart + 1
        if orders is not None:
            best.offer(_makespan(c, orders), orders)
    if best.span > goal:
        evals += _anneal_priorities(prob, rule, best, goal, rng, deadline(0.65), budget - evals)
    sched = _schedule(c, best.orders)
    if best.span > goal and time.perf_counter() < deadline(1.0) and evals < budget:
        sched, more = anneal_swaps(prob, sched, goal, deadline(1.0) - time.perf_counter(), rng, budget - evals)
        evals += more
    if memory_pass:
        memory_deadline = time.perf_counter() + max(1.0, 0.15 * time_limit)
        sched = _cap_memory(prob, sched, rng, memory_deadline, max_tries=None if max_evals is None else 4)
        sched = lower_memory(prob, sched, time_limit=max(0.0, memory_deadline - time.perf_counter()), seed=seed,
                             max_moves=None if max_evals is None else max_evals)
    return SearchResult(sched, simulate(prob, sched), lb, time.perf_counter() - t0, evals)


def _cap_memory(prob: Problem, sched: Schedule, rng: random.Random, deadline: float,
                max_tries: int | None = None, restarts: int = 8) -> Schedule:
    """Lower the peak activation memory at the same makespan: bisect a per-device memory cap between serial 1F1B's peak
    and this schedule's, asking the depth-first search (_reach) for a schedule at this makespan under the cap, each
    cap given `restarts` restarts and an equal share of the time left (a failed cap is not a proof of infeasibility,
    so the result is an upper estimate of the least memory at this makespan)."""
    c = compiled(prob)
    span = simulate(prob, sched).makespan
    _, tails = heads_and_tails(prob)
    low, high = max(simulate(prob, serial(prob)).peak_memory), max(peak_memory(prob, sched))
    unit, tries = min(pm.mem for pm in prob.models), 0
    while high - low >= unit and time.perf_counter() < deadline and (max_tries is None or tries < max_tries):
        cap = low + (high - low) // (2 * unit) * unit
        prio = [q + rng.gauss(0, min(pm.fwd for pm in prob.models)) for q in tails]
        share = (deadline - time.perf_counter()) / (1 + math.log2(max(2.0, (high - low) / unit)))
        orders, t_try = None, time.perf_counter()
        for _ in range(1 if max_tries is not None else restarts):
            orders = _reach(prob, span, prio, 2 * len(c.tasks), t_try + share, memory_cap=cap)
            if orders is not None or time.perf_counter() - t_try > share:
                break
            prio = [q + rng.gauss(0, min(pm.fwd for pm in prob.models)) for q in tails]
        tries += 1
        if orders is None:
            low = cap + unit
        else:
            sched = _schedule(c, orders)
            high = max(peak_memory(prob, sched))
    return sched


def _forward_backward(prob: Problem, best: _Best, goal: float, rounds: int, deadline: float) -> int:
    """Forward-backward improvement (justification, as in project scheduling): build the schedule backwards in time
    with the forward end times as priorities (what ended last is placed last), then forwards again with the backward
    pass's end times (what the backward pass could start earliest goes first). Returns schedules built."""
    _, end, _ = _active(prob, best.prio)
    built, stale = 1, 0
    while built < 2 * rounds and stale < 3 and best.span > goal and time.perf_counter() < deadline:
        _, back_end, _ = _active(prob, end, reverse=True)
        orders, end, span = _active(prob, back_end)
        built += 2
        stale = 0 if span < best.span - 1e-9 else stale + 1
        best.offer(span, orders, back_end)
    return built


def _list_times(prob: Problem, orders: list[list[int]], start: bool = False) -> list[float]:
    """End (or start) time of every task under these orders."""
    times = list_schedule(compiled(prob), orders)
    assert times is not None, "orders built by a construction never deadlock"
    return times[0] if start else times[1]


def _anneal_priorities(prob: Problem, start: _Best, best: _Best, goal: float, rng: random.Random, deadline: float,
                       budget: int) -> int:
    """Simulated annealing over per-task priorities from `start` (a few tasks re-keyed per step by noise of 0.3 of the
    big model's one-micro-batch path), returning to the best now and then; improvements go to `best`. Returns
    schedules built."""
    big = prob.models[0]
    scale = 0.3 * big.stages * (big.fwd + big.bwd)
    cur, cur_prio, n = start.span, list(start.prio), len(start.prio)
    temp, evals = max(1.0, 0.02 * cur), 0
    while best.span > goal and time.perf_counter() < deadline and evals < budget:
        cand = list(cur_prio)
        for i in rng.sample(range(n), k=max(1, n // 50)):
            cand[i] += rng.gauss(0, scale)
        orders, _, span = _active(prob, cand)
        evals += 1
        if span <= cur or rng.random() < math.exp(-(span - cur) / temp):
            cur, cur_prio = span, cand
            start.offer(span, orders, cand)
            best.offer(span, orders, cand)
        temp = max(0.05, temp * 0.995)
        if evals % 200 == 0 and cur > start.span:
            cur, cur_prio = start.span, list(start.prio)
    return evals


def _makespan(c: Compiled, orders: list[list[int]]) -> float:
    """List-scheduling makespan of index orders; inf on deadlock."""
    times = list_schedule(c, orders)
    return math.inf if times is None else max(times[1])


def anneal_swaps(prob: Problem, sched: Schedule, lb: float, time_limit: float, rng: random.Random,
                 max_evals: int = 10**12):
    """Simulated annealing over swaps of adjacent tasks on one device (never two of the same FIFO queue)."""
    c = compiled(prob)
    index = {t: i for i, t in enumerate(c.tasks)}
    queue_of = {i: (t.model, t.replica, t.stage, t.kind) for i, t in enumerate(c.tasks)}
    cur_orders = [[index[t] for t in o] for o in sched.orders]
    cur = best = _makespan(c, cur_orders)
    best_orders = [list(o) for o in cur_orders]
    t0, evals, temp = time.perf_counter(), 0, 2.0
    while best > lb + 1e-9 and time.perf_counter() - t0 < time_limit and evals < max_evals:
        d = rng.randrange(prob.devices)
        o = cur_orders[d]
        k = rng.randrange(len(o) - 1)
        if queue_of[o[k]] == queue_of[o[k + 1]]:
            continue
        o[k], o[k + 1] = o[k + 1], o[k]
        span = _makespan(c, cur_orders)
        evals += 1
        if span <= cur or (span < math.inf and rng.random() < math.exp(-(span - cur) / temp)):
            cur = span
            if span < best:
                best, best_orders = span, [list(x) for x in cur_orders]
        else:
            o[k], o[k + 1] = o[k + 1], o[k]
        temp = max(0.05, temp * 0.9995)
    return Schedule([[c.tasks[i] for i in o] for o in best_orders]), evals


def lower_memory(prob: Problem, sched: Schedule, time_limit: float, seed: int = 0, max_moves: int | None = None,
                 patience: int = 3000) -> Schedule:
    """Adjacent swaps on one device, accepted only when the makespan does not rise and (max peak, total peak)
    activation memory falls or stays (annealed on the memory objective); stops after `patience` moves without a
    new best."""
    c = compiled(prob)
    rng = random.Random(seed + 1)
    index = {t: i for i, t in enumerate(c.tasks)}
    queue_of = [(t.model, t.replica, t.stage, t.kind) for t in c.tasks]
    sign = [prob.models[t.model].mem * (1 if t.kind == "F" else -1) for t in c.tasks]
    orders = [[index[t] for t in o] for o in sched.orders]
    span = _makespan(c, orders)

    def peak(o):
        cur = top = 0.0
        for i in o:
            cur += sign[i]
            top = max(top, cur)
        return top

    peaks = [peak(o) for o in orders]
    score = (max(peaks), sum(peaks))
    best, best_orders = score, [list(o) for o in orders]
    t0, temp, moves, last_gain = time.perf_counter(), 1.0, 0, 0
    while time.perf_counter() - t0 < time_limit and (max_moves is None or moves < max_moves):
        if moves - last_gain > patience:
            break  # converged: spend no more of the time limit
        moves += 1
        d = rng.randrange(prob.devices)
        o = orders[d]
        k = rng.randrange(len(o) - 1)
        if queue_of[o[k]] == queue_of[o[k + 1]] or sign[o[k]] == sign[o[k + 1]]:
            continue  # only moving a backward past a forward (or back) changes memory
        o[k], o[k + 1] = o[k + 1], o[k]
        new_peak = peak(o)
        cand = (max(peaks[:d] + [new_peak] + peaks[d + 1:]), sum(peaks) - peaks[d] + new_peak)
        worse = (cand[0] - score[0]) * 100 + (cand[1] - score[1])
        if (worse <= 0 or rng.random() < math.exp(-worse / temp)) and _makespan(c, orders) <= span + 1e-9:
            peaks[d], score = new_peak, cand
            if score < best:
                best, best_orders, last_gain = score, [list(x) for x in orders], moves
        else:
            o[k], o[k + 1] = o[k + 1], o[k]
        temp = max(0.01, temp * 0.9995)
    return Schedule([[c.tasks[i] for i in o] for o in best_orders])
