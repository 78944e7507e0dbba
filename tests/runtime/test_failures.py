"""A rank that fails makes the others stop with an error naming it, in bounded time (fresh processes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import failure_cases as cases
import pytest

import pipedsl
from pipedsl.errors import PipeRuntimeError
from pipedsl.runtime.launch.errors import RankFailure, is_consequence
from pipedsl.runtime.launch.launcher import _report
from pipedsl.runtime.launch.rank_results import write_error

BOUNDS = {"timeout": 30.0, "join_timeout": 180.0, "threads": 1}


@pytest.mark.slow
def test_shape_mismatch_names_rank_stage_and_shapes() -> None:
    with pytest.raises(PipeRuntimeError) as info:
        pipedsl.launch(cases.shape_mismatch, 2, **BOUNDS)
    text = str(info.value)
    assert "rank 1 failed" in text
    assert "rank 1 instruction" in text and "(F0.1)" in text
    assert "stage 1 cannot take its input [2, 8] float32 from stage 0" in text
    assert "rank 0" in text, "the other rank's error is reported too"


@pytest.mark.slow
def test_non_finite_loss_names_rank_and_instruction() -> None:
    with pytest.raises(PipeRuntimeError) as info:
        pipedsl.launch(cases.nan_loss, 2, **BOUNDS)
    text = str(info.value)
    assert "rank 1 failed" in text
    assert "(F0.1): the loss of microbatch 0 is nan (not finite)" in text
    assert "rank 0: rank 0 stopped because rank 1 failed" in text


@pytest.mark.slow
def test_a_killed_rank_stops_the_others() -> None:
    with pytest.raises(PipeRuntimeError) as info:
        pipedsl.launch(cases.killed_mid_step, 3, **BOUNDS)
    text = str(info.value)
    assert text.splitlines()[0].endswith("rank 1 failed: killed by signal SIGKILL")
    notes = [line.strip() for line in text.splitlines()[1:]]
    for r in (0, 2):  # both neighbours stopped on their own, blaming rank 1
        assert any(n.startswith(f"note: rank {r}: ") and "rank 1" in n.partition(": rank")[2] for n in notes), text


@pytest.mark.slow
def test_a_rank_aborted_by_a_signal_prints_where_its_threads_were() -> None:
    """SIGABRT (glibc's answer to a corrupted heap) leaves no Python error to report: the rank's faulthandler prints
    every thread's stack to its stderr, down to the module's forward that was running.  A fresh interpreter, whose
    ranks' stderr is its own."""
    code = ("import pipedsl, failure_cases\n"
            f"pipedsl.launch(failure_cases.killed_mid_step, 3, True, **{BOUNDS!r})")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(cases.__file__).parent),
                                                         os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert "rank 1 failed: killed by signal SIGABRT" in proc.stderr, proc.stderr[-2000:]
    assert "Fatal Python error: Aborted" in proc.stderr, proc.stderr[-2000:]
    assert re.search(r'failure_cases\.py", line \d+ in forward', proc.stderr), proc.stderr[-2000:]


def _line_of(text: str) -> int:
    """The line of failure_cases.py holding `text` (the report must point there)."""
    lines = Path(cases.__file__).read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if text in line)


def _index_of(instr: str, schedule: str, P: int, M: int, rank: int = 1) -> int:
    """Where `instr` is in rank `rank`'s stream of the compiled schedule."""
    stream = pipedsl.load(schedule).compile(P=P, M=M).ranks[rank]
    return next(i for i, ins in enumerate(stream) if str(ins) == instr)


def _assert_user_frames_only(text: str) -> None:
    """Every frame of the report is in the user's file: none of pipedsl's runtime, torch or autograd."""
    frames = re.findall(r"^    (\S+):\d+ in \w+$", text, flags=re.M)
    assert frames and all(f.endswith("failure_cases.py") for f in frames), text
    for internal in ("executor.py", "stage.py", "pipeline.py", "launcher.py", "torch/", "autograd"):
        assert internal not in text.split("\n  note:")[0], f"{internal!r} in the user's traceback:\n{text}"


