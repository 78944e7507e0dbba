"""The local rank limit (runtime/launch/capacity.py, issue 13): a rank count that is not positive, or more
local processes than the machine runs sensibly, is one line (status 2 on the CLI) before any
process starts; `--allow-oversubscribe` / `max_local=` lift the limit.

Every test here replaces `multiprocessing`'s `Process.start` with one that records the call and
stops the run, so "nothing started" is observed, not assumed, and no test spawns anything.
"""

from __future__ import annotations

import multiprocessing.process

import pytest

import pipedsl
from pipedsl.cli import main
from pipedsl.errors import PipeDSLError
from pipedsl.runtime.launch.capacity import max_local_ranks

LIMIT = max_local_ranks()
SMALL = ["--seq", "8", "--embd", "16", "--threads", "1", "--steps", "1"]


class Started(Exception):  # noqa: N818 - the event the tests look for
    """Raised instead of starting a process."""


@pytest.fixture
def started(monkeypatch) -> list[str]:
    names: list[str] = []

    def start(self) -> None:
        names.append(self.name)
        raise Started(self.name)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)
    return names


@pytest.mark.parametrize(("argv", "message"), [
    (["train", "-P", "0"], "error: argument -P/--ranks: 0 must be at least 1"),
    (["train", "-P", "-3"], "error: argument -P/--ranks: -3 must be at least 1"),
    (["train", "-P", "2", "--dp", "0"], "error: argument --dp: 0 must be at least 1"),
    (["run", "--program", "p.json", "-P", "0"], "error: argument -P/--ranks: 0 must be at least 1"),
])
def test_no_ranks_is_one_line(run_cli, started, argv, message) -> None:
    code, lines = run_cli(*argv)
    assert (code, started) == (2, [])
    assert len(lines) == 1 and lines[0].startswith(message), lines


def test_more_pipeline_ranks_than_the_limit_is_one_line_before_compiling(run_cli, started) -> None:
    code, lines = run_cli("train", "-P", str(LIMIT + 1), "-M", str(LIMIT + 1), *SMALL)
    assert (code, started) == (2, [])
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: {LIMIT + 1} pipeline ranks = {LIMIT + 1} local processes is more than "
                               f"this machine runs sensibly (limit {LIMIT}:"), lines
    assert "--allow-oversubscribe" in lines[0] and "torchrun" in lines[0]


def test_a_dp_times_pp_product_beyond_the_limit_is_one_line(run_cli, started) -> None:
    dp = LIMIT // 2 + 1  # dp x 2 > LIMIT, each factor within it
    code, lines = run_cli("train", "-P", "2", "-M", "2", "--dp", str(dp), *SMALL)
    assert (code, started) == (2, [])
    assert len(lines) == 1 and lines[0].startswith(
        f"error: --dp {dp} x 2 pipeline ranks = {2 * dp} local processes is more than"), lines


def test_a_program_file_with_more_ranks_than_the_limit_is_one_line(run_cli, started, tmp_path) -> None:
    path = tmp_path / "wide.json"
    path.write_text(pipedsl.load("gpipe").compile(P=LIMIT + 1, M=1).to_json())
    code, lines = run_cli("run", "--program", str(path), *SMALL)
    assert (code, started) == (2, [])
    assert len(lines) == 1 and f"{LIMIT + 1} pipeline ranks = {LIMIT + 1} local processes" in lines[0], lines


def test_allow_oversubscribe_goes_past_the_limit(started, tmp_path) -> None:
    """The same run with the flag reaches the start of its first process (where the test stops it)."""
    with pytest.raises(Started):
        main(["train", "-P", str(LIMIT + 1), "-M", str(LIMIT + 1), *SMALL, "--allow-oversubscribe",
              "-o", str(tmp_path)])
    assert started == ["pipedsl-rank0"]


def noop(rank: int) -> int:
    return rank


@pytest.mark.parametrize(("nprocs", "message"), [
    (0, "nprocs must be a positive integer, got 0"),
    (-2, "nprocs must be a positive integer, got -2"),
    (2.0, "nprocs must be a positive integer, got 2.0"),
    (True, "nprocs must be a positive integer, got True"),
    (LIMIT + 1, f"nprocs = {LIMIT + 1} local processes is more than this machine runs sensibly (limit {LIMIT}:"),
    (10**9, f"nprocs = {10**9} local processes is more than this machine runs sensibly (limit {LIMIT}:"),
])
def test_launch_refuses_before_starting_anything(started, nprocs, message) -> None:
    with pytest.raises(PipeDSLError) as info:
        pipedsl.launch(noop, nprocs)
    assert info.value.message.startswith(message) and "\n" not in str(info.value), str(info.value)
    assert started == []


def test_launch_max_local_lifts_the_limit(started) -> None:
    with pytest.raises(Started):
        pipedsl.launch(noop, LIMIT + 1, max_local=LIMIT + 1)
    assert started == ["pipedsl-rank0"]
