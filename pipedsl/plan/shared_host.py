"""A program's timeline where its ranks share fewer processors than they are (a CPU host).

`pipedsl.simulate` gives every rank a device of its own, which is right for GPUs.  When ranks
share cores — the local machine `plan --calibrate` measures, 4 processes on 2 cores — a rank
waiting for a message leaves its core to the others, and ranks that compute at once slow each
other down.  This replay is a processor-sharing simulation in global time: while n ranks
compute on c cores, each advances at min(1, c·e / n) of its own speed (e: how well the shared
cores are used, measured; n counts the node's other pipelines' ranks by the share of the time
they compute); waiting inside an op (a blocking collective: tensor-parallel all-reduces, ZeRO-3
gathers) takes wall time but no core.  A message arrives `message_time`
after its send, as in `pipedsl.engine.dry_run`.  Cost: O(instructions · ranks), for the local
sizes it is used at.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pipedsl.errors import DeadlockError
from pipedsl.ir import RECVS, SENDS, Instr, Program

Work = Callable[[Instr], tuple[float, float]]  # (seconds of compute alone, seconds waiting on peers)

_COMPUTE, _WAITING_IN_OP, _BLOCKED, _DONE = range(4)


def shared_dry_run(program: Program, work: Work, message_time: Callable[[Instr], float], cores: float,
                   efficiency: float = 1.0, background: float = 0.0) -> tuple[list[list[float]], list[list[float]]]:
    """Start and end time of every instruction of a (validated) program whose ranks share `cores`
    processors with, on average, `background` computing ranks of other programs (the node's other
    pipelines: `plan/pipeline.py` finds how much of the time they compute)."""
    P = program.num_ranks
    streams = program.ranks
    starts = [[0.0] * len(s) for s in streams]
    ends = [[0.0] * len(s) for s in streams]
    pc = [0] * P
    state = [_BLOCKED] * P
    left = [0.0] * P  # compute seconds (at full speed) left in the current op
    wait = [0.0] * P  # then waiting seconds; while waiting, the time it ends
    channels: dict[tuple[int, int], deque[float]] = {}
    now = 0.0

    def advance(r: int) -> None:
        """Run rank r's messages until it computes, blocks on a receive, or ends."""
        stream = streams[r]
        while pc[r] < len(stream):
            i = pc[r]
            ins = stream[i]
            if ins.op in RECVS:
                if state[r] != _BLOCKED:  # starts waiting now
                    starts[r][i], state[r] = now, _BLOCKED
                q = channels.get((ins.peer, r))
                if not q or q[0] > now:
                    return
                q.popleft()
                ends[r][i] = now
            elif ins.op in SENDS:
                starts[r][i] = ends[r][i] = now
                channels.setdefault((r, ins.peer), deque()).append(now + message_time(ins))
            else:
                starts[r][i] = now
                left[r], wait[r] = work(ins)
                state[r] = _COMPUTE
                return
            state[r] = _COMPUTE  # between instructions: no longer blocked
            pc[r] += 1
        state[r] = _DONE

    for r in range(P):
        state[r] = _COMPUTE
        advance(r)
    while True:
        running = [r for r in range(P) if state[r] == _COMPUTE]
        load = len(running) + background
        speed = 1.0 if load <= cores else cores * efficiency / load
        candidates = [now + left[r] / speed for r in running]
        candidates += [wait[r] for r in range(P) if state[r] == _WAITING_IN_OP]
        for r in range(P):
            if state[r] == _BLOCKED:
                q = channels.get((streams[r][pc[r]].peer, r))
                if q:
                    candidates.append(max(q[0], now))
        if not candidates:
            break
        nxt = min(candidates)
        finished = []
        for r in running:
            if now + left[r] / speed <= nxt:
                left[r] = 0.0
                if wait[r] > 0:
                    state[r], wait[r] = _WAITING_IN_OP, nxt + wait[r]
                else:
                    finished.append(r)
            else:
                left[r] -= (nxt - now) * speed
        finished += [r for r in range(P) if state[r] == _WAITING_IN_OP and wait[r] <= nxt]
        now = nxt
        for r in finished:
            ends[r][pc[r]] = now
            pc[r] += 1
            state[r] = _COMPUTE
            advance(r)
        for r in range(P):
            if state[r] == _BLOCKED:
                advance(r)
    stuck = [r for r in range(P) if state[r] != _DONE]
    if stuck:
        raise DeadlockError(f"shared-host replay: rank {stuck[0]} waits at instruction {pc[stuck[0]]} "
                            f"({streams[stuck[0]][pc[stuck[0]]]}) for a message that never comes")
    return starts, ends
