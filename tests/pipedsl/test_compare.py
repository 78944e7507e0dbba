"""`pipedsl compare`: the table's numbers against formulas, and n/a rows instead of failures."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pipedsl
from pipedsl.arguments import parse_params
from pipedsl.cli import main
from pipedsl.compare import compare, compare_table
from pipedsl.errors import PipeDSLError


def frac(x: float) -> Fraction:
    return Fraction(x).limit_denominator(100_000)


@given(st.integers(2, 8), st.integers(1, 4))
def test_rows_match_the_formulas(P, k):
    M = k * P
    gpipe, one, inter = compare(["gpipe", "1f1b", "interleaved"], P, M, cost="F=1,B=2")
    for row in (gpipe, one):
        assert row.ok
        assert frac(row.bubble_ratio) == Fraction(P - 1, M + P - 1)
        assert row.makespan == 3 * (M + P - 1)
        assert row.messages == 2 * M * (P - 1)  # one activation and one gradient per boundary and microbatch
        assert row.weight_copies == 1
    assert gpipe.peak_activations == [M] * P
    assert one.peak_activations == [min(P - r, M) for r in range(P)]
    assert frac(inter.bubble_ratio) == Fraction(P - 1, 2 * M + P - 1)  # V = 2 by default
    assert inter.messages == 2 * M * (2 * P - 1)


@given(st.sampled_from([2, 4, 6, 8]), st.integers(1, 3))
def test_chimera_row_counts_two_weight_copies(P, k):
    M = k * P
    (row,) = compare(["chimera"], P, M, cost="F=1,B=1")
    assert row.weight_copies == 2
    assert frac(row.bubble_ratio) == Fraction(P - 2, 2 * M + P - 2)
    assert row.messages == 2 * M * (P - 1)


def test_rows_agree_with_simulate():
    for name in pipedsl.builtin_names():
        (row,) = compare([name], 4, 8)
        t = pipedsl.simulate(pipedsl.load(name).compile(P=4, M=8), pipedsl.Cost())
        assert (row.bubble_ratio, row.makespan, row.peak_activations) == \
            (t.bubble_ratio, t.makespan, t.peak_activations), name


def test_unusable_schedules_get_a_reason_instead_of_numbers():
    rows = {r.schedule: r for r in compare(["gpipe", "interleaved", "chimera", "nope"], 3, 7, {"V": 2})}
    assert "the last microbatch group, M % G, must be 0 or at least P" in rows["interleaved"].reason
    assert rows["chimera"].reason.startswith("requirement failed: Chimera needs an even number of ranks")
    assert "no schedule named 'nope'" in rows["nope"].reason
    assert rows["gpipe"].ok


def test_a_parameter_goes_to_the_schedules_that_declare_it_and_the_others_run_with_defaults():
    """-p V=3 used to make every schedule without V an n/a row ('takes no parameter V')."""
    rows = {r.schedule: r for r in compare(["gpipe", "1f1b", "interleaved", "hanayo"], 4, 8, {"V": 3})}
    assert all(r.ok for r in rows.values()), rows
    for name in ("gpipe", "1f1b", "hanayo"):
        (alone,) = compare([name], 4, 8)
        assert (rows[name].makespan, rows[name].peak_activations) == (alone.makespan, alone.peak_activations)
        assert rows[name].not_taken == ["V"] and rows[name].params == {}
    (v3,) = compare(["interleaved"], 4, 8, {"V": 3})
    (v2,) = compare(["interleaved"], 4, 8)
    assert rows["interleaved"].params == {"V": 3} and rows["interleaved"].makespan == v3.makespan != v2.makespan


def test_a_parameter_no_schedule_declares_is_an_error_naming_it(capsys):
    with pytest.raises(PipeDSLError, match=r"^error: parameter K=3: none of the schedules compared takes it "
                                           r"\(gpipe: none; hanayo: W, E\)$"):
        compare(["gpipe", "hanayo"], 4, 8, {"K": 3})
    assert main(["compare", "gpipe", "1f1b", "-P", "4", "-M", "8", "-p", "K=3"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["error: parameter K=3: none of the schedules compared takes it (gpipe: none; 1f1b: none)"]


def test_table_text():
    text = compare_table(["1f1b", "interleaved", "looped-bfs"], 4, 6, {"V": 2}, "F=1,B=2")
    lines = text.splitlines()
    assert lines[0].startswith("P=4 M=6 V=2") and "F=1 B=2" in lines[0]
    assert lines[1].split()[:4] == ["schedule", "stages", "bubble", "makespan"]
    (one,) = compare(["1f1b"], 4, 6, cost="F=1,B=2")  # 1F1B takes no V: compared with its defaults
    assert lines[2].split()[:4] == ["1f1b", "4", f"{one.bubble_ratio:.4f}", f"{one.makespan:g}"]
    (inter,) = compare(["interleaved"], 4, 6, {"V": 2}, "F=1,B=2")  # M = 6: one group of 6 (torch's rounds)
    assert lines[3].split()[:4] == ["interleaved", "8", f"{inter.bubble_ratio:.4f}", f"{inter.makespan:g}"]
    (bfs,) = compare(["looped-bfs"], 4, 6, {"V": 2}, "F=1,B=2")
    peaks = " ".join(["12"] * 4)  # every forward of both chunks before the first backward
    # memory vs 1F1B: 12 half-size chunk activations = 6 stage activations, against 1F1B's 4
    assert lines[4].split() == ["looped-bfs", "8", f"{bfs.bubble_ratio:.4f}", f"{bfs.makespan:g}", *peaks.split(),
                                "1.50", str(2 * 6 * (2 * 4 - 1)), "1"]
    assert lines[5] == ("note: V=2 applies to interleaved, looped-bfs; the others (1f1b) take no V and are compared "
                        "with their defaults")
    # 8-stage cuts at the same per-stage cost are another model than 1F1B's 4 stages: said, not left to be read
    assert lines[6].startswith("note: the stage counts differ (4: 1f1b; 8: interleaved, looped-bfs) and the cost is "
                               "per stage: the makespans are not of one model")


def test_cli_prints_one_table(capsys):
    assert main(["compare", "gpipe", "1f1b", "zb-h1", "-P", "4", "-M", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5
    row = {line.split()[0]: line.split() for line in out[2:]}
    assert row["1f1b"][1:] == ["4", "0.2727", "33", "4", "3", "2", "1", "1.00", "48", "1"]
    # ZB-H1 idles (P-1)(F+I-W) = 3 per rank: makespan M(F+I+W) + 3
    assert row["zb-h1"][3] == "27" and row["zb-h1"][4:8] == ["4", "4", "4", "4"]  # one stage a rank: no note


def test_cli_json_and_errors(capsys):
    assert main(["compare", "hanayo", "1f1b", "-P", "4", "-M", "8", "-p", "W=2", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["params"] == {"P": 4, "M": 8, "W": 2}
    hanayo, one = data["rows"]
    assert hanayo["ok"] and hanayo["weight_copies"] == 1 and len(hanayo["peak_activations"]) == 4
    assert one["ok"] and one["not_taken"] == ["W"] and hanayo["params"] == {"W": 2}
    assert data["notes"][0] == ("note: W=2 applies to hanayo; the others (1f1b) take no W and are compared with "
                                "their defaults")
    assert hanayo["stages"] == 16 and one["stages"] == 4 and data["notes"][1].startswith("note: the stage counts")
    assert main(["compare", "1f1b", "-P", "4", "-M", "8", "--cost", "F=x"]) == 2
    assert "--cost" in capsys.readouterr().err
    assert main(["compare", "1f1b", "-P", "4", "-M", "8", "-p", "V"]) == 2


def test_parse_params():
    assert parse_params(["V=2", " W = 3"]) == {"V": 2, "W": 3}


def test_the_readme_compare_line_runs(capsys):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    lines = [line.split("#", 1)[0].split() for line in readme.splitlines() if line.startswith("pipedsl compare")]
    assert lines
    for command in lines:
        assert main(command[1:]) == 0, command
        assert "n/a" not in capsys.readouterr().out
