"""NCCL's point-to-point semantics, as a model the validator proves programs against (docs/runtime.md, "NCCL").

gloo buffers a send; NCCL does not.  On a GPU a send larger than NCCL's staging buffer completes only when
the peer's stream reaches the matching receive, and every point-to-point operation of a communicator runs on
that communicator's one stream per rank, in the order the rank issued them, both directions together.  A
program that is hang-free when sends buffer (`engine.run_to_end`) can hang here: under one communicator per
pair of ranks, 1F1B at P = 2 has rank 0 sending F1 while rank 1 sends B0 — each send waits for a receive
that sits behind the other send on the peer's stream.

The model, per rank:

- the *host* issues every instruction in `issue order` at once (CUDA calls do not block; the runtime waits
  on the host only at the step's end);
- one *compute stream*: the compute ops in issue order, each starting when the one before it ended and the
  receives it reads have completed; OPTIMIZER_STEP also waits for every send and receive the rank issued
  before it (the step's; in consecutive steps, pipedsl/steps.py, each step's end);
- one *stream per communicator*: the sends and receives on it in issue order.  An operation may start when
  every compute op issued before it has ended (NCCL makes its stream wait for the compute stream at issue),
  and a send completes together with its receive, both at the head of their streams (a rendezvous,
  whatever the message's size).  The k-th send from a to b on a communicator is the k-th receive at b
  from a on it.

Where `run_rendezvous` returns, every operation completes; otherwise `DeadlockError` names the cycle of
waits: ranks, instructions and communicators.  `LAYOUT` is the communicator layout the runtime uses (one
communicator per directed edge: a stream holds the sends to one peer or the receives from one peer, never
both, so a send waits for nothing but its own receive); the others are what peers use, kept as the
model's negative controls.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from pipedsl.errors import DeadlockError
from pipedsl.ir import COMMS, RECVS, SENDS, Instr, Op, Program

# layout name -> the communicator a message from src to dst travels on (a hashable name)
Layout = Callable[[int, int], tuple[int, ...]]
LAYOUTS: dict[str, Layout] = {
    "edge": lambda src, dst: (src, dst),  # one per directed edge: pipedsl's runtime (runtime/p2p.py)
    "pair": lambda src, dst: (min(src, dst), max(src, dst)),  # NCCL's per-pair streams of one group
    "group": lambda src, dst: (),  # one stream for every peer: a group bound to a device (torch PR 132900)
}
LAYOUT = "edge"  # the runtime's layout: decided here, read by runtime/p2p.py and the validator


def communicator_name(layout: str, comm: tuple[int, ...]) -> str:
    """How a cycle names a communicator: `0>1` (a directed edge), `{0,1}` (a pair), `the group`."""
    if layout == "edge":
        return f"{comm[0]}>{comm[1]}"
    if layout == "pair":
        return f"{{{comm[0]},{comm[1]}}}"
    return "the group"


def edges(program: Program) -> list[tuple[int, int]]:
    """The directed edges (src, dst) the program sends along, sorted: the runtime's communicators."""
    return sorted({(r, ins.peer) for r, stream in enumerate(program.ranks) for ins in stream if ins.op in SENDS})


def _consumers(stream: Sequence[Instr]) -> dict[int, list[int]]:
    """Instruction index of each compute op -> the receives (indices) it reads: an F its RECV_F, a B or an I its
    RECV_B (same microbatch, stage and replica), a pair both halves' inputs."""
    recv_at: dict[tuple[Op, tuple], int] = {}
    for i, ins in enumerate(stream):
        if ins.op in RECVS:
            recv_at[(ins.op, ins.key)] = i
    reads: dict[int, list[int]] = {}
    for i, ins in enumerate(stream):
        for part in ins.parts:
            want = Op.RECV_F if part.op is Op.F else Op.RECV_B if part.op in (Op.B, Op.I) else None
            j = recv_at.get((want, part.key)) if want is not None else None
            if j is not None:
                reads.setdefault(i, []).append(j)
    return reads


