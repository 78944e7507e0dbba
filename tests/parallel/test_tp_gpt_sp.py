"""Sequence parallelism for the built-in GPT's 1-D tensor parallelism trains exactly like one process.

Each run builds the runtime's small GPT from one seed on every rank, slices it with
`GPT.tp_stages(..., sequence_parallel=True)`, trains it a few Adam steps in a pipeline and,
beside it, the dense model in one process on the whole global batch.  Checked: the loss of
every step, the gradients of the first step and the parameters after the last — every rank's
shards put back into the dense layout through test_pipeline_parallel's index model (every
element covered, replicated copies equal) — and the global gradient norm when clipping.
Also: the collectives (each all-reduce of activations becomes a reduce-scatter and an
all-gather of the same bytes) and the saved-activation bytes per rank (Korthikanti et al.).
"""

from __future__ import annotations

import copy

import pytest
import test_pipeline_parallel as grid
import torch
import torch.distributed as dist
from dense_index import gather_dense, index_model

import pipedsl
from pipedsl.errors import PipeRuntimeError
from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss
from pipedsl.models.gpt.parallelize import tp_gpt_loss
from pipedsl.parallel import ParallelConfig, ParallelConfigError, ParallelMesh, count_comm
from pipedsl.parallel.tp1d import ParallelSelfAttention
from pipedsl.runtime.precision import MixedPrecision

pytestmark = pytest.mark.slow

GPT_CFG, LR, EPS = grid.GPT_CFG, grid.LR, grid.EPS  # T = 8: shards of 4 tokens at tp 2
GRAD_ATOL = 2e-6
BF16_LOSS_RTOL, BF16_GRAD_RTOL = 1e-3, 6e-2  # tests/parallel/test_tp_hf.py's bf16 tolerances


# ----------------------------------------------------------------------------------- worker side


def _dense(model: GPT, batches, clip: float | None, bf16: bool) -> dict:
    """One process, the whole global batch per step: losses, first-step gradients, norms, final parameters."""
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(ref.parameters(), lr=LR, eps=EPS)
    out: dict = {"losses": [], "norms": []}
    for x, y in batches:
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            loss = gpt_loss(ref(x), y)
        loss.backward()
        out["losses"].append(loss.item())
        if "grads" not in out:
            out["grads"] = torch.cat([p.grad.reshape(-1) for p in ref.parameters()]).double()
        if clip is not None:
            out["norms"].append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    out["params"] = grid._flat(ref)
    return out


def _selective(module: torch.nn.Module) -> bool:
    return isinstance(module, ParallelSelfAttention)


def _precision(bf16: str | bool | None) -> MixedPrecision | None:
    """True: bf16 autocast over fp32 parameters; "params": bf16 parameters over fp32 main parameters (flat buffers)."""
    if not bf16:
        return None
    return MixedPrecision("bf16", params="bf16") if bf16 == "params" else MixedPrecision("bf16")


