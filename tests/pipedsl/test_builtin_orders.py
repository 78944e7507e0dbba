"""GPipe and 1F1B compile to the published orders and match the reference formulas."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import given
from hypothesis import strategies as st

import pipedsl

sizes = st.tuples(st.integers(1, 12), st.integers(1, 40))


def megatron_1f1b(P: int, M: int, r: int) -> list[str]:
    """Megatron-LM's forward_backward_pipelining_without_interleaving, rank r's compute order."""
    warmup = min(P - r - 1, M)
    order = [f"F{m}.{r}" for m in range(warmup)]
    for i in range(M - warmup):
        order += [f"F{warmup + i}.{r}", f"B{i}.{r}"]
    order += [f"B{m}.{r}" for m in range(M - warmup, M)]
    return order


def gpipe(M: int, r: int) -> list[str]:
    return [f"F{m}.{r}" for m in range(M)] + [f"B{m}.{r}" for m in range(M)]


@given(sizes)
def test_1f1b_is_megatrons_order(size):
    P, M = size
    program = pipedsl.load("1f1b").compile(P=P, M=M)
    assert program.compute_orders() == [megatron_1f1b(P, M, r) for r in range(P)]


@given(sizes)
def test_gpipe_runs_all_forwards_then_all_backwards(size):
    P, M = size
    program = pipedsl.load("gpipe").compile(P=P, M=M)
    assert program.compute_orders() == [gpipe(M, r) for r in range(P)]


@given(sizes, st.sampled_from(["gpipe", "1f1b"]))
def test_bubble_is_p_minus_1_over_m_plus_p_minus_1(size, name):
    P, M = size
    timeline = pipedsl.simulate(pipedsl.load(name).compile(P=P, M=M), pipedsl.Cost(F=1, B=2))
    assert Fraction(timeline.bubble_ratio).limit_denominator(10_000) == Fraction(P - 1, M + P - 1)
    assert timeline.makespan == 3 * (M + P - 1)


@given(sizes)
def test_peak_activations(size):
    P, M = size
    g = pipedsl.simulate(pipedsl.load("gpipe").compile(P=P, M=M))
    o = pipedsl.simulate(pipedsl.load("1f1b").compile(P=P, M=M))
    assert g.peak_activations == [M] * P
    assert o.peak_activations == [min(P - r, M) for r in range(P)]


def test_messages_follow_the_producer_and_precede_the_consumer():
    program = pipedsl.load("1f1b").compile(P=2, M=2)
    assert program.to_text().splitlines()[1:] == [
        "r0: F0.0 SEND_F0.0>1 F1.0 SEND_F1.0>1 RECV_B0.0<1 B0.0 RECV_B1.0<1 B1.0 REDUCE_GRAD.0 OPTIMIZER_STEP",
        "r1: RECV_F0.1<0 F0.1 B0.1 SEND_B0.1>0 RECV_F1.1<0 F1.1 B1.1 SEND_B1.1>0 REDUCE_GRAD.1 OPTIMIZER_STEP",
    ]


def test_every_builtin_has_a_doc_line_and_compiles():
    for name in pipedsl.builtin_names():
        schedule = pipedsl.load(name)
        assert schedule.doc, name
        pipedsl.validate(schedule.compile(P=4, M=8))
