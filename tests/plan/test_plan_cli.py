"""`pipedsl plan`: the ranked table and the rejections; bad input is one line and status 2."""

from __future__ import annotations

import pytest

from pipedsl.cli import main
from pipedsl.library import _builtin_dir


def test_plan_prints_a_ranked_table_and_why_others_were_rejected(capsys):
    code = main(["plan", "--model", "gpt-18b", "--gpus", "16", "--schedule", "1f1b", "--schedule", "interleaved",
                 "--zero", "0,1", "--top", "3"])
    out = capsys.readouterr().out
    assert code == 0
    assert "gpt-18b: 18.4B parameters" in out and "on 16 × a100-80gb" in out
    rows = [line for line in out.splitlines() if line.startswith("│ ") and "dp" in line]
    assert len(rows) == 3 and rows[0].split("│")[1].strip() == "1"
    assert "rejected" in out and "out of memory" in out and "divisibility" in out


def test_plan_with_explicit_sizes(capsys):
    code = main(["plan", "--layers", "8", "--hidden", "1024", "--heads", "16", "--seq", "1024", "--vocab", "32000",
                 "--global-batch", "64", "--gpus", "8", "--top", "2", "--zero", "0"])
    assert code == 0 and "custom: 0.1B parameters" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "gpt-9t"], "unknown model 'gpt-9t'"),
    (["--model", "gpt-1.7b", "--cluster", "tpu"], "unknown cluster 'tpu'"),
    (["--layers", "4", "--hidden", "64"], "missing: --heads, --seq, --vocab, --global-batch"),
    (["--model", "gpt-1.7b", "--zero", "4"], "--zero '4': expected comma-separated stages among 0,1,2,3"),
    (["--model", "gpt-1.7b", "--heads", "7"], "hidden 2304 is not divisible by heads 7"),
    (["--model", "gpt-1.7b", "--schedule", "nosuch"], "nosuch"),
])
def test_bad_input_is_one_line_and_status_2(capsys, argv, message):
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], captured.err


def test_a_pipe_file_is_planned_like_a_builtin(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.pipe").write_text((_builtin_dir() / "1f1b.pipe").read_text())
    code = main(["plan", "--model", "gpt-1.7b", "--gpus", "16", "--schedule", "mine.pipe", "--zero", "0", "--top", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│ ")]
    assert code == 0 and len(rows) == 2 and all("mine.pipe b" in row for row in rows)