class _Rank:
    """One rank's streams under the model: what has completed, what each stream's head waits for."""

    def __init__(self, stream: Sequence[Instr], order: Sequence[int], layout: Layout, me: int,
                 gates: dict[int, int] | None = None, ends: list[int] | None = None) -> None:
        self.stream, self.me = stream, me
        # compute-stream instruction indices, in issue order; -j: a gate, waiting for every rank's j-th step end
        self.compute: list[int] = []
        self.fifo: dict[tuple[int, ...], deque[tuple[int, int]]] = {}  # comm -> (index, computes issued before)
        self.comm_of: dict[int, tuple[int, ...]] = {}
        self.ends = ends if ends is not None else [0] * (me + 1)  # every rank's step ends passed (shared)
        self.counts_ends = bool(gates)  # only gates read them
        for i in order:
            if gates and i in gates:
                self.compute.append(-gates[i])
            ins = stream[i]
            if ins.op in COMMS:
                src, dst = (me, ins.peer) if ins.op in SENDS else (ins.peer, me)
                comm = layout(src, dst)
                self.comm_of[i] = comm
                self.fifo.setdefault(comm, deque()).append((i, len(self.compute)))
            else:
                self.compute.append(i)
        reads = _consumers(stream)
        self.reads = [reads.get(i, ()) for i in self.compute]  # per compute op, in issue order
        # a step's end waits for every comm op issued before it (the last; between consecutive steps, each)
        self.step_ends = {k for k, i in enumerate(self.compute) if i >= 0 and stream[i].op is Op.OPTIMIZER_STEP}
        self.comms = list(self.fifo)
        self.ended = 0  # compute ops ended, a prefix of `compute`
        self.done: set[int] = set()  # comm ops completed
        self.comms_left = sum(len(q) for q in self.fifo.values())

    def head(self, comm: tuple[int, ...]) -> tuple[int, int] | None:
        q = self.fifo.get(comm)
        return q[0] if q else None

    def armed(self, comm: tuple[int, ...]) -> int | None:
        """The instruction at the head of `comm`'s stream if it may start (the compute issued before it ended)."""
        h = self.head(comm)
        return h[0] if h is not None and h[1] <= self.ended else None

    def blocker(self) -> int | None:
        """What the compute stream's head waits for: a receive not completed, or (OPTIMIZER_STEP) any comm op
        issued before it; None when it can run."""
        k = self.ended
        if self.compute[k] < 0:  # a gate: the previous step's verdict, once every rank has ended that step
            return GATE if min(self.ends) < -self.compute[k] else None
        if self.comms_left and k in self.step_ends:
            for q in self.fifo.values():
                if q and q[0][1] <= k:  # issued before the step's end (a stream's later ops were issued later)
                    return q[0][0]
        done = self.done
        for j in self.reads[k]:
            if j not in done:
                return j
        return None

    def run_compute(self) -> bool:
        start, n = self.ended, len(self.compute)
        while self.ended < n and self.blocker() is None:
            if self.counts_ends and self.ended in self.step_ends:
                self.ends[self.me] += 1
            self.ended += 1
        return self.ended > start


GATE = -1  # `_Rank.blocker`: a gate waiting for the previous step's verdict


def run_rendezvous(program: Program, layout: str = LAYOUT, order: Sequence[Sequence[int]] | None = None,
                   gates: Sequence[dict[int, int]] | None = None) -> None:
    """Run `program` under NCCL's semantics with communicators laid out by `layout` (a `LAYOUTS` name) and each
    rank's instructions issued in `order` (indices; default program order, receives at their place — the
    latest the runtime posts them).  `DeadlockError` names the cycle of waits if some operation never
    completes.  Linear in the instruction count times the communicators a rank holds.  `gates` (consecutive
    steps, pipedsl/steps.py): per rank, {instruction index: j} where it waits, before issuing that instruction,
    until every rank has passed j OPTIMIZER_STEPs (a post-validated step's verdict)."""
    P, comm_for = program.num_ranks, LAYOUTS[layout]
    ends = [0] * P
    ranks = [_Rank(program.ranks[r], order[r] if order is not None else range(len(program.ranks[r])), comm_for, r,
                   gates[r] if gates is not None else None, ends) for r in range(P)]
    peers = [sorted({ins.peer for ins in program.ranks[r] if ins.op in COMMS}) for r in range(P)]
    queued = [True] * P
    todo = deque(range(P))
    while todo:
        r = todo.popleft()
        queued[r] = False
        me = ranks[r]
        ended = sum(ends) if gates else 0
        moved = me.run_compute()
        for comm in me.comms:
            while (i := me.armed(comm)) is not None and me.stream[i].op in SENDS:
                dst = me.stream[i].peer
                j = ranks[dst].armed(comm)
                if j is None or ranks[dst].stream[j].op not in RECVS or ranks[dst].stream[j].peer != r:
                    break
                me.fifo[comm].popleft()
                ranks[dst].fifo[comm].popleft()
                me.done.add(i)
                ranks[dst].done.add(j)
                me.comms_left -= 1
                ranks[dst].comms_left -= 1
                moved = True
                if not queued[dst]:
                    queued[dst] = True
                    todo.append(dst)
            moved = me.run_compute() or moved
        if moved:
            for q in range(P) if gates and sum(ends) != ended else (r, *peers[r]):  # a step's end may open gates
                if not queued[q]:
                    queued[q] = True
                    todo.append(q)
    stuck = [r for r in range(P) if ranks[r].ended < len(ranks[r].compute) or ranks[r].comms_left]
    if stuck:
        raise DeadlockError(_describe(ranks, stuck[0], layout, comm_for))


