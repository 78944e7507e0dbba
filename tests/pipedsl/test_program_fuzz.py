"""Program files (JSON, CSV, text) from anywhere: only clean `ValidationError`s, never a crash."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pipedsl
from pipedsl import PipeDSLError, Program, ValidationError
from pipedsl.limits import MAX_NUMBER_DIGITS, load_json

BASE = [pipedsl.load(name).compile(P=P, M=M) for name in ("gpipe", "1f1b") for P, M in ((2, 2), (3, 4))]
values = st.one_of(st.integers(-3, 9), st.none(), st.text(max_size=3), st.booleans(), st.floats(allow_nan=True),
                   st.lists(st.integers(0, 3), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))


def load_and_validate(parse, text: str) -> None:
    try:
        pipedsl.validate(parse(text))
    except ValidationError as err:
        assert str(err).startswith(("invalid program:", "deadlock:"))


@given(st.sampled_from(BASE), st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(
    ["op", "mb", "stage", "peer", "replica", "rank", "placement", "microbatch_replica", "num_stages", "ranks",
     "swap", "drop", "dup"]), values), min_size=1, max_size=4))
def test_mutated_json_programs_fail_cleanly(program, edits):
    d = program.to_dict()
    whole = []
    for where, what, value in edits:
        stream = d["ranks"][where % len(d["ranks"])]
        if what in ("rank", "num_stages", "ranks", "placement", "microbatch_replica"):
            whole.append((where, what, value))  # replaced last, so stream edits still apply
        elif not stream:
            continue
        elif what in ("op", "mb", "stage", "peer", "replica"):
            stream[where % len(stream)][what] = value
        elif what == "swap":
            at = where % len(stream)
            stream[at], stream[-1 - at] = stream[-1 - at], stream[at]
        elif what == "drop":
            del stream[where % len(stream)]
        else:  # dup
            stream.insert(where % len(stream), dict(stream[where % len(stream)]))
    for where, what, value in whole:
        if what == "placement" and isinstance(d["placement"], list):
            d["placement"][where % len(d["placement"])] = {"stage": value, "rank": 0}
        elif what == "microbatch_replica" and isinstance(d["microbatch_replica"], list):
            d["microbatch_replica"][where % len(d["microbatch_replica"])] = value
        else:
            d[what] = value
    load_and_validate(Program.from_json, json.dumps(d))


@given(st.sampled_from(BASE), st.text(alphabet="0123456789,FBIWSEND_RCVOPTIMZERGD_\n-", max_size=20),
       st.floats(0, 1), st.integers(0, 30))
def test_mutated_csv_and_text_programs_fail_cleanly(program, junk, where, cut):
    for text, parse in ((program.to_csv(), Program.from_csv), (program.to_text(), Program.from_text)):
        at = int(where * len(text))
        load_and_validate(parse, text[:at] + junk + text[at + cut:])


@given(st.binary(max_size=200))
def test_arbitrary_bytes_fail_cleanly(data):
    text = data.decode("utf-8", "replace")
    for parse in (Program.from_json, Program.from_csv, Program.from_text):
        load_and_validate(parse, text)


# ---------------------------------------------------------------- absurd numbers and counts (issue 13)

HEADER = ["num_stages", "num_replicas", "P", "M", "placement.stage", "placement.rank", "placement.replica",
          "microbatch_replica"]
INSTRUCTION = ["mb", "stage", "peer", "replica"]
absurd = st.one_of(st.integers(-(10 ** 40), 10 ** 40), st.sampled_from([2 ** 31, 2 ** 63, 2 ** 64, 10 ** 18, -1]),
                   st.floats(allow_nan=True, allow_infinity=True), st.integers(18, 6000).map(lambda n: "9" * n))


def _set(d: dict, field: str, where: int, value) -> None:
    if field in ("P", "M"):
        d["params"][field] = value
    elif field.startswith("placement."):
        d["placement"][where % len(d["placement"])][field.partition(".")[2]] = value
    elif field == "microbatch_replica":
        d[field][where % len(d[field])] = value
    elif field in INSTRUCTION:
        stream = d["ranks"][where % len(d["ranks"])]
        stream[where % len(stream)][field] = value
    else:
        d[field] = value


def _json_with(d: dict, values: list) -> str:
    """`d` as JSON with each ("9"*n) placeholder written as a bare n-digit number (json.dumps refuses
    to print ints past 4300 digits; a file may still hold them)."""
    text = json.dumps(d)
    for i, v in enumerate(values):
        text = text.replace(json.dumps(f"@{i}@"), v)
    return text


@given(st.sampled_from(BASE), st.lists(st.tuples(st.sampled_from(HEADER + INSTRUCTION), st.integers(0, 1000), absurd),
                                       min_size=1, max_size=3))
def test_json_programs_with_absurd_numbers_fail_cleanly(program, edits):
    d = program.to_dict()
    digits = []
    for field, where, value in edits:
        if isinstance(value, str):  # a number too long for json.dumps: a placeholder, replaced in the text
            digits.append(value)
            value = f"@{len(digits) - 1}@"
        _set(d, field, where, value)
    load_and_validate(Program.from_json, _json_with(d, digits))


@given(st.sampled_from(BASE), st.integers(0, 10_000), st.sampled_from(["mb", "stage", "peer", "rank"]),
       st.one_of(st.integers(10, 10 ** 30).map(str), st.integers(18, 6000).map(lambda n: "9" * n),
                 st.sampled_from(["-1", "1e9", "inf", "nan", "0x10", "１"])))
def test_text_and_csv_programs_with_absurd_numbers_fail_cleanly(program, where, field, number):
    csv_lines = program.to_csv().splitlines()
    row = 1 + where % (len(csv_lines) - 1)
    cells = csv_lines[row].split(",")
    column = {"rank": 0, "mb": 3, "stage": 4, "peer": 6}[field]
    cells[column] = number
    csv_lines[row] = ",".join(cells)
    load_and_validate(Program.from_csv, "\n".join(csv_lines) + "\n")
    text_lines = program.to_text().splitlines()
    line = text_lines[where % len(text_lines)]
    load_and_validate(Program.from_text, line.replace("0", number, 1) + "\n" + "\n".join(text_lines))


@given(st.integers(50, 200_000), st.sampled_from(["[", "{\"a\": ", "[{\"ranks\": "]))
def test_json_nested_past_the_decoders_recursion_fails_cleanly(depth, opener):
    load_and_validate(Program.from_json, opener * depth)
    try:
        pipedsl.Timeline.from_json(opener * depth)
    except ValidationError as err:
        assert "JSON" in str(err) or "timeline" in str(err)


@given(st.lists(st.tuples(st.integers(1, 25), st.sampled_from(["int", "negative", "string", "float"])), max_size=5))
def test_json_integers_past_the_digit_limit_are_refused_wherever_they_are(numbers):
    """load_json parses in C unless some run of digits is long enough to need the per-integer check."""
    cells = {"int": "{}", "negative": "-{}", "string": '"{}"', "float": "1.{}"}
    text = "[" + ",".join(cells[kind].format("9" * digits) for digits, kind in numbers) + "]"
    if any(digits > MAX_NUMBER_DIGITS and kind in ("int", "negative") for digits, kind in numbers):
        with pytest.raises(PipeDSLError, match=r"more than 18 digits \(MAX_NUMBER_DIGITS\)"):
            load_json(text)
    else:
        assert load_json(text) == json.loads(text)
