"""`order auto` (pipedsl/auto_order.py): each rank's order searched from the costs under the memory cap —
validated, within the cap, deterministic, and at or below the handcrafted zero-bubble schedules wherever the
cap holds them (ZB-H1 from P activations, ZB-H2 from 2P) on every cost draw."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipedsl
from pipedsl.cli import main

COSTS = st.tuples(st.sampled_from([0.5, 1.0, 1.5, 2.0]), st.sampled_from([0.5, 1.0, 1.5, 2.0]),
                  st.sampled_from([0.3, 0.6, 1.0]), st.sampled_from([0.0, 0.05, 0.3]))


def _cost(F: float, I: float, W: float, comm: float) -> pipedsl.Cost:  # noqa: E741, N803
    return pipedsl.Cost(F=F, B=I + W, I=I, W=W, comm=comm)


@settings(max_examples=12, deadline=None)
@given(P=st.integers(2, 5), extra=st.integers(0, 6), costs=COSTS)
def test_never_worse_than_zb_h1_and_zb_h2_at_the_same_memory(P: int, extra: int, costs: tuple) -> None:
    M = 2 * P + extra
    cost = _cost(*costs)
    auto = pipedsl.load("zb-auto")
    for mem, handcrafted in ((P, "zb-h1"), (2 * P, "zb-h1"), (2 * P, "zb-h2")):
        searched = pipedsl.simulate(auto.compile(P=P, M=M, mem=mem, cost=cost), cost)
        reference = pipedsl.simulate(pipedsl.load(handcrafted).compile(P=P, M=M), cost)
        assert searched.makespan <= reference.makespan * (1 + 1e-9), (mem, searched.makespan, reference.makespan)
        assert max(searched.peak_activations) <= mem


def test_uneven_costs_find_a_shorter_step_than_zb_h2() -> None:
    """Where the forward, the input gradient and the weight gradient differ and messages cost, the search beats the
    handcrafted order at the same memory (P=4, M=8, F=2, I=2, W=1, comm=0.3: ZB-H2 ends at the larger time)."""
    cost = _cost(2.0, 2.0, 1.0, 0.3)
    searched = pipedsl.simulate(pipedsl.load("zb-auto").compile(P=4, M=8, cost=cost), cost)
    zb_h2 = pipedsl.simulate(pipedsl.load("zb-h2").compile(P=4, M=8), cost)
    assert searched.makespan < zb_h2.makespan * 0.99


def test_deterministic_and_searched_under_the_given_costs() -> None:
    auto = pipedsl.load("zb-auto")
    a = auto.compile(P=4, M=10, mem=5, cost="F=1,I=1.5,W=0.5,comm=0.1")
    b = auto.compile(P=4, M=10, mem=5, cost=pipedsl.Cost(F=1, B=2, I=1.5, W=0.5, comm=0.1))
    assert a.to_text() == b.to_text()
    default = auto.compile(P=4, M=10, mem=5)  # Cost(): F = 1, I = W = 1, messages free
    assert default.to_text() == auto.compile(P=4, M=10, mem=5, cost=pipedsl.Cost()).to_text()


@pytest.mark.parametrize("text,said", [
    ("schedule A(P, M) {\n  order auto\n}", "'order auto' searches each rank's order under a memory cap"),
    ("schedule A(P, M) {\n  memory 2\n  order auto\n  wlag 1\n}", "'wlag' has no effect with 'order auto'"),
    ("schedule A(P, M) {\n  memory 2\n  order auto\n  warmup 1\n}", "'warmup' has no effect with 'memory'"),
])
def test_refusals_name_the_line(text: str, said: str) -> None:
    with pytest.raises(pipedsl.PipeSemanticError, match=said) as err:
        pipedsl.Schedule.from_text(text)
    assert err.value.span.line >= 2


def test_the_command_line_searches_under_cost(capsys) -> None:
    assert main(["simulate", "zb-auto", "-P", "4", "-M", "8", "-p", "mem=8", "--cost",
                 "F=2,B=3,I=2,W=1,comm=0.3"]) == 0
    out = capsys.readouterr().out
    assert "ZB-auto" in out and "bubble ratio" in out
    assert main(["compile", "zb-auto", "-P", "2", "-M", "3", "--cost", "F=1,I=1,W=1"]) == 0
    assert capsys.readouterr().out.startswith("# ZB-auto P=2 M=3 mem=4")


def test_the_planner_leaves_searched_schedules_out_unless_named() -> None:
    """zb-auto needs the costs it runs under; `pipedsl plan` tries every other built-in by default (a search per
    layout made its runs several times slower) and zb-auto only when named."""
    from pipedsl.plan import cluster_preset, layouts, model_preset

    assert pipedsl.load("zb-auto").searched and not pipedsl.load("zb-h2").searched
    model, cluster = model_preset("gpt-1.7b"), cluster_preset("h100")
    assert "zb-auto" not in {lay.schedule for lay in layouts(model, cluster)}
    assert {lay.schedule for lay in layouts(model, cluster, schedules=["zb-auto"]) if lay.pp > 1} == {"zb-auto"}
