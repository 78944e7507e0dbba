"""`pipedsl show`: look at a schedule — in the terminal, as a picture, a Chrome trace or a graph.

    pipedsl show 1f1b -P 4 -M 8                         # coloured grid in the terminal
    pipedsl show 1f1b -P 4 -M 8 -o 1f1b.svg             # picture (.svg, .png, .pdf)
    pipedsl show gpipe 1f1b -P 4 -M 8 -o cmp.png        # stacked, one shared time axis
    pipedsl show 1f1b -P 4 -M 8 -o 1f1b.json            # Chrome / Perfetto trace
    pipedsl show 1f1b -P 2 -M 3 -o deps.dot             # dependency graph (--graph -o deps.svg renders it)
    pipedsl show --trace measured.json [-o …]           # a runtime trace (Timeline JSON or our Chrome trace)
    pipedsl show 1f1b -P 4 -M 8 --trace measured.json -o cmp.png   # predicted vs measured

Beside a measured trace a prediction is drawn in seconds too: its costs are fitted to the (first)
measured trace — the mean time of each op kind, per stage when the stages match, and the mean
message delay (`Cost.fit`) — or `--cost` is read as seconds; each panel's title says which.
The renderers are imported only when used, so `pipedsl` starts fast for the other commands.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from pipedsl.arguments import add_sizes, add_steps, int_in, params_of
from pipedsl.ir import COMPUTE, Program
from pipedsl.limits import MAX_DRAWING_COLUMNS
from pipedsl.output import write_text
from pipedsl.timeline import Timeline

from .errors import VisualizeError

if TYPE_CHECKING:
    from pipedsl.simulate import Cost

PICTURES = (".png", ".svg", ".pdf")
OUTPUTS = {".png": "picture", ".svg": "picture", ".pdf": "picture", ".json": "Chrome trace",
           ".dot": "dependency graph", ".txt": "plain-text grid"}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "show", help="draw schedules or traces: terminal grid, SVG/PNG, Chrome trace, dependency graph",
        description=__doc__.split("\n\n")[0], epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sizes(p, many=True)
    p.add_argument("--cost", default="", help="cost model for the simulation, e.g. F=1,B=2,I=1,W=1,comm=0 (cost "
                                             "units; seconds beside a --trace that was measured, whose mean op "
                                             "times are the default there)")
    p.add_argument("--trace", action="append", default=[], metavar="FILE",
                   help="a timeline to draw: Timeline JSON (runtime tracer) or a Chrome trace written by pipedsl; "
                        "repeatable, drawn after the schedules")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="write " + ", ".join(f"{s} ({what})" for s, what in OUTPUTS.items())
                        + " instead of printing to the terminal")
    p.add_argument("--graph", action="store_true",
                   help="with -o FILE.svg/.png/.pdf: render the dependency graph instead of the timeline "
                        "(needs graphviz's dot program; the .dot is written regardless)")
    p.add_argument("--width", type=int_in(1, MAX_DRAWING_COLUMNS, "MAX_DRAWING_COLUMNS"),
                   help="terminal columns (default: the terminal's width)")
    add_steps(p)
    return p


def _epilog() -> str:
    return "examples:\n" + "\n".join(line for line in __doc__.splitlines() if line.startswith("    pipedsl"))


def run(args: argparse.Namespace) -> int:
    output = args.output
    suffix = Path(output).suffix.lower() if output else None
    if output is not None and suffix not in OUTPUTS:
        raise VisualizeError(f"cannot write {output!r}: unknown extension {suffix or '(none)'!r} "
                             f"(known: .png/.svg/.pdf picture, .json Chrome trace, .dot dependency graph, "
                             f".txt plain text)")
    if args.graph and suffix not in (*PICTURES, ".dot"):
        raise VisualizeError("--graph draws the dependency graph: give -o FILE.svg, .png, .pdf or .dot")
    if args.steps > 1 and (args.graph or suffix == ".dot"):
        raise VisualizeError(f"--steps {args.steps} draws consecutive steps on a timeline; the dependency graph "
                             f"is one step's")

    sources = _inputs(args)
    timelines = [s.timeline for s in sources]
    if output is None:
        from .terminal import print_timelines
        print_timelines(timelines, width=args.width)
        return 0
    if args.graph or suffix == ".dot":
        from .graph import write_graph
        _only_one(sources, "a dependency graph")
        print(write_graph(sources[0].program(), output))
        return 0
    if suffix in PICTURES:
        from .timeline_plot import plot_timelines
        plot_timelines(timelines, output)
    elif suffix == ".json":
        from .chrome_trace import write_chrome_trace
        _only_one(sources, "a Chrome trace")
        write_chrome_trace(timelines[0], output)
    else:
        from .terminal import render_text
        try:
            write_text(output, render_text(timelines, args.width or 120))
        except OSError as err:
            raise VisualizeError(f"cannot write {output}: {err.strerror or err}") from None
    print(f"wrote {output}")
    return 0


class _Source(NamedTuple):
    """One thing to draw: its timeline, and how to get its program (for the dependency graph)."""

    timeline: Timeline
    program: Callable[[], Program]


def _inputs(args: argparse.Namespace) -> list[_Source]:
    """Each schedule compiled and simulated, then each --trace read."""
    from pipedsl.library import load
    from pipedsl.simulate import Cost, simulate

    from .trace_file import read_timeline

    if not args.schedule and not args.trace:
        raise VisualizeError("show needs a SCHEDULE (with -P and -M) or --trace FILE")
    if args.schedule and (args.ranks is None or args.microbatches is None):
        missing = " and ".join(f for f, v in (("-P", args.ranks), ("-M", args.microbatches)) if v is None)
        raise VisualizeError(f"show {' '.join(args.schedule)}: needs {missing} (ranks and microbatches)")
    cost = Cost.parse(args.cost)
    params = params_of(args)
    schedules = [load(name) for name in args.schedule]
    traces = [(path, read_timeline(path)) for path in args.trace]
    measured = next(((path, t) for path, t in traces if t.kind == "measured"), None)
    sources = []
    for schedule in schedules:
        program = schedule.compile(P=args.ranks, M=args.microbatches, cost=cost,  # `order auto` is searched under it
                                   **_fitting(params, schedule, schedules))
        costs, how = (cost, "") if measured is None else _seconds(args.cost, cost, program, *measured)
        timeline = simulate(program, costs, steps=args.steps)
        if how:
            timeline = replace(timeline, meta={**timeline.meta, "costs": how})
        sources.append(_Source(timeline, lambda p=program: p))
    for _, timeline in traces:
        sources.append(_Source(timeline, lambda t=timeline: Program.from_streams(
            [[e.instr for e in events] for events in t.ranks], t.name, dict(t.params) or None)))
    return sources


def _seconds(text: str, cost: Cost, program: Program, path: str, measured: Timeline) -> tuple[Cost, str]:
    """The cost model, in seconds, of a prediction drawn beside `measured`, and how it was chosen:
    `--cost` as given, else fitted to the measurement (per stage only when its stages are the program's)."""
    from pipedsl.simulate import Cost

    if text:
        return cost, "--cost in seconds"
    fitted = Cost.fit(measured, statistic="mean")
    stages = 1 + max((e.instr.stage for events in measured.ranks for e in events if e.instr.op in COMPUTE),
                     default=-1)
    if stages != program.num_stages:
        fitted = replace(fitted, per_stage={})
    return fitted, f"mean op times of {Path(path).name}"


def _fitting(params: dict[str, int], schedule, schedules: list) -> dict[str, int]:
    """When comparing schedules, each gets the -p/-V parameters it declares (interleaved's V is not
    GPipe's business); a parameter no schedule declares still goes to all, so the typo is reported."""
    declared = {p.name for s in schedules for p in s.parameters}
    own = {p.name for p in schedule.parameters}
    return {k: v for k, v in params.items() if k in own or k not in declared}


def _only_one(sources: list[_Source], what: str) -> None:
    if len(sources) != 1:
        raise VisualizeError(f"{what} shows one schedule or trace, got {len(sources)}; "
                             f"compare several in a picture (-o FILE.png / .svg) or the terminal")


if __name__ == "__main__":  # python -m pipedsl.visualize.show … == pipedsl show …
    from pipedsl.cli import main
    raise SystemExit(main(["show", *sys.argv[1:]]))
