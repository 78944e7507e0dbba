"""Runtime costs in the model: a send keeps its rank busy (`send`); `Cost.fit` reads a runtime-style
trace, where a receive is only posted at its RECV and the consumer waits for the data."""

from __future__ import annotations

import pytest

import pipedsl
from pipedsl import Cost
from pipedsl.ir import Op
from pipedsl.timeline import Event, Timeline


def test_a_send_keeps_its_rank_busy():
    program = pipedsl.load("gpipe").compile(P=3, M=1)
    t = pipedsl.simulate(program, Cost(F=1, B=1, comm=0.5, send=0.25))
    # each of the 4 hops: the message arrives comm after the send starts (the sender's 0.25 overlaps it)
    assert t.makespan == pytest.approx(6 + 4 * 0.5)
    sends = [e for events in t.ranks for e in events if e.instr.op in (Op.SEND_F, Op.SEND_B)]
    assert sends and all(e.duration == pytest.approx(0.25) for e in sends)
    program = pipedsl.load("gpipe").compile(P=2, M=2)
    two = pipedsl.simulate(program, Cost(F=1, B=1, send=0.25))
    # r0: F0 [0,1] SEND [1,1.25] F1 [1.25,2.25]; r1: F0 [1,2] F1 [2.25,3.25] B0 [3.25,4.25] SEND [4.25,4.5]
    # B1 [4.5,5.5]; r0: B0 [4.25,5.25] B1 [5.5,6.5]: two sends on the critical path
    assert two.makespan == pytest.approx(pipedsl.simulate(program, Cost(F=1, B=1)).makespan + 2 * 0.25)


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "interleaved", "zb-h1"])
def test_fit_recovers_send_and_comm(name):
    program = pipedsl.load(name).compile(P=2, M=4)
    truth = Cost(F=1, B=2, I=1, W=1, comm=0.3, send=0.1)
    fitted = Cost.fit(pipedsl.simulate(program, truth))
    assert fitted.send == pytest.approx(0.1) and fitted.comm == pytest.approx(0.3)
    assert pipedsl.simulate(program, fitted).makespan == pytest.approx(pipedsl.simulate(program, truth).makespan)


def test_fit_reads_arrival_from_the_consumer_not_the_posted_receive():
    """As the runtime traces it: RECV is the (instant) posting, the consumer starts when the data is there."""
    program = pipedsl.load("gpipe").compile(P=2, M=1)
    r0, r1 = program.ranks
    # r0: F0.0 [0,1], SEND [1,1.1], RECV_B posted at 1.1, B0.0 starts when the gradient arrives at 4.4
    # r1: RECV_F posted at 0, F0.1 starts at 1.3 (0.3 after the send), B0.1 [2.3,4.3], SEND [4.3,4.4]
    times0 = [(0, 1), (1, 1.1), (1.1, 1.1), (4.7, 5.7), (5.7, 5.7), (5.7, 5.7)]
    times1 = [(0, 0), (1.3, 2.3), (2.3, 4.4), (4.4, 4.5), (4.5, 4.5), (4.5, 4.5)]
    ranks = tuple(tuple(Event(i, s, e) for i, (s, e) in zip(stream, times))
                  for stream, times in ((r0, times0), (r1, times1)))
    assert [str(i) for i in r0] == ["F0.0", "SEND_F0.0>1", "RECV_B0.0<1", "B0.0", "REDUCE_GRAD.0", "OPTIMIZER_STEP"]
    fitted = Cost.fit(Timeline("t", {}, ranks, "measured"))
    assert fitted.comm == pytest.approx(0.3)  # both messages: consumer start − send start
    assert fitted.send == pytest.approx(0.1)


def test_fit_with_means_counts_the_tail():
    program = pipedsl.load("gpipe").compile(P=1, M=3)
    r0 = program.ranks[0]
    times = {"F0.0": (0, 1), "F1.0": (1, 2), "F2.0": (2, 6)}  # one slow forward
    t, events = 6.0, []
    for ins in r0:
        s, e = times.get(str(ins), (t, t + 1 if ins.op is Op.B else t))
        events.append(Event(ins, s, e))
        t = max(t, e)
    tl = Timeline("t", {}, (tuple(events),), "measured")
    assert Cost.fit(tl).F == pytest.approx(1) and Cost.fit(tl, "mean").F == pytest.approx(2)
    with pytest.raises(pipedsl.PipeDSLError, match="statistic"):
        Cost.fit(tl, "max")