def _train(mesh: ParallelMesh, model: GPT, run: dict, batches) -> dict:
    """One pipeline run of `run` (schedule, sp, zero, recompute, clip, bf16) on `mesh`, gathered to dense layout."""
    program = pipedsl.load(run["schedule"]).compile(P=mesh.config.pp, M=run["M"],
                                                     **grid.SCHEDULE_PARAMS.get(run["schedule"], {}))
    S, sp, zero = program.num_stages, run["sp"], run.get("zero", 0)
    stages = copy.deepcopy(model).tp_stages(S, mesh, sequence_parallel=sp)
    shapes = []  # what stage 0 hands on: the sequence shard with SP
    if S > 1:
        stages[0].register_forward_hook(lambda _m, _a, out: shapes.append(tuple(out.shape)))
    recompute = run.get("recompute")
    pipe = pipedsl.Pipeline(stages, program=program, loss_fn=tp_gpt_loss(mesh), parallel=mesh.with_zero(zero),
                            recompute=recompute, recompute_filter=_selective if recompute == "selective" else None,
                            precision=_precision(run.get("bf16")), activation_bytes=True)
    opt = pipe.optimizer(torch.optim.Adam, lr=LR, eps=EPS)
    index, n = index_model(model)
    index_stages = index.tp_stages(S, mesh, sequence_parallel=sp)
    out: dict = {"losses": [], "norms": [], "peak_bytes": 0}
    with count_comm() as comm:
        for step, (x, y) in enumerate(batches):
            out["losses"].append(pipe.step(x, y))
            out["peak_bytes"] = max(out["peak_bytes"], pipe.counter.peak_bytes)
            if step == 0 and zero == 0:  # ZeRO keeps its gradients in flat buffers
                grads = {s: {k: p.grad for k, p in m.named_parameters()} for s, m in pipe.local_stages().items()}
                out["grads"] = gather_dense(grads, index_stages, n)
            if run.get("clip") is not None:
                out["norms"].append(float(pipe.clip_grad_norm_(run["clip"])))
            opt.step()
            opt.zero_grad()
    out["comm"] = dict(comm.sent), dict(comm.calls)
    out["params"] = gather_dense(opt.stage_parameters(), index_stages, n)
    out["shapes"] = sorted(set(shapes))
    out["keys"] = {s: {k: tuple(v.shape) for k, v in m.state_dict().items()} for s, m in pipe.local_stages().items()}
    pipe.close()
    return out


def _problems(got: dict, want: dict, bf16: bool) -> list[str]:
    bad = []
    rtol = BF16_LOSS_RTOL if bf16 else grid.LOSS_RTOL
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        if not abs(a - b) <= rtol * abs(b):
            bad.append(f"step {step}: loss {a!r} != one process {b!r}")
    for a, b in zip(got["norms"], want["norms"], strict=True):
        if not abs(a - b) <= rtol * b:
            bad.append(f"gradient norm {a!r} != one process {b!r}")
    if "grads" in got:
        g = got["grads"]
        err = float((g["values"] - want["grads"]).abs().max())
        tol = BF16_GRAD_RTOL * float(want["grads"].abs().max()) if bf16 else GRAD_ATOL
        if g["uncovered"] or not err <= tol or not g["spread"] <= tol:
            bad.append(f"first-step gradients: max error {err:.3g}, copies differ by {g['spread']:.3g}, "
                       f"{g['uncovered']} elements uncovered")
    if not bf16:  # Adam turns bf16's rounding of tiny gradients into full steps: losses and gradients say it
        bad += grid._compare({"losses": [], **got["params"]}, [], want["params"])
    return bad


