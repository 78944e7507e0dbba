"""Where to cut a model into stages from what a profiled step measured, and which searched schedule to run on it:
the decision `pipedsl train --schedule auto` takes after its profile steps (trainer/train.py's `_switch`).

Inputs: the traced step (a measured `Timeline` of some program over S stages) and, from every rank, each unit's
median forward seconds with the units each stage holds (runtime/unit_clock.py).  Each stage's measured F, I and
W are split among its units in proportion to their forward times (`partition.unit_costs`), the units are cut
again where the heaviest stage is lightest (`partition.even_sizes`), and the new cut is kept when ZB-auto's
simulated step on it is at least `GAIN` shorter than on the current one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pipedsl
from pipedsl.plan.partition import bounds_of, even_sizes, stage_costs_of, unit_costs
from pipedsl.simulate import Cost, simulate
from pipedsl.timeline import Timeline

GAIN = 0.97  # a new cut is taken for a predicted step this much of the current one's or less
UnitTimes = tuple[dict[int, float], dict[int, list[int]]]  # a rank's (unit -> median seconds, stage -> its units)


def choose_cut(timeline: Timeline, units: list[UnitTimes | None], program: Any,
               params: dict[str, int] | None = None) -> dict[str, Any]:
    """{"cost": the costs to search ZB-auto under (a `Cost`'s fields), "program": ZB-auto searched under them (its
    JSON: the search runs once, here), "points": the new cut points or None (keep the cut), "predicted_ms"
    (ZB-auto's simulated step under the chosen cut), "kept_ms" (under the current one), "profiled_ms" (the
    traced step)}; `units` None on some rank (stages without units) keeps the cut."""
    fitted = Cost.fit(timeline, statistic="mean")  # a path's expected length is the sum of mean costs
    typical = Cost.fit(timeline, statistic="median").per_stage  # a stage's: one slow op does not move it
    cost = replace(fitted, per_stage={s: {k: v for k, v in c.items() if k in ("F", "B", "I", "W")}
                                      for s, c in typical.items()})
    P, M, params = program.num_ranks, program.num_microbatches, params or {}

    def searched(c: Cost) -> tuple[Any, float]:
        found = pipedsl.load("zb-auto").compile(P=P, M=M, cost=c, **params)
        return found, simulate(found, c).makespan

    kept_program, kept = searched(cost)
    decision = {"cost": cost.__dict__, "program": kept_program.to_json(), "points": None, "predicted_ms": kept * 1e3,
                "kept_ms": kept * 1e3, "profiled_ms": timeline.makespan * 1e3}
    if any(u is None for u in units):
        return decision
    seconds: dict[int, list[float]] = {}
    held: dict[int, list[int]] = {}
    for medians, stages in units:  # type: ignore[misc]
        for u, t in medians.items():
            seconds.setdefault(u, []).append(t)
        held.update(stages)
    S = program.num_stages
    if sorted(held) != list(range(S)):
        return decision
    bounds = [min(held[s]) for s in range(S)] + [max(held[S - 1]) + 1]
    per_unit = unit_costs(cost.per_stage, {u: sum(t) / len(t) for u, t in seconds.items()}, bounds)
    cut = list(bounds_of(even_sizes([sum(c.values()) for c in per_unit], S)))
    if cut == bounds:
        return decision
    recut = replace(cost, per_stage=stage_costs_of(per_unit, cut))
    recut_program, then = searched(recut)
    if then < GAIN * kept:
        decision.update(cost=recut.__dict__, program=recut_program.to_json(), points=cut[1:-1],
                        predicted_ms=then * 1e3)
    return decision
