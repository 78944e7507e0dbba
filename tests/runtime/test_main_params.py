"""bf16/fp16 parameters with fp32 main parameters: every schedule, dp2 × pp2 under ZeRO 0-3, fp16 loss scaling,
the bytes of every piece of training state against the formula, and checkpoints across precision modes
(main_params_cases.py).

Tolerances: with no data parallelism and grads="fp32" the pipeline adds the same low-precision gradients into
the same fp32 accumulators as one process, so it is equal up to fp32 rounding (the order a schedule runs the
microbatches' backwards in; the global norm summed in float64 across ranks): 1e-10 on the main parameters.
With grads="bf16" (the ZeRO paper's policy) the accumulation itself rounds to bf16, and schedules order the
backwards differently (looped BFS, stage replicas): a unit or two in the last place of bf16.  Under dp the fp32
sums run in another order (replica sums, then the dp average): the fp32 main parameters agree to fp32 rounding,
the bf16 model to one unit in the last place where a value lands on a rounding boundary.
"""

from __future__ import annotations

import math

import main_params_cases as cases
import pytest

import pipedsl
from pipedsl.errors import PipeRuntimeError
from pipedsl.runtime.precision import MixedPrecision

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def every_schedule(pool):
    return pool.run(cases.every_schedule_job, 2)


def _close(got: list[float], want: list[float], rel: float) -> bool:
    return len(got) == len(want) and all(math.isclose(a, b, rel_tol=rel, abs_tol=1e-12) for a, b in zip(got, want))


@pytest.mark.parametrize("schedule", pipedsl.builtin_names())
def test_every_schedule_equals_one_process_with_main_parameters(every_schedule, schedule):
    """bf16 parameters over fp32 main ones, P=2, 3 clipped SGD steps: losses, norms and main parameters equal one
    process under the same policy (grads="fp32": main within 1e-7, first loss bitwise; grads="bf16": 5e-4, 2 ulps)."""
    for rank, out in enumerate(every_schedule):
        for grads in ("fp32", "bf16"):
            res = out[(schedule, grads)]
            what = f"rank {rank} {schedule} grads={grads}"
            assert res["dtypes"] == ["torch.bfloat16"], what
            if grads == "bf16":  # a bf16 sum depends on its order: schedules order the microbatches' backwards
                assert res["ulps"] <= 2.0 and res["main_err"] <= 5e-4, (what, res["ulps"], res["main_err"])
                assert _close(res["losses"], res["ref_losses"], 1e-3), what
            else:
                assert res["ulps"] <= 1.0 and res["main_err"] <= 1e-7, (what, res["ulps"], res["main_err"])
                assert res["losses"][0] == res["ref_losses"][0], what  # the first step is bitwise
                assert _close(res["losses"], res["ref_losses"], 1e-5) and _close(res["norms"], res["ref_norms"],
                                                                                  1e-6), what
            assert res["stepped"] == [True] * 3
            # low precision really ran (else the checks above would be vacuous); note that grads="fp32" computes
            # what autocast over fp32 weights computes, as Megatron's bf16 mode does: autocast casts the same weights
            if grads == "fp32":
                assert not _close(res["losses"], res["fp32_losses"], 1e-6), what


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_fp16_parameters_with_loss_scaling_equal_one_process(every_schedule, schedule):
    """fp16 parameters over fp32 main ones, loss scale 2^16 (1F1B, ZB-H1): main parameters (1e-7, the model's within
    one ulp) and losses (rtol 1e-5) of 3 steps equal one process under the same policy; no step is skipped."""
    for rank, out in enumerate(every_schedule):
        res = out[(schedule, "fp16")]
        assert res["dtypes"] == ["torch.float16"]
        assert res["ulps"] <= 1.0 and res["main_err"] <= 1e-7, (rank, res["ulps"], res["main_err"])
        assert _close(res["losses"], res["ref_losses"], 1e-5) and res["scale"] == 2.0 ** 16 and res["stepped"] == [True] * 3


# every ZeRO stage; split backward (ZB-H1), two stages a rank (interleaved), stage replicas (Chimera); both
# gradient dtypes (tensor parallelism with ZeRO-3: the next test)
ZERO_RUNS = [(0, "1f1b", "fp32"), (1, "interleaved", "bf16"), (2, "chimera", "fp32"), (3, "zb-h1", "fp32")]


