"""A rank that fails makes the others stop with an error naming it, in bounded time (fresh processes)."""

from __future__ import annotations

import failure_cases as cases
import pytest

import pipedsl
from pipedsl.errors import PipeRuntimeError

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
