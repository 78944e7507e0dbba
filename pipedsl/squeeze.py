"""The ordering rule under a `memory` cap: a greedy list schedule of all ranks at once.

With `memory CAP` a schedule gives no warmup: the compiler plays all ranks forward in time
(F = 1, B = 2, I = W = 1, messages free) and, whenever a rank is free, runs on it the first of

1. the oldest pending `W`, if more than `wlag(r)` are pending (split backward only);
2. a ready backward (`B`, or `I` when split) — the critical path — first in `order B` order;
3. a ready forward, first in `order F` order, if the cap allows it: an activation lives from
   its F to its B (or to its W when split, counting `wmem` of an activation after its I: the
   fraction a pending W holds, `Cost.wmem`), and a microbatch's first forward on a rank reserves
   room for all its stages there (a V placement's chunk 1 comes back to the same rank), so a
   new microbatch starts only if alive + reserved + its stages here <= `CAP(r)`;
4. the oldest pending `W` (it frees an activation and fills an idle slot);

and otherwise waits for the next op that ends anywhere.  This is the zero-bubble papers'
greedy under a memory limit (Qi et al., "Pipeline Parallelism with Controllable Memory",
NeurIPS'24: V-Half and V-Min are V-shaped placements squeezed under P/2- and P/3-sized caps).
The cap holds by construction; a cap too small to make progress is one error naming the rank.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pipedsl.errors import PipeSemanticError, Span
from pipedsl.ir import Op
from pipedsl.lowering import ComputeOp

COST = {Op.F: 1.0, Op.B: 2.0, Op.I: 1.0, Op.W: 1.0}
Keyed = list[tuple[tuple, int, int, int]]  # (key, m, s, c) sorted by key
NO_LAG = 1 << 30  # a lag no rank reaches: W only fills gaps or frees memory


@dataclass(frozen=True)
class Timing:
    """What the play-forward charges: an op's time by (kind, stage), and a message's between two ranks (`comm`,
    where a stage's input comes from another rank: `placement` (replica, stage) → rank)."""

    duration: Callable[[Op, int], float]
    comm: float = 0.0
    placement: dict[tuple[int, int], int] | None = None

    @staticmethod
    def unit() -> Timing:
        return Timing(lambda kind, s: COST[kind])


@dataclass(frozen=True)
class Policy:
    """How a free rank chooses, beyond the rule above (`order auto` tries several, runtime/auto_order.py):

    - `fill`: "greedy" runs a pending W whenever nothing else is ready (the rule); "fit" only when it ends
      before the next input this rank knows of arrives (a W that would delay a backward waits instead);
    - `forward_first`: a ready forward before a ready backward (more microbatches in flight early);
    - `inflight`: at most this many forwards on rank r whose backward has not run (1F1B's warm-up + 1),
      beside the cap, which counts activations until their W."""

    fill: str = "greedy"
    forward_first: bool = False
    inflight: tuple[int, ...] | None = None  # per rank; None: the cap alone


def squeeze(fwd: list[Keyed], bwd: list[Keyed], num_stages: int, cap: Callable[[int], int],
            lag: Callable[[int], int] | None, span: Span, timing: Timing | None = None,
            policy: Policy = Policy(), wmem: float = 1.0) -> list[list[ComputeOp]]:
    """Each rank's compute order (see the module docstring); `lag` None: full backwards."""
    return play(fwd, bwd, num_stages, cap, lag, span, timing, policy, wmem)[0]


def play(fwd: list[Keyed], bwd: list[Keyed], num_stages: int, cap: Callable[[int], int],
         lag: Callable[[int], int] | None, span: Span, timing: Timing | None = None,
         policy: Policy = Policy(), wmem: float = 1.0) -> tuple[list[list[ComputeOp]], float]:
    """`squeeze`'s orders and the time the play-forward ends (under `timing`); `wmem`: the fraction of an
    activation a pending W holds."""
    timing = timing or Timing.unit()
    P = len(fwd)
    split = lag is not None
    caps = [cap(r) for r in range(P)]
    lags = [lag(r) if split else 0 for r in range(P)]
    for r in range(P):
        if caps[r] < 1:
            raise PipeSemanticError(f"memory of rank {r} is {caps[r]}; it counts activations and must be at least 1",
                                    span)
        if lags[r] < 0:
            raise PipeSemanticError(f"wlag of rank {r} is {lags[r]}; it cannot be negative", span)
    # per rank, per (stage, replica): the forwards (backwards) in key order -- the heads are the candidates
    f_queues = [_by_stage(ops) for ops in fwd]
    b_queues = [_by_stage(ops) for ops in bwd]
    f_end: dict[tuple[int, int, int], float] = {}  # (m, s, c) -> when its forward ended
    g_end: dict[tuple[int, int, int], float] = {}  # (m, s, c) -> when its input gradient was ready
    clock = [0.0] * P
    live = [0.0] * P  # activations alive, in activations (a pending W's counts `wmem`)
    held = max(1.0, wmem) if split else 1.0  # from F to I: room for what its W will hold is reserved
    ahead = [0] * P  # forwards whose backward has not run (`Policy.inflight`)
    reserved = [0] * P  # forwards still to come on the rank for microbatches already started there
    here = [{} for _ in range(P)]  # rank -> replica -> its stages on the rank
    for r, ops in enumerate(fwd):
        for c, _ in {(c, s) for _, _, s, c in ops}:
            here[r][c] = here[r].get(c, 0) + 1
    left_f: dict[tuple[int, int, int], int] = {}  # (rank, m, c) -> forwards of a started microbatch to come
    pending_w: list[deque[tuple[int, int, int]]] = [deque() for _ in range(P)]
    orders: list[list[ComputeOp]] = [[] for _ in range(P)]
    left = [len(f) + len(b) + (len(b) if split else 0) for f, b in zip(fwd, bwd)]
    ends: list[float] = []  # a heap of op end times, to wake waiting ranks
    last = num_stages - 1
    duration, comm = timing.duration, timing.comm
    placed = timing.placement

    def hop(r: int, s: int, c: int) -> float:
        """The message time from stage s's rank to rank r (none on the same rank)."""
        return 0.0 if not comm or placed is None or placed[(c, s)] == r else comm

    def _next_input(r: int, t: float) -> float:
        """When the next backward or forward input this rank can see arrives after `t` (inf: none known)."""
        soon = _INF
        for q in b_queues[r]:
            if q:
                _, m, s, c = q[0]
                if s != last and (m, s + 1, c) in g_end:
                    soon = min(soon, max(f_end.get((m, s, c), _INF), g_end[(m, s + 1, c)] + hop(r, s + 1, c)))
        for q in f_queues[r]:
            if q:
                _, m, s, c = q[0]
                if s > 0 and (m, s - 1, c) in f_end:
                    soon = min(soon, f_end[(m, s - 1, c)] + hop(r, s - 1, c))
        return soon

    active = [r for r in range(P) if left[r]]
    stalled: dict[int, float] = {}  # rank -> the time at which it found nothing to run
    while active:
        r = min(active, key=lambda q: (clock[q], stalled.get(q) == clock[q], q))
        t = clock[r]
        if stalled.get(r) == t:  # every rank at the earliest time waits: move them to the next event
            while ends and ends[0] <= t:
                heapq.heappop(ends)
            later = [clock[q] for q in active if clock[q] > t] + ends[:1]
            if not later:
                raise PipeSemanticError(_stuck(live, caps, f_queues, r), span)
            for q in active:
                if clock[q] == t:
                    clock[q] = min(later)
            continue
        op = None
        if split and len(pending_w[r]) > lags[r]:
            op = (Op.W, *pending_w[r].popleft())

        def backward_ready(m: int, s: int, c: int, t: float = t, r: int = r) -> bool:
            return f_end.get((m, s, c), _INF) <= t and (s == last or g_end.get((m, s + 1, c), _INF)
                                                        + hop(r, s + 1, c) <= t)

        def admitted(m: int, s: int, c: int, t: float = t, r: int = r) -> bool:
            if s > 0 and f_end.get((m, s - 1, c), _INF) + hop(r, s - 1, c) > t:
                return False
            if (r, m, c) in left_f:
                return True
            if policy.inflight is not None and ahead[r] >= policy.inflight[r]:
                return False
            return live[r] + (reserved[r] + here[r][c]) * held <= caps[r] + _SLACK

        for kind in ((Op.F, Op.B) if policy.forward_first else (Op.B, Op.F)):
            if op is not None:
                break
            if kind is Op.B:
                head = _first_ready(b_queues[r], backward_ready)
                if head is not None:
                    op = (Op.I if split else Op.B, *head)
            else:
                head = _first_ready(f_queues[r], admitted)
                if head is not None:
                    op = (Op.F, *head)
        if op is None and split and pending_w[r]:
            w = pending_w[r][0]
            blocked = any(q and not admitted(*q[0][1:], t=_INF) for q in f_queues[r])  # the cap stops a forward
            if policy.fill == "greedy" or blocked or t + duration(Op.W, w[1]) <= _next_input(r, t):
                op = (Op.W, *pending_w[r].popleft())
        if op is None:
            stalled[r] = t
            continue
        kind, m, s, c = op
        end = t + duration(kind, s)
        if kind is Op.F:
            live[r] += held
            ahead[r] += 1
            f_end[(m, s, c)] = end
            key = (r, m, c)
            if key not in left_f:
                left_f[key] = here[r][c]
                reserved[r] += here[r][c]
            left_f[key] -= 1
            reserved[r] -= 1
        elif kind is Op.B or kind is Op.I:
            ahead[r] -= 1
            g_end[(m, s, c)] = end
            if split:
                pending_w[r].append((m, s, c))
                live[r] -= held - wmem
            else:
                live[r] -= held
        else:
            live[r] -= wmem
        heapq.heappush(ends, end)
        clock[r] = end
        orders[r].append(op)
        left[r] -= 1
        if not left[r]:
            active.remove(r)
    return orders, max(clock)


_INF = float("inf")
_SLACK = 1e-9  # fractional activations (`wmem`) summed in floating point: a cap met exactly is met


def _by_stage(ops: Keyed) -> list[deque[tuple[tuple, int, int, int]]]:
    stages: dict[tuple[int, int], deque] = {}
    for entry in ops:
        stages.setdefault((entry[3], entry[2]), deque()).append(entry)
    return list(stages.values())


def _first_ready(queues: list[deque], ready: Callable[[int, int, int], bool]) -> tuple[int, int, int] | None:
    """Pop and return the ready queue head with the smallest key, or None."""
    best = None
    for q in queues:
        if q and ready(*q[0][1:]) and (best is None or q[0] < best[0]):
            best = q
    if best is None:
        return None
    _, m, s, c = best.popleft()
    return (m, s, c)


def _stuck(live: list[float], caps: list[int], f_queues: list, r: int) -> str:
    nxt = [q[0] for q in f_queues[r] if q]
    what = f"F{nxt[0][1]}.{nxt[0][2]}" if nxt else "a backward"
    return (f"the memory cap is too small to make progress: rank {r} holds {round(live[r], 6):g} of its {caps[r]} "
            f"activations "
            f"and waits to run {what}, while no rank can run anything")
