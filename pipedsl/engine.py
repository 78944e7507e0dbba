"""Dry run of all ranks at once: sends buffer, receives block — as on real processes.

Shared by the validator (does every rank reach its end, does each receive get the message it
expects? if not, which ranks wait on whom) and the simulator (when does each instruction start
and end).  Each rank runs until it blocks on a receive; a send wakes the rank waiting for it.
Linear in the instruction count.  The validator's walk (`run_to_end`) keeps no clocks: at 10⁶
instructions the clocks' floats and lists are half of the simulator's time and a third of its memory.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from pipedsl.errors import DeadlockError, ValidationError
from pipedsl.ir import Instr, Op, Program

Duration = Callable[[Instr], float]
_SEND_F, _SEND_B, _RECV_F, _RECV_B, _STEP = Op.SEND_F, Op.SEND_B, Op.RECV_F, Op.RECV_B, Op.OPTIMIZER_STEP


def run_to_end(program: Program, gates: Sequence[dict[int, int]] | None = None) -> None:
    """Run every rank with blocking receives; `DeadlockError` naming the wait cycle if stuck.

    The k-th receive on b from a takes the k-th message a sent to b, as NCCL and gloo match
    them; a receive that expects another message than the one it would get raises
    `ValidationError` naming both instructions.  Fields are as the validator's earlier checks
    proved them (peers in range, each message sent once).  `gates` (consecutive steps,
    pipedsl/steps.py): per rank, {instruction index: j} where the rank waits, before that
    instruction, until every rank has passed j OPTIMIZER_STEPs (a post-validated step's verdict)."""
    P, ranks = program.num_ranks, program.ranks
    pc = [0] * P
    inbox: list[dict[int, deque[Instr]]] = [{} for _ in range(P)]  # inbox[dst][src]: sent, not yet received
    waiting = [-1] * P  # the rank each blocked rank waits for (VERDICT: every rank's step end)
    ended = [0] * P  # OPTIMIZER_STEPs passed, per rank
    gated = gates or [{} for _ in range(P)]
    ready = deque(range(P))
    while ready:
        r = ready.popleft()
        stream, box, i, n, gate = ranks[r], inbox[r], pc[r], len(ranks[r]), gated[r]
        while i < n:
            if gate and i in gate and min(ended) < gate[i]:
                waiting[r] = VERDICT
                break
            ins = stream[i]
            op = ins[0]
            if op is _RECV_F or op is _RECV_B:
                src = ins[3]
                q = box.get(src)
                if not q:
                    waiting[r] = src
                    break
                sent = q.popleft()  # SEND_F stage s is RECV_F stage s + 1; SEND_B stage s, RECV_B s - 1
                if (sent[1] != ins[1] or sent[4] != ins[4]
                        or (sent[0] is not _SEND_F or sent[2] + 1 != ins[2] if op is _RECV_F
                            else sent[0] is not _SEND_B or sent[2] - 1 != ins[2])):
                    raise ValidationError(
                        f"rank {r} instruction {i} ({ins}) receives from rank {src}, but the next message from "
                        f"rank {src} is its instruction {ranks[src].index(sent)} ({sent}): point-to-point messages "
                        f"match per pair in order, so the receives on rank {r} must follow rank {src}'s send order")
            elif op is _SEND_F or op is _SEND_B:
                dst = ins[3]
                q = inbox[dst].get(r)
                if q is None:
                    q = inbox[dst][r] = deque()
                q.append(ins)
                if waiting[dst] == r:
                    waiting[dst] = -1
                    ready.append(dst)
            elif op is _STEP and gates:
                ended[r] += 1
                for q in range(P):
                    if waiting[q] == VERDICT:
                        waiting[q] = -1
                        ready.append(q)
            i += 1
        pc[r] = i
    _raise_if_stuck(program, pc, waiting)


VERDICT = -2  # `run_to_end`'s wait for every rank's step end (a gate)


def dry_run(program: Program, compute_time: Duration, message_time: Duration | float,
            send_time: float = 0.0) -> tuple[list[list[float]], list[list[float]]]:
    """Start and end time of every instruction of a program that `run_to_end` accepts.

    A message arrives `message_time` after its send starts (a number: the same for every
    message, without a call per message); the send itself keeps its rank busy for `send_time`
    (issuing it: a runtime's cost, not the wire's).  The k-th receive on b from a takes the k-th
    message a sent to b."""
    latency = None if callable(message_time) else float(message_time)
    P, ranks = program.num_ranks, program.ranks
    starts = [[0.0] * len(s) for s in ranks]
    ends = [[0.0] * len(s) for s in ranks]
    pc = [0] * P
    clock = [0.0] * P
    inbox: list[dict[int, deque[float]]] = [{} for _ in range(P)]  # inbox[dst][src]: arrival times
    waiting = [-1] * P
    ready = deque(range(P))
    while ready:
        r = ready.popleft()
        stream, st, en, box = ranks[r], starts[r], ends[r], inbox[r]
        i, t, n = pc[r], clock[r], len(stream)
        while i < n:
            ins = stream[i]
            op = ins[0]
            st[i] = t
            if op is _RECV_F or op is _RECV_B:
                q = box.get(ins[3])
                if not q:
                    waiting[r] = ins[3]
                    break
                arrival = q.popleft()
                if arrival > t:
                    t = arrival
            elif op is _SEND_F or op is _SEND_B:
                dst = ins[3]
                q = inbox[dst].get(r)
                if q is None:
                    q = inbox[dst][r] = deque()
                q.append(t + (latency if latency is not None else message_time(ins)))  # type: ignore[operator]
                if waiting[dst] == r:
                    waiting[dst] = -1
                    ready.append(dst)
                t += send_time
            else:
                t += compute_time(ins)
            en[i] = t
            i += 1
        pc[r], clock[r] = i, t
    _raise_if_stuck(program, pc)
    return starts, ends


def _raise_if_stuck(program: Program, pc: list[int], waiting: Sequence[int] = ()) -> None:
    stuck = [r for r in range(program.num_ranks) if pc[r] < len(program.ranks[r])]
    if stuck:
        gated = [r for r in stuck if waiting and waiting[r] == VERDICT]
        if gated:
            r = gated[0]
            behind = [q for q in stuck if q not in gated]
            raise DeadlockError(f"rank {r} waits at instruction {pc[r]} ({program.ranks[r][pc[r]]}) for the previous "
                                f"step's verdict, which needs every rank's step end, but "
                                + (f"rank {behind[0]} is stuck at instruction {pc[behind[0]]} "
                                   f"({program.ranks[behind[0]][pc[behind[0]]]})" if behind else
                                   "every rank waits for a verdict"))
        raise DeadlockError(_describe_cycle(program, pc, stuck[0]))


def _describe_cycle(program: Program, pc: list[int], first: int) -> str:
    """Follow who-waits-on-whom from a stuck rank until a rank repeats."""
    seen: list[int] = []
    r = first
    while r not in seen:
        seen.append(r)
        ins = program.ranks[r][pc[r]]
        if pc[r] >= len(program.ranks[ins.peer]):
            return (f"rank {r} waits at instruction {pc[r]} ({ins}) for a message that rank {ins.peer} "
                    f"never sends (it has finished)")
        r = ins.peer
    cycle = seen[seen.index(r):]
    steps = [f"rank {q} waits at instruction {pc[q]} ({program.ranks[q][pc[q]]}) for rank "
             f"{program.ranks[q][pc[q]].peer}" for q in cycle]
    return "the ranks wait on each other in a cycle: " + "; ".join(steps)
