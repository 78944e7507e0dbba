"""Chrome / Perfetto traces: one process per rank, compute and comm threads, and the way back."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from vis_support import simulated

from pipedsl.ir import COMMS, Instr, Op
from pipedsl.timeline import Event, Timeline
from pipedsl.visualize import VisualizeError
from pipedsl.visualize.chrome_trace import from_chrome_trace, to_chrome_trace, write_chrome_trace


def _complete(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def test_one_process_per_rank_with_compute_and_comm_threads(tmp_path):
    timeline = simulated("1f1b", 4, 8)
    write_chrome_trace(timeline, tmp_path / "t.json")
    trace = json.loads((tmp_path / "t.json").read_text())  # strict JSON: no Infinity from the cost's bandwidth
    events = _complete(trace)
    assert Counter(e["pid"] for e in events) == {r: len(ev) for r, ev in enumerate(timeline.ranks)}
    for r, ev in enumerate(timeline.ranks):
        mine = [e for e in events if e["pid"] == r]
        assert sum(e["tid"] == 0 for e in mine) == sum(e.instr.op not in COMMS for e in ev)
        assert sum(e["tid"] == 1 for e in mine) == sum(e.instr.op in COMMS for e in ev)
    names = {(e["pid"], e["tid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {(r, 0, "compute") for r in range(4)} | {(r, 1, "comm") for r in range(4)}
    procs = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert procs == {r: f"rank {r}" for r in range(4)}


def test_events_carry_op_microbatch_stage_replica_and_time_in_microseconds(pipes):
    timeline = simulated(pipes["replicas"], 2, 2)
    events = _complete(to_chrome_trace(timeline))
    # Simulated cost units are shown as milliseconds: 1 unit = 1000 µs.
    f = next(e for e in events if e["name"] == "F1.1r1")
    assert f["args"] == {"rank": 0, "op": "F", "mb": 1, "stage": 1, "replica": 1}
    assert (f["ts"], f["dur"]) == (3000.0, 1000.0)  # F1.1r1 runs [3, 4] (see test_terminal)
    send = next(e for e in events if e["args"]["op"] == "SEND_F")
    assert send["cat"] == "comm" and "peer" in send["args"]
    assert {e["args"]["op"] for e in events if e["cat"] == "compute"} >= {o.value for o in (Op.F, Op.B)}


def test_measured_seconds_become_microseconds_from_the_first_event():
    t0 = 5000.0
    ranks = ((Event(Instr(Op.F, 0, 0), t0 + 0.5, t0 + 0.75),),)
    trace = to_chrome_trace(Timeline("run", {"P": 1, "M": 1}, ranks, "measured"))
    (event,) = _complete(trace)
    assert (event["ts"], event["dur"]) == (0.0, 250000.0)


@pytest.mark.parametrize("name, P, M", [("1f1b", 4, 8), ("split", 3, 4), ("replicas", 2, 4), ("interleaved", 2, 4)])
def test_round_trip(pipes, name, P, M):
    timeline = simulated(pipes.get(name, name), P, M)
    back = from_chrome_trace(json.loads(json.dumps(to_chrome_trace(timeline))))
    assert (back.name, back.params, back.kind) == (timeline.name, timeline.params, timeline.kind)
    assert [[e.instr for e in ev] for ev in back.ranks] == [[e.instr for e in ev] for ev in timeline.ranks]
    for got, want in zip(back.ranks, timeline.ranks):
        flat = [t for e in got for t in (e.start, e.end)]
        assert flat == pytest.approx([t for e in want for t in (e.start, e.end)])
    assert back.bubble_ratio == pytest.approx(timeline.bubble_ratio)


def test_round_trip_keeps_a_measured_clock():
    t0 = 1234.5
    ranks = ((Event(Instr(Op.F, 0, 0), t0, t0 + 0.01), Event(Instr(Op.B, 0, 0), t0 + 0.02, t0 + 0.04)),)
    timeline = Timeline("run", {"P": 1, "M": 1}, ranks, "measured")
    back = from_chrome_trace(to_chrome_trace(timeline))
    assert back.kind == "measured" and back.start == pytest.approx(t0)
    assert back.makespan == pytest.approx(0.04)


def test_foreign_trace_with_pipedsl_args_reads_pid_as_rank_and_microseconds():
    data = [{"ph": "X", "pid": 1, "tid": 7, "ts": 10, "dur": 5, "name": "x", "args": {"op": "F", "mb": 0, "stage": 1}},
            {"ph": "X", "pid": 0, "tid": 7, "ts": 0, "dur": 10, "name": "y", "args": {"op": "F", "mb": 0, "stage": 0}},
            {"ph": "X", "pid": 0, "tid": 7, "ts": 3, "dur": 1, "name": "unrelated"}]
    timeline = from_chrome_trace(data)
    assert [[str(e.instr) for e in ev] for ev in timeline.ranks] == [["F0.0"], ["F0.1"]]
    assert timeline.kind == "measured" and timeline.makespan == pytest.approx(15e-6)


@pytest.mark.parametrize("data, message", [
    ({"traceEvents": []}, "no pipedsl events"),
    ({"traceEvents": "x"}, "not a Chrome trace"),
    ([{"ph": "X", "pid": 0, "ts": 0, "args": {"op": "Q", "mb": 0, "stage": 0}}], "unknown op 'Q'"),
    ([{"ph": "X", "pid": 0, "args": {"op": "F", "mb": 0, "stage": 0}}], "event 0"),
])
def test_bad_traces_say_what_is_wrong(data, message):
    with pytest.raises(VisualizeError, match=message):
        from_chrome_trace(data, "t.json")
