"""The command line: a thin layer over the API, exit status 2 and one clear message on errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import pipedsl
from pipedsl.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_compile_json_is_the_program_contract(capsys):
    code, out, _ = run(capsys, "compile", "1f1b", "-P", "3", "-M", "4", "--format", "json")
    assert code == 0
    assert json.loads(out) == pipedsl.load("1f1b").compile(P=3, M=4).to_dict()


@pytest.mark.parametrize("fmt", ["text", "csv"])
def test_compile_text_and_csv_round_trip(capsys, fmt):
    code, out, _ = run(capsys, "compile", "gpipe", "-P", "2", "-M", "3", "--format", fmt)
    assert code == 0
    parse = pipedsl.Program.from_text if fmt == "text" else pipedsl.Program.from_csv
    assert parse(out).ranks == pipedsl.load("gpipe").compile(P=2, M=3).ranks


def test_simulate_json_reports_the_metrics(capsys):
    code, out, _ = run(capsys, "simulate", "1f1b", "-P", "4", "-M", "8", "--cost", "F=1,B=2", "--format", "json")
    assert code == 0
    d = json.loads(out)
    assert d["makespan"] == 33 and d["bubble_ratio"] == pytest.approx(3 / 11)
    assert d["peak_activations"] == [4, 3, 2, 1] and d["busy"] == [24, 24, 24, 24]
    assert d["messages"] == 2 * 8 * 3


def test_cost_per_stage(capsys):
    code, out, _ = run(capsys, "simulate", "gpipe", "-P", "2", "-M", "1", "--cost", "F=1,B=1,F@1=3", "--format", "json")
    assert code == 0 and json.loads(out)["makespan"] == 1 + 3 + 1 + 1


def test_list_shows_every_builtin(capsys):
    code, out, _ = run(capsys, "list")
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()] == pipedsl.builtin_names()


def test_check_reports_not_applicable_and_passes(capsys, tmp_path):
    path = tmp_path / "even.pipe"
    path.write_text('schedule even(P, M) {\n  require M % 2 == 0 : "M must be even"\n  warmup min(P - r - 1, M)\n}\n')
    code, out, _ = run(capsys, "check", str(path), "--ranks", "2,3")
    assert code == 0
    assert "P=2: 4 ok, 4 not applicable, 0 failed" in out
    assert "not applicable (M=1,3,5,7): requirement failed: M must be even" in out


def test_check_fails_on_a_deadlocking_schedule(capsys, tmp_path):
    path = tmp_path / "stuck.pipe"
    path.write_text("schedule stuck(P, M) {\n  stages 2 * P\n  order F by -s\n}\n")
    code, out, _ = run(capsys, "check", str(path), "--ranks", "2")
    assert code == 1
    assert "FAILED M=1" in out and "stuck.pipe:3:3" in out


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["compile", "nope", "-P", "2", "-M", "2"], "no schedule named 'nope'"),
        (["compile", "9" * 400, "-P", "2", "-M", "2"], "no schedule named '9999"),  # too long to be a path: not OSError
        (["compile", "1f1b", "-P", "0", "-M", "2"], "0 is not in 1..1,024 (MAX_RANKS)"),
        (["compile", "1f1b", "-P", "2", "-M", "2", "-p", "X"], "expected NAME=INTEGER"),
        (["compile", "1f1b", "-P", "2", "-M", "2", "-p", "X=1"], "has no parameter 'X'"),
        (["simulate", "1f1b", "-P", "2", "-M", "2", "--cost", "F=abc"], "not NAME=VALUE"),
        (["simulate", "1f1b", "-P", "2", "-M", "2", "--cost", "Q=1"], "unknown cost 'Q'"),
        (["compile", "/nonexistent/x.pipe", "-P", "2", "-M", "2"], "cannot read /nonexistent/x.pipe"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_errors_exit_2_with_one_clear_message(capsys, argv, words):
    with pytest.raises(SystemExit) as info:
        raise SystemExit(main(argv))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert words in err
    assert "Traceback" not in err


def test_console_script_prints_source_errors_without_traceback(tmp_path):
    path = tmp_path / "bad.pipe"
    path.write_text("schedule bad(P, M) {\n  stages P *\n}\n")
    proc = subprocess.run([sys.executable, "-m", "pipedsl.cli", "compile", str(path), "-P", "2", "-M", "2"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"{path}:3:1: syntax error: unexpected '}}'")
    assert "   3 | }" in proc.stderr and "     | ^" in proc.stderr
    assert "Traceback" not in proc.stderr
