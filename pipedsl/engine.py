"""Dry run of all ranks at once: sends buffer, receives block — as on real processes.

Shared by the validator (does every rank reach its end? if not, which ranks wait on whom)
and the simulator (when does each instruction start and end).  Each rank runs until it
blocks on a receive; a send wakes the rank waiting for it.  Linear in the instruction count.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pipedsl.errors import DeadlockError, ValidationError
from pipedsl.ir import RECVS, SENDS, Instr, Op, Program

Duration = Callable[[Instr], float]


def dry_run(program: Program, compute_time: Duration, message_time: Duration, check_pairs: bool = False,
            send_time: float = 0.0) -> tuple[list[list[float]], list[list[float]]]:
    """Start and end time of every instruction; `DeadlockError` naming the wait cycle if stuck.

    A message arrives `message_time` after its send starts; the send itself keeps its rank busy
    for `send_time` (issuing it: a runtime's cost, not the wire's).

    The k-th receive on b from a takes the k-th message a sent to b, as NCCL and gloo
    match them.  With `check_pairs`, a receive that expects another message than the one
    it would get raises `ValidationError` naming both instructions.
    """
    P = program.num_ranks
    ranks = program.ranks
    starts = [[0.0] * len(s) for s in ranks]
    ends = [[0.0] * len(s) for s in ranks]
    pc = [0] * P
    clock = [0.0] * P
    channels: dict[tuple[int, int], deque[tuple[float, Instr, int]]] = {}
    blocked_on: dict[tuple[int, int], int] = {}  # (src, dst) -> dst, while dst waits on src
    ready = deque(range(P))
    while ready:
        r = ready.popleft()
        stream, st, en = ranks[r], starts[r], ends[r]
        i, t, n = pc[r], clock[r], len(stream)
        while i < n:
            ins = stream[i]
            op = ins.op
            if op in RECVS:
                q = channels.get((ins.peer, r))
                if not q:
                    blocked_on[(ins.peer, r)] = r
                    break
                st[i] = t
                arrival, sent, sent_at = q.popleft()
                if check_pairs and not _matches(sent, ins):
                    raise ValidationError(
                        f"rank {r} instruction {i} ({ins}) receives from rank {ins.peer}, but the next message from "
                        f"rank {ins.peer} is its instruction {sent_at} ({sent}): point-to-point messages match per "
                        f"pair in order, so the receives on rank {r} must follow rank {ins.peer}'s send order")
                if arrival > t:
                    t = arrival
            elif op in SENDS:
                st[i] = t
                key = (r, ins.peer)
                channels.setdefault(key, deque()).append((t + message_time(ins), ins, i))
                if blocked_on.pop(key, None) is not None:
                    ready.append(ins.peer)
                t += send_time
            else:
                st[i] = t
                t += compute_time(ins)
            en[i] = t
            i += 1
        pc[r], clock[r] = i, t
    stuck = [r for r in range(P) if pc[r] < len(ranks[r])]
    if stuck:
        raise DeadlockError(_describe_cycle(program, pc, stuck[0]))
    return starts, ends


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


def _matches(send: Instr, recv: Instr) -> bool:
    if send.mb != recv.mb or send.replica != recv.replica:
        return False
    if send.op is Op.SEND_F:
        return recv.op is Op.RECV_F and recv.stage == send.stage + 1
    return recv.op is Op.RECV_B and recv.stage == send.stage - 1
