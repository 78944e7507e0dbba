"""Per-token loss normalisation: the pipeline's loss and gradients are the mean over every non-ignored
token of the global batch — padding spread unevenly over microbatches and dp replicas — equal to one
process's `F.cross_entropy(..., ignore_index=-100)` over the whole batch."""

from __future__ import annotations

import llm_cases as cases
import pytest
from test_pipeline import compile_for

import pipedsl


@pytest.mark.slow
@pytest.mark.parametrize("schedule", pipedsl.builtin_names())
def test_token_loss_equals_one_process(schedule: str, pool2) -> None:
    """Per-token loss under each built-in schedule at P=2, padding spread unevenly: the loss and every gradient of 2
    steps equal one process's `F.cross_entropy(ignore_index=-100)` mean over the whole batch (rtol 2e-5)."""
    program = compile_for(schedule, 2)
    problems = [f"rank {r}: {p}" for r, res in enumerate(pool2.run(cases.token_loss_check, program.to_json()))
                for p in res]
    assert not problems, "\n".join(problems[:20])


@pytest.mark.slow
def test_token_loss_dp_pp_tp_zero(pool) -> None:
    """dp2 x pp2 x tp2 (Megatron 1-D tp, vocabulary-parallel loss): ZeRO-3 with selective recomputation under the
    split backward and a local batch, ZeRO-1 with full recomputation under 1F1B and a global batch; a changing
    sequence length and a partial batch; every loss and the SGD-updated parameters equal one process."""
    runs = (("zb-h1", 2, 3, "local", "selective"), ("1f1b", 2, 1, "global", "full"))
    (found, *_) = pool.run(cases.parallel_job, 8, 2, 2, 2, runs, 1)
    assert len(found) == len(runs)
    problems = [f"{run}: {p}" for run, ps in found.items() for p in ps]
    assert not problems, "\n".join(problems)


def test_bad_options_are_named(pool2) -> None:
    first, _ = pool2.run(cases.api_errors)
    assert "loss_reduction must be one of 'microbatch', 'token'" in first["reduction"]
    assert "recompute must be None" in first["recompute"]
    assert "needs recompute_filter" in first["selective"]
