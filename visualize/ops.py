"""What an event *is* when drawn: its kind, chunk, label, and the words that describe a timeline.

Shared by every renderer so the picture, the terminal grid and the trace agree on names.
"""

from __future__ import annotations

from collections.abc import Iterable

from pipedsl.ir import COMMS, COMPUTE, Instr, Op
from pipedsl.timeline import Event, Timeline

KIND_NAMES = {
    Op.F: "forward",
    Op.B: "backward",
    Op.I: "input grad",
    Op.W: "weight grad",
    Op.REDUCE_GRAD: "grad reduce",
    Op.OPTIMIZER_STEP: "optimizer step",
}
COMPUTE_ORDER = (Op.F, Op.B, Op.I, Op.W)
STEP_ORDER = (Op.REDUCE_GRAD, Op.OPTIMIZER_STEP)
COST_UNITS = "cost units"


def is_message(instr: Instr) -> bool:
    return instr.op in COMMS


def chunk_index(timeline: Timeline) -> dict[tuple[int, int, int], int]:
    """(rank, replica, stage) → v, the stage's position among the stages its rank holds for that replica.

    Derived from the events themselves, so it works for measured traces without a program.
    """
    chunks: dict[tuple[int, int, int], int] = {}
    for rank, events in enumerate(timeline.ranks):
        held = sorted({(e.instr.replica, e.instr.stage) for e in events if e.instr.op in COMPUTE})
        position: dict[int, int] = {}
        for replica, stage in held:
            chunks[(rank, replica, stage)] = position.get(replica, 0)
            position[replica] = position.get(replica, 0) + 1
    return chunks


def num_chunks(chunks: dict[tuple[int, int, int], int]) -> int:
    return max(chunks.values(), default=-1) + 1


def num_replicas(timelines: Iterable[Timeline]) -> int:
    return 1 + max((e.instr.replica for t in timelines for ev in t.ranks for e in ev), default=0)


def kinds_present(timelines: Iterable[Timeline]) -> list[Op]:
    """Compute kinds that occur, in F, B, I, W order."""
    seen = {e.instr.op for t in timelines for ev in t.ranks for e in ev}
    return [op for op in COMPUTE_ORDER if op in seen]


def label(instr: Instr) -> str:
    """The short text drawn in a compute box: the microbatch number."""
    return "" if instr.mb is None else str(instr.mb)


def params_text(timeline: Timeline) -> str:
    """`P=4 M=8 V=2`: P and M first, then the other parameters as given."""
    first = [k for k in ("P", "M") if k in timeline.params]
    rest = [k for k in timeline.params if k not in first]
    return " ".join(f"{k}={timeline.params[k]}" for k in first + rest)


def format_time(value: float, unit: tuple[float, str]) -> str:
    """A duration in the (factor, unit) of `time_unit`: `33` in cost units, `40.2 ms`, `1.5 s`."""
    factor, name = unit
    if name == COST_UNITS:
        return f"{value:g}"
    return f"{value * factor:.3g} {name}"


def costs_note(timelines: Iterable[Timeline], unit: tuple[float, str]) -> str:
    """What a prediction drawn beside a measurement assumed, in the shared unit: `simulated with F 1.2 ms,
    B 2.5 ms (mean op times of m.json)` (`Timeline.meta`: "cost" from `simulate`, "costs" how they were
    chosen); empty when nothing measured is drawn, the axis then being in cost units."""
    if unit[1] == COST_UNITS:
        return ""
    notes: dict[str, None] = {}
    for t in timelines:
        cost = t.meta.get("cost")
        if t.kind == "measured" or not isinstance(cost, dict):
            continue
        names = [op.value for op in kinds_present([t])] + [k for k in ("comm", "send") if cost.get(k)]
        parts = ", ".join(f"{k} {format_time(cost[k], unit)}" for k in names if isinstance(cost.get(k), int | float))
        how = t.meta.get("costs")
        notes[f"{t.kind} with {parts}" + (f" ({how})" if how else "")] = None
    return "; ".join(notes)


def time_unit(timelines: Iterable[Timeline]) -> tuple[float, str]:
    """(factor, unit) shared by timelines drawn together: ms or s (seconds × factor) when one of them
    is measured — a prediction drawn beside a measurement is then in seconds too — else cost units."""
    timelines = list(timelines)
    if not any(t.kind == "measured" for t in timelines):
        return 1.0, COST_UNITS
    return (1e3, "ms") if max((t.makespan for t in timelines), default=0.0) < 1 else (1.0, "s")


def relative(event: Event, timeline: Timeline) -> tuple[float, float]:
    """Start and end measured from the timeline's first instruction."""
    return event.start - timeline.start, event.end - timeline.start
