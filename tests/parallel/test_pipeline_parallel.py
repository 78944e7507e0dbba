"""`pipedsl.Pipeline(…, parallel=…)`: data × pipeline × tensor parallelism trains exactly like one process.

Every job builds the runtime's small GPT from one seed on every rank, trains it for a few Adam
steps with a parallel pipeline, and beside it trains the same dense model in one process on the
whole global batch (the reference).  Checked: the loss of every step, and the final parameters —
every rank's tensor-parallel / ZeRO shards unpacked and put back into the dense layout through
an *index model* (the dense model with each parameter holding its element numbers, sliced by the
same `from_dense` code), summed over the world and compared element by element with the dense
reference; every dense element must be covered, and the copies of replicated elements agree.

Adam's eps is 1e-4, as in test_zero.py: the attention key bias has an exactly-zero gradient, so
its gradient is float rounding noise that Adam with eps=1e-8 would turn into full-size steps of
either sign.
"""

from __future__ import annotations

import copy
import importlib.util
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dense_index import gather_dense, index_model

import pipedsl
from pipedsl.errors import PipeRuntimeError
from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch
from pipedsl.models.gpt.parallelize import tp_gpt_loss
from pipedsl.parallel import ParallelConfig, ParallelConfigError, ParallelMesh

pytestmark = pytest.mark.slow

GPT_CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
LR, EPS = 1e-2, 1e-4
LOSS_RTOL = 2e-6  # fp32: different summation orders only
PARAM_ATOL = 2e-6  # after 3 Adam steps of lr 1e-2 (parameters are O(0.1))
SCHEDULE_PARAMS = {"hanayo": {"W": 1}}


# ----------------------------------------------------------------------------------- worker side


def _batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [synthetic_batch(batch, GPT_CFG.block_size, GPT_CFG.vocab_size, gen) for _ in range(steps)]


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()


