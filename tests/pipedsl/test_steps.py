"""Consecutive steps that overlap (pipedsl/steps.py): proven hang-free together, simulated, drawn; the period of
overlapped steps is the longest rank span, the quantity `period 1` (zb-auto's post=1) minimises."""

from __future__ import annotations

import pytest
from test_zb_paper import paper_cost

import pipedsl
from pipedsl.cli import main
from pipedsl.engine import run_to_end
from pipedsl.errors import DeadlockError, ValidationError
from pipedsl.ir import Op, Program
from pipedsl.nccl_model import run_rendezvous
from pipedsl.steps import FORWARD_WORK, MAX_STEPS, consecutive, gates, prove_consecutive, step_gates


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


def test_every_builtins_gates_are_a_consistent_cut() -> None:
    """Post-validated steps (runtime/post_validate.py) read the previous step's verdict at each rank's gate, its
    first instruction that is not forward work; every message received before a gate is sent before its sender's,
    and the messages sent before the gates but received after them are each rank's drains."""
    for program in [*_programs(), pipedsl.load("1f1b").compile(P=8, M=16), pipedsl.load("zb-v").compile(P=8, M=16)]:
        g = gates(program)
        for r, stream in enumerate(program.ranks):
            at = g.at[r]
            assert all(ins.op in FORWARD_WORK for ins in stream[:at]) and stream[at].op not in FORWARD_WORK
            for j in g.drains[r]:
                assert j >= at and stream[j].op in (Op.RECV_F, Op.RECV_B)
        for src in range(program.num_ranks):
            for dst in range(program.num_ranks):
                sent = sum(1 for ins in program.ranks[src][:g.at[src]]
                           if ins.op in (Op.SEND_F, Op.SEND_B) and ins.peer == dst)
                got = sum(1 for ins in program.ranks[dst][:g.at[dst]]
                          if ins.op in (Op.RECV_F, Op.RECV_B) and ins.peer == src)
                drained = sum(1 for j in g.drains[dst] if program.ranks[dst][j].peer == src)
                assert got <= sent and got + drained == sent, (program.name, src, dst)


def test_a_program_whose_forwards_before_the_gates_are_not_a_cut_is_named() -> None:
    """A valid V order where rank 0 runs its last stage's backward before sending microbatch 1 on, which rank 1
    receives before its own first backward: its gates are not a consistent cut, so a rollback could not drain."""
    program = Program.from_text(
        "r0: F0.0 SEND_F0.0>1 RECV_F0.2<1 F0.2 B0.2 F1.0 SEND_F1.0>1 SEND_B0.2>1 RECV_F1.2<1 F1.2 B1.2 SEND_B1.2>1 "
        "RECV_B0.0<1 B0.0 RECV_B1.0<1 B1.0 REDUCE_GRAD.0 REDUCE_GRAD.2 OPTIMIZER_STEP\n"
        "r1: RECV_F0.1<0 F0.1 SEND_F0.1>0 RECV_F1.1<0 F1.1 SEND_F1.1>0 RECV_B0.1<0 B0.1 SEND_B0.1>0 RECV_B1.1<0 "
        "B1.1 SEND_B1.1>0 REDUCE_GRAD.1 OPTIMIZER_STEP\n")
    pipedsl.validate(program)
    with pytest.raises(ValidationError, match=r"rank 1 instruction 3 \(RECV_F1\.1<0\) receives before rank 1's first "
                                              r"backward a message rank 0 sends after its own first backward"):
        gates(program)


def test_both_walks_wait_at_the_gates_for_every_ranks_step_end() -> None:
    """prove_consecutive models the post-validated runtime's gates (`step_gates`); a gate made to wait for the
    end of its own step (the next verdict, which needs the gated work) is named as a hang by both walks."""
    program = pipedsl.load("1f1b").compile(P=2, M=2)
    waits = step_gates(program, 2)
    assert waits == [{len(program.ranks[r]) + gates(program).at[r]: 1} for r in range(2)]
    repeated = consecutive(program, 2)
    run_to_end(repeated, waits)
    run_rendezvous(repeated, gates=waits)
    wrong = [{i: 2 for i in w} for w in waits]  # wait for every rank's second step end, inside the second step
    with pytest.raises(DeadlockError, match=r"waits at instruction \d+ \(.*\) for the previous step's verdict"):
        run_to_end(repeated, wrong)
    with pytest.raises(DeadlockError, match=r"waits at its gate for every rank's step end 2"):
        run_rendezvous(repeated, gates=wrong)
