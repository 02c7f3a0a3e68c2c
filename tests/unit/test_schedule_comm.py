"""The executor's point-to-point order, replayed without torch.distributed: on every channel of fused schedules from
the search (4 and 8 devices, K = 1 and 2 critic replicas) the i-th send meets the i-th receive, and the programs
finish even when every send blocks until its receive is posted. Mis-ordered programs are caught."""

import pytest

from rlfuse.schedule.build import fused, serial
from rlfuse.schedule.comm import Message, Recv, Run, Send, input_of, message_of, programs, verify
from rlfuse.schedule.model import Problem, ScheduleError, Task, check

SHAPES = [  # devices, critic stages per replica (K = devices / that), micro-batches actor, critic per replica
    (4, 4, 4, 4), (4, 2, 6, 3), (8, 8, 8, 8), (8, 4, 8, 4), (8, 4, 12, 6),
]


def fused_schedule(shape, seed=0):
    prob = Problem.fused(*shape, 2, 1)
    sched = fused(prob, seed=seed, time_limit=1e9, max_evals=150).schedule
    check(prob, sched)
    return prob, sched


def channels(progs):
    """(src, dst) -> ([messages sent, in order], [messages received, in order])."""
    out = {}
    for d, prog in enumerate(progs):
        for op in prog:
            if isinstance(op, Send):
                out.setdefault((d, op.message.dst), ([], []))[0].append(op.message)
            elif isinstance(op, Recv):
                out.setdefault((op.message.src, d), ([], []))[1].append(op.message)
    return out


def tag_matched_programs(prob, sched):
    """The order the tag-matched executor posted in: receive when the task needs it, send right after."""
    progs = []
    for order in sched.orders:
        prog = []
        for t in order:
            prog += [Recv(m) for m in [input_of(prob, t)] if m is not None]
            prog += [Run(t)] + [Send(m) for m in [message_of(prob, t)] if m is not None]
        progs.append(prog)
    return progs


@pytest.mark.parametrize("shape", SHAPES, ids=[f"P{s[0]}-K{s[0] // s[1]}-M{s[2]}/{s[3]}" for s in SHAPES])
def test_fused_schedules_agree_on_every_channel_and_finish(shape):
    prob, sched = fused_schedule(shape)
    progs = programs(prob, sched)
    # each device runs exactly its schedule, in order
    assert [[op.task for op in p if isinstance(op, Run)] for p in progs] == sched.orders
    chans = channels(progs)
    expected = {message_of(prob, t) for o in sched.orders for t in o} - {None}
    assert {m for sent, _ in chans.values() for m in sent} == expected  # every message sent once...
    assert sum(len(sent) for sent, _ in chans.values()) == len(expected)
    both_ways = 0
    for (src, dst), (sent, received) in chans.items():
        assert abs(src - dst) == 1  # neighbours only
        assert sent == received  # ...and the i-th send is the i-th receive: same model, replica, stage, mb, kind
        both_ways += len({(m.task.model, m.task.kind) for m in sent}) > 1
    assert both_ways > 0  # the shape really shares channels between the two pipelines
    verify(prob, progs)  # also replays with blocking sends: raises on any deadlock


def test_serial_schedule_programs_verify():
    prob = Problem.fused(4, 2, 4, 2, 2, 1)
    verify(prob, programs(prob, serial(prob)))


def test_tag_matched_order_disagrees_on_a_shared_channel():
    """Why the order is derived: posting each receive when its task needs it pairs the wrong tensors under NCCL."""
    # a shape whose fused schedule (seeded, fixed evaluation budget) interleaves the two pipelines' messages on a
    # channel out of step; not every schedule does, so the shape follows the search
    prob, sched = fused_schedule((4, 4, 6, 6))
    progs = tag_matched_programs(prob, sched)
    assert any(sent != received for sent, received in channels(progs).values())
    with pytest.raises(ScheduleError, match=r"channel \d->\d: send #\d+ is .* but receive #\d+ is"):
        verify(prob, progs)


def test_swapped_receives_are_caught():
    prob, sched = fused_schedule((4, 2, 6, 3))
    progs = programs(prob, sched)
    prog = progs[1]
    recvs = [i for i, op in enumerate(prog) if isinstance(op, Recv)]
    # the first two receives on one channel, swapped
    i, j = next((a, b) for a in recvs for b in recvs if a < b and prog[a].message.src == prog[b].message.src)
    prog[i], prog[j] = prog[j], prog[i]
    with pytest.raises(ScheduleError, match=r"channel .* send #\d+ is .* but receive #\d+ is"):
        verify(prob, progs)


def test_opposite_sends_first_deadlock_is_caught():
    """Both ends send before they receive: the orders agree per channel, but with blocking sends neither receive is
    ever posted."""
    prob = Problem.fused(2, 2, 1, 1, 2, 1)
    up = Message(Task(0, 0, 0, "F", 0), 0, 1)  # actor activation, device 0 -> 1
    down = Message(Task(1, 0, 0, "F", 0), 1, 0)  # critic activation, device 1 -> 0
    progs = [[Run(up.task), Send(up), Recv(down), Run(Task(1, 0, 1, "F", 0))],
             [Run(down.task), Send(down), Recv(up), Run(Task(0, 0, 1, "F", 0))]]
    with pytest.raises(ScheduleError, match="deadlock: device 0 waits on send actor"):
        verify(prob, progs)
    progs[1] = [Run(down.task), Recv(up), Send(down), Run(Task(0, 0, 1, "F", 0))]  # one end receives first: fine
    verify(prob, progs)


def test_running_before_the_input_is_received_is_caught():
    prob, sched = fused_schedule((4, 4, 4, 4))
    progs = programs(prob, sched)
    prog = progs[2]
    k = next(i for i, op in enumerate(prog) if isinstance(op, Recv))
    run = next(i for i, op in enumerate(prog) if isinstance(op, Run) and input_of(prob, op.task) == prog[k].message)
    prog.insert(run + 1, prog.pop(k))  # the receive moved after the task that consumes it
    with pytest.raises(ScheduleError, match="before posting the receive of its input"):
        verify(prob, progs)
