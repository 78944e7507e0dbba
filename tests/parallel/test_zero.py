"""Every ZeRO stage equals plain data parallel: parameters after 3 Adam steps with M = 3 microbatches.

References, from the same initial weights and data: DDP-style training (each rank's microbatch
gradients summed, all-reduced with torch.distributed directly and averaged) and one dense
process on the global batch.  Memory is checked against the ZeRO formulas on the padded sizes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from checks import diff
from torch import nn

from pipedsl.models.gpt import model as gpt
from pipedsl.parallel import (
    ParallelConfig,
    ParallelConfigError,
    ParallelMesh,
    ZeroOptimizer,
    count_comm,
    memory_report,
)

pytestmark = pytest.mark.slow

STEPS, M, MB = 3, 3, 2
LR = 1e-2
# Adam's eps: the attention key bias has an exactly zero gradient (softmax ignores a constant per query), so
# its gradient is float rounding noise of ~1e-9, which Adam with eps=1e-8 would turn into full-size steps
# whose sign depends on summation order; eps=1e-4 keeps the comparison about ZeRO, not about that noise.
EPS = 1e-4
KEEP = "step, reshard=step"  # reduce="step" with ZeRO-3's units kept gathered from their first use to the reduction
MODES = [(0, "step"), (1, "step"), (2, "step"), (3, "step"), (2, "microbatch"), (3, "microbatch"), (3, KEEP)]


def _zero_options(mode: str) -> dict[str, str]:
    reduce, _, reshard = mode.partition(", reshard=")
    return {"reduce": reduce, "reshard": reshard or "unit"}


def mlp_model(g: torch.Generator) -> nn.Module:
    # 1087 parameters: not a multiple of 2 or 4, so every flat buffer is padded
    return gpt.randomize_(nn.Sequential(nn.Linear(10, 24), nn.GELU(), nn.Linear(24, 24), nn.Tanh(),
                                        nn.LayerNorm(24), nn.Linear(24, 7)), g)


def block_model(g: torch.Generator) -> nn.Module:
    return gpt.randomize_(gpt.Block(gpt.GPTConfig(n_embd=8, n_head=2)), g)


MODELS = {
    "mlp": (mlp_model, lambda g, n: torch.randn(STEPS, n, M, MB, 10, generator=g),
            lambda g, n: torch.randn(STEPS, n, M, MB, 7, generator=g)),
    "block": (block_model, lambda g, n: torch.randn(STEPS, n, M, MB, 5, 8, generator=g),
              lambda g, n: torch.randn(STEPS, n, M, MB, 5, 8, generator=g)),
}


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def zero_job(model_name: str) -> dict:
    n = dist.get_world_size()
    mesh = ParallelMesh(ParallelConfig(dp=n))
    group, r = mesh.dp_group, mesh.coords.dp
    make, make_x, make_y = MODELS[model_name]
    g = torch.Generator().manual_seed(0)
    base = make(g)
    X, Y = make_x(g, n), make_y(g, n)  # the same global data on every rank; rank r trains on [:, r]
    initial = {k: v.detach().clone() for k, v in base.named_parameters()}

    # DDP-style reference: local accumulation, all-reduce, average
    ddp = copy.deepcopy(base)
    opt = torch.optim.Adam(ddp.parameters(), lr=LR, eps=EPS)
    for s in range(STEPS):
        for m in range(M):
            (loss_fn(ddp, X[s, r, m], Y[s, r, m]) / M).backward()
        for p in ddp.parameters():
            dist.all_reduce(p.grad, group=group)
            p.grad /= n
        opt.step()
        opt.zero_grad()
    # one dense process on the global batch
    dense = copy.deepcopy(base)
    opt = torch.optim.Adam(dense.parameters(), lr=LR, eps=EPS)
    for s in range(STEPS):
        sum(loss_fn(dense, X[s, q, m], Y[s, q, m]) for q in range(n) for m in range(M)).div(n * M).backward()
        opt.step()
        opt.zero_grad()

    out: dict = {"errors": {}, "memory": {}, "comm": {}, "between": {}, "moved": float(max((dict(ddp.named_parameters())[k].detach() - v).abs().max()
                                                                 for k, v in initial.items()))}
    for stage, reduce in MODES:
        model = copy.deepcopy(base)
        zero = ZeroOptimizer(model, torch.optim.Adam, group=group, stage=stage, **_zero_options(reduce), lr=LR,
                             eps=EPS)
        for s in range(STEPS):
            last = s == STEPS - 1
            if last:
                zero.reset_peak()
            with count_comm() as c:
                for m in range(M):
                    loss = loss_fn(model, X[s, r, m], Y[s, r, m]) / M
                    if last and m == 0:
                        out["between"][(stage, reduce)] = zero.memory().params  # after forward, before backward
                    loss.backward()
                zero.reduce_gradients()
            if last:
                out["comm"][(stage, reduce)] = (dict(c.calls), c.by_op())
                out["memory"][(stage, reduce)] = memory_report(zero)
                out["units"] = out.get("units", {}) | {(stage, reduce): [u.padded for u in zero.units]}
            zero.step()
            zero.zero_grad()
        after = zero.memory()
        out["memory"][(stage, reduce, "after step")] = after
        got = zero.state_dict_full()
        for name, p in ddp.named_parameters():
            out["errors"][f"{stage} {reduce}: vs ddp {name}"] = diff(got[name], p)
        for name, p in dense.named_parameters():
            out["errors"][f"{stage} {reduce}: vs dense {name}"] = diff(got[name], p)
    return out


@pytest.fixture(scope="module", params=[(2, "mlp"), (4, "mlp"), (2, "block")], ids=lambda p: f"dp{p[0]}-{p[1]}")
def job(request, run_once):
    n, model = request.param
    return n, run_once(zero_job, n, model)


@pytest.mark.parametrize("stage,reduce", MODES)
def test_zero_equals_data_parallel(job, stage, reduce):
    """Each ZeRO stage and reduce mode: every parameter after 3 Adam steps of 3 microbatches equals DDP-style data
    parallel (gradients all-reduced and averaged) and one dense process on the global batch (2e-6 + 2e-6 of the max)."""
    n, per_rank = job
    bad = []
    for rank, res in enumerate(per_rank):
        assert res["moved"] > 1e-2, "training did not move the parameters: the comparison would be vacuous"
        names = [k for k in res["errors"] if k.startswith(f"{stage} {reduce}:")]
        assert len(names) >= 8
        for k in names:
            err, mag = res["errors"][k]
            if not err <= 2e-6 + 2e-6 * mag:
                bad.append(f"rank {rank} {k}: {err:.3g} (magnitude {mag:.3g})")
    assert not bad


@pytest.mark.parametrize("stage,reduce", MODES)
def test_memory_matches_the_zero_formulas(job, stage, reduce):
    """fp32 Adam on the padded flat buffers: p = g = 4 bytes, K = 8 bytes per parameter (+4 per unit's step count)."""
    n, per_rank = job
    for res in per_rank:
        mem = res["memory"][(stage, reduce)]
        units = res["units"][(stage, reduce)]
        P = mem.padded_numel
        assert P == sum(units) and all(u % n == 0 for u in units) and P >= mem.numel
        params = 4 * P if stage < 3 else 4 * P // n
        grads = 4 * P if stage < 2 else 4 * P // n
        optim = (8 * P if stage == 0 else 8 * P // n) + 4 * len(units)
        assert (mem.params, mem.grads, mem.optimizer) == (params, grads, optim)
        if stage >= 2 and reduce != "microbatch":  # the full gradient lives until REDUCE_GRAD
            assert mem.peak_grads == 4 * P + 4 * P // n
        if reduce == "microbatch":  # one unit's full gradient at a time
            assert mem.peak_grads <= 4 * P // n + 4 * max(units)
            if len(units) > 1:  # less than reduce="step", which holds every unit's full gradient at once
                assert mem.peak_grads < 4 * P + 4 * P // n
        after = res["memory"][(stage, reduce, "after step")]
        assert after.params == params, "stage 3 must hold only its slice between steps"


def test_stage3_gathers_each_unit_for_forward_and_backward_and_releases_it(job):
    """Per microbatch every unit is all-gathered twice (forward, backward); between them only slices are held."""
    n, per_rank = job
    for res in per_rank:
        for reduce in ("step", "microbatch"):
            units = res["units"][(3, reduce)]
            P = sum(units)
            calls, by_op = res["comm"][(3, reduce)]
            gathers = sum(k for (op, _), k in calls.items() if op == "all_gather")
            assert gathers == 2 * M * len(units)
            assert by_op["all_gather"] == 2 * M * (n - 1) * 4 * P // n
            scatters = sum(k for (op, _), k in calls.items() if op == "reduce_scatter")
            assert scatters == (M if reduce == "microbatch" else 1) * len(units)
            assert res["between"][(3, reduce)] == 4 * P // n
        # reshard="step": each unit gathered once a step and held whole until the reduction frees it
        units = res["units"][(3, KEEP)]
        calls, by_op = res["comm"][(3, KEEP)]
        assert sum(k for (op, _), k in calls.items() if op == "all_gather") == len(units)
        assert by_op["all_gather"] == (n - 1) * 4 * sum(units) // n
        assert res["between"][(3, KEEP)] == 4 * sum(units) + 4 * sum(units) // n  # the whole buffers and the slices
        for stage in (1, 2):  # the data-parallel volume: one reduce-scatter of the gradients per step
            calls, by_op = res["comm"][(stage, "step")]
            assert by_op == {"reduce_scatter": (n - 1) * 4 * sum(res["units"][(stage, "step")]) // n}


def _train_zero(model: nn.Module, group, stage: int, X: torch.Tensor, Y: torch.Tensor) -> dict[str, torch.Tensor]:
    """STEPS Adam steps of M accumulated microbatches (X[s, m]) under ZeRO `stage`; the dense parameters after."""
    zero = ZeroOptimizer(model, torch.optim.Adam, group=group, stage=stage, lr=LR, eps=EPS)
    for s in range(STEPS):
        for m in range(M):
            (loss_fn(model, X[s, m], Y[s, m]) / M).backward()
        zero.reduce_gradients()
        zero.step()
        zero.zero_grad()
    return zero.state_dict_full()


def _train_fsdp2(model: nn.Module, mesh: ParallelMesh, X: torch.Tensor, Y: torch.Tensor) -> dict:
    """torch's FSDP2 (`fully_shard` per child with parameters, then the root, over the mesh's dp dimension):
    STEPS Adam steps of M microbatches accumulated locally and reduced with the last; the whole parameters after."""
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh.device_mesh["dp"])
    fully_shard(model, mesh=mesh.device_mesh["dp"])
    opt = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
    for s in range(STEPS):
        for m in range(M):
            model.set_requires_gradient_sync(m == M - 1)
            (loss_fn(model, X[s, m], Y[s, m]) / M).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def fsdp2_job(model_name: str) -> dict:
    """torch's FSDP2 (`fully_shard` per child and the root) as a second oracle for stage 3, same data and steps."""
    n = dist.get_world_size()
    mesh = ParallelMesh(ParallelConfig(dp=n))
    r = mesh.coords.dp
    make, make_x, make_y = MODELS[model_name]
    g = torch.Generator().manual_seed(0)
    base = make(g)
    X, Y = make_x(g, n), make_y(g, n)
    ref = _train_fsdp2(copy.deepcopy(base), mesh, X[:, r], Y[:, r])
    model = copy.deepcopy(base)
    got = _train_zero(model, mesh.dp_group, 3, X[:, r], Y[:, r])
    return {name: diff(got[name], ref[name]) for name in got}


@pytest.mark.parametrize("n,model", [(2, "mlp"), (2, "block")])
def test_stage3_equals_torch_fsdp2(run_once, n, model):
    """ZeRO-3's parameters after 3 Adam steps of 3 accumulated microbatches equal torch FSDP2's (`fully_shard` per child
    and the root) on the same data (2e-6 + 2e-6 of the max)."""
    for errs in run_once(fsdp2_job, n, model):
        assert len(errs) >= 6
        bad = {k: v for k, v in errs.items() if not v[0] <= 2e-6 + 2e-6 * v[1]}
        assert not bad


def test_zero_rejects_bad_settings():
    model = nn.Linear(2, 2)
    with pytest.raises(ParallelConfigError, match="ZeRO stage must be 0, 1, 2 or 3, got 4"):
        ZeroOptimizer(model, torch.optim.Adam, group=None, stage=4)
    with pytest.raises(ParallelConfigError, match="reduce must be one of 'step', 'microbatch', got 'never'"):
        ZeroOptimizer(model, torch.optim.Adam, group=None, stage=2, reduce="never")
    with pytest.raises(ParallelConfigError, match="only helps stages 2 and 3"):
        ZeroOptimizer(model, torch.optim.Adam, group=None, stage=1, reduce="microbatch")


def released_job() -> dict:
    """A ZeroOptimizer dropped with its module, after a backward: both are freed (its hooks hold them weakly;
    torch keeps a parameter's post-accumulate hooks out of the garbage collector's sight), while one still held
    keeps its parameters from a second ZeroOptimizer."""
    import gc
    import weakref

    group = ParallelMesh(ParallelConfig(dp=dist.get_world_size())).dp_group

    def build() -> tuple:
        model = mlp_model(torch.Generator().manual_seed(0))
        zero = ZeroOptimizer(model, torch.optim.Adam, group=group, stage=3, lr=LR)
        loss_fn(model, torch.randn(2, 10), torch.randn(2, 7)).backward()
        return weakref.ref(zero), weakref.ref(zero.units[0].flat), model, zero

    zero_ref, flat_ref = build()[:2]
    gc.collect()
    _, _, kept_model, kept_zero = build()
    try:
        ZeroOptimizer(kept_model, torch.optim.Adam, group=group, stage=3, lr=LR)
        second = "accepted"
    except ParallelConfigError as err:
        second = err.message
    return {"freed": zero_ref() is None and flat_ref() is None, "second": second}


def test_a_dropped_zero_optimizer_frees_its_buffers(run_once):
    for out in run_once(released_job, 2):
        assert out["freed"] and "is held by another ZeroOptimizer already" in out["second"], out


def dp_tp_job(stage: int) -> dict:
    """dp=2 × tp=2: a 1-D tensor-parallel block under ZeRO over the dp group trains like the dense block."""
    from pipedsl.parallel import ParallelBlock

    mesh = ParallelMesh(ParallelConfig(dp=2, tp=2, zero=stage))
    d = mesh.coords.dp
    g = torch.Generator().manual_seed(0)
    base = block_model(g)
    X, Y = MODELS["block"][1](g, 2), MODELS["block"][2](g, 2)
    dense = copy.deepcopy(base)
    opt = torch.optim.Adam(dense.parameters(), lr=LR, eps=EPS)
    for s in range(STEPS):
        sum(loss_fn(dense, X[s, q, m], Y[s, q, m]) for q in range(2) for m in range(M)).div(2 * M).backward()
        opt.step()
        opt.zero_grad()
    model = ParallelBlock.from_dense(copy.deepcopy(base), mesh.tp_group)
    got = _train_zero(model, mesh.dp_group, stage, X[:, d], Y[:, d])
    want = dict(ParallelBlock.from_dense(dense, mesh.tp_group).named_parameters())
    return {name: diff(got[name], want[name]) for name in got}


@pytest.mark.parametrize("stage", [1, 3])
def test_tensor_parallel_block_under_zero_equals_dense(run_once, stage):
    """dp2 × tp2: a 1-D tensor-parallel block under ZeRO-1 and 3 over dp ends 3 Adam steps equal to the dense block
    trained in one process on the global batch, sliced the same way (2e-6 + 2e-6 of the max)."""
    for errs in run_once(dp_tp_job, 4, stage):
        assert len(errs) == 12
        bad = {k: v for k, v in errs.items() if not v[0] <= 2e-6 + 2e-6 * v[1]}
        assert not bad


def fsdp2_tp_job(stage: int) -> dict:
    """dp=2 × tp=2 with torch's DTensor tensor parallelism (`parallelize_module`, as parallel/tp_hf.py uses it):
    ZeRO `stage` over the dp group, which packs each DTensor parameter's local shard, against torch's FSDP2
    `fully_shard` on the same 2-D mesh (torchtitan's FSDP + TP); rowwise biases are replicated DTensors."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = ParallelMesh(ParallelConfig(dp=2, tp=2))
    r = mesh.coords.dp
    g = torch.Generator().manual_seed(0)
    # 535 local parameters a tp rank: the flat buffers are padded
    base = gpt.randomize_(nn.Sequential(nn.Linear(10, 24), nn.GELU(), nn.Linear(24, 12), nn.Tanh(),
                                        nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 7)), g)
    X, Y = MODELS["mlp"][1](g, 2), MODELS["mlp"][2](g, 2)
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(), "6": RowwiseParallel()}
    tp = mesh.device_mesh["tp"]
    ref = _train_fsdp2(parallelize_module(copy.deepcopy(base), tp, plan), mesh, X[:, r], Y[:, r])
    model = parallelize_module(copy.deepcopy(base), tp, plan)
    got = _train_zero(model, mesh.dp_group, stage, X[:, r], Y[:, r])
    assert all(isinstance(v, DTensor) for v in got.values())  # named as the module's, placed as the module's
    return {name: diff(got[name].full_tensor(), ref[name]) for name in got}


@pytest.mark.parametrize("stage", [1, 3])
def test_dtensor_tensor_parallel_under_zero_equals_torch_fsdp2(run_once, stage):
    """dp2 × tp2 with torch's DTensor tensor parallelism: ZeRO-1 and 3 over dp end 3 Adam steps equal to torch FSDP2's
    `fully_shard` on the same 2-D mesh, compared as whole tensors (2e-6 + 2e-6 of the max)."""
    for errs in run_once(fsdp2_tp_job, 4, stage):
        assert len(errs) == 8
        bad = {k: v for k, v in errs.items() if not v[0] <= 2e-6 + 2e-6 * v[1]}
        assert not bad, bad


def reduce_scatter_job() -> dict:
    """`reduce_scatter_into` with `overwrite` (gloo: an in-place all-reduce, then this rank's slice) against gloo's own
    reduce-scatter and a sum computed here from every rank's tensor, sync and async."""
    from pipedsl.parallel.comm import reduce_scatter_into

    n, rank = dist.get_world_size(), dist.get_rank()
    tensors = [torch.randn(n * 1000, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    want = torch.stack(tensors).sum(0).view(n, -1)[rank]
    native = torch.empty(1000)
    reduce_scatter_into(native, tensors[rank].clone(), None)
    out, mine = {}, {}
    for mode in ("sync", "async"):
        out[mode], given = torch.empty(1000), tensors[rank].clone()
        work = reduce_scatter_into(out[mode], given, None, async_op=mode == "async", overwrite=True)
        if work is not None:
            work.wait()
        mine[mode] = diff(out[mode], want)
    return {"native": diff(native, want), **mine, "same": all(torch.equal(o, native) for o in out.values())}


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_of_a_given_up_buffer_equals_the_collective(run_once, world):
    """The overwrite path (gloo: an in-place all-reduce, then this rank's slice), sync and async, and gloo's own
    reduce-scatter equal this rank's slice of the sum computed here (1e-5); at 2 ranks the overwrite path equals
    gloo's bit for bit."""
    for out in run_once(reduce_scatter_job, world):
        assert max(out["native"][0], out["sync"][0], out["async"][0]) < 1e-5, out
        if world == 2:  # a + b either way
            assert out["same"], out
