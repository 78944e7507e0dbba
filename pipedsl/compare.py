"""`pipedsl compare`: several schedules side by side at one size and one cost model.

One row per schedule: its stage count, bubble ratio, makespan, peak live activations per rank, the largest of
them as activation memory relative to 1F1B's (stage activations are 1/V of a one-stage-per-rank
stage's with V stages a rank, so `max peak · P / stages ÷ min(P, M)`: the memory/bubble
trade-off in one number), messages per step (point-to-point sends) and copies of the weights.
A schedule that cannot run at these sizes -- a `require` rejects the sizes, the name is unknown -- gets an
"n/a: reason" row instead of stopping the comparison.  A parameter (`-p V=2`) goes to the schedules that
declare it; the others are compared with their defaults, and a note under the table says so (a parameter
that no schedule declares is an error: a typo, not a comparison).  The cost is per stage, so schedules that
cut the model into different numbers of stages (interleaved, V-shapes: 2P) have makespans of different models;
a note under the table says so.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from pipedsl.arguments import add_param, parse_params, positive_int
from pipedsl.compiler import Schedule
from pipedsl.errors import PipeDSLError
from pipedsl.ir import SENDS
from pipedsl.library import load
from pipedsl.simulate import Cost, simulate

HEADERS = ("schedule", "stages", "bubble", "makespan", "peak activations per rank", "memory vs 1F1B", "messages",
           "weight copies")


@dataclass
class Row:
    """One schedule's numbers, or why it has none (`reason`)."""

    schedule: str
    reason: str = ""
    bubble_ratio: float = 0.0
    makespan: float = 0.0
    peak_activations: list[int] = field(default_factory=list)
    messages: int = 0
    weight_copies: int = 0
    memory_vs_1f1b: float = 0.0
    stages: int = 0  # how many stages the model is cut into: the cost is per stage
    params: dict[str, int] = field(default_factory=dict)  # the given parameters this schedule declares
    not_taken: list[str] = field(default_factory=list)  # the given parameters it does not: it ran without them

    @property
    def ok(self) -> bool:
        return not self.reason


def compare(schedules: Sequence[str], P: int, M: int, params: Mapping[str, int] | None = None,
            cost: Cost | str | None = None) -> list[Row]:
    """Compile and simulate each schedule at P ranks and M microbatches; one `Row` each.

    Each schedule gets the `params` it declares and runs with its defaults for the rest (`Row.not_taken`);
    a parameter that none of them declares is a `PipeDSLError` naming it.
    """
    cost = Cost.parse(cost) if isinstance(cost, str) else (cost or Cost())
    params = dict(params or {})
    loaded: dict[str, Schedule | PipeDSLError] = {}
    for name in schedules:
        try:
            loaded[name] = load(name)
        except PipeDSLError as err:
            loaded[name] = err
    found = {name: s for name, s in loaded.items() if isinstance(s, Schedule)}
    unused = [k for k in params if not any(p.name == k for s in found.values() for p in s.parameters)]
    if unused and found:  # a parameter no schedule declares is a typo, not something to compare without
        takes = "; ".join(f"{name}: {', '.join(p.name for p in s.parameters) or 'none'}" for name, s in found.items())
        raise PipeDSLError(f"parameter {unused[0]}={params[unused[0]]}: none of the schedules compared takes it "
                           f"({takes})")
    return [_row(name, loaded[name], P, M, params, cost) for name in schedules]


def _row(name: str, schedule: Schedule | PipeDSLError, P: int, M: int, params: dict[str, int], cost: Cost) -> Row:
    if isinstance(schedule, PipeDSLError):
        return Row(name, reason=schedule.message)
    takes = {p.name for p in schedule.parameters}
    own = {k: v for k, v in params.items() if k in takes}
    not_taken = [k for k in params if k not in takes]
    try:
        program = schedule.compile(P=P, M=M, **own)
    except PipeDSLError as err:
        return Row(name, reason=err.message, params=own, not_taken=not_taken)
    timeline = simulate(program, cost)
    sends = sum(1 for stream in program.ranks for ins in stream if ins.op in SENDS)
    memory = max(timeline.peak_activations) * P / program.num_stages / min(P, M)
    return Row(name, "", timeline.bubble_ratio, timeline.makespan, list(timeline.peak_activations), sends,
               program.num_replicas, memory, program.num_stages, own, not_taken)


