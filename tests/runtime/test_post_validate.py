"""Post-validated steps (runtime/post_validate.py) equal synchronous ones bit for bit: 20 steps of a small GPT with
clipping that triggers on some steps and an inf put into one gradient at one step (skipped by both), under 1F1B,
ZB-H1, zb-auto and DualPipeV, at pp2 and at dp2 × pp2 with ZeRO-1 and ZeRO-3 — every parameter and every
optimizer-state tensor equal, the same steps clipped and skipped, the same losses and norms; each clipped or
skipped step was rolled back and redone (the rollback in step k+1 undoes its forward work and drains the
messages in flight).  Also under NCCL's semantics on CPU (`PIPEDSL_P2P=rendezvous`)."""

from __future__ import annotations

import nccl_cases
import pytest
import torch
from post_validate_cases import INF_STEP, STEPS, sync_and_post

import pipedsl
from pipedsl.errors import PipeRuntimeError
from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss
from pipedsl.runtime.launch.pool import with_rank
from pipedsl.runtime.post_validate import TrainingSteps

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
    _check(pool2.run(sync_and_post, schedule, 2, 4))


@pytest.mark.parametrize("schedule,zero", [("1f1b", 1), ("dualpipev", 1), ("zb-h1", 3), ("zb-auto", 3)])
def test_post_validated_steps_equal_synchronous_ones_at_dp2_pp2_under_zero(schedule: str, zero: int, pool) -> None:
    _check(pool.run(with_rank, 4, sync_and_post, schedule, 2, 4, zero, 2))


def test_post_validated_steps_under_nccls_semantics(pool) -> None:
    """Every send a rendezvous on its edge's stream: the gates' waits and the rollback's drains cannot hang."""
    results = pool.run(with_rank, 4, nccl_cases.by_rendezvous, sync_and_post, "dualpipev", 2, 4, 3, 2)
    _check([res for res, _ in results])
    assert all(sent > 0 for _, sent in results)


def _fp16(rank: int) -> str:
    model = GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=1, n_embd=8))
    pipe = pipedsl.Pipeline(model.stages(2), "1f1b", microbatches=2, loss_fn=gpt_loss, precision="fp16")
    opt = pipe.optimizer(torch.optim.SGD, lr=0.1)
    try:
        TrainingSteps(pipe, opt, max_norm=1.0, post_validate=True)
    except PipeRuntimeError as err:
        return str(err)
    finally:
        pipe.close()
    return "accepted"


@pytest.mark.quick
def test_fp16_loss_scaling_is_refused_in_words(pool2) -> None:
    for text in pool2.run(_fp16):
        assert "post-validated steps do not support fp16's dynamic loss scaling" in text, text
