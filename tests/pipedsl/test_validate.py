"""Hand-broken programs are rejected with a message naming the rank and the instruction."""

from __future__ import annotations

import dataclasses

import pytest

import pipedsl
from pipedsl import DeadlockError, Instr, Program, ValidationError


def base() -> Program:
    return pipedsl.load("1f1b").compile(P=2, M=2)


def with_streams(program: Program, text: dict[int, str]) -> Program:
    ranks = list(program.ranks)
    for r, line in text.items():
        ranks[r] = tuple(Instr.parse(t) for t in line.split())
    return dataclasses.replace(program, ranks=tuple(ranks), meta={})


R0 = "F0.0 SEND_F0.0>1 F1.0 SEND_F1.0>1 RECV_B0.0<1 B0.0 RECV_B1.0<1 B1.0 REDUCE_GRAD.0 OPTIMIZER_STEP"
R1 = "RECV_F0.1<0 F0.1 B0.1 SEND_B0.1>0 RECV_F1.1<0 F1.1 B1.1 SEND_B1.1>0 REDUCE_GRAD.1 OPTIMIZER_STEP"


def test_the_base_program_is_valid():
    assert [" ".join(map(str, s)) for s in base().ranks] == [R0, R1]
    pipedsl.validate(with_streams(base(), {0: R0, 1: R1}))


@pytest.mark.parametrize(
    ("r0", "r1", "expected"),
    [
        pytest.param(R0.replace(" B1.0", ""), R1, r"rank 0.*B1\.0.*missing|B1\.0 is missing.*rank 0", id="missing-op"),
        pytest.param(R0.replace("F1.0 SEND_F1.0>1 ", ""), "F1.0 " + R1, r"rank 1 instruction 0 \(F1\.0\).*placed on rank 0",
                     id="wrong-rank"),
        pytest.param(R0, R1.replace("F0.1 B0.1", "B0.1 F0.1"), r"rank 1 instruction 1 \(B0\.1\).*needs its forward F0\.1",
                     id="dependency-inversion"),
        pytest.param(R0, "RECV_F1.1<0 RECV_F0.1<0 F0.1 B0.1 SEND_B0.1>0 F1.1 B1.1 SEND_B1.1>0 REDUCE_GRAD.1 OPTIMIZER_STEP",
                     r"rank 1 instruction 0 \(RECV_F1\.1<0\).*instruction 1 \(SEND_F0\.0>1\)", id="receives-swapped"),
        pytest.param(R0, R1.replace("RECV_F0.1<0 F0.1", "F0.1 RECV_F0.1<0"),
                     r"rank 1 instruction 0 \(F0\.1\): runs before its input", id="use-before-receive"),
        pytest.param(R0.replace(" REDUCE_GRAD.0", "").replace("RECV_B0.0<1", "REDUCE_GRAD.0 RECV_B0.0<1"), R1,
                     r"rank 0 instruction 4 \(REDUCE_GRAD\.0\): reduces stage 0's gradients after 0 of its 2 backwards", id="reduce-too-early"),
        pytest.param(R0.replace("F1.0 SEND_F1.0>1", "F1.0 SEND_F1.0>1 F1.0"), R1,
                     r"rank 0 instruction 4 \(F1\.0\): repeats rank 0 instruction 2", id="duplicate"),
        pytest.param(R0.replace("SEND_F1.0>1", "SEND_B1.0>1"), R1, r"rank 0 instruction 3 \(SEND_B1\.0>1\): no such message",
                     id="bogus-message"),
    ],
)
def test_broken_programs_are_rejected(r0, r1, expected):
    with pytest.raises(ValidationError, match=expected):
        pipedsl.validate(with_streams(base(), {0: r0, 1: r1}))


def test_a_wait_cycle_is_reported_as_a_deadlock_with_the_cycle():
    r0 = "F0.0 RECV_B0.0<1 SEND_F0.0>1 B0.0 F1.0 SEND_F1.0>1 RECV_B1.0<1 B1.0 REDUCE_GRAD.0 OPTIMIZER_STEP"
    with pytest.raises(DeadlockError) as info:
        pipedsl.validate(with_streams(base(), {0: r0, 1: R1}))
    message = str(info.value)
    assert "rank 0 waits at instruction 1 (RECV_B0.0<1) for rank 1" in message
    assert "rank 1 waits at instruction 0 (RECV_F0.1<0) for rank 0" in message


def test_placement_must_cover_every_stage():
    program = dataclasses.replace(base(), placement={(0, 0): 0}, meta={})
    with pytest.raises(ValidationError, match="placement names no rank for stage 1"):
        pipedsl.validate(program)


def test_routing_must_name_existing_replicas():
    program = dataclasses.replace(base(), microbatch_replica=(0, 1), meta={})
    with pytest.raises(ValidationError, match="microbatch 1 is routed to replica 1"):
        pipedsl.validate(program)


def test_optimizer_step_ends_each_rank():
    with pytest.raises(ValidationError, match="rank 1 instruction 0 \\(OPTIMIZER_STEP\\)"):
        pipedsl.validate(with_streams(base(), {0: R0, 1: "OPTIMIZER_STEP " + R1}))