def format_table(rows: Sequence[Row], P: int, M: int, params: Mapping[str, int] | None = None,
                 cost: Cost | None = None) -> str:
    """The rows as an aligned text table with a header line naming sizes and costs."""
    cost = cost or Cost()
    sizes = " ".join([f"P={P}", f"M={M}", *(f"{k}={v}" for k, v in (params or {}).items())])
    costs = " ".join(f"{k}={getattr(cost, k):g}" for k in ("F", "B", "I", "W", "FB", "comm")
                     if getattr(cost, k) is not None) + (f" wmem={cost.wmem:g}" if cost.wmem != 1 else "")
    cells = [list(HEADERS)]
    for row in rows:
        if row.ok:
            cells.append([row.schedule, str(row.stages), f"{row.bubble_ratio:.4f}", f"{row.makespan:g}",
                          " ".join(map(str, row.peak_activations)), f"{row.memory_vs_1f1b:.2f}", str(row.messages),
                          str(row.weight_copies)])
        else:
            cells.append([row.schedule, f"n/a: {row.reason}"])
    widths = [max(len(c[i]) for c in cells if len(c) == len(HEADERS)) for i in range(len(HEADERS))]
    widths[0] = max(len(c[0]) for c in cells)
    lines = [f"{sizes}   cost {costs}"]
    for c in cells:
        if len(c) == len(HEADERS):
            lines.append("  ".join(v.ljust(w) if i in (0, 4) else v.rjust(w)
                                   for i, (v, w) in enumerate(zip(c, widths))).rstrip())
        else:
            lines.append(f"{c[0].ljust(widths[0])}  {c[1]}")
    return "\n".join(lines + params_notes(rows, params or {}) + stages_notes(rows))


def stages_notes(rows: Sequence[Row]) -> list[str]:
    """A line when the schedules cut the model into different numbers of stages: the cost is per stage, so their
    makespans are of different models (each stage of an 8-stage cut is half of a 4-stage one's)."""
    by_count: dict[int, list[str]] = {}
    for r in rows:
        if r.ok:
            by_count.setdefault(r.stages, []).append(r.schedule)
    if len(by_count) < 2:
        return []
    which = "; ".join(f"{n}: {', '.join(names)}" for n, names in sorted(by_count.items()))
    return [f"note: the stage counts differ ({which}) and the cost is per stage: the makespans are not of one model "
            f"— compare the bubble ratios, or give each stage count its own cost (F, B … × P / stages)"]


def params_notes(rows: Sequence[Row], params: Mapping[str, int]) -> list[str]:
    """One line per given parameter that some schedules do not declare: which took it, which ran without."""
    notes = []
    for k, v in params.items():
        without = [r.schedule for r in rows if k in r.not_taken]
        if without:
            takers = ", ".join(r.schedule for r in rows if k in r.params)
            notes.append(f"note: {k}={v} applies to {takers}; the others ({', '.join(without)}) take no {k} "
                         f"and are compared with their defaults")
    return notes


def compare_table(schedules: Sequence[str], P: int, M: int, params: Mapping[str, int] | None = None,
                  cost: Cost | str | None = None) -> str:
    """`compare` and `format_table` in one call: the text `pipedsl compare` prints."""
    cost = Cost.parse(cost) if isinstance(cost, str) else (cost or Cost())
    return format_table(compare(schedules, P, M, params, cost), P, M, params, cost)


# ---------------------------------------------------------------- command line


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register `pipedsl compare` on the CLI's sub-parsers."""
    p = subparsers.add_parser("compare", help="bubble, makespan, memory and messages of several schedules")
    p.add_argument("schedules", nargs="+", metavar="SCHEDULE", help="built-in names or .pipe files")
    p.add_argument("-P", "--ranks", type=positive_int, required=True, help="pipeline ranks")
    p.add_argument("-M", "--microbatches", type=positive_int, required=True, help="microbatches per step")
    add_param(p, help="a schedule parameter, passed to the schedules that declare it (the others run with their "
                      "defaults; repeatable)")
    p.add_argument("--cost", default="", help="e.g. F=1,B=2,I=1,W=1,comm=0 (per stage: F@3=1.5)")
    p.add_argument("--format", choices=("text", "json"), default="text")
    return p


def run(args: argparse.Namespace) -> int:
    """`pipedsl compare`: print the table (or JSON rows); 0 even when some rows are n/a."""
    params = parse_params(args.param)
    cost = Cost.parse(args.cost)
    rows = compare(args.schedules, args.ranks, args.microbatches, params, cost)
    if args.format == "json":
        print(json.dumps({"params": {"P": args.ranks, "M": args.microbatches, **params},
                          "rows": [{**asdict(r), "ok": r.ok} for r in rows],
                          "notes": params_notes(rows, params) + stages_notes(rows)}))
    else:
        print(format_table(rows, args.ranks, args.microbatches, params, cost))
    return 0
