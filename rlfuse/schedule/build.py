"""Schedule generators: 1F1B for one model, serial (one model after the other, each 1F1B), and the fused schedule
(greedy fill, then a seeded local search on makespan, then a pass that lowers peak memory at the same makespan).

The fused search builds active schedules (Giffler-Thompson): repeatedly take the task that could finish first, and
among the tasks on that device that could start before it finishes, run the one with the highest priority. A
schedule is thus defined by one priority per task; the local search anneals those priorities.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

from rlfuse.schedule.model import (Compiled, Problem, Schedule, SimResult, Task, compiled, list_schedule, lower_bound,
                                   simulate)


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


def active_schedule(prob: Problem, priority: dict[Task, float] | list[float]) -> Schedule:
    return _active(prob, priority)[0]


def _active(prob: Problem, priority) -> tuple[Schedule, float]:
    """Giffler-Thompson construction honouring FIFO micro-batch order per (model, stage, kind) on each device.
    Returns the schedule and its makespan (the construction times are the list-scheduling times of its orders)."""
    c = compiled(prob)
    prio = priority if isinstance(priority, list) else [priority[t] for t in c.tasks]
    P, dur = prob.devices, c.duration
    heads = [[0] * len(q) for q in c.queues]
    free = [0.0] * P
    end = [-1.0] * len(c.tasks)
    orders: list[list[int]] = [[] for _ in range(P)]
    options: list[list[tuple[float, int, int]]] = [[] for _ in range(P)]
    best_c = [math.inf] * P
    dirty = set(range(P))
    remaining = len(c.tasks)
    while remaining:
        for d in dirty:  # only devices whose state changed are re-examined
            opts, bc = [], math.inf
            for qi, q in enumerate(c.queues[d]):
                h = heads[d][qi]
                if h >= len(q):
                    continue
                i = q[h]
                ready = c.ready_time(i, free[d], end)
                if ready is not None:
                    opts.append((ready, qi, i))
                    if ready + dur[i] < bc:
                        bc = ready + dur[i]
            options[d], best_c[d] = opts, bc
        dirty = set()
        d = min(range(P), key=best_c.__getitem__)
        cmax = best_c[d]
        ready, qi, i = max((o for o in options[d] if o[0] < cmax - 1e-9), key=lambda o: (prio[o[2]], -o[0]))
        orders[d].append(i)
        end[i] = ready + dur[i]
        free[d] = end[i]
        heads[d][qi] += 1
        remaining -= 1
        dirty.add(d)
        dirty |= c.succ_devices[i]
    return Schedule([[c.tasks[i] for i in o] for o in orders]), max(free)


@dataclass
class SearchResult:
    schedule: Schedule
    result: SimResult
    lower_bound: float
    seconds: float
    evaluations: int


def fused(prob: Problem, seed: int = 0, time_limit: float = 60.0, memory_pass: bool = True,
          max_evals: int | None = None) -> SearchResult:
    """Greedy fill, then simulated annealing over per-task priority keys, then over adjacent swaps, makespan first;
    stops at the lower bound, the time limit or `max_evals` schedules. Then the memory pass. With max_evals (and a
    time limit that does not bind) the result depends only on the seed."""
    budget = max_evals if max_evals is not None else 10**12
    t0 = time.perf_counter()
    rng = random.Random(seed)
    tasks = compiled(prob).tasks
    lb = lower_bound(prob)
    search_limit = 0.85 * time_limit if memory_pass else time_limit
    # makespan first: start from pure critical-path keys (the 1F1B-like keys of the greedy fill save memory but
    # start further from the bound; the memory pass recovers memory afterwards at the same makespan)
    greedy = [base_priority(prob, t) for t in tasks]
    prio = [base_priority(prob, t, backward_first=False) for t in tasks]
    g_span, c_span = _active(prob, greedy)[1], _active(prob, prio)[1]
    best_prio = greedy if g_span <= c_span else prio
    best = cur = min(g_span, c_span)
    cur_prio = list(best_prio)
    evals, temp = 2, max(1.0, 0.02 * best)
    scale = max(prio) - 1e3
    n = len(tasks)
    while best > lb + 1e-9 and time.perf_counter() - t0 < 0.3 * search_limit and evals < 0.3 * budget:
        cand = list(cur_prio)
        for i in rng.sample(range(n), k=max(1, n // 50)):  # re-key a few tasks
            cand[i] += rng.gauss(0, 0.3 * scale)
        span = _active(prob, cand)[1]
        evals += 1
        if span <= cur or rng.random() < math.exp(-(span - cur) / temp):
            cur, cur_prio = span, cand
            if span < best:
                best, best_prio = span, list(cand)
        temp = max(0.05, temp * 0.995)
        if evals % 200 == 0 and cur > best:  # return to the best now and then
            cur, cur_prio = best, list(best_prio)
    sched = active_schedule(prob, best_prio)
    if best > lb + 1e-9 and time.perf_counter() - t0 < search_limit:
        sched, more = anneal_swaps(prob, sched, lb, search_limit - (time.perf_counter() - t0), rng, budget - evals)
        evals += more
    if memory_pass:
        sched = lower_memory(prob, sched, time_limit=max(1.0, 0.15 * time_limit), seed=seed,
                             max_moves=None if max_evals is None else max_evals)
    return SearchResult(sched, simulate(prob, sched), lb, time.perf_counter() - t0, evals)


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


def lower_memory(prob: Problem, sched: Schedule, time_limit: float, seed: int = 0, max_moves: int | None = None) -> Schedule:
    """Adjacent swaps on one device, accepted only when the makespan does not rise and (max peak, total peak)
    activation memory falls or stays (annealed on the memory objective)."""
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
    t0, temp, moves = time.perf_counter(), 1.0, 0
    while time.perf_counter() - t0 < time_limit and (max_moves is None or moves < max_moves):
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
                best, best_orders = score, [list(x) for x in orders]
        else:
            o[k], o[k + 1] = o[k + 1], o[k]
        temp = max(0.01, temp * 0.9995)
    return Schedule([[c.tasks[i] for i in o] for o in best_orders])