def _describe(ranks: list[_Rank], first: int, layout: str, comm_for: Layout) -> str:
    """Follow what waits for what, from a stuck rank, until an operation repeats: the cycle, in words."""
    def node_of_stuck(r: int) -> tuple[int, int]:
        me = ranks[r]
        if me.ended < len(me.compute):
            return r, me.compute[me.ended]
        return r, next(q[0][0] for q in me.fifo.values() if q)

    def waits_for(r: int, i: int) -> tuple[tuple[int, int], str]:
        me = ranks[r]
        if i < 0:  # a gate
            q = min(range(len(ranks)), key=lambda p: ranks[p].ends[p])
            return node_of_stuck(q), (f"rank {r} waits at its gate for every rank's step end {-i}, which rank {q} "
                                      f"has not reached")
        ins = me.stream[i]
        where = f"rank {r} instruction {i} ({ins})"
        if ins.op not in COMMS:
            j = me.blocker()
            if j is None or j == GATE:  # behind an earlier compute op (or a gate): the compute stream's head
                j = me.compute[me.ended]
                return (r, j), f"{where} waits on the compute stream behind instruction {j}"
            return (r, j), f"{where} waits for instruction {j} ({me.stream[j]})"
        comm = me.comm_of[i]
        name = communicator_name(layout, comm)
        h = me.head(comm)
        assert h is not None
        if h[0] != i:
            return (r, h[0]), (f"{where} waits behind instruction {h[0]} ({me.stream[h[0]]}) on communicator "
                               f"{name}'s stream")
        if h[1] > me.ended:
            j = me.compute[me.ended]
            what = me.stream[j] if j >= 0 else "its gate"
            return (r, j), f"{where} on communicator {name} waits for the compute issued before it ({what})"
        peer = ranks[ins.peer]
        other = peer.head(comm)
        if other is None:  # the peer has nothing left on this communicator: it has finished
            return (ins.peer, node_of_stuck(ins.peer)[1]), f"{where} waits for rank {ins.peer}, which has finished"
        verb = "its receive" if ins.op in SENDS else "its send"
        return (ins.peer, other[0]), (f"{where} on communicator {name} waits for rank {ins.peer} to reach {verb}, "
                                      f"but rank {ins.peer}'s stream of {name} is at instruction {other[0]} "
                                      f"({peer.stream[other[0]]})")

    seen: dict[tuple[int, int], int] = {}
    steps: list[str] = []
    node = node_of_stuck(first)
    while node not in seen:
        seen[node] = len(steps)
        node, text = waits_for(*node)
        steps.append(text)
    cycle = steps[seen[node]:]
    return ("under NCCL's point-to-point semantics (a send completes only when its receive is reached; one stream "
            f"per communicator and rank; communicators per {_LAYOUT_WORDS[layout]}) the ranks wait on each other in "
            "a cycle: " + "; ".join(cycle))


_LAYOUT_WORDS = {"edge": "directed edge", "pair": "pair of ranks", "group": "group: one"}
