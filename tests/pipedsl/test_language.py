"""The .pipe language: syntax, meaning, and errors that say file:line:col in words."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pipedsl
from pipedsl import PipeDSLError, PipeSemanticError, PipeSyntaxError, Schedule


def compile_text(text: str, P: int = 2, M: int = 2, **params: int) -> pipedsl.Program:
    return Schedule.from_text(text, "t.pipe").compile(P=P, M=M, **params)


def error_of(text: str, P: int = 2, M: int = 2, **params: int) -> PipeDSLError:
    with pytest.raises(PipeDSLError) as info:
        compile_text(text, P, M, **params)
    return info.value


def caret_column(rendered: str) -> int:
    """1-based column the caret line points at (the excerpt's gutter is 7 characters)."""
    caret_line = next(line for line in rendered.splitlines() if line.strip().startswith("|") and "^" in line)
    return caret_line.index("^") - len("     | ") + 1


# ---------------------------------------------------------------- syntax


@pytest.mark.parametrize(
    ("text", "line", "col", "words"),
    [
        ("schedule x {\n  stages P *\n}", 3, 1, "expected"),
        ("schedule x {\n  stages P $ 2\n}", 2, 12, "unexpected character '$'"),
        ("schedule x {\n  let if = 3\n}", 2, 7, "unexpected 'if'; expected a name"),
        ("schedule x {\n  stages P P\n}", 2, 12, "unexpected name 'P'"),
        ("schedule x {\n  order F by (m, \n}", 3, 1, "unexpected '}'"),
        ("schedule x {\n  doc unquoted\n}", 2, 7, 'a quoted string'),
        ("schedule x {", 1, 13, "unexpected end of file"),
        ("schedule x { order Q by m }", 1, 20, "'order' sorts F (forwards) or B (backwards), not 'Q'"),
        ("schedule x { compute { X(0, 0) } }", 1, 24, "a compute op is F, B, I or W"),
    ],
)
def test_syntax_errors_name_the_place_and_what_was_expected(text, line, col, words):
    with pytest.raises(PipeSyntaxError) as info:
        Schedule.from_text(text, "t.pipe")
    rendered = str(info.value)
    assert rendered.startswith(f"t.pipe:{line}:{col}: syntax error: ")
    assert words in rendered
    assert text.splitlines()[line - 1].expandtabs(1) in rendered  # the offending line is shown
    assert caret_column(rendered) == col


# ---------------------------------------------------------------- meaning


def test_let_folds_constants_and_expands_context_macros():
    text = """
    schedule s(P, M) {
      let half = M / 2
      let late = if m >= half then 1 else 0     # uses m: expanded inside the key
      order F by (late, -m)
      order B by m
    }"""
    program = compile_text(text, P=1, M=4)
    assert program.compute_orders()[0][:4] == ["F1.0", "F0.0", "F3.0", "F2.0"]


def test_parameters_defaults_and_overrides():
    text = "schedule s(P, M, K = P + 1) { require K == 3 : \"K must be 3\" }"
    compile_text(text, P=2)
    assert "K must be 3" in str(error_of(text, P=2, K=4))


def test_expression_semantics_floor_division_and_precedence():
    text = "schedule s(P, M) { require -7 / 2 == -4 and -7 % 2 == 1 and 1 + 2 * 3 == 7 and not 1 > 2 : \"math\" }"
    compile_text(text)


def test_explicit_compute_block_equals_the_rule():
    """A hand-written 1F1B `compute` block compiles to instructions equal, rank for rank, to the built-in 1f1b rule's
    at four (P, M)."""
    explicit = """
    schedule explicit_1f1b(P, M) {
      compute {
        let warm = min(P - r - 1, M)
        for i in 0 .. warm { F(i, r) }
        for i in 0 .. M - warm { F(warm + i, r)  B(i, r) }
        for i in M - warm .. M { B(i, r) }
      }
    }"""
    for P, M in [(1, 1), (2, 5), (4, 8), (5, 3)]:
        assert compile_text(explicit, P, M).ranks == pipedsl.load("1f1b").compile(P=P, M=M).ranks


def test_split_backward_emits_w_lagging_behind_i():
    text = "schedule zb(P, M) { order F by m  order B by m  warmup min(P - r - 1, M)  wlag 1 }"
    orders = compile_text(text, P=2, M=3).compute_orders()
    assert orders[1] == ["F0.1", "I0.1", "F1.1", "I1.1", "W0.1", "F2.1", "I2.1", "W1.1", "W2.1"]


def test_replicas_route_and_place():
    text = """
    schedule bi(P, M) {
      replicas 2
      route m % 2
      place if c == 0 then s else P - 1 - s
      warmup M
    }"""
    program = compile_text(text, P=2, M=4)
    assert program.num_replicas == 2 and program.microbatch_replica == (0, 1, 0, 1)
    assert program.placement == {(0, 0): 0, (0, 1): 1, (1, 0): 1, (1, 1): 0}
    assert "F1.1r1" in program.compute_orders()[0]


# ---------------------------------------------------------------- semantic errors


@pytest.mark.parametrize(
    ("text", "params", "words", "line"),
    [
        ("schedule s(P, M) {\n  order F by q\n}", {}, "unknown name 'q' in order F", 2),
        ("schedule s(P, M) {\n  place s < 2\n}", {}, "place needs a number, but this is a condition", 2),
        ("schedule s(P, M) {\n  warmup m\n}", {}, "unknown name 'm' in warmup (visible here: M, P, r)", 2),
        ("schedule s(P, M) {\n  require M : \"x\"\n}", {}, "require needs a condition", 2),
        ("schedule s(P, M) {\n  warmup 1\n  warmup 2\n}", {}, "'warmup' is declared twice", 3),
        ("schedule s(P, M) {\n  stages 2 * P\n  place s\n}", {}, "stage 2 is placed on rank 2, but the ranks are 0..1", 3),
        ("schedule s(P, M) {\n  stages 1\n}", {}, "rank 1 holds no stage", 1),
        ("schedule s(P, M) {\n  warmup -1\n}", {}, "warmup of rank 0 is -1", 2),
        ("schedule s(P, M) {\n  order F by m / (r - r)\n}", {}, "division by zero in '/' (with m=0", 2),
        ("schedule s(P, M) {\n  require M % 3 == 0 : \"M must be a multiple of 3\"\n}", {},
         "requirement failed: M must be a multiple of 3", 2),
        ("schedule s(P, M, K) {\n}", {}, "parameter K has no default", 1),
        ("schedule s(P, M) {\n}", {"Q": 1}, "has no parameter 'Q'", 1),
        ("schedule s(P, M) {\n  replicas 2\n}", {}, "need a 'route'", 2),
        ("schedule s(P, M) {\n  replicas 2\n  route 2\n}", {}, "routed to replica 2", 3),
        ("schedule s(P, M) {\n  compute { F(0, r) }\n}", {}, "never lists", 2),
        ("schedule s(P, M) {\n  compute { for i in 0 .. M { F(i, 0) B(i, 0) } }\n}", {}, "stage 0 is placed on rank 0", 2),
        ("schedule s(P, M) {\n  compute { F(0, r) F(0, r) }\n}", {}, "listed twice", 2),
        ("schedule s(P, M) {\n  warmup 1\n  compute { F(0, r) }\n}", {}, "no effect next to an explicit 'compute'", 2),
        ("schedule s(P = 3, M) {\n}", {}, "P is always given by the caller", 1),
        ("schedule s(P, M) {\n  let x = 1 + (2 < 3)\n}", {}, "'+' needs a number, but this is a condition", 2),
    ],
)
def test_semantic_errors_point_at_the_declaration(text, params, words, line):
    err = error_of(text, **params)
    assert isinstance(err, PipeSemanticError)
    rendered = str(err)
    assert words in rendered
    assert rendered.startswith(f"t.pipe:{line}:")
    assert "^" in rendered


# ---------------------------------------------------------------- orders that cannot make progress


@pytest.mark.parametrize(
    ("body", "blamed"),
    [
        ("stages 2 * P\n  place s % P\n  order F by -s\n  order B by m", "order F by -s"),
        ("stages 2 * P\n  place s % P\n  order F by (m, s)\n  order B by (m, s)", "order B by (m, s)"),
        ("stages 2 * P\n  place s % P\n  order F by (m, s)\n  order B by (m, -s)\n  warmup 0", "warmup 0"),
    ],
)
def test_a_deadlocking_order_is_rejected_at_the_responsible_line(body, blamed):
    text = "schedule s(P, M) {\n  " + body + "\n}"
    err = error_of(text, P=2, M=3)
    rendered = str(err)
    blamed_line = next(i for i, line in enumerate(text.splitlines(), 1) if blamed in line)
    assert rendered.startswith(f"t.pipe:{blamed_line}:3: error: schedule cannot make progress with P=2, M=3")
    assert re.search(r"rank \d+ (waits|instruction \d+)", rendered)


def test_backwards_in_reverse_microbatch_order_blame_order_b_not_the_warmup():
    """`order B by -m` under a 1F1B warmup runs a backward before its own forward on rank 0; the caret
    used to point at `warmup`, which is not what is wrong (no warmup short of every forward helps)."""
    text = """schedule "Neg"(P, M) {
  stages P
  place s
  order F by m
  order B by -m
  warmup min(P - r - 1, M)
}"""
    lines = str(error_of(text, P=2, M=3)).splitlines()
    assert lines[0] == ("t.pipe:5:3: error: schedule cannot make progress with P=2, M=3: 'order B' puts an op "
                        "before one it depends on: rank 0 runs B2.0 before its forward F2.0: stage 0's backwards "
                        "run microbatches 2, 1, 0, its forwards 0, 1, 2")
    assert lines[1:3] == ["   5 |   order B by -m",
                          "     |   ^^^^^^^^^^^^^"]
    assert lines[3] == "  note: rank 0 instruction 5 (B2.0): a backward needs its forward F2.0 first on this rank"


def test_an_explicit_order_that_deadlocks_blames_the_compute_block():
    text = """schedule s(P, M) {
  compute {
    if r == 0 { B(0, 0) F(0, 0) } else { F(0, 1) B(0, 1) }
  }
}"""
    err = error_of(text, P=2, M=1)
    assert str(err).startswith("t.pipe:2:3: error: schedule cannot make progress")
    assert "B0.0" in str(err)


# ---------------------------------------------------------------- fuzzing


VALID = [pipedsl.load(name).source for name in pipedsl.builtin_names()]
PIECES = ["(", ")", "{", "}", ",", ":", "..", "-", "*", "/", "%", "==", "if", "then", "else", "let", "order",
          "F", "B", "by", "m", "P", "0", "99999999999999999999", '"', "#", "\n", "compute", "for", "in", "warmup",
          "place", "replicas 3", "route m", "wlag", "stages 0", "merge", "require 1 == 2 : \"no\""]


@given(st.sampled_from(VALID), st.lists(st.tuples(st.floats(0, 1), st.integers(0, 6), st.sampled_from(PIECES)),
                                        min_size=1, max_size=4),
       st.integers(1, 6), st.integers(1, 12))
def test_mutated_sources_fail_only_with_pipedsl_errors(source, edits, P, M):
    text = source
    for where, cut, piece in edits:
        at = int(where * len(text))
        text = text[:at] + piece + text[at + cut:]
    try:
        schedule = Schedule.from_text(text, "fuzz.pipe")
        schedule.compile(P=P, M=M)
    except PipeDSLError as err:
        assert str(err).startswith(("fuzz.pipe:", "error:", "invalid program:", "deadlock:"))


def test_the_examples_in_language_md_compile_and_do_what_the_text_says():
    """Every ```pipe block of docs/language.md compiles and validates at P = 4, M = 6, with the
    numbers its text quotes (F = 1, B = 2, I = W = 1)."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "language.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```pipe\n(.*?)```", doc, re.S)
    assert len(blocks) >= 4
    cost = pipedsl.Cost(F=1, B=2, I=1, W=1)
    one = pipedsl.simulate(pipedsl.load("1f1b").compile(P=4, M=6), cost)
    runs, sources = {}, {}
    for text in blocks:
        schedule = Schedule.from_text(text)
        runs[schedule.name] = pipedsl.simulate(schedule.compile(P=4, M=6), cost)
        sources[schedule.name] = schedule
    assert runs["mixed"].makespan == one.makespan
    assert round(runs["1F1B, split"].bubble_ratio, 3) == 0.217 < round(one.bubble_ratio, 3) == 0.333
    assert runs["1F1B, capped"].peak_activations == [2, 2, 2, 1]
    assert round(runs["1F1B, capped"].bubble_ratio, 3) == 0.538
    paired = pipedsl.simulate(sources["1F1B, overlapped"].compile(P=4, M=16), pipedsl.Cost(F=1, B=2, FB=2))
    assert round(paired.bubble_ratio, 2) == 0.57
