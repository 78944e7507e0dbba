"""Global gradient clipping and mixed precision under `parallel=`: dp2 × pp2 with ZeRO 0-3, 1-D and 3-D tp.

dp2 × pp2 trains the convolution stack of tests/precision_cases.py (no other parallel test
has seen it) and compares with one process under the same policy: M·dp microbatches of the
global batch, torch's `clip_grad_norm_`, `torch.amp.GradScaler` for fp16 (whose first step
overflows: every rank of the world skips it, as one process does; the pipeline's scale applies
to each replica's loss, so one process scales its global mean by dp times as much).  ZeRO's slices,
Chimera's stage replicas and ZB-H1's split backward all give the one-process norm and
parameters up to fp32 summation order.  Tensor parallelism trains the small GPT: fp32 with
clipping must equal the dense model's `clip_grad_norm_` (LayerNorms, row-parallel biases and
position tables are whole on every tp rank and counted once); bf16 splits each matmul's sum
over the tp ranks, so it equals the dense bf16 model only to bf16's tolerance.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import precision_cases as cases
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

import pipedsl
from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch
from pipedsl.models.gpt.parallelize import tp_gpt_loss
from pipedsl.parallel import ParallelConfig, ParallelMesh
from pipedsl.runtime.precision import MixedPrecision

pytestmark = pytest.mark.slow

PARAM_ATOL = 1e-6  # fp32 summation order (measured <= 3e-8)
NORM_RTOL = 1e-5
GPT_CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
DP_RUNS = (("1f1b", 0, "bf16"), ("chimera", 1, "fp16"), ("hanayo", 2, "bf16"), ("zb-h1", 3, "fp16"))


def _errors(named: dict[int, dict[str, torch.Tensor]], ref_stages) -> float:
    err = 0.0
    for s, params in named.items():
        want = dict(ref_stages[s].named_parameters())
        for name, v in params.items():
            err = max(err, float((v - want[name].detach()).abs().max()))
    return err


def dp_pp_job(runs: tuple, steps: int) -> dict:
    """dp2 × pp2 on 4 ranks: each (schedule, zero, precision) with clipping, against one process."""
    M, dp = 2, 2
    mesh = ParallelMesh(ParallelConfig(dp=dp, pp=2))
    data = cases.batches(steps, 2 * M * dp)
    out = {}
    for schedule, zero, prec in runs:
        # fp16: a scale that overflows at step 1 (every rank skips it) and fits after one backoff
        policy = MixedPrecision(prec, init_scale=2.0 ** 19) if prec == "fp16" else MixedPrecision(prec)
        prog = pipedsl.load(schedule).compile(P=2, M=M, **cases.SCHEDULE_PARAMS.get(schedule, {}))
        stages = cases.conv_stages(prog.num_stages)
        # the loss scale multiplies each replica's loss (as GradScaler under DDP), 1/dp of one process's global
        # mean: the same fp16 values flow backward when one process scales by dp times as much
        ref_policy = replace(policy, init_scale=policy.init_scale * dp)
        ref = cases.reference(stages, data, M * dp, ref_policy, max_norm=0.5)
        pipe = pipedsl.Pipeline(copy.deepcopy(stages), program=prog, loss_fn=F.cross_entropy, precision=policy,
                                parallel=mesh.with_zero(zero))
        opt = pipe.optimizer(torch.optim.SGD, lr=cases.LR, momentum=cases.MOMENTUM)
        losses, norms, stepped, scales = [], [], [], []
        for x, y in data:
            losses.append(pipe.step(x, y))
            norms.append(float(pipe.clip_grad_norm_(0.5)))
            stepped.append(opt.step())
            opt.zero_grad()
            scales.append(pipe.scaler.scale * dp if pipe.scaler is not None else None)
        out[(schedule, zero, prec)] = {"losses": losses, "norms": norms, "ref": ref["norms"],
                                       "ref_losses": ref["losses"], "stepped": stepped, "scales": scales,
                                       "ref_scales": ref["scales"],
                                       "error": _errors(opt.stage_parameters(), ref["stages"])}
    return out


def _gpt_reference(model: GPT, pp: int, data, M: int, policy: MixedPrecision, max_norm: float) -> dict:
    """The dense model cut into the same pp stages (the same casts at the boundaries), in one process."""
    ref = cases.reference(model.stages(pp), data, M, policy, max_norm, loss_fn=gpt_loss)
    ref["flat"] = torch.cat([p.detach().reshape(-1) for s in ref["stages"] for p in s.parameters()]).double()
    return ref


def tp_job(dp: int, pp: int, tp: int, tp_mode: str, zero: int, M: int, batch: int, precisions: tuple) -> dict:
    """The small GPT on a dp × pp × tp mesh with clipping, against the dense model in one process."""
    mesh = ParallelMesh(ParallelConfig(dp=dp, pp=pp, tp=tp, tp_mode=tp_mode, zero=zero))
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    gen = torch.Generator().manual_seed(1)
    data = [synthetic_batch(batch, GPT_CFG.block_size, GPT_CFG.vocab_size, gen) for _ in range(2)]
    out = {}
    for prec in precisions:
        policy = MixedPrecision(prec)
        ref = _gpt_reference(model, pp, data, M * dp, policy, max_norm=0.5)
        ref32 = _gpt_reference(model, pp, data, M * dp, MixedPrecision(), max_norm=0.5) if prec != "fp32" else ref
        pipe = pipedsl.Pipeline(copy.deepcopy(model).tp_stages(pp, mesh), "1f1b", microbatches=M,
                                loss_fn=tp_gpt_loss(mesh), parallel=mesh, precision=policy)
        opt = pipe.optimizer(torch.optim.SGD, lr=cases.LR, momentum=cases.MOMENTUM)
        norms, losses = [], []
        for x, y in data:
            losses.append(pipe.step(x, y))
            norms.append(float(pipe.clip_grad_norm_(0.5)))
            opt.step()
            opt.zero_grad()
        # the final parameters, in the dense layout, through the index model of test_pipeline_parallel
        from dense_index import gather_dense, index_model
        from test_pipeline_parallel import _flat

        index, n = index_model(model)
        gathered = gather_dense(opt.stage_parameters(), index.tp_stages(pp, mesh), n)
        dense = ref["flat"]
        out[prec] = {"norms": norms, "ref": ref["norms"], "ref32": ref32["norms"], "losses": losses,
                     "ref_losses": ref["losses"], "uncovered": gathered["uncovered"],
                     "error": float((gathered["values"] - dense).abs().max()),
                     "error_vs_fp32": float((gathered["values"] - ref32["flat"]).abs().max()),
                     "moved": float((dense - _flat(model)).abs().max())}
    return out if dist.get_rank() == 0 else {}


@pytest.mark.parametrize("schedule,zero,prec", DP_RUNS)
def test_dp2_pp2_zero_clip_and_precision_equal_one_process(run_once, schedule, zero, prec):
    """dp2 × pp2, clipping at 0.5 under each ZeRO stage with bf16 or fp16: losses (rtol 1e-6), global norms (rtol 1e-5)
    and parameters (atol 1e-6) of 2 SGD steps equal one process under the same policy, torch's `clip_grad_norm_` and
    GradScaler; fp16's overflowed first step is skipped by both."""
    for rank, results in enumerate(run_once(dp_pp_job, 4, DP_RUNS, 2)):
        res = results[(schedule, zero, prec)]
        assert res["error"] <= PARAM_ATOL, f"rank {rank}: parameters differ from one process by {res['error']:.3g}"
        for got, want in zip(res["norms"], res["ref"], strict=True):
            if not math.isfinite(want):  # fp16 overflow: every rank sees it and skips, as GradScaler does
                assert not math.isfinite(got), f"rank {rank}: norm {got}, one process overflowed"
                continue
            assert math.isclose(got, want, rel_tol=NORM_RTOL), f"rank {rank}: global norm {got} != {want}"
        assert max(n for n in res["norms"] if math.isfinite(n)) > 0.5  # the clip was active
        if prec == "fp16":
            assert res["stepped"] == [False, True] and res["scales"] == res["ref_scales"] == [2.0 ** 19] * 2
        for got, want in zip(res["losses"], res["ref_losses"], strict=True):
            assert math.isclose(got, want, rel_tol=1e-6)


