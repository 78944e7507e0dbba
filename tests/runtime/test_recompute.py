"""Activation recomputation (full and selective) gives the gradients of no recomputation — with dropout,
under every built-in schedule (split backward I/W and replicas included) — and its saved-activation
bytes are what the simulator's peak activation count predicts."""

from __future__ import annotations

import llm_cases as cases
import pytest
from test_pipeline import compile_for

import pipedsl


@pytest.mark.slow
@pytest.mark.parametrize("schedule", pipedsl.builtin_names())
def test_same_gradients_with_dropout(schedule: str, pool2) -> None:
    program = compile_for(schedule, 2)
    results = pool2.run(cases.recompute_check, program.to_json(), ("full", "selective"))
    problems = [f"rank {r}: {p}" for r, res in enumerate(results) for p in res["problems"]]
    assert not problems, "\n".join(problems[:20])
    # recomputation never keeps more; full keeps less on the first rank, where most activations wait for
    # their backward (a split backward's I-W window keeps the recomputed graph: the last rank may gain nothing)
    for r, res in enumerate(results):
        b = res["bytes"]
        assert b["full"] <= b["selective"] <= b["None"], (r, b)
    assert results[0]["bytes"]["full"] < results[0]["bytes"]["None"], results[0]["bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [None, "full", "selective"])
def test_saved_bytes_match_the_simulator(mode: str | None, pool4) -> None:
    program = pipedsl.load("1f1b").compile(P=4, M=6)
    results = pool4.run(cases.bytes_prediction, program.to_json(), mode)
    for r, res in enumerate(results):
        assert res["measured"] == res["predicted"], (r, res)
    if mode == "full":  # rank 0 keeps 4 microbatches' stage inputs (token ids) instead of 4 whole activations
        assert results[0]["kept"] * 10 < results[0]["full"]
