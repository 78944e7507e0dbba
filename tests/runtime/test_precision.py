"""Mixed precision and global gradient clipping on every built-in schedule (P=2), against one process.

The model is a 1-D convolution stack no other test trains (precision_cases.py).  The
reference runs the same stages in one process under the same policy (`run_stages`), with
torch's `clip_grad_norm_` and, for fp16, `torch.amp.GradScaler`.  Because the policy casts
every stage output to the compute dtype *and* makes it contiguous (as a message arrives), the
pipeline computes the very same low-precision ops: its parameters equal the reference's up to
fp32 summation order (measured max 1.5e-8), while they differ from the fp32 reference by
1.6e-6 (fp16) to 6e-5 (bf16) — so the tolerance below tells the policies apart.
"""

from __future__ import annotations

import math

import precision_cases as cases
import pytest
import torch

import pipedsl
from pipedsl.errors import PipeRuntimeError
from pipedsl.runtime.optim import LRSchedule
from pipedsl.runtime.precision import MixedPrecision, policy

pytestmark = pytest.mark.slow

P, M, STEPS = 2, 4, 2
PARAM_ATOL = 1e-6  # fp32 summation order only (measured <= 1.5e-8 on parameters of magnitude <= 1)
NORM_RTOL = 1e-5


@pytest.fixture(scope="module")
def every_schedule(pool):
    return pool.run(cases.every_schedule_job, P, P, M, STEPS)


def _check(res: dict, what: str) -> None:
    assert res["moved"] > 1e-3, f"{what}: the reference did not train"
    assert res["error"] <= PARAM_ATOL, f"{what}: parameters differ from one process by {res['error']:.3g}"
    assert len(res["norms"]) == STEPS and len(res["ref"]["norms"]) == STEPS
    for got, want in zip(res["norms"], res["ref"]["norms"]):
        assert math.isclose(got, want, rel_tol=NORM_RTOL), f"{what}: global norm {got} != one process {want}"
    for got, want in zip(res["losses"], res["ref"]["losses"]):
        assert math.isclose(got, want, rel_tol=1e-6), f"{what}: loss {got} != one process {want}"


@pytest.mark.parametrize("schedule", pipedsl.builtin_names())
def test_bf16_fp16_and_clipping_equal_one_process(every_schedule, schedule):
    """Each built-in schedule at P=2, bf16 and fp16 with 2-norm and fp32 with inf-norm clipping: losses (rtol 1e-6), norms
    (rtol 1e-5) and parameters (atol 1e-6) equal one process under the same policy, and stand apart from fp32's."""
    for rank, out in enumerate(every_schedule):
        for prec, norm_type in (("bf16", 2.0), ("fp16", 2.0), ("fp32", math.inf)):
            res = out[(schedule, prec, norm_type)]
            _check(res, f"rank {rank} {schedule} {prec} norm {norm_type}")
            if prec != "fp32":  # the low-precision policy really ran: fp32 training ends elsewhere
                assert res["error_vs_fp32"] > 100 * max(res["error"], 1e-8), (prec, res["error_vs_fp32"])
            if prec == "fp16":
                assert res["scales"] == res["ref"]["scales"] == [2.0 ** 16] * STEPS
        # every rank returns the same global norm (the clip coefficient must agree everywhere)
        assert out[(schedule, "bf16", 2.0)]["norms"] == every_schedule[0][(schedule, "bf16", 2.0)]["norms"]


@pytest.mark.parametrize("schedule", ["1f1b", "chimera"])
def test_a_weight_tied_between_stages_counts_once(every_schedule, schedule):
    """Stage 0's and the last stage's `mix.weight` are one parameter: one process's norm counts it once."""
    for rank, out in enumerate(every_schedule):
        _check(out[(schedule, "tied", 2.0)], f"rank {rank} {schedule} tied")


def test_activations_and_gradients_travel_in_the_compute_dtype(every_schedule):
    for out in every_schedule:
        fp32 = out[("bytes", "fp32")]
        assert fp32 > 0 and out[("bytes", "bf16")] * 2 == fp32 and out[("bytes", "fp16")] * 2 == fp32


