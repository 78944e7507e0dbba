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
    assert code == 0 and "custom: 135M parameters" in capsys.readouterr().out


def test_a_small_model_prints_in_units_that_fit_and_orders_equal_times_by_memory(capsys):
    """Was: `0.0B parameters`, every time, FLOP rate and memory cell 0 or 0.0, ten rows alike."""
    code = main(["plan", "--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "100",
                 "--global-batch", "8", "--gpus", "4"])
    out = capsys.readouterr().out
    assert code == 0 and "custom: 209k parameters" in out
    assert "equal times: less memory first, then fewer GPUs" in out
    head = next(line for line in out.splitlines() if "┃" in line and "layout" in line)
    heads = [h.strip() for h in head.split("┃")[1:-1]]
    assert heads[2:7] == ["iteration µs", "TFLOP/s/GPU", "MFU", "memory MB", "params KB"]
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│ ")]
    assert len(rows) == 10
    column = {h.split(" ")[0]: i for i, h in enumerate(heads)}  # by the header's first word
    for row in rows:  # iteration, FLOP/s, memory, params, grads, optimizer, activations: none shows as zero
        assert all(float(row[column[c]]) > 0 for c in ("iteration", "TFLOP/s/GPU", "memory", "params", "grads",
                                                         "optim", "activ")), row
    assert {"grad", "gathered"} <= set(column)  # ZeRO 2-3's buffers during the step, shown where ranked
    times = [float(row[2]) for row in rows]
    assert len(set(times)) > 1 and times == sorted(times)
    # the two fastest tie in time and in memory (ZeRO-2 holds its whole gradient until REDUCE_GRAD, so its saving
    # is between steps): its smaller grads column and its gradient buffer say so
    zero1, zero2 = sorted(rows[:2], key=lambda row: row[1][-1])
    assert zero1[1].endswith("zero1") and zero2[1].endswith("zero2") and times[0] == times[1]
    assert zero1[column["memory"]] == zero2[column["memory"]]
    assert float(zero2[column["grads"]]) < float(zero1[column["grads"]]) and float(zero2[column["grad"]]) > 0


def test_a_cpu_sized_cluster_prints_gflops(capsys):
    """What --calibrate plans on: a one-node CPU cluster of some GFLOP/s a rank."""
    code = main(["plan", "--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "100",
                 "--global-batch", "8", "--gpus", "4", "--peak-tflops", "0.05", "--memory-gb", "8", "--top", "3"])
    out = capsys.readouterr().out
    assert code == 0 and "(8/node, 50.0 GFLOP/s, 8.00 GB)" in out
    head = next(line for line in out.splitlines() if "┃" in line and "layout" in line)
    assert "GFLOP/s/GPU" in head and "iteration ms" in head


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


def test_plan_modes_and_runtime_rejections(capsys):
    """--recompute/--sequence-parallel/--attention narrow the search; HF layouts the runtime refuses are listed
    as 'runtime:' with the module that refuses them."""
    code = main(["plan", "--model", "llama-8b", "--cluster", "h100", "--gpus", "16", "--schedule", "1f1b",
                 "--zero", "0,1", "--recompute", "selective", "--sequence-parallel", "on", "--attention", "eager",
                 "--top", "2", "--rejected", "40"])
    out = capsys.readouterr().out
    assert code == 0 and "(hf layout)" in out
    rows = [line for line in out.splitlines() if line.startswith("│ ") and "dp" in line]
    assert rows and all(" selective" in r and " flash" not in r and ("+sp" in r or " tp1 " in r) for r in rows)
    assert "runtime: Hugging Face stages support 1-D tensor parallelism only (models/hf/parallelize.py)" in out


def test_plan_rejects_an_unknown_recompute_mode(run_cli):
    code, err = run_cli("plan", "--model", "gpt-1.7b", "--recompute", "some")
    assert code == 2 and len(err) == 1 and "--recompute 'some'" in err[0]
