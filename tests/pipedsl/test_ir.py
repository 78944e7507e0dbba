"""Instructions and programs round-trip through text, JSON and CSV."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pipedsl
from pipedsl import Instr, Op, Program, ValidationError
from pipedsl.ir import _parse_token, _plain  # the loaders' fast paths
from pipedsl.limits import MAX_MICROBATCHES, MAX_RANKS, MAX_STAGES

compute = st.builds(lambda op, m, s, c: Instr(op, m, s, None, c), st.sampled_from([Op.F, Op.B, Op.I, Op.W]),
                    st.integers(0, 99), st.integers(0, 99), st.integers(0, 3))
instrs = st.one_of(
    compute,
    st.builds(lambda op, m, s, p, c: Instr(op, m, s, p, c), st.sampled_from([Op.SEND_F, Op.SEND_B, Op.RECV_F,
              Op.RECV_B]), st.integers(0, 99), st.integers(0, 99), st.integers(0, 99), st.integers(0, 3)),
    st.builds(lambda f, b: Instr.pair(f._replace(op=Op.F), b._replace(op=Op.B)), compute, compute),
    st.builds(lambda s, c: Instr(Op.REDUCE_GRAD, None, s, None, c), st.integers(0, 99), st.integers(0, 3)),
    st.just(Instr(Op.OPTIMIZER_STEP)),
)


@given(instrs)
def test_instruction_text_and_dict_round_trip(ins):
    assert Instr.parse(str(ins)) == ins
    assert Instr.from_dict(ins.to_dict(with_replica=True)) == ins


def test_text_forms():
    assert str(Instr(Op.F, 2, 3)) == "F2.3"
    assert str(Instr(Op.SEND_F, 2, 3, 1)) == "SEND_F2.3>1"
    assert str(Instr(Op.RECV_B, 0, 1, 2, 1)) == "RECV_B0.1r1<2"
    assert str(Instr(Op.REDUCE_GRAD, stage=4)) == "REDUCE_GRAD.4"


@pytest.mark.parametrize("bad", ["X1.2", "F1", "SEND_F1.2<3", "RECV_B1.2", "F1.2>3", ""])
def test_bad_instruction_text_is_rejected(bad):
    with pytest.raises(ValueError):
        Instr.parse(bad)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_program_round_trips(name):
    program = pipedsl.load(name).compile(P=3, M=5)
    assert Program.from_json(program.to_json()).to_text() == program.to_text()
    assert Program.from_csv(program.to_csv()).ranks == program.ranks
    assert Program.from_text(program.to_text()).ranks == program.ranks
    pipedsl.validate(Program.from_json(program.to_json()))


def test_json_is_the_documented_contract():
    d = json.loads(pipedsl.load("1f1b").compile(P=2, M=2).to_json())
    assert list(d) == ["schedule", "params", "num_stages", "num_replicas", "placement", "microbatch_replica", "ranks"]
    assert d["schedule"] == "1F1B" and d["params"] == {"P": 2, "M": 2}
    assert d["placement"] == [{"replica": 0, "stage": 0, "rank": 0}, {"replica": 0, "stage": 1, "rank": 1}]
    assert d["ranks"][0][:2] == [{"op": "F", "mb": 0, "stage": 0}, {"op": "SEND_F", "mb": 0, "stage": 0, "peer": 1}]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{", "not JSON"),
        ("[]", "JSON object"),
        ('{"ranks": [[{"op": "F"}]]}', "rank 0 instruction 0: F needs 'mb'"),
        ('{"ranks": [[{"op": "Z", "mb": 0, "stage": 0}]]}', "unknown op 'Z'"),
        ('{"ranks": [[{"op": "F", "mb": -1, "stage": 0}]]}', "non-negative"),
        ('{"ranks": [[{"op": "F", "mb": 0, "stage": 0}], [{"op": "F", "mb": 0, "stage": 0}]]}', "a stage lives on one rank"),
    ],
)
def test_malformed_json_gives_one_clear_error(text, expected):
    with pytest.raises(ValidationError, match=expected):
        Program.from_json(text)


def test_malformed_csv_names_the_line():
    program = pipedsl.load("gpipe").compile(P=2, M=1)
    lines = program.to_csv().splitlines()
    assert ",SEND_F," in lines[2]
    lines[2] = lines[2].replace("SEND_F", "SEND_X")
    with pytest.raises(ValidationError, match="CSV line 3: unknown op 'SEND_X'"):
        Program.from_csv("\n".join(lines))


# ---------------------------------------------------------------- the loaders' fast paths (issue 25)

edge = st.sampled_from([0, 1, -1, MAX_MICROBATCHES - 1, MAX_MICROBATCHES, MAX_STAGES, MAX_RANKS - 1, MAX_RANKS])
field = st.one_of(st.none(), st.integers(-5, 120), edge, st.booleans(), st.floats(-1, 5), st.text(max_size=2))
single_ops = st.sampled_from([op for op in Op if op is not Op.OVERLAP])


@given(single_ops, field, field, field, st.one_of(field, st.just("absent")))
def test_the_fast_instruction_check_accepts_exactly_what_the_full_checks_accept(op, mb, stage, peer, replica):
    d = {"op": op.value, "mb": mb, "stage": stage, "peer": peer}
    if replica != "absent":
        d["replica"] = replica
    fast = _plain(op, mb, stage, peer, d.get("replica", 0))
    try:
        full = Instr.from_dict(d)
    except ValueError:
        assert fast is None
    else:
        assert fast == full and type(fast.mb) is type(full.mb)


tokens = st.one_of(instrs.map(str), st.builds(lambda ins, at, junk: (s := str(ins))[:at % (len(s) + 1)] + junk
                                                + s[at % (len(s) + 1):], instrs, st.integers(0, 40),
                                                st.sampled_from(["0", "9" * 9, "9" * 10, ">1", "<1", "r", ".", "&"])))


@given(tokens)
def test_a_text_token_parses_alike_on_the_fast_path(token):
    try:
        full = Instr.parse(token)
    except ValueError as err:
        with pytest.raises(ValueError) as fast_err:
            _parse_token(token)
        assert str(fast_err.value) == str(err)
    else:
        assert _parse_token(token) == full


@pytest.mark.parametrize("name", ["interleaved", "zb-v", "dualpipev", "chimera"])
def test_every_loader_gives_back_the_compiled_program(name):
    """JSON, CSV and text of programs with messages, split backwards, pairs and replicas."""
    program = pipedsl.load(name).compile(P=4, M=8)
    for loaded in (Program.from_json(program.to_json()), Program.from_csv(program.to_csv()),
                   Program.from_text(program.to_text())):
        assert loaded.ranks == program.ranks and loaded.placement == program.placement
        assert all(type(i) is Instr for stream in loaded.ranks for i in stream)
    assert Program.from_json(program.to_json()).to_json() == program.to_json()


def test_a_header_number_json_cannot_hold_as_an_integer_is_a_clear_error():
    """Infinity in the header escaped as an OverflowError (found by the fuzzer)."""
    d = json.loads(pipedsl.load("gpipe").compile(P=2, M=2).to_json())
    d["microbatch_replica"][0] = float("inf")
    with pytest.raises(ValidationError, match="malformed program header: cannot convert float infinity"):
        Program.from_json(json.dumps(d))
