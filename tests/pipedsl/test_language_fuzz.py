"""Generated `.pipe` sources built to exhaust the parser and compiler: each one compiles or is
refused with a located `PipeDSLError`, and one that is past a limit names the limit.

Strategies build deep nesting of every construct, long sums, long literals and `let` chains
whose expansion grows linearly or doubles; depths and lengths straddle the limits
(pipedsl/limits.py), so both sides of each are generated.  The alarm turns a hang into a failure.
"""

from __future__ import annotations

import signal

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipedsl
from pipedsl.errors import PipeDSLError
from pipedsl.limits import MAX_NESTING, MAX_NUMBER_DIGITS

CASE_LIMIT = 30  # seconds: a hang, not a speed test
HEAD = "schedule s(P, M) {\n  stages P\n  place s\n"
ORDERS = "  order F by m\n  order B by m\n  warmup 0\n"
LIMIT_NAMES = ("MAX_NESTING", "MAX_NUMBER_DIGITS", "MAX_VALUE_BITS", "MAX_EXPANSION", "MAX_COMPUTE_STEPS",
               "MAX_SOURCE_BYTES", "MAX_COMPUTE_OPS")
depths = st.one_of(st.integers(1, 2 * MAX_NESTING), st.integers(MAX_NESTING - 3, MAX_NESTING + 3),
                   st.integers(2 * MAX_NESTING, 3000))


def _expression(kind: str, depth: int) -> str:
    return {
        "parens": "(" * depth + "1" + ")" * depth,
        "minus": "- " * depth + "1",
        "not": "if " + "not " * depth + "P > 0 then 1 else 0",
        "ifexpr": "if P > 0 then " * depth + "1" + " else 0" * depth,
        "elseexpr": "if P == 0 then 0 else " * depth + "1",
        "call": "min(1, " * depth + "1" + ")" * depth,
        "sum": " + ".join(["1"] * (depth + 1)),
        "product": " * ".join(["1"] * (depth + 1)),
        "mixed": "(- 1 + " * depth + "1" + ")" * depth,
    }[kind]


def _block(kind: str, depth: int) -> str:
    open_, close = {"if": ("if r >= 0 {", "}"), "for": ("for i in 0..1 {", "}")}[kind]
    return "  compute {" + f" {open_}" * depth + " F(0, r) B(0, r)" + f" {close}" * depth + " }\n"


def check(text: str, P: int = 2, M: int = 2) -> None:
    def hang(signum, frame):
        raise TimeoutError(f"a generated source ran longer than {CASE_LIMIT} s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(CASE_LIMIT)
    try:
        pipedsl.Schedule.from_text(text, "fuzz.pipe").compile(P=P, M=M)
    except PipeDSLError as err:
        first = str(err).splitlines()[0]
        assert first.startswith("fuzz.pipe:") or first.startswith(("error:", "invalid program:")), str(err)
        assert len(first) < 400, first
        return
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def refused_by(text: str, limit: str) -> None:
    try:
        pipedsl.Schedule.from_text(text, "fuzz.pipe")
    except PipeDSLError as err:
        assert limit in str(err), str(err)
        return
    raise AssertionError(f"not refused by {limit}")


FUZZ = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.sampled_from(["parens", "minus", "not", "ifexpr", "elseexpr", "call", "sum", "product", "mixed"]),
       depths)
def test_deep_expressions(kind, depth):
    text = HEAD + ORDERS + f"  let x = {_expression(kind, depth)}\n  require x == x: \"x\"\n}}\n"
    if len(text) > 32 * 1024:
        return refused_by(text, "MAX_SOURCE_BYTES")
    check(text)
    if depth > 10 * MAX_NESTING + 20 or (kind in ("sum", "product") and depth > MAX_NESTING):
        refused_by(text, "MAX_NESTING")


@FUZZ
@given(st.sampled_from(["if", "for"]), depths)
def test_deep_blocks(kind, depth):
    text = HEAD + _block(kind, depth) + "}\n"
    check(text)
    if depth > MAX_NESTING and len(text) <= 32 * 1024:
        refused_by(text, "MAX_NESTING")


@FUZZ
@given(st.integers(1, 3 * MAX_NUMBER_DIGITS) | st.integers(3 * MAX_NUMBER_DIGITS, 20_000), st.booleans())
def test_long_literals(digits, negative):
    text = HEAD + ORDERS + f"  let x = {'-' if negative else ''}{'7' * digits}\n  require x != 0: \"x\"\n}}\n"
    check(text)
    if digits > MAX_NUMBER_DIGITS and len(text) <= 32 * 1024:
        refused_by(text, "MAX_NUMBER_DIGITS")


@FUZZ
@given(st.integers(1, 60), st.sampled_from(["+", "*"]), st.integers(1, 3), st.booleans())
def test_let_chains(length, op, uses, in_compute):
    """`let a{i+1} = a{i} op a{i} …`: the expansion is uses**length nodes; values square under `*`."""
    lets = "".join(f"  let a{i + 1} = {f' {op} '.join([f'a{i}'] * uses)}\n" for i in range(length))
    use = (f"  compute {{ for m in 0..min(M, a{length} - a{length} + 1) {{ F(m, r) B(m, r) }} }}\n"
           if in_compute else ORDERS + f"  require a{length} > 0: \"a\"\n")
    check(HEAD + "  let a0 = 2\n" + lets + use + "}\n")