def _dense_reference(model: GPT, batches) -> tuple[list[float], torch.Tensor]:
    """One process, the whole global batch per step: losses and the final parameters (flat, named order)."""
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(ref.parameters(), lr=LR, eps=EPS)
    losses = []
    for x, y in batches:
        loss = gpt_loss(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, _flat(ref)


def _train(mesh: ParallelMesh, model: GPT, schedule: str, M: int, zero_cfg: ParallelConfig, batches, tp_layers: bool,
           batch_mode: str = "global") -> dict:
    params = SCHEDULE_PARAMS.get(schedule, {})
    program = pipedsl.load(schedule).compile(P=mesh.config.pp, M=M, **params)
    S = program.num_stages
    work = copy.deepcopy(model)
    if tp_layers:
        stages, loss_fn = work.tp_stages(S, mesh), tp_gpt_loss(mesh)
    else:
        stages, loss_fn = work.stages(S), gpt_loss
    run_mesh = mesh.with_zero(zero_cfg.zero, zero_cfg.zero_reduce, zero_cfg.zero_reshard)
    pipe = pipedsl.Pipeline(stages, program=program, loss_fn=loss_fn, parallel=run_mesh, batch=batch_mode)
    rows = []  # samples per microbatch entering stage 0 here: the dp split happened
    if 0 in pipe.local_stages():
        pipe.local_stages()[0].register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    opt = pipe.optimizer(torch.optim.Adam, lr=LR, eps=EPS)
    losses, seconds = [], []
    for x, y in batches:
        if batch_mode == "local":
            d, n = mesh.coords.dp, x.shape[0] // mesh.config.dp
            x, y = x[d * n:(d + 1) * n], y[d * n:(d + 1) * n]
        t0 = time.perf_counter()
        losses.append(pipe.step(x, y))
        opt.step()
        opt.zero_grad()
        seconds.append(time.perf_counter() - t0)
    index, n = index_model(model)
    index_stages = index.tp_stages(S, mesh) if tp_layers else index.stages(S)
    gathered = gather_dense(opt.stage_parameters(), index_stages, n)
    # per local stage: ZeRO's largest gradient bytes held at once, and the 'microbatch' bound for it: this
    # rank's [S] slices plus one unit's full gradient (fp32)
    peak = {s: (m.peak_grads, 4 * sum(u.size for u in opt.zero[s].units) + 4 * max(u.padded for u in opt.zero[s].units),
                len(opt.zero[s].units)) for s, m in opt.memory().items()}
    return {"losses": losses, "seconds": seconds, "rows": sorted(set(rows)), "peak_grads": peak, **gathered}


def _compare(res: dict, ref_losses: list[float], ref_params: torch.Tensor) -> list[str]:
    bad = []
    for step, (got, want) in enumerate(zip(res["losses"], ref_losses)):
        if not abs(got - want) <= LOSS_RTOL * abs(want):
            bad.append(f"step {step}: loss {got!r} != one process {want!r}")
    if res["uncovered"]:
        bad.append(f"{res['uncovered']} dense parameter elements held by no rank")
    err = float((res["values"] - ref_params).abs().max())
    if not err <= PARAM_ATOL:
        bad.append(f"final parameters: max |parallel - one process| = {err:.3g}")
    if not res["spread"] <= PARAM_ATOL:
        bad.append(f"copies of a replicated parameter differ by {res['spread']:.3g}")
    return bad


def grid_job(dp: int, pp: int, tp: int, tp_mode: str, runs: tuple, steps: int, tp_layers: bool = True) -> dict:
    """Each run (schedule, M, batch, zero, mode) on one mesh, `mode` a zero_reduce or "reshard=unit" (ZeRO-3 freeing
    each unit after every use; the default at pp > 1 keeps them gathered through the step); on rank 0: {run: problems, seconds}."""
    base = ParallelConfig(dp=dp, pp=pp, tp=tp, tp_mode=tp_mode)
    mesh = ParallelMesh(base)
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    out = {}
    references: dict[int, tuple[list[float], torch.Tensor]] = {}  # by global batch: the same batches, the same run
    for schedule, M, batch, zero, reduce in runs:
        batches = _batches(steps, batch)
        zero_mode = {"zero_reshard": "unit"} if reduce == "reshard=unit" else {"zero_reduce": reduce}
        cfg = ParallelConfig(dp=dp, pp=pp, tp=tp, tp_mode=tp_mode, zero=zero, **zero_mode)
        res = _train(mesh, model, schedule, M, cfg, batches, tp_layers)
        if dist.get_rank() != 0:  # rank 0 compares (res gathers every rank's parameters) and reports
            continue
        if batch not in references:
            references[batch] = _dense_reference(model, batches)
        ref_losses, ref_params = references[batch]
        problems = _compare(res, ref_losses, ref_params)
        if res["rows"] and res["rows"] != [batch // (dp * M)]:
            problems.append(f"stage 0 ran microbatches of {res['rows']} samples, not batch/(dp*M) = {batch // (dp * M)}")
        out[(schedule, zero, reduce)] = {"problems": problems, "seconds": res["seconds"], "losses": res["losses"],
                                         "ref": ref_losses, "moved": float((ref_params - _flat(model)).abs().max()),
                                         "peak_grads": res["peak_grads"],
                                         "error": float((res["values"] - ref_params).abs().max())}
    return out if dist.get_rank() == 0 else {}


def buckets_job(user_optimizer: bool) -> dict:
    """dp2 × pp2 without ZeRO, 1F1B: losses and final parameters against one process; every gradient a view of
    the dp reduction's one bucket per rank (no flat copy of the gradients kept), with pipe.optimizer (gradients
    zeroed in place) or a user's Adam whose zero_grad() sets them to None (rebound at each reduction)."""
    from pipedsl.runtime.reduce import DataParallelReducer

    mesh = ParallelMesh(ParallelConfig(dp=2, pp=2))
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    batches = _batches(3, 8)
    ref_losses, ref_params = _dense_reference(model, batches)
    pipe = pipedsl.Pipeline(copy.deepcopy(model).stages(2), program=pipedsl.load("1f1b").compile(P=2, M=2),
                            loss_fn=gpt_loss, parallel=mesh)
    opt = (torch.optim.Adam(pipe.parameters(), lr=LR, eps=EPS) if user_optimizer else
           pipe.optimizer(torch.optim.Adam, lr=LR, eps=EPS))
    losses, storages = [], set()
    for x, y in batches:
        losses.append(pipe.step(x, y))
        storages |= {p.grad.untyped_storage().data_ptr() for p in pipe.parameters()}
        opt.step()
        opt.zero_grad()
    [reducer] = [h for h in pipe.reducer.hooks if isinstance(h, DataParallelReducer)]
    index, n = index_model(model)
    values = {s: dict(m.named_parameters()) for s, m in pipe.local_stages().items()}
    res = {"losses": losses, **gather_dense(values, index.stages(2), n)}
    pipe.close()
    return {"problems": _compare(res, ref_losses, ref_params), "storages": len(storages),
            "copies": sum(len(v) for v in reducer._flat.values())}


def _message(fn) -> str:
    try:
        fn()
    except (PipeRuntimeError, ParallelConfigError) as err:
        return err.message
    return "no error"


def api_job() -> dict:
    """dp=2 × pp=2 on 4 ranks: the mistakes every rank makes alike are clear errors; batch='local' trains alike."""
    mesh = ParallelMesh(ParallelConfig(dp=2, pp=2, zero=1))
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    x, y = _batches(1, 16)[0]
    out = {}

    def pipe(schedule="1f1b", M=4, parallel=mesh, **kw):
        prog = pipedsl.load(schedule).compile(P=2, M=M, **SCHEDULE_PARAMS.get(schedule, {}))
        return pipedsl.Pipeline(copy.deepcopy(model).stages(prog.num_stages), program=prog, loss_fn=gpt_loss,
                                parallel=parallel, **kw)

    out["world"] = _message(lambda: pipe(parallel=ParallelConfig(dp=2, pp=2, tp=2)))
    out["P != pp"] = _message(lambda: pipedsl.Pipeline(copy.deepcopy(model).stages(4), "1f1b", loss_fn=gpt_loss,
                                                       program=pipedsl.load("1f1b").compile(P=4, M=4),
                                                       parallel=mesh))
    out["group and parallel"] = _message(lambda: pipe(group=mesh.pp_group))
    out["microbatch replicas"] = _message(lambda: pipe("chimera", parallel=mesh.with_zero(2, "microbatch")))
    p = pipe()
    out["no optimizer"] = _message(lambda: p.step(x, y))
    opt = p.optimizer(torch.optim.Adam, lr=LR, eps=EPS)
    out["second optimizer"] = _message(lambda: p.optimizer(torch.optim.Adam))
    out["batch"] = _message(lambda: p.step(x[:12], y[:12]))
    d = mesh.coords.dp
    out["different batches"] = _message(lambda: p.step(x[8 * d:8 * d + 8].repeat(2, 1), y[8 * d:8 * d + 8].repeat(2, 1)))
    out["global loss"] = p.step(x, y)  # still usable after refused batches
    opt.step()
    timeline = p.timeline()  # gathered on each pipeline's first pp rank
    out["timeline"] = None if timeline is None else (timeline.num_ranks, [len(r) for r in timeline.ranks])
    out["program"] = [len(r) for r in p.program.ranks]
    out["coords"] = mesh.coords
    by_config = pipe(parallel=ParallelConfig(dp=2, pp=2))  # the pipeline builds the mesh itself
    out["config loss"] = by_config.step(x, y)
    local = pipe(batch="local")
    local.optimizer(torch.optim.Adam, lr=LR, eps=EPS)
    out["local batch"] = _message(lambda: local.step(x[:6], y[:6]))
    out["local loss"] = local.step(x[8 * d:8 * d + 8], y[8 * d:8 * d + 8])
    # Chimera holds stage 0 and the last stage on both pp ranks: a replica's two pp ranks must agree
    out["local mismatch"] = _message(lambda: pipe("chimera", batch="local", parallel=mesh.with_zero(0))
                                     .step(x[mesh.coords.pp:][:8], y[mesh.coords.pp:][:8]))
    out["one process"] = gpt_loss(model(x), y).item()
    return out


def tp3d_errors_job() -> str:
    mesh = ParallelMesh(ParallelConfig(tp=8, tp_mode="3d"))
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    pipe = pipedsl.Pipeline(model.tp_stages(1, mesh), "1f1b", microbatches=2, loss_fn=tp_gpt_loss(mesh), parallel=mesh)
    x, y = _batches(1, 4)[0]
    return _message(lambda: pipe.step(x, y))


def example_job() -> dict:
    path = Path(__file__).resolve().parents[2] / "examples" / "parallel_3d.py"
    spec = importlib.util.spec_from_file_location("example_parallel_3d", path)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    return ex.train(dist.get_rank(), ParallelConfig(dp=2, pp=2, tp=2, zero=1), "1f1b", {}, 4, 3, GPT_CFG, 16,
                    check=True)


def readme_job(steps: int) -> list[float]:
    """The "Parallel groups" snippet (docs/parallelism.md, linked from the README), run as written."""
    import re

    readme = "\n".join((Path(__file__).resolve().parents[2] / name).read_text() for name in ("README.md", "docs/parallelism.md"))
    [snippet] = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "parallel=mesh" in b]
    scope: dict = {}
    exec(compile(snippet, "README.md", "exec"), scope)
    return scope["train"](dist.get_rank(), steps)


# ----------------------------------------------------------------------------------- tests

ZERO_MODES = [(0, "step"), (1, "step"), (2, "step"), (2, "microbatch"), (3, "step"), (3, "reshard=unit")]
TP1D_RUNS = tuple((s, 4, 16, z, r) for s in ("1f1b", "hanayo") for z, r in ZERO_MODES)
TP3D_RUNS = tuple((s, 2, 8, z, "step") for s in ("1f1b", "hanayo") for z in (0, 1))
CUBE1_RUNS = tuple((s, 4, 16, z, "step") for s in ("1f1b", "hanayo") for z in (1, 3))


def _every_schedule_runs() -> tuple:
    """Every built-in with ZeRO-1, and ZeRO 0, 2 and 3 each with a third of them in turn (ZeRO-3 meets the
    split-backward schedules dualpipe, v-half and zb-v; zb-h1 takes ZeRO-2), plus per-microbatch reduction for
    every other schedule without replicas (and under ZeRO-3 for 1F1B, ZB-H1 and ZB-V), and ZeRO-3 freeing its units
    after every use (not its default in a pipeline: gathered through the step) for schedules with a split backward,
    two stages a rank or replicas: 2-4 runs a schedule instead of 5, the suite's slowest test."""
    runs = []
    for i, name in enumerate(pipedsl.builtin_names()):
        prog = pipedsl.load(name).compile(P=2, M=4, **SCHEDULE_PARAMS.get(name, {}))
        runs += [(name, 4, 16, z, "step") for z in (1, (0, 2, 3)[i % 3])]
        if prog.num_replicas == 1 and i % 2 == 0:
            runs.append((name, 4, 16, 2, "microbatch"))
        if name in ("zb-h1", "interleaved", "dualpipev", "chimera"):
            runs.append((name, 4, 16, 3, "reshard=unit"))
        if name in ("1f1b", "zb-h1", "zb-v"):  # ZeRO-3 resharded by step with per-microbatch reduce-scatters
            runs.append((name, 4, 16, 3, "microbatch"))
    return tuple(runs)


def _problems(results: dict) -> list[str]:
    return [f"{key}: {p}" for key, res in results.items() for p in res["problems"]]


@pytest.mark.parametrize("schedule", ["1f1b", "hanayo"])
@pytest.mark.parametrize("zero,reduce", ZERO_MODES)
def test_dp2_pp2_tp2_1d_equals_one_process(run_once, schedule, zero, reduce):
    """dp2 × pp2 × tp2 (1-D) under each ZeRO mode: the loss of 3 Adam steps (rtol 2e-6) and every final parameter, shards
    put back in the dense layout (atol 2e-6), equal one process training the dense GPT on the global batch."""
    res = run_once(grid_job, 8, 2, 2, 2, "1d", TP1D_RUNS, 3)[0][(schedule, zero, reduce)]
    assert len(res["losses"]) == 3 and res["moved"] > 1000 * PARAM_ATOL
    assert not res["problems"], "\n".join(res["problems"])


@pytest.mark.parametrize("schedule", ["1f1b", "hanayo"])
def test_reduce_every_microbatch_holds_less_gradient_memory(run_once, schedule):
    """ZeRO-2 in a pipeline: 'microbatch' keeps one unit's (child module's) full gradient at a time, 'step' the
    whole stage's until REDUCE_GRAD (measured on rank 0's stages)."""
    results = run_once(grid_job, 8, 2, 2, 2, "1d", TP1D_RUNS, 3)[0]
    step, micro = results[(schedule, 2, "step")]["peak_grads"], results[(schedule, 2, "microbatch")]["peak_grads"]
    assert step.keys() == micro.keys() and step
    for s, (peak, bound, units) in micro.items():
        assert 0 < peak <= bound, (s, peak, bound)
        if units > 1:  # a stage of one unit holds its full gradient either way
            assert peak < step[s][0], (s, peak, step[s][0])


@pytest.mark.parametrize("schedule", ["1f1b", "hanayo"])
@pytest.mark.parametrize("zero", [0, 1])
def test_3d_tensor_parallel_tp8_equals_one_process(run_once, schedule, zero):
    """tp=8 as a q=2 cube (3-D) under ZeRO 0 and 1: the loss of 3 Adam steps (rtol 2e-6) and every final parameter in the
    dense layout (atol 2e-6) equal one process training the dense GPT on the whole batch."""
    res = run_once(grid_job, 8, 1, 1, 8, "3d", TP3D_RUNS, 3)[0][(schedule, zero, "step")]
    assert res["moved"] > 1000 * PARAM_ATOL
    assert not res["problems"], "\n".join(res["problems"])


@pytest.mark.parametrize("schedule", ["1f1b", "hanayo"])
@pytest.mark.parametrize("zero", [1, 3])
def test_3d_stages_across_pipeline_and_data_parallel_ranks(run_once, schedule, zero):
    """The 3-D stages between pipeline ranks, under dp and ZeRO, on a cube of one (q = 1: 4 processes).

    A q = 2 cube beside pp = 2 and dp = 2 needs 32 processes; this runs the same stage and loss
    code (row blocks, the cube's groups, the handshake of 3-D activations) at every size but q."""
    res = run_once(grid_job, 4, 2, 2, 1, "3d", CUBE1_RUNS, 3)[0][(schedule, zero, "step")]
    assert not res["problems"], "\n".join(res["problems"])


def test_every_builtin_schedule_dp2_pp2_zero(run_once):
    runs = _every_schedule_runs()
    results = run_once(grid_job, 4, 2, 2, 1, "1d", runs, 2, False)[0]
    assert {name for name, *_ in results} == set(pipedsl.builtin_names())
    assert all((name, 1, "step") in results for name in pipedsl.builtin_names())
    problems = _problems(results)
    assert not problems, "\n".join(problems)


@pytest.mark.quick
@pytest.mark.parametrize("user_optimizer", [False, True])
def test_dp_gradients_are_views_of_the_reduction_buckets(run_once, user_optimizer):
    """Without ZeRO the dp all-reduce runs in place on one bucket whose views are the gradients (DDP's
    gradient_as_bucket_view): no flat copy doubles the gradient memory, and training equals one process."""
    for out in run_once(buckets_job, 4, user_optimizer):
        assert not out["problems"], out["problems"]
        assert out["storages"] == 1 and out["copies"] == 0, out


def test_clear_errors_and_local_batches(run_once):
    for out in run_once(api_job, 4):
        assert out["world"] == "world size 4 is not dp*pp*tp = 2*2*2 = 8"
        assert out["P != pp"].startswith("the program '1F1B' has P=4 ranks, but the parallel layout has pp=2")
        assert "not both" in out["group and parallel"]
        assert out["microbatch replicas"].startswith("zero_reduce='microbatch' does not support stage replicas")
        assert "pipe.optimizer(torch.optim.Adam" in out["no optimizer"]
        assert "already has its optimizer" in out["second optimizer"]
        assert "batch size 12 (dim 0) do not split into dp*M = 2*4 = 8 equal microbatches" in out["batch"]
        assert "passed different inputs" in out["different batches"] and "batch='local'" in out["different batches"]
        assert "batch size 6 (dim 0) do not split into M=4" in out["local batch"]
        assert "passed different inputs" in out["local mismatch"]
        assert "batch='local' expects the same samples on every pp and tp rank" in out["local mismatch"]
        assert out["timeline"] == ((2, out["program"]) if out["coords"].pp == 0 else None)
        assert abs(out["global loss"] - out["one process"]) <= LOSS_RTOL * out["one process"]
        assert abs(out["local loss"] - out["one process"]) <= LOSS_RTOL * out["one process"]
        assert abs(out["config loss"] - out["one process"]) <= LOSS_RTOL * out["one process"]


def test_3d_microbatch_must_divide_by_q_squared(run_once):
    for message in run_once(tp3d_errors_job, 8):
        assert "microbatches of 2 samples (inputs) are not divisible by q*q=4" in message


def test_parallel_3d_example_equals_one_process(run_once):
    """examples/parallel_3d.py at dp2 × pp2 × tp2, ZeRO-1, with check=True: every rank's 3 losses agree and equal those
    of one process training the dense model on the whole batch (rank 0's reference, rtol 2e-6)."""
    results = run_once(example_job, 8)
    ref = results[0]["reference"]
    assert len(ref) == 3
    for res in results:
        assert res["losses"] == results[0]["losses"]
        for got, want in zip(res["losses"], ref):
            assert abs(got - want) <= LOSS_RTOL * want


def test_readme_parallel_snippet_runs(run_once):
    results = run_once(readme_job, 8, 2)
    assert len(results[0]) == 2 and all(r == results[0] for r in results)
    assert all(3 < v < 7 for v in results[0])  # ln(256) = 5.5 at the start