def test_tp2_1d_dp2_pp2_zero1(run_once):
    """8 ranks: fp32 clipping equals the dense clip; bf16 equals dense bf16 to bf16's tolerance."""
    res = run_once(tp_job, 8, 2, 2, 2, "1d", 1, 2, 8, ("fp32", "bf16"))[0]
    fp32, bf16 = res["fp32"], res["bf16"]
    assert not fp32["uncovered"] and fp32["moved"] > 1e-3
    for got, want in zip(fp32["norms"], fp32["ref"], strict=True):
        assert math.isclose(got, want, rel_tol=NORM_RTOL), (got, want)
    assert fp32["norms"][0] > 0.5 and fp32["error"] <= PARAM_ATOL, fp32["error"]
    for got, want in zip(bf16["norms"], bf16["ref"], strict=True):
        assert math.isclose(got, want, rel_tol=2e-2), (got, want)  # bf16: 8 bits of mantissa
    assert bf16["error"] <= 0.05 * bf16["moved"], (bf16["error"], bf16["moved"])


def test_tp8_3d_clip_equals_dense(run_once):
    """A q=2 cube (tp=8, 3-D): global norms (rtol 1e-5) and the parameters after 2 clipped SGD steps (atol 1e-6) equal
    the dense model's `clip_grad_norm_` in one process; biases and LayerNorm vectors are copies over q² planes, counted
    once."""
    res = run_once(tp_job, 8, 1, 1, 8, "3d", 0, 2, 8, ("fp32",))[0]["fp32"]
    assert not res["uncovered"] and res["moved"] > 1e-3
    for got, want in zip(res["norms"], res["ref"], strict=True):
        assert math.isclose(got, want, rel_tol=NORM_RTOL), (got, want)
    assert res["error"] <= PARAM_ATOL, res["error"]