@pytest.mark.parametrize("zero,schedule,grads", ZERO_RUNS)
def test_dp2_pp2_zero_equals_one_process(pool, zero, schedule, grads):
    """dp2 × pp2, bf16 parameters over fp32 main ones, ZeRO 0-3: losses and norms (rtol 1e-4; grads="bf16" 2e-3) and
    main parameters (2e-6; 5e-4) of 3 clipped steps equal one process on the global batch; every rank clips alike."""
    results = pool.run(cases.zero_job, 4, zero, schedule, grads)
    for rank, res in enumerate(results):
        what = f"rank {rank} zero={zero} {schedule} grads={grads}"
        assert res["dtypes"] == ["torch.bfloat16"], what
        tol, ulps = (2e-6, 1.0) if grads == "fp32" else (5e-4, 2.0)  # bf16 sums round in their own order
        assert res["main_err"] <= tol and res["ulps"] <= ulps, (what, res["main_err"], res["ulps"])
        rel = 1e-4 if grads == "fp32" else 2e-3
        assert _close(res["losses"], res["ref_losses"], rel), (what, res["losses"], res["ref_losses"])
        assert _close(res["norms"], res["ref_norms"], rel), what
        assert res["norms"] == results[0]["norms"], "every rank must clip by the same norm"


def test_tensor_parallel_gpt_with_main_parameters_equals_one_process(pool):
    """1-D tensor parallelism at dp2 × pp2 × tp2 under ZeRO-3, and 3-D at tp8: tensor-parallel matmuls round
    their partial sums in bf16 in another order than the dense one, so the losses agree to bf16's precision;
    the fp32 run of the same layout agrees to fp32's (what the tolerance would not tell apart otherwise)."""
    for out in pool.run(cases.tp_jobs, 8, (("1d", 3), ("3d", 0))):
        for layout, res in out.items():
            assert _close(res["fp32"]["losses"], res["fp32"]["ref_losses"], 2e-6), (layout, res["fp32"])
            assert _close(res["bf16"]["losses"], res["bf16"]["ref_losses"], 1e-2), (layout, res["bf16"])
            assert not _close(res["bf16"]["losses"], res["fp32"]["losses"], 1e-4), (layout, "bf16 did not run")


def test_measured_bytes_equal_the_formula_for_every_mode_and_zero_stage(pool):
    """The bytes of every parameter, gradient, main-parameter and optimizer-state tensor on each rank equal
    `pipedsl.plan.memory.model_states` — the planner's function — plus Adam's one fp32 step counter a tensor."""
    results = pool.run(cases.bytes_job, 4)
    for rank, out in enumerate(results):
        for (mode, zero), got in out.items():
            assert (got["params"], got["grads"], got["optimizer"]) == got["want"], (rank, mode, zero, got)
    per_param = {key: sum(got["want"][:2]) / got["padded"] for key, got in results[0].items()}
    assert per_param[("megatron", 0)] == 6 and per_param[("zero-paper", 0)] == 4 and per_param[("autocast", 0)] == 8


def test_checkpoints_move_between_precision_modes_and_zero_stages(pool, tmp_path):
    """Resuming a main-parameter run under the same layout is bit-exact; under ZeRO-3 (resharded) and in
    autocast mode (fp32 weights read from the fp32 main parameters) it continues from the same values; an
    autocast checkpoint starts a main-parameter run from its fp32 weights."""
    results = pool.run(cases.checkpoint_job, 4, str(tmp_path))
    for res in results:
        straight = res["straight"]
        assert res["same"]["losses"] == {k: v for k, v in straight["losses"].items() if k > 2}
        for s, named in res["same"]["main"].items():
            for k, v in named.items():
                assert v.equal(straight["main"][s][k]), (res["rank"], s, k)
        assert _close(list(res["zero3"]["losses"].values()), [straight["losses"][k] for k in (3, 4)], 1e-5)
        assert res["as_autocast"]["losses"][3] == pytest.approx(straight["losses"][3], rel=2e-2)
        assert all(math.isfinite(v) for v in res["from_autocast"]["losses"].values())


def test_a_model_loaded_in_bf16_still_gets_fp32_main_parameters(every_schedule):
    for out in every_schedule:
        res = out[("1f1b", "bf16-module")]
        assert res["main_dtypes"] == ["torch.float32"] and res["dtypes"] == ["torch.bfloat16"]
        assert res["ulps"] <= 1.0 and res["main_err"] <= 1e-7, (res["ulps"], res["main_err"])


def test_weights_only_checkpoints_and_per_tensor_optimizers_are_refused(pool, tmp_path):
    for res in pool.run(cases.refusals_job, 2, str(tmp_path)):
        assert "params='bf16' (fp32 main parameters): the stages' parameters live in the optimizer's flat buffers; " \
               "pass the optimizer pipe.optimizer(...) returned (got none)" in res["weights_only"]
        assert "Adafactor computes per-tensor statistics" in res["adafactor"]


def test_main_parameters_need_the_optimizer_first_and_a_valid_policy():
    with pytest.raises(PipeRuntimeError, match="held in fp32 .autocast. or in the compute dtype"):
        MixedPrecision("bf16", params="fp16")
    with pytest.raises(PipeRuntimeError, match="gradients accumulate in fp32 or"):
        MixedPrecision("bf16", params="fp32", grads="bf16")
