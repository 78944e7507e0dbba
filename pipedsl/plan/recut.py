"""Where to cut a model into stages from what a profiled step measured, and which searched schedule to run on it:
the decision `pipedsl train --schedule auto` takes after its profile steps (trainer/train.py's `_switch`).

Inputs: the traced step (a measured `Timeline` of some program over S stages) and, from every rank, each unit's
median forward seconds and saved bytes with the units each stage holds (runtime/unit_clock.py), and what each
rank gives activations (`Room`).  Each stage's measured F, I and W are split among its units in proportion to
their forward times (`partition.unit_costs`).

Memory: ZB-auto's cap counts stage activations, but a cut decides how large a stage activation is, so the cap is
taken per cut — the activations of its stage that fit each rank's budget, the least over ranks, at most 2P (ZB-2p)
and at least 1 — unless the user fixed it (`-p mem`).  A rank's budget on another cut is its budget on the
profiled one less the model states of the units it gains (`Room.per_param`).  The candidates are the current cut,
the cut where the heaviest stage is lightest (`partition.even_sizes`), and the same held to stages whose
activations fit their rank k times, for k of 2P, ⌈3P/2⌉, P and one more than that cut's cap (a memory-bound rank
gives up layers so that more microbatches fit everywhere).
The one whose ZB-auto step simulates shortest is taken when it is at least `GAIN` shorter than the current cut's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any

import pipedsl
from pipedsl.errors import PipeDSLError
from pipedsl.plan.partition import Fits, bounds_of, even_sizes, stage_costs_of, unit_costs
from pipedsl.simulate import Cost, simulate
from pipedsl.steps import period
from pipedsl.timeline import Timeline

GAIN = 0.97  # a new cut is taken for a predicted step this much of the current one's or less
ROOM_UNBOUNDED = 1 << 30  # "any number of activations fit": no budget, or activations of no bytes
# a rank's (unit -> median seconds, stage -> its units, unit -> median saved bytes (none when not counted),
# unit -> its parameters)
UnitTimes = tuple[dict[int, float], dict[int, list[int]], dict[int, float], dict[int, int]]


@dataclass(frozen=True)
class Room:
    """Per rank: the bytes it gives stage activations on the profiled cut, and one activation's bytes as it measured
    them there (0: not counted); `per_param`: the bytes of model states a parameter brings (weights, gradients,
    optimizer state), which a cut that moves a unit moves with it (0: the budget is for activations alone)."""

    budget: tuple[float, ...]
    measured: tuple[float, ...]
    per_param: float = 0.0


@dataclass(frozen=True)
class CutChoice:
    """What `choose_cut` decided, for rank 0 to send every rank (pickled) and `pipedsl train` to log: the cut, the
    ZB-auto program searched for it, and the predictions that justify it."""

    cost: Cost  # the costs ZB-auto was searched under: the profile's, per stage of the chosen cut
    program: str  # ZB-auto searched under `cost` (its JSON: the search runs once, on the deciding rank)
    points: list[int] | None  # the new cut points (where stages 1 … S-1 begin, in units); None: keep the cut
    predicted_ms: float  # ZB-auto's simulated step under the chosen cut (with `post`, its period of steps)
    kept_ms: float  # ZB-auto's simulated step under the current cut
    profiled_ms: float  # the traced step (with `post`, scaled to its program's simulated period)
    mem: int  # ZB-auto's cap on stage activations
    fit: int | None  # the stage activations that fit a rank, the least over ranks; None: a fixed cap, or no bytes
    stage_bytes: list[float] | None  # one activation's predicted bytes per stage; None: not counted
    peak_bytes: list[float] | None  # per rank: its simulated peak activations times its stage's bytes


def activations_that_fit(budget: float, each: float) -> int:
    """How many activations of `each` bytes fit `budget` (`ROOM_UNBOUNDED` for activations of no bytes)."""
    return ROOM_UNBOUNDED if each <= 0 else int(min(max(budget, 0.0) // each, ROOM_UNBOUNDED))


def choose_cut(timeline: Timeline, units: Sequence[UnitTimes | None], program: Any,
               params: dict[str, int] | None = None, room: Room | None = None,
               wmem: float | None = None) -> CutChoice:
    """The cut and the ZB-auto program to run (a `CutChoice`).  `units` None on some rank (stages without units)
    keeps the cut; `params["mem"]` fixes the cap; `params["post"]` = 1 searches the period of overlapped steps
    (post-validated steps: `predicted_ms` is then that period, `profiled_ms` the traced step scaled to its
    program's simulated period).  `wmem`: the share of an activation a pending W holds, measured (`Cost.wmem`;
    None: 1, whole until W); the cap and `peak_bytes` count it from I to W."""
    fitted = Cost.fit(timeline, statistic="mean")  # a path's expected length is the sum of mean costs
    typical = Cost.fit(timeline, statistic="median").per_stage  # a stage's: one slow op does not move it
    cost = replace(fitted, per_stage={s: {k: v for k, v in c.items() if k in ("F", "B", "I", "W")}
                                      for s, c in typical.items()}, wmem=1.0 if wmem is None else wmem)
    P, M, S = program.num_ranks, program.num_microbatches, program.num_stages
    params = dict(params or {})
    fixed = "mem" in params or room is None

    least = max(1, math.ceil(cost.wmem - 1e-9))  # the least cap ZB-auto runs with: one activation, and its W's share

    def cap(stage_bytes: Sequence[float] | None, budget: Sequence[float]) -> tuple[int, int | None]:
        """(ZB-auto's cap, the activations that fit) for stages of these bytes, one a rank, in `budget`."""
        if fixed or stage_bytes is None:
            return params.get("mem", 2 * P), None
        fit = min(activations_that_fit(b, e) for b, e in zip(budget, stage_bytes))
        return max(least, min(2 * P, fit)), fit

    def searched(c: Cost, stage_bytes: Sequence[float] | None, points: list[int] | None,
                 budget: Sequence[float]) -> CutChoice:
        """ZB-auto searched and simulated under `c` on a cut; `kept_ms` and `profiled_ms` are the caller's."""
        mem, fit = cap(stage_bytes, budget)
        found = pipedsl.load("zb-auto").compile(P=P, M=M, cost=c, **{**params, "mem": mem})
        timed = simulate(found, c)
        step = period(simulate(found, c, steps=3)) if params.get("post") else timed.makespan
        peaks = None if stage_bytes is None else [n * b for n, b in zip(timed.peak_activations, stage_bytes)]
        return CutChoice(cost=c, program=found.to_json(), points=points, predicted_ms=step * 1e3,
                         kept_ms=math.nan, profiled_ms=math.nan, mem=mem, fit=fit,
                         stage_bytes=None if stage_bytes is None else list(stage_bytes), peak_bytes=peaks)

    def profiled_ms() -> float:
        """The traced step; with `post`, scaled to the profiled program's period of overlapped steps (simulated
        under the same costs): what the searched period is compared with."""
        if not params.get("post"):
            return timeline.makespan * 1e3
        return timeline.makespan * 1e3 * period(simulate(program, cost, steps=3)) / simulate(program, cost).makespan

    measured = list(room.measured) if room is not None and len(room.measured) == S and all(room.measured) else None
    whole = units and all(u is not None for u in units)
    held: dict[int, list[int]] = {}
    for report in units if whole else ():
        held.update(report[1])  # type: ignore[index]
    if not whole or sorted(held) != list(range(S)):  # no units to move: the current cut, its measured bytes
        decision = searched(cost, measured, None, room.budget if room is not None else ())
        return replace(decision, kept_ms=decision.predicted_ms, profiled_ms=profiled_ms())
    seconds: dict[int, list[float]] = {}
    saved: dict[int, float] = {}
    unit_params: dict[int, int] = {}
    for medians, _, unit_saved, counts in units:  # type: ignore[misc]
        for u, t in medians.items():
            seconds.setdefault(u, []).append(t)
        for u, b in unit_saved.items():  # data-parallel replicas: the most any measured, as for `Room.measured`
            saved[u] = max(saved.get(u, 0.0), b)
        unit_params.update(counts)
    bounds = [min(held[s]) for s in range(S)] + [max(held[S - 1]) + 1]
    per_unit = unit_costs(cost.per_stage, {u: sum(t) / len(t) for u, t in seconds.items()}, bounds)
    weights = [sum(c.values()) for c in per_unit]
    unit_bytes = _unit_bytes(saved, bounds, measured)
    moved = _moved_states(unit_params, bounds, room)

    def stage_bytes(cut: Sequence[int]) -> list[float] | None:
        """Per stage of `cut`, one activation's bytes: its units' sum; without units' bytes (recomputation), each
        stage's as measured on the profiled cut (a stage under recomputation keeps about its input, whatever its
        layers)."""
        return measured if unit_bytes is None else [sum(unit_bytes[a:b]) for a, b in zip(cut, cut[1:])]

    def budget(cut: Sequence[int]) -> list[float]:
        """Each rank's room on `cut`: its room on the profiled cut less the model states of the units it gains."""
        if room is None:
            return []
        return [b - moved(s, a, e) for s, (b, a, e) in enumerate(zip(room.budget, cut, cut[1:]))]

    kept = searched(cost, stage_bytes(bounds), None, budget(bounds))
    cuts = [list(bounds_of(even_sizes(weights, S)))]
    if unit_bytes is not None and room is not None and not fixed:
        even_cap = cap(stage_bytes(cuts[0]), budget(cuts[0]))[0]
        for k in sorted({2 * P, (3 * P + 1) // 2, P, even_cap + 1}, reverse=True):
            if even_cap < k <= 2 * P:
                try:
                    cuts.append(list(bounds_of(even_sizes(weights, S, _fitting(unit_bytes, room.budget, moved, k)))))
                except PipeDSLError:  # no cut holds k activations on every rank
                    continue
    best = kept
    for cut in dict.fromkeys(map(tuple, cuts)):  # each distinct cut once, in order
        if list(cut) == bounds:
            continue
        tried = searched(replace(cost, per_stage=stage_costs_of(per_unit, cut)), stage_bytes(cut), list(cut[1:-1]),
                         budget(cut))
        if tried.predicted_ms < min(GAIN * kept.predicted_ms, best.predicted_ms):
            best = tried
    return replace(best, kept_ms=kept.predicted_ms, profiled_ms=profiled_ms())


def _unit_bytes(saved: dict[int, float], bounds: list[int], measured: list[float] | None) -> list[float] | None:
    """Each unit's bytes of one activation: what its forward saved (runtime/unit_clock.py), and the last stage's
    measured bytes beyond its units' (the loss after the head) with the last unit; None where a unit was not
    counted."""
    L = bounds[-1]
    if any(u not in saved for u in range(L)):
        return None
    out = [saved[u] for u in range(L)]
    if measured is not None:
        out[-1] += max(measured[-1] - sum(out[bounds[-2]:]), 0.0)
    return out


def _moved_states(unit_params: dict[int, int], bounds: list[int],
                  room: Room | None) -> Callable[[int, int, int], float]:
    """(stage, first unit, end unit) -> the bytes of model states that stage gains over its profiled units by
    holding these (negative: it gives some up); 0 without `Room.per_param` or the units' parameter counts."""
    L = bounds[-1]
    per_param = room.per_param if room is not None else 0.0
    if not per_param or any(u not in unit_params for u in range(L)):
        return lambda s, a, b: 0.0
    prefix = list(accumulate((unit_params[u] for u in range(L)), initial=0))
    return lambda s, a, b: per_param * ((prefix[b] - prefix[a]) - (prefix[bounds[s + 1]] - prefix[bounds[s]]))


def _fitting(unit_bytes: list[float], budget: Sequence[float], moved: Callable[[int, int, int], float],
             k: int) -> Fits:
    """The `partition.Fits` of stages whose activations fit their rank's `budget` `k` times, after the model states
    the units they gain bring (stage s on rank s)."""
    prefix = list(accumulate(unit_bytes, initial=0.0))
    return lambda s, a, b: (prefix[b] - prefix[a]) * k <= budget[s] - moved(s, a, b)