def test_fp16_overflow_skips_the_step_on_every_rank(pool):
    """A loss scale of 2^20 overflows fp16 at step 1, fits after one backoff, grows back after two clean
    steps (growth_interval 2) and overflows again at step 4: GradScaler's sequence, on both ranks."""
    results = pool.run(cases.overflow_job, P, P, M, 4)
    for res in results:
        assert res["stepped"] == [False, True, True, False], res["stepped"]
        assert res["skipped"] == 2
        assert res["scales"] == res["ref"]["scales"] == [2.0 ** 19, 2.0 ** 19, 2.0 ** 20, 2.0 ** 19]
        assert res["error"] <= PARAM_ATOL and res["moved"] > 1e-3
        assert not math.isfinite(res["norms"][0]) and math.isfinite(res["norms"][1])


def test_checkpoint_resumes_the_loss_scale_and_lr_schedule_bit_exactly(pool, tmp_path):
    """fp16 with a warmup + cosine lr schedule, saved after step 2 and resumed into fresh stages: losses, loss scales,
    lrs, scaler and schedule state of steps 3-4 and the parameters equal the run that never stopped, bit for bit."""
    res = pool.run(cases.resume_job, P, str(tmp_path))
    for out in res:
        straight, resumed = out["straight"], out["resumed"]
        # backoff at step 1, growth at step 3 after two clean steps: step 2's growth counter crosses the checkpoint
        assert straight["scales"][:3] == [2.0 ** 19, 2.0 ** 19, 2.0 ** 20]
        assert resumed["losses"] == straight["losses"][2:]
        assert resumed["scales"] == straight["scales"][2:] and resumed["scaler"] == straight["scaler"]
        assert resumed["lrs"] == straight["lrs"][2:] and resumed["schedule"] == straight["schedule"]
        assert out["same_params"]


def test_lr_schedule_warmup_then_cosine():
    s = LRSchedule("cosine", lr=1.0, warmup=4, total=12, min_lr=0.1)
    assert [s(k) for k in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert math.isclose(s(8), 0.1 + 0.9 * 0.5) and math.isclose(s(12), 0.1) and math.isclose(s(20), 0.1)
    assert LRSchedule("constant", lr=2.0, warmup=2)(5) == 2.0
    with pytest.raises(ValueError, match="warmup < total"):
        LRSchedule("cosine", lr=1.0, warmup=5, total=5)


def test_lr_schedule_linear_and_warmup_stable_decay():
    """linear: from lr after the warmup to min_lr at total; wsd (MiniCPM): lr until the last `decay` steps, then
    linear to min_lr (by default the last tenth of the steps after the warmup decays)."""
    linear = LRSchedule("linear", lr=1.0, warmup=2, total=12, min_lr=0.2)
    assert [linear(k) for k in (1, 2)] == [0.5, 1.0]
    assert math.isclose(linear(7), 0.6) and math.isclose(linear(12), 0.2) and math.isclose(linear(30), 0.2)
    wsd = LRSchedule("wsd", lr=1.0, warmup=2, total=22, min_lr=0.0, decay=4)
    assert [wsd(k) for k in (3, 10, 18)] == [1.0, 1.0, 1.0]
    assert [wsd(k) for k in (19, 20, 21, 22)] == [0.75, 0.5, 0.25, 0.0]
    default = LRSchedule("wsd", lr=1.0, warmup=0, total=100)
    assert default(90) == 1.0 and math.isclose(default(95), 0.5) and default(100) == 0.0
    with pytest.raises(ValueError, match="min_lr must be in"):
        LRSchedule("linear", lr=1.0, total=10, min_lr=2.0)
    with pytest.raises(ValueError, match="decays over at most the 8 steps"):
        LRSchedule("wsd", lr=1.0, warmup=2, total=10, decay=9)


def test_bad_precision_is_one_clear_error():
    with pytest.raises(PipeRuntimeError, match="precision must be one of 'fp32', 'bf16', 'fp16'"):
        policy("half")
    with pytest.raises(PipeRuntimeError, match="growth_factor > 1"):
        MixedPrecision("fp16", growth_factor=1.0)
    assert policy("fp16").scales_loss and not policy("bf16").scales_loss
    assert policy(None).dtype is torch.float32
