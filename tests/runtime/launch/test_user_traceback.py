"""The user's part of a traceback: their frames, the torch line they reached, bounded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipedsl.ir import Instr, Op
from pipedsl.runtime.launch.errors import RankFailure, failure_at
from pipedsl.runtime.launch.tracebacks import MAX_FRAMES, MAX_LINE, frames_of, trace_of


def _wrong_shape() -> None:
    nn.Linear(4, 4)(torch.zeros(2, 3))  # the user's bad call


def _caught(fn) -> BaseException:
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def test_a_torch_error_shows_the_users_frame_then_the_final_torch_line() -> None:
    trace = trace_of(_caught(_wrong_shape))
    files = [f.file.rsplit("/", 1)[-1] for f in trace.frames]
    assert files[-2:] == ["test_user_traceback.py", "linear.py"], trace  # not torch's Module._call_impl
    assert [f.user for f in trace.frames][-2:] == [True, False]
    assert trace.frames[-2].function == "_wrong_shape" and "the user's bad call" in trace.frames[-2].source
    assert trace.exception.startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    lines = trace.lines()
    assert any(line.startswith("  torch/nn/modules/linear.py:") for line in lines), lines
    assert not any("module.py" in line for line in lines), lines


def test_deep_user_recursion_keeps_the_innermost_frames_and_short_lines() -> None:
    def deep(n: int) -> None:
        if n == 0:
            raise KeyError("x" * 1000)
        deep(n - 1)

    trace = trace_of(_caught(lambda: deep(30)))
    assert len(trace.frames) == MAX_FRAMES and trace.hidden == 33 - MAX_FRAMES  # _caught, the lambda, 31 deeps
    assert trace.frames[-1].source == 'raise KeyError("x" * 1000)'
    assert trace.lines()[1] == f"  … {trace.hidden} earlier frames"
    assert all(len(line) <= MAX_LINE + 4 for line in trace.lines()[:-1])
    assert len(trace.exception) <= 400 and trace.exception.endswith("…")


def test_the_frame_where_a_library_raised_is_left_out_on_request() -> None:
    """The launcher asks for the outer frames of a RankFailure without the runtime line that raised it."""
    tb = _caught(_wrong_shape).__traceback__
    assert [f.function for f in frames_of(tb, innermost=False)] == ["_caught", "_wrong_shape"]
    assert [f.function for f in frames_of(tb)] == ["_caught", "_wrong_shape", "forward"]


def test_a_rank_failure_renders_the_users_frames_and_the_exception_line() -> None:
    failure = failure_at(1, 7, Instr(Op.F, 2, 1), _caught(_wrong_shape))
    lines = failure.render().splitlines()
    assert lines[0] == "runtime error: rank 1 instruction 7 (F2.1): RuntimeError: mat1 and mat2 shapes cannot be " \
                       "multiplied (2x3 and 4x4)"
    assert lines[1] == "  traceback, your code (most recent call last):"
    assert "  nn.Linear(4, 4)(torch.zeros(2, 3))  # the user's bad call" in [line.strip() and line[4:] for line in lines]
    assert lines[-1] == "  RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x3 and 4x4)"
    assert not failure.peer_failure and failure.message == lines[0].removeprefix("runtime error: ")
    assert isinstance(failure, RankFailure)
