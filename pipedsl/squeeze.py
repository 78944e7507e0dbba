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
from functools import partial

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
    _check_limits(caps, lags, span)
    return _Play(fwd, bwd, num_stages, caps, lags, split, span, timing, policy, wmem).run()


def _check_limits(caps: list[int], lags: list[int], span: Span) -> None:
    """Refuse, naming the rank, a cap under one activation or a negative wlag: no play could honour them."""
    for r in range(len(caps)):
        if caps[r] < 1:
            raise PipeSemanticError(f"memory of rank {r} is {caps[r]}; it counts activations and must be at least 1",
                                    span)
        if lags[r] < 0:
            raise PipeSemanticError(f"wlag of rank {r} is {lags[r]}; it cannot be negative", span)


class _Play:
    """One play-forward of all ranks at once: the state the greedy rule reads, and the steps that advance it."""

    def __init__(self, fwd: list[Keyed], bwd: list[Keyed], num_stages: int, caps: list[int], lags: list[int],
                 split: bool, span: Span, timing: Timing, policy: Policy, wmem: float) -> None:
        P = len(fwd)
        self.caps, self.lags, self.split, self.span = caps, lags, split, span
        self.policy, self.wmem = policy, wmem
        # per rank, per (stage, replica): the forwards (backwards) in key order -- the heads are the candidates
        self.f_queues = [_by_stage(ops) for ops in fwd]
        self.b_queues = [_by_stage(ops) for ops in bwd]
        self.f_end: dict[tuple[int, int, int], float] = {}  # (m, s, c) -> when its forward ended
        self.g_end: dict[tuple[int, int, int], float] = {}  # (m, s, c) -> when its input gradient was ready
        self.clock = [0.0] * P
        self.live = [0.0] * P  # activations alive, in activations (a pending W's counts `wmem`)
        self.held = max(1.0, wmem) if split else 1.0  # from F to I: room for what its W will hold is reserved
        self.ahead = [0] * P  # forwards whose backward has not run (`Policy.inflight`)
        self.reserved = [0] * P  # forwards still to come on the rank for microbatches already started there
        self.here = _stages_here(fwd)  # rank -> replica -> its stages on the rank
        self.left_f: dict[tuple[int, int, int], int] = {}  # (rank, m, c) -> forwards of a started microbatch to come
        self.pending_w: list[deque[tuple[int, int, int]]] = [deque() for _ in range(P)]
        self.orders: list[list[ComputeOp]] = [[] for _ in range(P)]
        self.left = [len(f) + len(b) + (len(b) if split else 0) for f, b in zip(fwd, bwd)]
        self.ends: list[float] = []  # a heap of op end times, to wake waiting ranks
        self.last = num_stages - 1
        self.duration, self.comm, self.placed = timing.duration, timing.comm, timing.placement
        self.active = [r for r in range(P) if self.left[r]]
        self.stalled: dict[int, float] = {}  # rank -> the time at which it found nothing to run

    def run(self) -> tuple[list[list[ComputeOp]], float]:
        """Each rank's order and the end time: the earliest free rank runs what the rule picks, or waits."""
        while self.active:
            clock, stalled = self.clock, self.stalled
            r = min(self.active, key=lambda q: (clock[q], stalled.get(q) == clock[q], q))
            t = clock[r]
            if stalled.get(r) == t:  # every rank at the earliest time waits: move them to the next event
                self._wake(r, t)
                continue
            op = self._choose(r, t)
            if op is None:
                stalled[r] = t
                continue
            self._run(r, t, op)
        return self.orders, max(self.clock)

    def _wake(self, r: int, t: float) -> None:
        """Move every rank waiting at `t` to the next time anything changes; none: the cap is too small."""
        ends = self.ends
        while ends and ends[0] <= t:
            heapq.heappop(ends)
        later = [self.clock[q] for q in self.active if self.clock[q] > t] + ends[:1]
        if not later:
            raise PipeSemanticError(_stuck(self.live, self.caps, self.f_queues, r), self.span)
        for q in self.active:
            if self.clock[q] == t:
                self.clock[q] = min(later)

    def _choose(self, r: int, t: float) -> ComputeOp | None:
        """The rule's pick for free rank `r` at `t` (popped from its queue), or None: nothing to run yet."""
        pending = self.pending_w[r]
        if self.split and len(pending) > self.lags[r]:
            return (Op.W, *pending.popleft())
        for kind in ((Op.F, Op.B) if self.policy.forward_first else (Op.B, Op.F)):
            if kind is Op.B:
                head = _first_ready(self.b_queues[r], partial(self._backward_ready, r, t))
                if head is not None:
                    return (Op.I if self.split else Op.B, *head)
            else:
                head = _first_ready(self.f_queues[r], partial(self._admitted, r, t))
                if head is not None:
                    return (Op.F, *head)
        if self.split and pending:
            return self._fill(r, t)
        return None

    def _fill(self, r: int, t: float) -> ComputeOp | None:
        """The oldest pending W when the policy lets it fill this idle slot (`Policy.fill`), else None."""
        w = self.pending_w[r][0]
        blocked = any(q and not self._admitted(r, _INF, *q[0][1:]) for q in self.f_queues[r])  # the cap stops one
        if self.policy.fill == "greedy" or blocked or t + self.duration(Op.W, w[1]) <= self._next_input(r, t):
            return (Op.W, *self.pending_w[r].popleft())
        return None

    def _run(self, r: int, t: float, op: ComputeOp) -> None:
        """Charge `op` on rank `r` from `t`: its memory, its end time for the ops waiting on it, the rank's order."""
        kind, m, s, c = op
        end = t + self.duration(kind, s)
        if kind is Op.F:
            self._ran_forward(r, m, s, c, end)
        elif kind is Op.B or kind is Op.I:
            self.ahead[r] -= 1
            self.g_end[(m, s, c)] = end
            if self.split:
                self.pending_w[r].append((m, s, c))
                self.live[r] -= self.held - self.wmem
            else:
                self.live[r] -= self.held
        else:
            self.live[r] -= self.wmem
        heapq.heappush(self.ends, end)
        self.clock[r] = end
        self.orders[r].append(op)
        self.left[r] -= 1
        if not self.left[r]:
            self.active.remove(r)

    def _ran_forward(self, r: int, m: int, s: int, c: int, end: float) -> None:
        """A forward holds an activation; a microbatch's first one here reserves room for all its stages here."""
        self.live[r] += self.held
        self.ahead[r] += 1
        self.f_end[(m, s, c)] = end
        key = (r, m, c)
        if key not in self.left_f:
            self.left_f[key] = self.here[r][c]
            self.reserved[r] += self.here[r][c]
        self.left_f[key] -= 1
        self.reserved[r] -= 1

    def _hop(self, r: int, s: int, c: int) -> float:
        """The message time from stage s's rank to rank r (none on the same rank)."""
        return 0.0 if not self.comm or self.placed is None or self.placed[(c, s)] == r else self.comm

    def _backward_ready(self, r: int, t: float, m: int, s: int, c: int) -> bool:
        """Its forward has ended and, but on the last stage, the next stage's input gradient has arrived by `t`."""
        return self.f_end.get((m, s, c), _INF) <= t and (s == self.last or self.g_end.get((m, s + 1, c), _INF)
                                                         + self._hop(r, s + 1, c) <= t)

    def _admitted(self, r: int, t: float, m: int, s: int, c: int) -> bool:
        """Its input has arrived by `t` and, for a microbatch new on this rank, the in-flight limit and the cap
        leave room for all its stages here."""
        if s > 0 and self.f_end.get((m, s - 1, c), _INF) + self._hop(r, s - 1, c) > t:
            return False
        if (r, m, c) in self.left_f:
            return True
        if self.policy.inflight is not None and self.ahead[r] >= self.policy.inflight[r]:
            return False
        return self.live[r] + (self.reserved[r] + self.here[r][c]) * self.held <= self.caps[r] + _SLACK

    def _next_input(self, r: int, t: float) -> float:
        """When the next backward or forward input this rank can see arrives after `t` (inf: none known)."""
        soon = _INF
        for q in self.b_queues[r]:
            if q:
                _, m, s, c = q[0]
                if s != self.last and (m, s + 1, c) in self.g_end:
                    soon = min(soon, max(self.f_end.get((m, s, c), _INF),
                                         self.g_end[(m, s + 1, c)] + self._hop(r, s + 1, c)))
        for q in self.f_queues[r]:
            if q:
                _, m, s, c = q[0]
                if s > 0 and (m, s - 1, c) in self.f_end:
                    soon = min(soon, self.f_end[(m, s - 1, c)] + self._hop(r, s - 1, c))
        return soon


_INF = float("inf")
_SLACK = 1e-9  # fractional activations (`wmem`) summed in floating point: a cap met exactly is met


def _stages_here(fwd: list[Keyed]) -> list[dict[int, int]]:
    """Rank -> replica -> how many of its stages lie on the rank: a microbatch reserves room for them all."""
    here: list[dict[int, int]] = [{} for _ in range(len(fwd))]
    for r, ops in enumerate(fwd):
        for c, _ in {(c, s) for _, _, s, c in ops}:
            here[r][c] = here[r].get(c, 0) + 1
    return here


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
