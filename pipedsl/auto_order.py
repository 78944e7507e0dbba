"""`order auto`: each rank's order of F, I and W searched from the op and message costs, under the
`memory` cap.

The zero-bubble paper's automatic schedules (Qi et al., ICLR'24, section 3) start from a heuristic —
warm-up forwards up to the memory limit, then one forward, one backward and one W in turn, the W's
placed where they fill a gap — and refine it.  The candidates here:

1. the memory-capped play-forward of squeeze.py, charged with the real costs (each kind's time per
   stage, a message's time between two ranks), under several policies: W's greedy (whenever nothing
   else is ready) or only where they end before the next input the rank knows of arrives; backwards or
   forwards first when both are ready; a W forced once 0, 1, 2, r, 2r (ZB-H1's and ZB-H2's lags) or no
   backwards are pending after it;
2. where every rank holds one stage, the 1F1B rule's family — w(r) warm-up forwards, then 1F1B, each W
   lag(r) backwards after its I, w(r) + 1 + lag(r)·wmem within the cap (`Cost.wmem`: a pending W's share of
   an activation); ZB-H1 (cap P) and ZB-H2 (cap 2P) are members, and so is ZB-2p's shape: the warm-ups that
   fill each rank's wait for its first backward and no more, lag(r) = k·r + c — and the same warm-ups with
   the play placing the W's;
3. a coordinate descent over that family's w(r), lag(r), one rank and one step at a time.

Every candidate is lowered, validated and simulated under the costs; the shortest step wins (ties: the
first tried), so the result is deterministic and never worse than ZB-H1 or ZB-H2 wherever the cap holds
them.
At large sizes fewer candidates are tried and the descent is skipped (`LARGE`).  The cap holds by
construction, as for `memory`.
"""

from __future__ import annotations

from collections.abc import Callable

from pipedsl.errors import PipeSemanticError, Span
from pipedsl.ir import Op
from pipedsl.lowering import ComputeOp
from pipedsl.simulate import Cost
from pipedsl.squeeze import NO_LAG, Keyed, Policy, Timing, play

LARGE = 20_000  # compute ops beyond which fewer candidates are tried and the descent is skipped
EVALUATIONS = 400_000  # the descent's budget: compute ops summed over the programs it simulates


def _lags() -> list[Callable[[int], int]]:
    """The W lags tried: constant 0, 1 and 2, ZB-H1's r, ZB-H2's 2r, and none (W's only fill gaps or free memory)."""
    return [lambda r: 0, lambda r: 1, lambda r: 2, lambda r: r, lambda r: 2 * r, lambda r: NO_LAG]


Orders = list[list[ComputeOp]]


def _covering_warmups(caps: list[int], M: int, cost: Cost, comm: float, P: int, whole: bool = False) -> list[int]:
    """Per rank, the warm-up that covers the wait for its first backward: as many forwards as fit in
    (P−1−r)(F + I + 2·comm) (rounded; `whole`: only those that end before it), within the cap."""
    F, I = max(cost.F, 1e-12), cost.I  # noqa: E741
    fit = int if whole else round
    return [max(0, min(caps[r] - 1, M, fit((P - 1 - r) * (F + I + 2 * comm) / F))) for r in range(P)]


def _rule_peak(warm: int, lag: int, f: float) -> float:
    """The most activations the rule's order holds on a rank (`warm` warm-up forwards, each W `lag` backwards after
    its I, a pending W holding `f` of an activation): warm + 1 in flight and lag pending W's, or, where a pending W
    holds more than its activation did (f > 1), right after an I: warm + (lag + 1)·f."""
    return warm + 1 + lag * f + max(0.0, f - 1)


def _pending_ws(room: float, f: float, M: int) -> int:
    """How many pending W's, each holding `f` of an activation, fit in `room` activations: ⌊room⌋ at f = 1; at
    most M otherwise (no more ever pend)."""
    if f == 1:
        return int(room + 1e-9)
    return M if f <= 0 else max(0, min(M, int(room / f + 1e-9)))


def _descend(best: tuple[Orders, float] | None, structured: Callable[[list[int], list[int]], Orders],
             evaluate: Callable[[Orders], float | None], caps: list[int], M: int, cost: Cost, comm: float,
             P: int, budget: int) -> tuple[Orders, float] | None:
    """Refine the rule's family rank by rank: from the warm-up that covers the wait for the first backward
    (as many forwards as fit in (P−1−r)(F + I + 2·comm), within the cap), move each rank's warm-up and W lag
    by one while the step gets shorter (a coordinate descent; each move costs one evaluation, `budget` of them)."""
    f = cost.wmem
    warm = _covering_warmups(caps, M, cost, comm, P)
    lags = [_pending_ws(caps[r] - _rule_peak(warm[r], 0, f), f, M) for r in range(P)]

    left = [budget]

    def score(w: list[int], lag: list[int]) -> tuple[Orders, float] | None:
        left[0] -= 1
        orders = structured(w, lag)
        end = evaluate(orders)
        return None if end is None else (orders, end)

    current = score(warm, lags)
    if current is not None and (best is None or current[1] < best[1]):
        best = current
    if current is None:
        return best
    for _ in range(3):  # sweeps
        improved = False
        for r in range(P):
            for dw, dl in ((1, -1), (-1, 1), (-1, 0), (0, -1), (1, 0), (0, 1)):
                w, lag = list(warm), list(lags)
                w[r], lag[r] = w[r] + dw, lag[r] + dl
                if not (0 <= w[r] <= M and lag[r] >= 0 and _rule_peak(w[r], lag[r], f) <= caps[r] + 1e-9):
                    continue
                if left[0] <= 0:
                    return current if best is None or current[1] < best[1] else best
                tried = score(w, lag)
                if tried is not None and tried[1] < current[1] - 1e-12 * max(current[1], 1.0):
                    current, warm, lags, improved = tried, w, lag, True
        if not improved:
            break
    return current if best is None or current[1] < best[1] else best


