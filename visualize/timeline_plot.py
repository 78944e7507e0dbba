"""Timeline pictures with matplotlib (headless: the Agg/SVG canvases, never a display).

One row per rank, time on x; compute boxes coloured by op kind, lighter for later chunks,
hatched for replica 1; sends and receive waits on a thin lane under each row; idle time is
the empty grey band.  Several timelines stack with one shared time axis (schedule A vs B, or
predicted vs measured).

Every drawn element carries an SVG id so tests and tools can find it:
`rank-{panel}-{rank}` for a row, `op-{panel}-{rank}-{instr}` for a compute box (`F0.1`),
`label-{panel}-{rank}-{instr}` for its microbatch number (drawn when it fits),
`msg-{panel}-{rank}-{index}` for a message mark, `step-{panel}-{rank}-{index}` for a
timed REDUCE_GRAD / OPTIMIZER_STEP.  SVG text stays text (`svg.fonttype` none).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib import rc_context
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter, MaxNLocator

from pipedsl.ir import COMPUTE, Op
from pipedsl.output import replacing
from pipedsl.timeline import Timeline

from . import ops, style
from .errors import VisualizeError

FORMATS = (".png", ".svg", ".pdf")

# Vertical layout of one rank, in row units (rank r's row starts at y = r).
BOX_TOP, BOX_H = 0.0, 0.64
LANE_TOP, LANE_H = 0.70, 0.15
ROW_H_IN = 0.40  # inches per rank
MIN_W_IN, MAX_W_IN = 8.0, 22.0


def plot_timeline(timeline: Timeline, path: str | Path | None = None) -> Figure:
    """Draw one timeline; save it when `path` is given (format from the extension)."""
    return plot_timelines([timeline], path)


def plot_timelines(timelines: Sequence[Timeline], path: str | Path | None = None,
                   titles: Sequence[str] | None = None) -> Figure:
    """Stack timelines top to bottom with one shared time axis; save when `path` is given."""
    if not timelines:
        raise VisualizeError("nothing to draw: no timelines")
    timelines = [t.halves() for t in timelines]  # an overlapped pair F&B: its forward, then its backward
    if path is not None:
        check_format(path)
    span = max((t.makespan for t in timelines), default=0.0) or 1.0
    width = _width_inches(timelines, span)
    heights = [max(t.num_ranks, 1) for t in timelines]
    height = sum(h * ROW_H_IN + 0.45 for h in heights) + 0.95
    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(len(timelines), 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": heights, "hspace": 0.06})[:, 0]
    chunks_seen = 1
    show_kind = len({t.kind for t in timelines}) > 1  # predicted vs measured: say which is which
    factor, unit = time_unit = ops.time_unit(timelines)
    for panel, (ax, timeline) in enumerate(zip(axes, timelines)):
        title = titles[panel] if titles else None
        chunks_seen = max(chunks_seen, _draw(ax, timeline, panel, span, width, title, show_kind, time_unit))
    axes[-1].set_xlabel(f"time ({unit})", fontsize=8.5, color=style.TEXT)
    if factor != 1.0:
        axes[-1].xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x * factor:g}"))
    axes[-1].set_xlim(0, span * 1.005)
    _legend(fig, timelines, chunks_seen, ops.costs_note(timelines, time_unit))
    if path is not None:
        save(fig, path)
    return fig


def check_format(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise VisualizeError(f"cannot draw a timeline to {str(path)!r}: unknown extension {suffix or '(none)'!r} "
                             f"(pictures: {', '.join(FORMATS)})")
    return suffix


def save(fig: Figure, path: str | Path) -> None:
    suffix = check_format(path)
    try:
        # SVG keeps its text as text (searchable, small) and its ids stable from run to run.
        with rc_context({"svg.fonttype": "none", "svg.hashsalt": "pipedsl"}), replacing(path) as tmp:
            fig.savefig(tmp, format=suffix[1:], dpi=150, facecolor="white",
                        metadata={"Date": None} if suffix == ".svg" else None)
    except OSError as err:
        raise VisualizeError(f"cannot write {path}: {err.strerror or err}") from None


# ---------------------------------------------------------------- drawing


def _width_inches(timelines: Sequence[Timeline], span: float) -> float:
    """Wide enough that the shortest compute box gets about 13 points, within sane bounds."""
    shortest = min((e.duration for t in timelines for ev in t.ranks for e in ev
                    if e.instr.op in COMPUTE and e.duration > 0), default=span)
    return max(MIN_W_IN, min(MAX_W_IN, span / shortest * 13 / 72 + 1.6))


def _draw(ax, timeline: Timeline, panel: int, span: float, width_in: float, title: str | None,
          show_kind: bool, time_unit: tuple[float, str]) -> int:
    chunks = ops.chunk_index(timeline)
    n_chunks = ops.num_chunks(chunks)
    P = max(timeline.num_ranks, 1)
    points_per_unit = (width_in - 1.3) * 72 / (span * 1.005)
    font = 7.0 if P <= 8 else 6.0

    own = timeline.makespan  # the band ends where this timeline does, even when the axis is shared
    for r in range(timeline.num_ranks):
        _rect(ax, 0, r + BOX_TOP - 0.03, own, BOX_H + 0.06, style.IDLE, None, f"rank-{panel}-{r}", z=0)
        _rect(ax, 0, r + LANE_TOP, own, LANE_H, "#fafafa", None, f"lane-{panel}-{r}", z=0)

    for r, events in enumerate(timeline.ranks):
        for index, event in enumerate(events):
            instr = event.instr
            x0, x1 = ops.relative(event, timeline)
            if instr.op in COMPUTE:
                chunk = chunks.get((r, instr.replica, instr.stage), 0)
                face = style.fill(instr.op, chunk, n_chunks)
                box = _rect(ax, x0, r + BOX_TOP, x1 - x0, BOX_H, face, style.edge(face),
                            f"op-{panel}-{r}-{instr}", z=2, hatch=style.hatch(instr.replica))
                box.set_linewidth(0.5)
                text = ops.label(instr)
                if _fits(text, (x1 - x0) * points_per_unit, font):
                    ax.text((x0 + x1) / 2, r + BOX_TOP + BOX_H / 2, text, ha="center", va="center",
                            fontsize=font, color=style.text_on(face), zorder=3,
                            fontweight="bold" if style.text_on(face) == "#ffffff" else "normal",
                            gid=f"label-{panel}-{r}-{instr}")
            elif ops.is_message(instr):
                w = max(x1 - x0, span * 0.0018)
                lane_h = LANE_H * (1.0 if instr.op.value.startswith("SEND") else 0.6)
                y = r + LANE_TOP + (LANE_H - lane_h) / 2
                _rect(ax, x0, y, w, lane_h, style.BASE[instr.op], None, f"msg-{panel}-{r}-{index}", z=2)
            elif x1 > x0:  # a REDUCE_GRAD / OPTIMIZER_STEP that takes time
                face = style.BASE[instr.op]
                _rect(ax, x0, r + BOX_TOP + BOX_H * 0.2, x1 - x0, BOX_H * 0.6, face, style.edge(face),
                      f"step-{panel}-{r}-{index}", z=2)

    ax.set_ylim(P - 1 + LANE_TOP + LANE_H + 0.12, -0.12)
    ax.set_yticks([r + BOX_TOP + BOX_H / 2 for r in range(timeline.num_ranks)],
                  [f"rank {r}" for r in range(timeline.num_ranks)], fontsize=8, color=style.TEXT)
    ax.tick_params(axis="y", length=0, pad=4)
    ax.tick_params(axis="x", labelsize=8, colors="#555555", length=3)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=12, integer=timeline.kind != "measured"))
    ax.grid(axis="x", color=style.GRID, linewidth=0.5, zorder=1)
    ax.set_axisbelow(True)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.spines["bottom"].set_color("#999999")
    name = title or (f"{timeline.name} ({timeline.kind})" if show_kind else timeline.name)
    ax.set_title(f"{name}   {ops.params_text(timeline)}", loc="left", fontsize=10, fontweight="bold",
                 color=style.TEXT, pad=4)
    ax.set_title(f"bubble {timeline.bubble_ratio:.1%}    makespan {ops.format_time(timeline.makespan, time_unit)}",
                 loc="right", fontsize=9, color="#444444", pad=4)
    return n_chunks


def _rect(ax, x: float, y: float, w: float, h: float, face: str, edgecolor: str | None, gid: str,
          z: float, hatch: str = "") -> Rectangle:
    patch = Rectangle((x, y), w, h, facecolor=face, edgecolor=edgecolor or "none", linewidth=0,
                      hatch=hatch or None, zorder=z)
    patch.set_gid(gid)
    ax.add_patch(patch)
    return patch


def _fits(text: str, width_points: float, font: float) -> bool:
    return bool(text) and len(text) * font * 0.62 + 2.5 <= width_points


def _legend(fig: Figure, timelines: Sequence[Timeline], n_chunks: int, note: str = "") -> None:
    """The kinds, chunks and replicas drawn; `note` (what a prediction's costs are) as its title."""
    handles: list[Patch] = []
    for op in ops.kinds_present(timelines):
        face = style.BASE[op]
        handles.append(Patch(facecolor=face, edgecolor=style.edge(face), linewidth=0.5,
                             label=f"{op.value}  {ops.KIND_NAMES[op]}"))
    steps = {e.instr.op for t in timelines for ev in t.ranks for e in ev
             if e.instr.op in ops.STEP_ORDER and e.duration > 0}
    for op in (op for op in ops.STEP_ORDER if op in steps):
        handles.append(Patch(facecolor=style.BASE[op], label=ops.KIND_NAMES[op]))
    if n_chunks > 1:
        for v in range(n_chunks):
            face = style.fill(Op.F, v, n_chunks)
            handles.append(Patch(facecolor=face, edgecolor=style.edge(face), linewidth=0.5, label=f"chunk {v}"))
    for c in range(1, ops.num_replicas(timelines)):
        handles.append(Patch(facecolor="white", edgecolor="#555555", hatch=style.hatch(c), linewidth=0.5,
                             label=f"replica {c}"))
    handles.append(Patch(facecolor=style.BASE[Op.SEND_F], label="send"))
    handles.append(Patch(facecolor=style.BASE[Op.RECV_F], label="receive wait"))
    handles.append(Patch(facecolor=style.IDLE, edgecolor="#cccccc", linewidth=0.5, label="idle"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 10), fontsize=8,
               frameon=False, handlelength=1.4, handleheight=1.0, columnspacing=1.4,
               title=note or None, title_fontsize=8)
