"""Post-validated steps (runtime/post_validate.py) equal synchronous ones bit for bit: 20 steps of a small GPT with
clipping that triggers on some steps and an inf put into one gradient at one step (skipped by both), under 1F1B,
ZB-H1, zb-auto and DualPipeV, at pp2 and at dp2 × pp2 with ZeRO-1 and ZeRO-3, at tp2 × pp2, under fp16 —
every parameter and every optimizer-state tensor equal, the same steps clipped and skipped, the same losses and
norms; each clipped or skipped step was rolled back and redone (the rollback in step k+1 undoes its forward work
and drains the messages in flight).  Also under NCCL's semantics on CPU (`PIPEDSL_P2P=rendezvous`)."""

from __future__ import annotations

import nccl_cases
import pytest
from post_validate_cases import INF_STEP, STEPS, sync_and_post

from pipedsl.runtime.launch.pool import with_rank

pytestmark = pytest.mark.slow


def _check(results: list[dict]) -> None:
    problems = [f"rank {r}: {p}" for r, res in enumerate(results) for p in res["problems"]]
    assert not problems, "\n".join(problems[:20])
    for res in results:
        assert res["steps"] == STEPS
        assert res["skipped"] == 1, f"the inf at step {INF_STEP} skips that step and no other"
        assert res["clipped"] >= 1, "clipping must trigger on some step, or the rollback is not exercised"
        assert res["clipped"] <= STEPS // 2, "clipping on most steps would not be the case post-validation is for"
        assert res["redone"] == res["clipped"] + res["skipped"]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-auto", "dualpipev", "gpipe"])  # gpipe: every loss before a gate
def test_post_validated_steps_equal_synchronous_ones(schedule: str, pool2) -> None:
    """pp2, 20 steps with clipping on some and an inf at step 7: parameters, optimizer state and norms equal the
    synchronous run's bit for bit, losses to 1e-12, the same steps clipped and skipped; each of those was redone."""
    _check(pool2.run(sync_and_post, schedule, 2, 4))


@pytest.mark.parametrize("zero", [1, 3])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-auto", "dualpipev"])
def test_post_validated_steps_equal_synchronous_ones_at_dp2_pp2_under_zero(schedule: str, zero: int, pool) -> None:
    """dp2 × pp2 under ZeRO-1 and 3, 20 steps with clipping and one inf: parameters, optimizer state and norms equal the
    synchronous run's bit for bit, losses to 1e-12, the same steps clipped and skipped; each of those was redone."""
    _check(pool.run(with_rank, 4, sync_and_post, schedule, 2, 4, zero, 2))


def test_post_validated_steps_with_tensor_parallel_stages(pool) -> None:
    """tp2 × pp2 (Megatron's split of the GPT, models/gpt/tp.py) under ZeRO-1: the norm counts each tp copy once
    and the loss is the pipelines' mean, as synchronous steps do."""
    _check(pool.run(with_rank, 4, sync_and_post, "zb-h1", 2, 4, 1, 1, 0.8, None, 2))


def test_post_validated_steps_under_nccls_semantics(pool) -> None:
    """Every send a rendezvous on its edge's stream: the gates' waits and the rollback's drains cannot hang."""
    results = pool.run(with_rank, 4, nccl_cases.by_rendezvous, sync_and_post, "dualpipev", 2, 4, 3, 2)
    _check([res for res, _ in results])
    assert all(sent > 0 for _, sent in results)


def test_post_validated_fp16_skips_and_backs_off_as_synchronous_steps(pool2) -> None:
    """fp16 with its dynamic loss scale: the inf's step is an overflow that both runs skip, backing the scale off;
    the post-validated run updates the scale optimistically and puts it back when it redoes the step."""
    results = pool2.run(sync_and_post, "zb-h1", 2, 4, 0, 1, 0.8, "fp16")
    _check(results)
    assert all(res["scale"]["skipped"] == 1 for res in results)