def sp_job(dp: int, pp: int, runs: tuple, steps: int) -> dict:
    """Each run on a dp × pp × tp2 mesh against the dense model; rank 0: {name: problems and measurements}."""
    mesh = ParallelMesh(ParallelConfig(dp=dp, pp=pp, tp=2))
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    out = {}
    for name, run in runs:
        run = dict(run)
        batches = grid._batches(steps, run["batch"])
        want = _dense(model, batches, run.get("clip"), bool(run.get("bf16")))
        got = _train(mesh, model, run, batches)
        peak = torch.tensor([got["peak_bytes"]], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        every_comm: list = [None] * dist.get_world_size()
        dist.all_gather_object(every_comm, got["comm"])
        out[name] = {"problems": _problems(got, want, bool(run.get("bf16"))), "losses": got["losses"],
                     "moved": float((want["params"] - grid._flat(model)).abs().max()), "shapes": got["shapes"],
                     "peak_bytes": int(peak.item()), "comm": got["comm"], "every_comm": every_comm,
                     "keys": got["keys"]}
    return out if dist.get_rank() == 0 else {}


def sp_error_job() -> dict:
    """tp2 on 2 ranks: a sequence the tp ranks cannot share equally, dropout, 3-D: one-line errors."""
    mesh = ParallelMesh(ParallelConfig(tp=2))
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    pipe = pipedsl.Pipeline(model.tp_stages(1, mesh, sequence_parallel=True), "1f1b", microbatches=2,
                            loss_fn=tp_gpt_loss(mesh), parallel=mesh)
    x, y = grid._batches(1, 4)[0]
    out = {"odd": grid._message(lambda: pipe.step(x[:, :7], y[:, :7]))}
    try:
        GPT(GPTConfig(**{**GPT_CFG.__dict__, "dropout": 0.1})).tp_stages(1, mesh, sequence_parallel=True)
        out["dropout"] = "no error"
    except (PipeRuntimeError, ParallelConfigError) as err:
        out["dropout"] = err.message
    return out


def sp_checkpoint_job(root: str) -> dict:
    """pp2 × tp2: a checkpoint saved at step 1 of an SP run resumes with SP (bit-exact) and without SP."""
    from pipedsl.runtime import checkpoint

    mesh = ParallelMesh(ParallelConfig(pp=2, tp=2))
    batches = grid._batches(3, B)

    def run(sp: bool, save: bool = False, resume: bool = False) -> list[float]:
        torch.manual_seed(5 if resume else 0)  # a resumed run must not depend on its own initial weights
        stages = GPT(GPT_CFG).tp_stages(2, mesh, sequence_parallel=sp)
        pipe = pipedsl.Pipeline(stages, "1f1b", microbatches=M, loss_fn=tp_gpt_loss(mesh), parallel=mesh)
        opt = pipe.optimizer(torch.optim.Adam, lr=LR, eps=EPS)
        start = checkpoint.load(pipe, root, opt).step if resume else 0
        losses = []
        for step in range(start, len(batches)):
            losses.append(pipe.step(*batches[step]))
            opt.step()
            opt.zero_grad()
            if save and step == 0:
                checkpoint.save(pipe, root, 1, opt, timeout=60.0)
        pipe.close()
        return losses

    whole = run(True, save=True)
    return {"whole": whole[1:], "sp": run(True, resume=True), "tp": run(False, resume=True)}


# ----------------------------------------------------------------------------------- tests

B, M = 8, 2  # per dp replica: 2 microbatches of 4 samples


def _runs(**common) -> tuple:
    return tuple((name, tuple(sorted({**common, **run}.items()))) for name, run in [
        ("tp", {"sp": False}),
        ("sp", {"sp": True}),
        ("sp zb-h1", {"sp": True, "schedule": "zb-h1"}),
        ("sp full recompute", {"sp": True, "recompute": "full"}),
        ("sp selective recompute", {"sp": True, "recompute": "selective"}),
        ("sp bf16", {"sp": True, "bf16": True}),
    ])


PP2_TP2 = _runs(schedule="1f1b", M=M, batch=B)
# one 8-process run covering several things: dp, ZeRO-3, interleaved 1F1B, global clipping; and bf16 parameters
# over fp32 main parameters under ZeRO-1, with and without SP (the dense model has no bf16 parameters: SP is
# compared with tp)
DP2_PP2_TP2 = (("sp zero3 interleaved clip", (("M", 4), ("batch", 2 * 8), ("clip", 0.05), ("schedule", "interleaved"),
                                              ("sp", True), ("zero", 3))),
               *((f"{kind} bf16 params", (("M", 2), ("batch", 2 * 8), ("bf16", "params"), ("schedule", "1f1b"),
                                          ("sp", kind == "sp"), ("zero", 1))) for kind in ("tp", "sp")))


@pytest.mark.parametrize("name", [name for name, _ in PP2_TP2 if name != "tp"])
def test_pp2_tp2_sequence_parallel_equals_one_process(run_once, name):
    """pp2 × tp2 with SP (1F1B, ZB-H1, recompute, bf16): losses of 2 Adam steps, first-step gradients and final parameters
    (dense layout) equal one process training the dense GPT (2e-6; bf16 against autocast: losses 1e-3, gradients 6e-2)."""
    res = run_once(sp_job, 4, 1, 2, PP2_TP2, 2)[0][name]
    assert res["moved"] > 1000 * grid.PARAM_ATOL
    assert res["shapes"] == [(B // M, GPT_CFG.block_size // 2, GPT_CFG.n_embd)]  # stage 0 sends its shard
    assert not res["problems"], "\n".join(res["problems"])


def test_dp2_pp2_tp2_sequence_parallel_zero3_interleaved_clipping_equals_one_process(run_once):
    """dp2 × pp2 × tp2 with SP, ZeRO-3, interleaved 1F1B and clipping at 0.05: the losses and global norms of 2 Adam steps
    (rtol 2e-6) and the final parameters in the dense layout (atol 2e-6) equal one process training the dense GPT."""
    res = run_once(sp_job, 8, 2, 2, DP2_PP2_TP2, 2)[0]["sp zero3 interleaved clip"]
    assert not res["problems"], "\n".join(res["problems"])


def test_dp2_pp2_tp2_sequence_parallel_bf16_parameters_zero1_equals_tp(run_once):
    """bf16 parameters over fp32 main ones, ZeRO-1, dp2 × pp2 × tp2: the losses of 2 steps with SP equal those of the
    same run without SP (rtol 1e-4); the dense model has no bf16 parameters, so plain tp is the reference."""
    results = run_once(sp_job, 8, 2, 2, DP2_PP2_TP2, 2)[0]
    tp, sp = results["tp bf16 params"]["losses"], results["sp bf16 params"]["losses"]
    # the same bf16 rounding of gradients summed in another order: 4e-6 apart measured, 1.3e-3 without SP's tp sum
    assert len(sp) == 2 and all(abs(a - b) <= 1e-4 * b for a, b in zip(sp, tp, strict=True)), (sp, tp)


def test_sequence_parallel_keeps_the_checkpoint_layout(run_once):
    """Same parameter names and shapes with and without SP: a checkpoint of one loads into the other."""
    results = run_once(sp_job, 4, 1, 2, PP2_TP2, 2)[0]
    assert results["sp"]["keys"] == results["tp"]["keys"]


def test_sequence_parallel_checkpoint_resumes_with_and_without_sp(run_once, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("sp_ckpt"))
    for out in run_once(sp_checkpoint_job, 4, root):
        assert len(out["whole"]) == 2 and out["sp"] == out["whole"]
        assert all(abs(a - b) <= grid.LOSS_RTOL * b for a, b in zip(out["tp"], out["whole"], strict=True))


def test_sequence_parallel_replaces_all_reduces_by_reduce_scatter_and_all_gather(run_once):
    """Per microbatch and block, tp's four all-reduces of [mb, T, C] (2 forward, 2 backward) become two
    all-gathers and two reduce-scatters forward, the same backward, plus the all-gather again of each
    column-parallel input in backward (Megatron saves the shard, not the gathered input).  The only
    all-reduces left are the loss's and the gradients of the weights applied to shards (LayerNorms,
    row-parallel biases), and the position table's gradient rows are all-gathered."""
    results = run_once(sp_job, 4, 1, 2, PP2_TP2, 2)[0]  # rank 0: stage 0 = the embedding and one block
    assert sorted({k.split(".")[0] for k in results["sp"]["keys"][0]}) == ["0", "1"]
    tp_sent, sp_sent = results["tp"]["comm"][0], results["sp"]["comm"][0]

    def tp_bytes(sent: dict, op: str) -> int:
        return sum(n for (o, g), n in sent.items() if o == op and g == "tp")

    C, T, microbatches = GPT_CFG.n_embd, GPT_CFG.block_size, 2 * M  # 2 steps
    act = (2 - 1) / 2 * (B // M) * T * C * 4  # one all-gather or reduce-scatter of [mb, T, C] fp32 at t = 2
    n_ar = 4 + 1  # per microbatch: the block's 4 all-reduces and the embedding's
    assert tp_bytes(tp_sent, "all_reduce") == microbatches * n_ar * 2 * act
    assert tp_bytes(tp_sent, "all_gather") == tp_bytes(tp_sent, "reduce_scatter") == 0
    # sequence parallelism: every all-reduce is a reduce-scatter and an all-gather ...
    assert tp_bytes(sp_sent, "reduce_scatter") == microbatches * n_ar * act
    regather = 2  # ... and the block's two column-parallel inputs are gathered again in backward
    positions = (2 - 1) / 2 * T * C * 4  # the position table's gradient rows [T, C]
    assert tp_bytes(sp_sent, "all_gather") == microbatches * ((n_ar + regather) * act + positions)
    shard_weights = 2 * 2 * C + 2 * C  # ln1, ln2 (weight, bias) and the two row-parallel biases
    assert tp_bytes(sp_sent, "all_reduce") == 2 * 2 * (2 - 1) / 2 * 4 * shard_weights  # summed once per step
    assert results["sp"]["comm"][1][("all_reduce", "tp")] == 2  # one all-reduce a step
    print(f"tp bytes per step on stage 0 (embedding + 1 block, M={M}): tp {tp_bytes(tp_sent, 'all_reduce') / 2:.0f} "
          f"all-reduce; SP {tp_bytes(sp_sent, 'reduce_scatter') / 2:.0f} reduce-scatter + "
          f"{tp_bytes(sp_sent, 'all_gather') / 2:.0f} all-gather + {tp_bytes(sp_sent, 'all_reduce') / 2:.0f} all-reduce")


def test_split_backward_moves_the_same_bytes(run_once):
    """ZB-H1's I computes the column-parallel input gradients (reduce-scatter) and W the weight gradients (the
    input gathered again): the same collectives as 1F1B's one backward, on every rank (not both in each pass)."""
    results = run_once(sp_job, 4, 1, 2, PP2_TP2, 2)[0]
    assert results["sp zb-h1"]["every_comm"] == results["sp"]["every_comm"]


def test_sequence_parallel_saves_fewer_activation_bytes(run_once):
    """Korthikanti et al. 2022: a block saves 10 + 24/t (fp16 bytes, ·s·b·h) with tp, 34/t with SP.
    Counted for these layers in fp32, without dropout: the replicated part is the two LayerNorm inputs
    and the two column-parallel inputs, 16; the split part q, k, v, the attention output (which the
    output projection reads as a view), the GELU input and output, 48/t; with SP all of it is /t:
    SP / tp = 64/t / (16 + 48/t) = 32/40 at t = 2 (measured per block on a 4- vs 2-block GPT, h = 64,
    T = 64: 40.4 and 32.3 bytes·sbh).  Here the whole stages, embedding and head included."""
    results = run_once(sp_job, 4, 1, 2, PP2_TP2, 2)[0]
    tp, sp = results["tp"]["peak_bytes"], results["sp"]["peak_bytes"]
    ratio = sp / tp
    print(f"peak saved-activation bytes per rank, pp2 tp2 1F1B M={M}: tp {tp}, tp+SP {sp}, ratio {ratio:.3f}")
    assert abs(ratio - 32 / 40) <= 0.03, (tp, sp, ratio)


def test_sequence_parallel_errors_are_one_line(run_once):
    for out in run_once(sp_error_job, 2):
        assert out["odd"].endswith("ParallelConfigError: invalid parallel configuration: sequence parallelism needs "
                                   "the sequence length 7 divisible by the 2 tensor-parallel ranks")
        assert out["dropout"] == "tensor-parallel GPT stages need dropout=0, got 0.1"
