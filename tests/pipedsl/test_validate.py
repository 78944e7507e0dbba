"""Hand-broken programs are rejected with a message naming the rank and the instruction."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipedsl
from pipedsl import DeadlockError, Instr, Op, Program, ValidationError
from pipedsl.fastcheck import streams_pass
from pipedsl.validate import _check_header, _check_streams


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


# ---------------------------------------------------------------- the array checks (fastcheck, issue 25)

FAST_BASE = [pipedsl.load(name).compile(P=P, M=M) for name, P, M in (
    ("1f1b", 2, 3), ("interleaved", 2, 4), ("zb-h1", 3, 3), ("zb-v", 2, 4), ("dualpipev", 2, 4), ("chimera", 2, 2),
    ("dualpipe", 2, 4), ("hanayo", 2, 2))]
fields = st.one_of(st.integers(-1, 8), st.none(), st.booleans(), st.just(2 ** 60), st.floats(0, 3))
edit = st.tuples(st.sampled_from(["op", "mb", "stage", "peer", "replica", "swap", "drop", "dup", "move", "pair",
                                  "unpair"]), st.integers(0, 10 ** 6), st.integers(0, 10 ** 6), fields,
                 st.sampled_from(list(Op)))


def _edited(program: Program, edits) -> Program:
    ranks = [list(s) for s in program.ranks]
    for what, a, b, value, op in edits:
        stream = ranks[a % len(ranks)]
        if not stream:
            continue
        at, to = a % len(stream), b % len(stream)
        ins = stream[at]
        if what in ("mb", "stage", "peer", "replica"):
            stream[at] = ins._replace(**{what: value})
        elif what == "op":
            stream[at] = ins._replace(op=op)
        elif what == "swap":
            stream[at], stream[to] = stream[to], stream[at]
        elif what == "drop":
            del stream[at]
        elif what == "dup":
            stream.insert(to, ins)
        elif what == "move":
            ranks[b % len(ranks)].insert(to, stream.pop(at))
        elif what == "pair" and ins.sub is None and to != at:  # two ops become one (possibly odd) pair
            stream[at] = Instr(Op.OVERLAP, sub=(ins, stream[to]))
            del stream[to]
        elif what == "unpair" and ins.sub is not None:
            stream[at:at + 1] = list(ins.sub)
    return dataclasses.replace(program, ranks=tuple(map(tuple, ranks)), meta={})


@settings(max_examples=400)
@given(st.sampled_from(FAST_BASE), st.lists(edit, min_size=1, max_size=3))
def test_the_array_checks_pass_only_what_the_instruction_passes_pass(program, edits):
    """streams_pass saying yes skips the per-instruction passes: it must never say yes to a program they refuse."""
    broken = _edited(program, edits)
    try:
        _check_header(broken)
    except ValidationError:
        return
    if streams_pass(broken):
        _check_streams(broken)  # raises if the array checks let a broken program through


@pytest.mark.parametrize("name", pipedsl.builtin_names())
def test_every_builtin_passes_the_array_checks(name):
    """So that validating a compiled or loaded program takes the fast path."""
    for P, M in ((2, 4), (4, 8), (3, 6), (4, 4)):
        try:
            program = pipedsl.load(name).compile(P=P, M=M)
        except pipedsl.PipeDSLError:
            continue
        assert streams_pass(program), (name, P, M)
        assert streams_pass(Program.from_json(program.to_json()))
