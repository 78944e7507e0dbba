"""The simulator: costs per kind, per stage and per message, and fitting costs from a trace."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pipedsl
from pipedsl import Cost


def test_message_latency_delays_each_hop():
    program = pipedsl.load("gpipe").compile(P=3, M=1)
    t = pipedsl.simulate(program, Cost(F=1, B=1, comm=0.5))
    # F on 3 stages, B on 3 stages, 4 hops in between.
    assert t.makespan == pytest.approx(6 + 4 * 0.5)


def test_bandwidth_adds_bytes_over_bandwidth():
    program = pipedsl.load("gpipe").compile(P=2, M=1)
    t = pipedsl.simulate(program, Cost(F=1, B=1, comm=0.1, message_bytes=100, bandwidth=1000))
    assert t.makespan == pytest.approx(4 + 2 * 0.2)


def test_a_cost_subclass_may_price_each_message():
    """simulate asks Cost for one message time; a subclass that overrides message_time is asked per message."""

    class ForwardOnly(Cost):
        def message_time(self, ins):
            return 0.5 if ins.op is pipedsl.Op.SEND_F else 0.0

    program = pipedsl.load("gpipe").compile(P=3, M=1)
    assert pipedsl.simulate(program, ForwardOnly(F=1, B=1)).makespan == pytest.approx(6 + 2 * 0.5)


def test_per_stage_costs_and_reduce_and_step():
    program = pipedsl.load("gpipe").compile(P=2, M=2)
    t = pipedsl.simulate(program, Cost(F=1, B=1, reduce=0.25, step=0.5, per_stage={1: {"F": 2, "B": 3}}))
    # rank 1: F0 [1,3] F1 [3,5] B0 [5,8] B1 [8,11]; rank 0 gets its gradients at 8 and 11:
    # B0 [8,9], B1 [11,12], then REDUCE_GRAD (0.25) and OPTIMIZER_STEP (0.5).
    assert t.busy == [4, 10]
    assert t.makespan == pytest.approx(12 + 0.25 + 0.5)


@given(st.sampled_from(["gpipe", "1f1b"]), st.integers(1, 5), st.integers(1, 8),
       st.floats(0.1, 3), st.floats(0.1, 3), st.floats(0, 0.5))
def test_fit_recovers_the_costs_of_a_simulated_timeline(name, P, M, f, b, comm):
    program = pipedsl.load(name).compile(P=P, M=M)
    truth = Cost(F=f, B=b, comm=comm)
    fitted = Cost.fit(pipedsl.simulate(program, truth))
    assert fitted.F == pytest.approx(f) and fitted.B == pytest.approx(b)
    if P > 1:
        assert fitted.comm == pytest.approx(comm, abs=1e-9)
    again = pipedsl.simulate(program, fitted)
    assert again.makespan == pytest.approx(pipedsl.simulate(program, truth).makespan)


def test_an_overlapped_pair_hides_each_halfs_expert_exchanges_behind_the_other() -> None:
    """F&B with exchange_f / exchange_b: max(F + B - exchange_f - exchange_b, F, B); FB, when given, wins; without
    exchanges, F + B."""
    from pipedsl.ir import Op

    program = pipedsl.load("dualpipev").compile(P=2, M=4)

    def pairs(cost: pipedsl.Cost) -> set[float]:
        events = [e for rank in pipedsl.simulate(program, cost).ranks for e in rank if e.instr.op is Op.OVERLAP]
        assert events
        return {round(e.end - e.start, 9) for e in events}

    assert pairs(pipedsl.Cost(F=1, B=2)) == {3.0}
    assert pairs(pipedsl.Cost(F=1, B=2, exchange_f=0.4, exchange_b=0.5)) == {2.1}
    assert pairs(pipedsl.Cost(F=1, B=2, exchange_f=0.9, exchange_b=0.9)) == {2.0}  # B's own chain bounds it
    assert pairs(pipedsl.Cost(F=1, B=2, exchange_f=0.4, FB=2.5)) == {2.5}
    assert pipedsl.Cost.parse("F=1,exchange_f=0.25").exchange_f == 0.25
