"""Consecutive steps that overlap (pipedsl/steps.py): proven hang-free together, simulated, drawn; the period of
overlapped steps is the longest rank span, the quantity `period 1` (zb-auto's post=1) minimises."""

from __future__ import annotations

import pytest
from test_zb_paper import paper_cost

import pipedsl
from pipedsl.cli import main
from pipedsl.ir import Op
from pipedsl.steps import MAX_STEPS, consecutive, prove_consecutive


def _programs():
    for name in pipedsl.builtin_names():
        for P in (2, 4):
            for M in (P, 2 * P):
                try:
                    yield pipedsl.load(name).compile(P=P, M=M)
                except pipedsl.PipeSemanticError:  # a `require` the size does not meet
                    continue


def test_two_steps_of_every_builtin_are_hang_free_under_both_transport_models() -> None:
    """Each rank starts its next step when its own part of this one ends: both deadlock walks (buffered sends;
    NCCL's rendezvous on the runtime's communicators, each step's end waiting for the rank's earlier operations)
    reach the end of two and three consecutive steps of every built-in, zb-auto with post=1 among them."""
    programs = list(_programs())
    programs.append(pipedsl.load("zb-auto").compile(P=4, M=8, mem=8, post=1, cost=pipedsl.Cost(W=0.6, wmem=0.4)))
    assert {p.name for p in programs} >= {pipedsl.load(n).compile(P=4, M=8).name for n in ("1f1b", "dualpipev")}
    for program in programs:
        for steps in (2, 3):
            repeated = prove_consecutive(program, steps)
            assert repeated.num_microbatches == steps * program.num_microbatches


def test_each_step_is_the_program_again_with_its_own_microbatches() -> None:
    program = pipedsl.load("zb-h1").compile(P=2, M=3)
    two = consecutive(program, 2)
    assert two.params["steps"] == 2 and two.meta == {"steps": 2, "step_microbatches": 3}
    for stream, again in zip(program.ranks, two.ranks, strict=True):
        n = len(stream)
        assert len(again) == 2 * n and again[:n] == stream
        for a, b in zip(stream, again[n:], strict=True):
            assert (b.op, b.stage, b.peer) == (a.op, a.stage, a.peer)
            assert b.mb == (a.mb if a.op in (Op.REDUCE_GRAD, Op.OPTIMIZER_STEP) else a.mb + 3)
    assert consecutive(program, 1) is program
    for bad in (0, MAX_STEPS + 1, 1.5):
        with pytest.raises(pipedsl.PipeDSLError, match="steps must be an integer from 1 to 16"):
            consecutive(program, bad)


@pytest.mark.parametrize("setup", [("6.2B", 8, 24), ("1.5B", 8, 24)], ids=lambda s: f"{s[0]}-p{s[1]}-m{s[2]}")
def test_the_period_of_overlapped_steps_is_the_longest_rank_span(setup: tuple[str, int, int]) -> None:
    """Simulated as consecutive steps, what each step adds to the makespan equals the single step's longest rank
    span (the zero-bubble paper's bubble denominator), for 1F1B, ZB-H1 and zb-auto alike; and zb-auto searched
    for it (post=1) has a shorter period than searched for the makespan (post=0): 6.7 % (6.2B), 1.6 % (1.5B)."""
    _, P, M = setup
    cost = paper_cost(setup)
    periods = {}
    for name, params in (("1f1b", {}), ("zb-h1", {}), ("zb-auto", {"mem": 2 * P, "post": 0}),
                         ("zb-auto", {"mem": 2 * P, "post": 1})):
        program = pipedsl.load(name).compile(P=P, M=M, cost=cost, **params)
        one = pipedsl.simulate(program, cost)
        three = pipedsl.simulate(program, cost, steps=3)
        period = (three.makespan - one.makespan) / 2
        assert period == pytest.approx(max(one.rank_spans), rel=1e-9), name
        assert three.meta["steps"] == 3 and max(three.peak_activations) == max(one.peak_activations)
        periods[(name, params.get("post"))] = period
    assert periods[("zb-auto", 1)] < 0.99 * periods[("zb-auto", 0)]
    assert periods[("zb-auto", 1)] < periods[("zb-h1", None)] < periods[("1f1b", None)]


def test_the_command_line_draws_and_simulates_steps_that_overlap(capsys) -> None:
    assert main(["simulate", "zb-h1", "-P", "4", "-M", "4", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ZB-H1 ×2 steps") and "period        15  (2 steps overlapping" in out, out
    assert main(["show", "zb-h1", "-P", "4", "-M", "4", "--steps", "2", "--width", "100"]) == 0
    drawn = capsys.readouterr().out
    assert drawn.startswith("ZB-H1 ×2 steps") and "F7" in drawn and "W7" in drawn
    with pytest.raises(SystemExit) as refused:
        main(["simulate", "zb-h1", "-P", "4", "-M", "4", "--steps", "17"])
    assert refused.value.code == 2 and "--steps: 17 is not in 1..16 (MAX_STEPS)" in capsys.readouterr().err
