"""Program files (JSON, CSV, text) from anywhere: only clean `ValidationError`s, never a crash."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

import pipedsl
from pipedsl import Program, ValidationError

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