@pytest.mark.slow
def test_a_user_forward_that_raises_is_reported_with_its_frames() -> None:
    with pytest.raises(PipeRuntimeError) as info:
        pipedsl.launch(cases.user_forward_raises, 2, **BOUNDS)
    text = str(info.value)
    lines = text.splitlines()
    index = _index_of("F2.1", "1f1b", P=2, M=4)
    assert lines[0] == f"runtime error: rank 1 failed: rank 1 instruction {index} (F2.1): ValueError: user forward " \
                       "rejects microbatch 2", text
    raising = _line_of("# the user's forward raises")
    assert f"failure_cases.py:{raising} in forward" in text, text
    assert 'raise ValueError(f"user forward rejects microbatch {microbatch}")' in text, text
    assert f"failure_cases.py:{_line_of('# the user' + chr(39) + 's loop')} in user_forward_raises" in text, \
        "the user's call to step is shown too"
    assert lines[lines.index(next(ln for ln in lines if ln.startswith("  note:"))) - 1] == \
        "  ValueError: user forward rejects microbatch 2", "the exception line closes the traceback"
    _assert_user_frames_only(text)
    assert "rank 0: rank 0 stopped because rank 1 failed" in text


@pytest.mark.slow
def test_a_user_backward_that_raises_is_reported_with_its_frames() -> None:
    with pytest.raises(PipeRuntimeError) as info:
        pipedsl.launch(cases.user_backward_raises, 2, **BOUNDS)
    text = str(info.value)
    index = _index_of("B2.1", "1f1b", P=2, M=4)
    assert text.splitlines()[0] == f"runtime error: rank 1 failed: rank 1 instruction {index} (B2.1): " \
                                   "FloatingPointError: user backward rejects this gradient", text
    assert f"failure_cases.py:{_line_of('# the user' + chr(39) + 's backward raises')} in backward" in text, text
    assert 'raise FloatingPointError("user backward rejects this gradient")' in text
    _assert_user_frames_only(text)


@pytest.mark.slow
def test_a_peers_lost_connection_does_not_displace_the_cause() -> None:
    """Rank 0 is still sending when rank 1 fails: its 'Connection closed by peer' is a consequence
    (it used to be reported as the failure, rank 0 being the lower rank)."""
    with pytest.raises(PipeRuntimeError) as info:
        pipedsl.launch(cases.sends_to_a_failed_rank, 2, **BOUNDS)
    text = str(info.value)
    index = _index_of("F0.1", "gpipe", P=2, M=8)
    assert text.splitlines()[0] == f"runtime error: rank 1 failed: rank 1 instruction {index} (F0.1): ValueError: " \
                                   "user forward rejects microbatch 0", text
    notes = [line for line in text.splitlines() if line.startswith("  note:")]
    assert len(notes) == 1 and notes[0].startswith("  note: rank 0: rank 0 stopped because rank 1 failed: "), text


def test_a_lost_connection_is_a_consequence_and_a_users_error_is_not() -> None:
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:4004. This is typically caused by a remote worker crashing.")
    assert is_consequence(gloo)
    try:
        try:
            raise gloo
        except RuntimeError as err:
            raise KeyError("what the user's handler raised instead") from err
    except KeyError as err:
        assert is_consequence(err), "an error raised from a lost connection is one too"
    assert not is_consequence(ValueError("user forward rejects microbatch 2"))
    assert is_consequence(RankFailure("waiting failed", 0, peer_failure=True))
    assert not is_consequence(RankFailure("the loss is nan", 0))


def test_the_report_names_the_first_rank_to_record_its_own_failure(tmp_path) -> None:
    """Ranks 0 and 2 failed on their own, 2 first (the store's order); rank 1 lost a connection."""
    procs = [SimpleNamespace(exitcode=1) for _ in range(3)]
    write_error(tmp_path, 0, "rank 0: ValueError: second", consequence=False)
    write_error(tmp_path, 1, "rank 1: Connection closed by peer", consequence=True)
    write_error(tmp_path, 2, "rank 2: ValueError: first\n  traceback, your code (most recent call last):",
                consequence=False)
    outcome = {"timed_out": False, "killed": set(), "grace": 1.0, "order": [2, 0]}
    with pytest.raises(PipeRuntimeError) as info:
        _report(outcome, procs, 10.0, str(tmp_path))
    lines = str(info.value).splitlines()
    assert lines[:2] == ["runtime error: rank 2 failed: rank 2: ValueError: first",
                         "  traceback, your code (most recent call last):"]
    assert lines[2:] == ["  note: rank 0: rank 0: ValueError: second", "  note: rank 1: rank 1: Connection closed by peer"]
    outcome["order"] = []  # nothing in the store: the lowest rank that failed on its own
    with pytest.raises(PipeRuntimeError, match="^runtime error: rank 0 failed"):
        _report(outcome, procs, 10.0, str(tmp_path))
