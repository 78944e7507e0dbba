"""`memory CAP`: the compiler orders each rank's ops greedily under a cap on live activations;
V-Half and V-Min (Qi et al., NeurIPS'24) built on it meet the paper's activation bounds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipedsl
from pipedsl.compare import compare
from pipedsl.errors import PipeSemanticError

COST = "F=1,B=2,I=1,W=1"


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 8), st.integers(0, 3))
def test_v_half_and_v_min_meet_the_papers_activation_bounds(P, k):
    """(P+2)/2 and (P+4)/3 microbatches' worth of activations a rank (a chunk holds half of a
    rank's layers, so 2*((P+2)/2) and 2*((P+4)/3) chunk activations), against 1F1B's P."""
    M = 2 * P + k * P
    for name, bound in (("v-half", (P + 2) // 2), ("v-min", (P + 4) // 3)):
        t = pipedsl.simulate(pipedsl.load(name).compile(P=P, M=M), COST)
        assert max(t.peak_activations) <= 2 * bound, (name, t.peak_activations)


@pytest.mark.parametrize("P", [2, 4, 6, 8])
def test_v_half_beats_the_papers_bubble_for_even_p(P):
    """At T_F = T_I = T_W the paper gives V-Half a bubble of about P/(2M); the greedy's is
    below that and below 1F1B's for even P (odd P: see docs/schedules.md)."""
    for M in (3 * P, 4 * P):
        half = pipedsl.simulate(pipedsl.load("v-half").compile(P=P, M=M), COST).bubble_ratio
        one = pipedsl.simulate(pipedsl.load("1f1b").compile(P=P, M=M), COST).bubble_ratio
        assert half < P / (2 * M) and half < one


def test_compare_shows_the_memory_bubble_trade_off():
    rows = {r.schedule: r for r in compare(["1f1b", "zb-v", "v-half", "v-min", "dualpipe"], 4, 16, {}, COST)}
    assert [rows[n].memory_vs_1f1b for n in ("1f1b", "zb-v", "v-half", "v-min", "dualpipe")] == [1, 1, 0.75, 0.5, 1.25]
    assert rows["zb-v"].bubble_ratio < rows["v-half"].bubble_ratio < rows["v-min"].bubble_ratio


def _schedule(body: str) -> pipedsl.Schedule:
    return pipedsl.Schedule.from_text("schedule T(P, M) {\n" + body + "\n}", "t.pipe")


@given(st.integers(1, 6), st.integers(1, 12), st.integers(1, 6))
def test_any_cap_holds_on_1f1b_placements(P, M, cap):
    t = pipedsl.simulate(_schedule(f"  memory {cap}").compile(P=P, M=M), "F=1,B=2")
    assert max(t.peak_activations) <= cap
    if cap >= P:  # enough for 1F1B: the greedy finds its makespan
        assert t.makespan == pipedsl.simulate(pipedsl.load("1f1b").compile(P=P, M=M), "F=1,B=2").makespan


@pytest.mark.parametrize("body, message, line", [
    ("  memory 2\n  warmup 1", "'warmup' has no effect with 'memory'", 3),
    ("  memory r - 1", "memory of rank 0 is -1", 2),
    ("  stages 2 * P\n  place if s < P then s else 2 * P - 1 - s\n  memory 1",
     "the memory cap is too small to make progress: rank 0 holds 0 of its 1 activations", 4),
    ("  memory 1\n  compute { F(0, r) B(0, r) }", "'memory' has no effect next to an explicit 'compute'", 2),
])
def test_memory_errors_point_at_the_declaration(body, message, line):
    with pytest.raises(PipeSemanticError) as err:
        _schedule(body).compile(P=2, M=2)
    assert message in err.value.message and err.value.span.line == line
