"""Timelines in the terminal: one line per rank, time scaled to the available columns.

`render_text` is the pure-text form (ASCII, what golden tests check and what a pipe or
`NO_COLOR` gets); `render_rich` is the same grid with coloured boxes; `print_timelines`
picks one for the output stream.

Plain-text cells: a box starts with its op letter and microbatch (`F3`, or just `F` when the
box is too narrow) and continues with a fill character (`-` for chunk 0, `=` chunk 1,
`~` chunk 2, …); a lowercase letter marks replica 1; `.` is idle time.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from rich.console import Console
from rich.text import Text

from pipedsl.ir import COMPUTE, Instr, Op
from pipedsl.timeline import Timeline

from . import ops, style

FILLS = "-=~+:"
IDLE = "."
STEP_LETTERS = {Op.REDUCE_GRAD: "R", Op.OPTIMIZER_STEP: "S"}
MIN_COLUMNS = 8


@dataclass(frozen=True)
class Segment:
    """An instruction's cells [start, end) on its rank's line."""

    start: int
    end: int
    instr: Instr
    chunk: int


def layout(timeline: Timeline, columns: int, span: float | None = None) -> list[list[Segment]]:
    """Per rank, the cells each timed instruction covers when `span` time units fill `columns` cells.

    Cell edges are the times rounded to the nearest column; a box that would vanish keeps one
    cell if one is free; boxes never overlap.  Messages are not shown (one line per rank).
    """
    span = timeline.makespan if span is None else span
    scale = columns / span if span > 0 else 0.0
    chunks = ops.chunk_index(timeline)
    rows = []
    for r, events in enumerate(timeline.ranks):
        segments: list[Segment] = []
        free = 0
        for event in events:
            op = event.instr.op
            if op not in COMPUTE and (op not in STEP_LETTERS or event.duration <= 0):
                continue
            x0, x1 = ops.relative(event, timeline)
            c0 = max(math.floor(x0 * scale + 0.5), free)
            c1 = min(math.floor(x1 * scale + 0.5), columns)
            if c1 <= c0 and event.duration > 0 and c0 < columns:
                c1 = c0 + 1
            if c1 > c0:
                instr = event.instr
                segments.append(Segment(c0, c1, instr, chunks.get((r, instr.replica, instr.stage), 0)))
                free = c1
        rows.append(segments)
    return rows


def cell_text(segment: Segment, fill: str | None = None) -> str:
    """The characters of one box: `F3--`, or `F-` when the microbatch number does not fit."""
    instr, width = segment.instr, segment.end - segment.start
    letter = STEP_LETTERS.get(instr.op, instr.op.value)
    if instr.replica % 2:
        letter = letter.lower()
    full = letter + ops.label(instr) if instr.op in COMPUTE else letter
    text = full if len(full) <= width else letter[:width]
    pad = FILLS[segment.chunk % len(FILLS)] if fill is None else fill
    return text + pad * (width - len(text))


def _frame(timelines: Sequence[Timeline], width: int) -> tuple[int, int, float]:
    """(label width, grid columns, shared span) for a set of timelines drawn `width` characters wide."""
    ranks = max((t.num_ranks for t in timelines), default=1)
    label_w = len(f"r{max(ranks - 1, 0)}")
    columns = max(MIN_COLUMNS, width - label_w - 3)  # "r0 |" … "|"
    span = max((t.makespan for t in timelines), default=0.0)
    return label_w, columns, span


def _axis(label_w: int, columns: int, span: float, unit: tuple[float, str]) -> str:
    end = ops.format_time(span, unit)
    return " " * (label_w + 2) + "0" + end.rjust(columns - 1)


def _summary(timeline: Timeline, unit: tuple[float, str]) -> str:
    peaks = " ".join(map(str, timeline.peak_activations))
    return (f"makespan {ops.format_time(timeline.makespan, unit)}  bubble {timeline.bubble_ratio:.1%}  "
            f"peak activations {peaks}")


def _header(timeline: Timeline, show_kind: bool) -> str:
    kind = f" ({timeline.kind})" if show_kind else ""
    return f"{timeline.name}{kind}  {ops.params_text(timeline)}"


def _legend_items(timelines: Sequence[Timeline]) -> list[tuple[Op, str]]:
    """(op, letter) for every kind drawn: the compute kinds present, then timed reduce / step."""
    items = [(op, op.value) for op in ops.kinds_present(timelines)]
    for op in ops.STEP_ORDER:
        letter = STEP_LETTERS[op]
        if any(e.instr.op is op and e.duration > 0 for t in timelines for ev in t.ranks for e in ev):
            items.append((op, letter))
    return items


def render_text(timelines: Timeline | Sequence[Timeline], width: int = 80) -> str:
    """The plain-text grid: header, one line per rank, time axis and summary per timeline; one legend."""
    timelines = [t.halves() for t in ([timelines] if isinstance(timelines, Timeline) else timelines)]
    label_w, columns, span = _frame(timelines, width)
    show_kind = len({t.kind for t in timelines}) > 1
    unit = ops.time_unit(timelines)
    lines: list[str] = []
    for timeline in timelines:
        lines.append(_header(timeline, show_kind))
        for r, segments in enumerate(layout(timeline, columns, span)):
            row = [IDLE] * columns
            for seg in segments:
                row[seg.start:seg.end] = cell_text(seg)
            lines.append(f"r{r}".ljust(label_w) + " |" + "".join(row) + "|")
        lines.append(_axis(label_w, columns, span, unit))
        lines.append(_summary(timeline, unit))
    legend = "  ".join(f"{letter} {ops.KIND_NAMES[op]}" for op, letter in _legend_items(timelines))
    n_chunks = max((ops.num_chunks(ops.chunk_index(t)) for t in timelines), default=1)
    extras = ["number = microbatch"]
    if n_chunks > 1:
        extras.append(", ".join(f"{FILLS[v % len(FILLS)]} chunk {v}" for v in range(n_chunks)))
    if ops.num_replicas(timelines) > 1:
        extras.append("lowercase = replica 1")
    lines.append(f"{legend}  ({'; '.join(extras)})  {IDLE} idle")
    note = ops.costs_note(timelines, unit)
    return "\n".join(lines + ([note] if note else [])) + "\n"


def render_rich(timelines: Timeline | Sequence[Timeline], width: int = 80, colours: int = 256) -> Text:
    """The same grid as `render_text`, with boxes in the op colours (chunks lighter, replica 1 underlined).

    `colours`: 256 or more uses the picture's palette (neighbouring boxes alternate in shade);
    fewer uses the 16 standard terminal colours, where downsampled hues would look alike.
    """
    timelines = [t.halves() for t in ([timelines] if isinstance(timelines, Timeline) else timelines)]
    label_w, columns, span = _frame(timelines, width)
    show_kind = len({t.kind for t in timelines}) > 1
    unit = ops.time_unit(timelines)
    out = Text()
    for timeline in timelines:
        n_chunks = ops.num_chunks(ops.chunk_index(timeline))
        out.append(_header(timeline, show_kind) + "\n", style="bold")
        for r, segments in enumerate(layout(timeline, columns, span)):
            out.append(f"r{r}".ljust(label_w) + " │", style="dim")
            at = 0
            for k, seg in enumerate(segments):
                out.append(" " * (seg.start - at))
                look = _box_style(seg, n_chunks, k, colours)
                out.append(cell_text(seg, fill=" "), style=look + (" underline" if seg.instr.replica % 2 else ""))
                at = seg.end
            out.append(" " * (columns - at) + "│\n", style="dim")
        out.append(_axis(label_w, columns, span, unit) + "\n", style="dim")
        out.append(_summary(timeline, unit) + "\n")
    for op, letter in _legend_items(timelines):
        out.append(f" {letter} ", style=_box_style(Segment(0, 1, Instr(op), 0), 1, 0, colours))
        out.append(f" {ops.KIND_NAMES[op]}  ")
    extras = ["number = microbatch"]
    if any(ops.num_chunks(ops.chunk_index(t)) > 1 for t in timelines):
        extras.append("lighter = later chunk")
    if ops.num_replicas(timelines) > 1:
        extras.append("underlined = replica 1")
    out.append(f"({'; '.join(extras)})", style="dim")
    note = ops.costs_note(timelines, unit)
    if note:
        out.append("\n" + note, style="dim")
    return out


def _box_style(seg: Segment, n_chunks: int, k: int, colours: int) -> str:
    op = seg.instr.op
    if colours < 256:
        return style.ansi(op, seg.chunk)
    face = style.fill(op, seg.chunk, n_chunks) if op in COMPUTE else style.BASE[op]
    if k % 2:  # neighbouring boxes of one kind stay distinguishable
        face = style.mix(face, "#000000", 0.14)
    return f"{style.text_on(face)} on {face}"


def use_colour(stream: TextIO) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set (https://no-color.org)."""
    return bool(getattr(stream, "isatty", lambda: False)()) and not os.environ.get("NO_COLOR")


def print_timelines(timelines: Timeline | Sequence[Timeline], stream: TextIO | None = None,
                    width: int | None = None) -> None:
    """Print to `stream` (stdout): coloured on a terminal, plain text otherwise; fits the width."""
    stream = stream or sys.stdout
    width = width or shutil.get_terminal_size((100, 24)).columns
    if use_colour(stream):
        console = Console(file=stream, width=width, highlight=False, soft_wrap=True)
        colours = 16 if console.color_system in ("standard", "windows") else 256
        console.print(render_rich(timelines, width, colours))
    else:
        stream.write(render_text(timelines, width))