def search_orders(fwd: list[Keyed], bwd: list[Keyed], num_stages: int, cap: Callable[[int], int], span: Span,
                  cost: Cost, placement: dict[tuple[int, int], int], evaluate: Callable[[Orders], float | None],
                  structured: Callable[[list[int], list[int]], Orders] | None = None) -> Orders:
    """The candidate whose step under `cost` ends first (`evaluate`: the makespan of the validated, simulated
    program, None where it does not validate); see the module docstring.  `structured(warmups, lags)` builds
    the rule's order (warm-up forwards, 1F1B, each W `lag` backwards after its I) where every rank holds one
    stage: ZB-H1 and ZB-H2 are its members at caps P and 2P, and the ones between are tried too."""
    def duration(kind: Op, s: int) -> float:
        return cost.per_stage.get(s, {}).get(kind.value, getattr(cost, kind.value))

    f = cost.wmem  # a pending W's share of an activation: lag pending W's hold lag·f

    timing = Timing(duration, cost.message_time(None), placement)  # type: ignore[arg-type]
    P = len(fwd)
    M = len(fwd[0])
    ops = sum(len(q) for q in fwd) * 3
    policies = [Policy(fill, first) for fill in ("fit", "greedy") for first in (False, True)]
    lags = _lags()
    no_lag = lags[-1]
    if ops > LARGE:
        policies, lags = policies[:1], [lags[3], no_lag]
    candidates: list[Orders] = []
    refusal: PipeSemanticError | None = None
    for policy in policies:
        for lag in lags:
            try:
                candidates.append(play(fwd, bwd, num_stages, cap, lag, span, timing, policy, f)[0])
            except PipeSemanticError as err:  # this lag cannot make progress under the cap; another may
                refusal = refusal or err
    caps = [cap(r) for r in range(P)]
    if structured is not None:
        for k in (1, 2):  # ZB-H1 (k = 1) and ZB-H2 (k = 2) themselves, wherever the cap holds them
            warm = [max(0, min(k * (P - r) - 1, M)) for r in range(P)]
            lags_r = [k * r for r in range(P)]
            if all(_rule_peak(warm[r], lags_r[r], f) <= caps[r] + 1e-9 for r in range(P)):
                candidates.append(structured(warm, lags_r))
        for shift in (0, -1, 1, -2, 2):
            # the cap split between warm-up forwards and pending W's, more of it to the W's on later ranks
            lags_r = [max(0, min(_pending_ws(caps[r] - 1, f, M), _pending_ws(r * caps[r] / P, f, M) + shift))
                      for r in range(P)]
            warm = [max(0, min(int(caps[r] - _rule_peak(0, lags_r[r], f) + 1e-9), M)) for r in range(P)]
            candidates.append(structured(warm, lags_r))
            if ops > LARGE:
                continue
            # the same warm-up, its W's placed by the play instead: where they fit, or when memory needs them
            for fill in ("fit", "greedy"):
                policy = Policy(fill, False, tuple(w + 1 for w in warm))
                try:
                    candidates.append(play(fwd, bwd, num_stages, cap, no_lag, span, timing, policy, f)[0])
                except PipeSemanticError as err:
                    refusal = refusal or err
        # the warm-up that fills each rank's wait for its first backward and no more (a forward still running
        # when the gradient arrives delays every rank before it), each W k·r + c backwards after its I: later
        # ranks defer more W's, which fill their cooldown (k = 2: ZB-H2's lags).  With pending W's holding less
        # than an activation (`wmem`) this is the zero-bubble paper's ZB-2p (its Table 5, at k = 3).
        for whole in (True, False):
            cover = _covering_warmups(caps, M, cost, timing.comm, P, whole)
            for k in (range(1, 7) if ops <= LARGE else (2, 3, 4)):
                for c in ((0, 1) if ops <= LARGE else (0,)):
                    lags_r = [k * r + c for r in range(P)]
                    warm = [min(cover[r], int(caps[r] - _rule_peak(0, lags_r[r], f) + 1e-9)) for r in range(P)]
                    if min(warm) >= 0:
                        candidates.append(structured(warm, lags_r))
    best: tuple[Orders, float] | None = None
    for orders in candidates:
        end = evaluate(orders)
        if end is not None and (best is None or end < best[1] - 1e-12 * max(end, 1.0)):
            best = (orders, end)
    if structured is not None and ops <= LARGE:
        budget = max(P, EVALUATIONS // max(ops, 1))  # moves the descent may try: fewer at large sizes
        best = _descend(best, structured, evaluate, caps, M, cost, timing.comm, P, budget)
    if best is None:
        if refusal is not None:
            raise refusal
        raise PipeSemanticError("'order auto' found no order that runs under the memory cap", span)
    return best[0]
