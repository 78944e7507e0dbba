"""Measured timelines are causal: one host's ranks share a clock; other hosts get an estimated offset."""

from __future__ import annotations

import pytest
import trace_cases

import pipedsl
from pipedsl.timeline import Event, Timeline


@pytest.mark.parametrize("schedule,M", [("1f1b", 4), ("gpipe", 3), ("interleaved", 4), ("zb-h1", 4)])
def test_no_consumer_starts_before_its_producer_ended(pools, schedule, M):
    P = 2
    problems = pools[P].run(trace_cases.causal_timeline, schedule, M)[0]
    assert problems == []


def test_ping_pong_offset_is_within_half_the_round_trip(pool2):
    got = pool2.run(trace_cases.ping_pong_offset)
    assert got[0] == {"offset": 0.0, "rtt": 0.0, "shared": False}  # rank 0 is the reference
    assert got[1]["rtt"] > 0
    assert abs(got[1]["offset"]) <= got[1]["rtt"] / 2 + 1e-9  # the true offset is 0 on one host


def test_causality_check_finds_a_consumer_before_its_producer():
    program = pipedsl.load("1f1b").compile(P=2, M=1)
    ranks = []
    for r, stream in enumerate(program.ranks):
        t, events = (0.0 if r == 0 else -0.5), []  # rank 1's clock is off by half an op
        for ins in stream:
            events.append(Event(ins, t, t + 1.0))
            t += 1.0
        ranks.append(tuple(events))
    problems = trace_cases.causality_problems(Timeline("t", {}, tuple(ranks), "measured"))
    assert any("F0.1" in p for p in problems)


def test_the_clock_exchange_sends_device_tensors_under_nccl(monkeypatch):
    """NCCL moves device memory only: the ping-pong between hosts (different clocks) sent host tensors and failed.
    Under a faked NCCL group the buffers are on the current GPU; under gloo on the CPU."""
    import torch
    import torch.distributed as dist

    from pipedsl.runtime import tracer

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert tracer.message_device(None) == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert tracer.message_device(None) == torch.device("cpu")
