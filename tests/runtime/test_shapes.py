"""Shapes that change between steps (a last partial batch, length bucketing): the pipeline learns each new
shape once, agrees on it across ranks, trains exactly like one process, and never hangs on a mismatch.
With the per-token loss a batch that does not split evenly runs as unequal microbatches."""

from __future__ import annotations

import llm_cases as cases
import pytest
from test_pipeline import compile_for


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "chimera", "interleaved"])
def test_batch_and_length_change(schedule: str, pool2) -> None:
    program = compile_for(schedule, 2)
    M = program.num_microbatches
    # the 4th is known: no new handshake; the last is a partial batch of unequal microbatches (sizes 2 and 1)
    shapes = [(2 * M, 6), (2 * M, 4), (M, 6), (2 * M, 6), (M, 3), (2 * M - 1, 5)]
    results = pool2.run(cases.shapes_check, program.to_json(), shapes)
    problems = [f"rank {r}: {p}" for r, res in enumerate(results) for p in res["problems"]]
    assert not problems, "\n".join(problems[:20])
    assert [res["learned"] for res in results] == [5, 5]


def test_ranks_disagreeing_on_shapes_stop_with_the_reason(pool2) -> None:
    messages = pool2.run(cases.disagreeing_shapes)
    for m in messages:
        assert "passed inputs of different shapes" in m, m
        assert "[2, 6]" in m and "[2, 5]" in m, m
