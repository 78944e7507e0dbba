"""Timelines as Chrome / Perfetto traces (the Trace Event Format), and back.

Open the file in https://ui.perfetto.dev or chrome://tracing.  One process per rank
(`pid` = rank), two threads in each: `compute` (tid 0: F, B, I, W, REDUCE_GRAD,
OPTIMIZER_STEP) and `comm` (tid 1: SEND_*, RECV_*; a receive lasts as long as it waited).
Every event is a complete event (`"ph": "X"`) named by the instruction's text (`F3.1`,
`SEND_F3.1>2`) with `op`, `mb`, `stage`, `replica`, `peer` and `rank` in its args.

Times are in µs.  A measured timeline (seconds) is scaled by 10⁶; a simulated one (cost
units) shows one cost unit as 1 ms.  The scale and the timeline's name, parameters and kind
are kept under `otherData.pipedsl`, so `from_chrome_trace` gives the timeline back.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pipedsl.ir import COMMS, Instr
from pipedsl.output import write_text
from pipedsl.timeline import Event, Timeline

from .errors import VisualizeError

COMPUTE_TID, COMM_TID = 0, 1
US_PER_SECOND = 1e6
US_PER_COST_UNIT = 1e3


def us_per_unit(timeline: Timeline) -> float:
    return US_PER_SECOND if timeline.kind == "measured" else US_PER_COST_UNIT


def to_chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """The trace as a JSON-ready dict: `{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}`."""
    timeline = timeline.halves()
    scale = us_per_unit(timeline)
    events: list[dict[str, Any]] = []
    for rank, rank_events in enumerate(timeline.ranks):
        events += [
            {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
            {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": COMPUTE_TID, "args": {"name": "compute"}},
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": COMM_TID, "args": {"name": "comm"}},
        ]
        for e in rank_events:
            instr = e.instr
            args = {"rank": rank, **instr.to_dict(with_replica=True)}
            events.append({
                "name": str(instr),
                "cat": "comm" if instr.op in COMMS else "compute",
                "ph": "X",
                "pid": rank,
                "tid": COMM_TID if instr.op in COMMS else COMPUTE_TID,
                "ts": (e.start - timeline.start) * scale,
                "dur": max(e.end - e.start, 0.0) * scale,
                "args": args,
            })
    other = {"schedule": timeline.name, "params": dict(timeline.params), "kind": timeline.kind,
             "us_per_unit": scale, "start": timeline.start, "makespan": timeline.makespan,
             "bubble_ratio": timeline.bubble_ratio, "meta": _finite(timeline.meta)}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"pipedsl": other}}


def write_chrome_trace(timeline: Timeline, path: str | Path) -> None:
    try:
        write_text(path, json.dumps(to_chrome_trace(timeline), allow_nan=False))
    except OSError as err:
        raise VisualizeError(f"cannot write {path}: {err.strerror or err}") from None


def from_chrome_trace(data: Any, source: str = "trace") -> Timeline:
    """Rebuild a `Timeline` from a trace written by `to_chrome_trace` (or any trace whose complete
    events carry pipedsl's `op`/`mb`/`stage` args; then `pid` is the rank and times are µs)."""
    if isinstance(data, dict):
        raw = data.get("traceEvents")
        info = (data.get("otherData") or {}).get("pipedsl") or {}
    else:
        raw, info = data, {}
    if not isinstance(raw, list) or not isinstance(info, dict):
        raise VisualizeError(f"{source}: not a Chrome trace (expected 'traceEvents', a list of events)")
    scale = info.get("us_per_unit", US_PER_SECOND)
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise VisualizeError(f"{source}: otherData.pipedsl.us_per_unit must be a positive number")
    start = float(info.get("start", 0.0) or 0.0)
    per_rank: dict[int, list[tuple[float, int, Event]]] = {}
    for n, ev in enumerate(raw):
        if not isinstance(ev, dict) or ev.get("ph") != "X" or not isinstance(ev.get("args"), dict) \
                or "op" not in ev["args"]:
            continue
        args = ev["args"]
        try:
            rank = int(args.get("rank", ev.get("pid")))
            instr = Instr.from_dict({k: v for k, v in args.items() if k != "rank"})
            ts, dur = float(ev["ts"]), float(ev.get("dur", 0.0))
        except (KeyError, TypeError, ValueError) as err:
            raise VisualizeError(f"{source}: event {n} ({ev.get('name', '?')}): {err}") from None
        if rank < 0 or not math.isfinite(ts) or not math.isfinite(dur):
            raise VisualizeError(f"{source}: event {n} ({ev.get('name', '?')}): bad rank or time")
        t0 = start + ts / scale
        per_rank.setdefault(rank, []).append((ts, n, Event(instr, t0, t0 + dur / scale)))
    if not per_rank:
        raise VisualizeError(f"{source}: no pipedsl events in this trace (complete events with an 'op' arg)")
    ranks = tuple(tuple(e for _, _, e in sorted(per_rank.get(r, []))) for r in range(max(per_rank) + 1))
    params = info.get("params", {})
    return Timeline(str(info.get("schedule", Path(source).stem)),
                    dict(params) if isinstance(params, dict) else {}, ranks,
                    str(info.get("kind", "measured")), dict(info.get("meta") or {}))


def _finite(value: Any) -> Any:
    """JSON-safe copy: infinities and NaN become strings (strict JSON, which Perfetto needs, has none)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
