"""Rank functions for the GPT's Mixture-of-Experts (models/gpt/moe.py) and expert parallelism
(parallel/expert.py), run by tests/models/test_gpt_moe.py on the worker pools."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import pipedsl
from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, randomize_, synthetic_batch
from pipedsl.models.gpt.moe import MoE
from pipedsl.models.gpt.parallelize import parallelize_gpt
from pipedsl.parallel import ParallelConfig, ParallelMesh
from pipedsl.parallel.expert import ExpertParallel, expert_shards, shard_experts_over
from pipedsl.runtime.expert_load import ExpertLoad

LR = 0.05
LOSS_RTOL = 1e-5
PARAM_ATOL = 2e-5
MB = 2  # samples a microbatch


def _mesh(dp: int, pp: int, ep: int, zero: int = 0) -> ParallelMesh:
    """The dp × pp mesh with the experts over ep (its device type: CUDA under NCCL)."""
    kind = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return ParallelMesh(ParallelConfig(dp=dp, pp=pp, ep=ep, zero=zero), device_type=kind)


def tiny_moe(layers: int, capacity: float | None = None, experts: int = 4) -> GPT:
    """Four experts, top-2, a router loss and a z-loss large enough to move the weights, random LayerNorms."""
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=layers, n_head=2, n_embd=16, n_experts=experts, top_k=2,
                    expert_ffn=24, capacity_factor=capacity, aux_loss_coef=0.1, z_loss_coef=0.01)
    return randomize_(GPT(cfg), torch.Generator().manual_seed(0))


def train_equal(rank: int, schedule: str, M: int, dp: int = 1, ep: int = 1, zero: int = 0, steps: int = 2,
                capacity: float | None = None, recompute: str | None = None,
                params: dict[str, Any] | None = None, device: str | None = None) -> dict[str, Any]:
    """`steps` SGD steps of the pipelined MoE GPT (dp × pp, experts over ep) against the whole model trained with
    gradient accumulation over the same dp·M microbatches: each step's loss and gradient norm, then every
    parameter (an expert shard against its experts' rows of the whole model).  `device`: both on it (the
    pipeline's default when None; benchmarks/gpu_check.py runs it on a GPU)."""
    pp = dist.get_world_size() // dp
    program = pipedsl.load(schedule).compile(P=pp, M=M, **(params or {}))
    S = program.num_stages
    model = tiny_moe(max(S - 1, 2), capacity)
    ref = copy.deepcopy(model)
    stages = model.stages(S)
    whole = {id(p): n for n, p in model.named_parameters()}
    names = {s: {n: whole[id(p)] for n, p in m.named_parameters()} for s, m in enumerate(stages)}
    mesh = _mesh(dp, pp, ep, zero) if dp > 1 else None
    if mesh is not None:
        shard_experts_over(stages, mesh)  # any module's experts over ep (the GPT's own plan: test_gpt_moe.py)
    pipe = pipedsl.Pipeline(stages, program=program, loss_fn=gpt_loss, parallel=mesh, recompute=recompute,
                            device=device)
    ref.to(pipe.device)
    opt = pipe.optimizer(torch.optim.SGD, lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    load, ref_load = ExpertLoad(pipe.local_stages().values(), 4, pipe.device), ExpertLoad([ref], 4, pipe.device)
    gen = torch.Generator().manual_seed(1)
    problems: list[str] = []
    stats = ref_stats = None
    for step in range(steps):
        x, y = synthetic_batch(MB * M * dp, 8, 32, gen)
        loss = pipe.step(x, y)
        norm = pipe.grad_norm().item()
        opt.step()
        opt.zero_grad()
        want = 0.0
        for xm, ym in zip(x.to(pipe.device).chunk(M * dp), y.to(pipe.device).chunk(M * dp)):
            part = gpt_loss(ref(xm), ym) / (M * dp)
            part.backward()
            want += part.item()
        want_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters() if p.grad is not None]).item()
        ref_opt.step()
        ref_opt.zero_grad()
        if abs(loss - want) > LOSS_RTOL * abs(want):
            problems.append(f"rank {rank} step {step}: loss {loss!r} != one process {want!r}")
        if abs(norm - want_norm) > LOSS_RTOL * want_norm:
            problems.append(f"rank {rank} step {step}: gradient norm {norm!r} != one process {want_norm!r}")
        if step == 0:  # every rank's routings, summed over the world, are the whole model's
            stats, ref_stats = load.read(), ref_load.read(reduce=False)
    checked = compare_parameters(rank, pipe, opt, names, ref, problems)
    moved = max((p.detach().cpu() - q).abs().max().item() for p, q in zip(ref.parameters(), tiny_moe(
        max(S - 1, 2), capacity).parameters()))
    pipe.close()
    return {"problems": problems, "checked": sorted(checked), "moved": moved, "stats": stats,
            "ref_stats": ref_stats, "dp_rank": mesh.coords.dp if mesh else 0,
            "stages": sorted(pipe.local_stages()), **_names_and_rows(ref)}


def _names_and_rows(ref: torch.nn.Module) -> dict[str, Any]:
    """The whole model's parameter names and first dimensions (what tests/compared.py checks coverage against)."""
    return {"all": sorted(n for n, _ in ref.named_parameters()),
            "rows": {n: p.shape[0] for n, p in ref.named_parameters() if p.dim()}}


def compare_parameters(rank: int, pipe: pipedsl.Pipeline, opt: Any, names: dict[int, dict[str, str]],
                       ref: torch.nn.Module, problems: list[str]) -> set[str]:
    """Every local parameter (ZeRO's slices gathered) against the whole model's — an expert shard against its rows
    [first, first + E/ep) — appending to `problems`; the names checked.  `names[s]`: stage s's names (a shard keeps
    its experts module's) → the whole model's."""
    shards = {s: expert_shards(module) for s, module in pipe.local_stages().items()}
    ref_params = dict(ref.named_parameters())
    checked = set()
    for s, named in opt.stage_parameters().items():
        for name, v in named.items():
            if name in shards[s]:  # an expert shard (held by its experts module or a view's holder): its rows
                whole = names[s][name]
                ep, at = shards[s][name]
                rows = ref_params[whole].shape[0] // ep
                want = ref_params[whole][at * rows:(at + 1) * rows]
                key = f"{whole}[{at * rows}:{(at + 1) * rows}]"
            else:
                want, key = ref_params[names[s][name]], names[s][name]
            checked.add(key)
            if isinstance(v, DTensor):  # a tensor-parallel shard: the whole weight (every tp rank asks alike)
                v = v.full_tensor()
            err = (v - want.detach()).abs().max().item()
            if err > PARAM_ATOL:
                problems.append(f"rank {rank} stage {s} {key}: max |pipeline - one process| = {err:.3g}")
    return checked


def hf_train_equal(rank: int, family: str, schedule: str, M: int, dp: int = 1, ep: int = 1, zero: int = 0,
                   steps: int = 2, tp: int = 1, sp: bool = False, adamw: bool = False,
                   tie: bool | None = None) -> dict[str, Any]:
    """A transformers MoE decoder with its router loss, dp × pp × tp with the experts over ep (tp: the attention
    tensor-parallel, each MoE block on its tp rank's share of the tokens; `sp` sequence-parallel), against the
    whole model accumulating the same dp·M microbatches (HF's loss per microbatch, averaged): loss, gradient norm,
    weights after SGD steps (each step's change is lr × the gradient) or, with `adamw`, AdamW steps.  `tie`: the
    word embeddings tied to the head (the family's default when None)."""
    import hf_cases
    from reference_once import on_rank_zero

    from pipedsl.models.hf.parallelize import parallelize_hf, tp_hf_loss
    from pipedsl.models.hf.stages import causal_lm_loss, causal_lm_stages, shift_labels

    pp = dist.get_world_size() // (dp * tp)
    program = pipedsl.load(schedule).compile(P=pp, M=M)
    model = hf_cases.tiny_model(family, tie=tie)
    ref = copy.deepcopy(model)
    stages = causal_lm_stages(model, program.num_stages, attention_mask=True)
    whole = {id(p): n for n, p in model.named_parameters()}
    names = {s: {n: whole[id(p)] for n, p in m.named_parameters()} for s, m in enumerate(stages)}
    mesh = ParallelMesh(ParallelConfig(dp=dp, pp=pp, tp=tp, ep=ep, zero=zero)) if dp * tp > 1 else None
    if mesh is not None:  # tp slices and experts over ep: the family's own plan
        stages = parallelize_hf(stages, mesh, sequence_parallel=sp)
    loss_fn = tp_hf_loss(mesh) if tp > 1 else causal_lm_loss
    pipe = pipedsl.Pipeline(stages, program=program, loss_fn=loss_fn, parallel=mesh)
    kind, lr = (torch.optim.AdamW, 1e-2) if adamw else (torch.optim.SGD, hf_cases.LR)
    opt = pipe.optimizer(kind, lr=lr)
    x, mask, labels = hf_cases.batch(M * dp, True)
    got = []
    for _ in range(steps):
        loss = pipe.step((x, mask), shift_labels(labels))
        got.append((loss, pipe.grad_norm().item()))
        opt.step()
        opt.zero_grad()

    def one_process() -> list[tuple[float, float]]:
        """The whole model accumulating the same dp·M microbatches: each step's loss and gradient norm."""
        ref_opt, wants = kind(ref.parameters(), lr=lr), []
        for _ in range(steps):
            want = 0.0
            for xm, mm, lm in zip(x.chunk(M * dp), mask.chunk(M * dp), labels.chunk(M * dp)):
                out = ref(xm, attention_mask=mm, labels=lm, use_cache=False)
                (out.loss / (M * dp)).backward()
                want += out.loss.item() / (M * dp)
            wants.append((want, torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()
                                                                if p.grad is not None]).item()))
            ref_opt.step()
            ref_opt.zero_grad()
        return wants

    problems: list[str] = []
    for step, ((loss, norm), (want, want_norm)) in enumerate(zip(got, on_rank_zero(one_process, ref), strict=True)):
        if abs(loss - want) > LOSS_RTOL * abs(want):
            problems.append(f"rank {rank} step {step}: loss {loss!r} != one process {want!r}")
        if abs(norm - want_norm) > 1e-4 * want_norm:
            problems.append(f"rank {rank} step {step}: gradient norm {norm!r} != one process {want_norm!r}")
    checked = compare_parameters(rank, pipe, opt, names, ref, problems)
    pipe.close()
    return {"problems": problems, "checked": sorted(checked), **_names_and_rows(ref)}


def overlap_identical(rank: int, schedule: str, M: int, recompute: str | None = None, dropout: float = 0.0,
                      capacity: float | None = None, latency: float = 0.0, steps: int = 2,
                      device: str | None = None) -> dict[str, Any]:
    """The same MoE GPT at dp2 × pp2 × ep2 trained with its F&B pairs overlapped and not: every loss and every
    gradient bit-identical; the hand-overs made (none without overlap)."""
    from pipedsl.parallel import comm
    from pipedsl.runtime.overlap import PairOverlap

    pp = dist.get_world_size() // 2
    mesh = _mesh(2, pp, 2)
    program = pipedsl.load(schedule).compile(P=pp, M=M)
    out: dict[str, Any] = {}
    for overlap in (False, True):
        cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=program.num_stages, n_head=2, n_embd=16,
                        n_experts=4, top_k=2, expert_ffn=24, aux_loss_coef=0.1, dropout=dropout,
                        capacity_factor=capacity)
        model = randomize_(GPT(cfg), torch.Generator().manual_seed(0))
        torch.manual_seed(11)  # dropout's stream: the same for both runs
        stages = parallelize_gpt(model, program.num_stages, mesh, by="blocks")
        pipe = pipedsl.Pipeline(stages, program=program, loss_fn=gpt_loss,
                                parallel=mesh, recompute=recompute,  # a block a stage: both halves of a pair exchange
                                recompute_filter=lambda m: isinstance(m, MoE),  # its exchanges
                                overlap=overlap, device=device)
        gen = torch.Generator().manual_seed(1)
        before = PairOverlap.handovers
        losses, grads = [], []
        with comm.exchange_latency(latency):
            for _ in range(steps):
                losses.append(pipe.step(*synthetic_batch(MB * M * 2, 8, 32, gen)))
                grads.append({f"{s}.{n}": p.grad.clone() for s, m in pipe.local_stages().items()
                              for n, p in m.named_parameters() if p.grad is not None})
                with torch.no_grad():
                    for p in pipe.parameters():
                        if p.grad is not None:
                            p -= LR * p.grad
                            p.grad = None
        out[overlap] = {"losses": losses, "grads": grads, "handovers": PairOverlap.handovers - before,
                        "timeline": pipe.timeline()}
        pipe.close()
    same = out[False]["losses"] == out[True]["losses"] and all(
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        for a, b in zip(out[False]["grads"], out[True]["grads"]))
    return {"same": same, "losses": out[True]["losses"], "handovers": (out[False]["handovers"],
                                                                      out[True]["handovers"])}


def mismatched_peers(rank: int) -> dict[str, str]:
    """Data-parallel replicas that would run their ep exchanges at different points, and ep over a model with no
    experts (which would shard nothing): each is refused on every rank, before any exchange (which would hang)."""
    from pipedsl.errors import PipeRuntimeError

    mesh = ParallelMesh(ParallelConfig(dp=2, pp=2, ep=2))
    other = mesh.coords.dp == 1
    out = {}
    for case, schedule, layers in (("program", "gpipe" if other else "1f1b", 3),
                                   ("stages", "1f1b", 4 if other else 3)):
        try:
            pipedsl.Pipeline(parallelize_gpt(tiny_moe(layers), 2, mesh), schedule, microbatches=2, loss_fn=gpt_loss,
                             parallel=mesh)
            out[case] = "no error"
        except PipeRuntimeError as err:
            out[case] = err.message
    dense = randomize_(GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=3, n_head=2, n_embd=16)),
                       torch.Generator().manual_seed(0))
    try:
        pipedsl.Pipeline(parallelize_gpt(dense, 2, mesh), "1f1b", microbatches=2, loss_fn=gpt_loss, parallel=mesh)
        out["dense"] = "no error"
    except PipeRuntimeError as err:
        out["dense"] = err.message
    return out


def _synthetic_steps(pipe: pipedsl.Pipeline, opt: Any, steps: int) -> list[float]:
    """`steps` optimizer steps of `pipe` on batches of 8 synthetic samples (seed 1): each step's loss."""
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        losses.append(pipe.step(*synthetic_batch(8, 8, 32, gen)))
        opt.step()
        opt.zero_grad()
    return losses


def sharded_by_the_pipeline(rank: int) -> dict[str, Any]:
    """The MoE GPT at dp2 × pp2 × ep2 with its experts sharded by its plan (`parallelize_gpt`) and left whole for the
    `Pipeline` (the older call): for each, the warnings building the pipeline gave (category, message, the file
    they point at), the expert shards it holds, and two SGD steps' losses."""
    import warnings

    mesh = ParallelMesh(ParallelConfig(dp=2, pp=2, ep=2))
    out: dict[str, Any] = {}
    for case in ("plan", "pipeline"):
        model = tiny_moe(3)
        stages = parallelize_gpt(model, 2, mesh) if case == "plan" else model.stages(2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe = pipedsl.Pipeline(stages, "1f1b", microbatches=2, loss_fn=gpt_loss, parallel=mesh)
        losses = _synthetic_steps(pipe, pipe.optimizer(torch.optim.SGD, lr=LR), 2)
        out[case] = {"warnings": [(w.category.__name__, str(w.message), w.filename) for w in caught],
                     "shards": sum(isinstance(m, ExpertParallel) for st in pipe.local_stages().values()
                                   for m in st.modules()),
                     "losses": losses}
        pipe.close()
    return out


def bf16_main(rank: int) -> dict[str, Any]:
    """Three AdamW steps of the MoE GPT at dp2 × pp2: fp32 without ep, and bf16 parameters over fp32 main parameters
    with the experts over ep=2 under ZeRO-1 and ZeRO-3; the losses, and the dtypes the expert shards are held in."""
    from pipedsl.runtime.precision import MixedPrecision

    out: dict[str, Any] = {}
    for name, precision, ep, zero in (("fp32", None, 1, 1), ("z1", MixedPrecision("bf16", params="bf16"), 2, 1),
                                      ("z3", MixedPrecision("bf16", params="bf16"), 2, 3)):
        mesh = ParallelMesh(ParallelConfig(dp=2, pp=2, ep=ep, zero=zero))
        pipe = pipedsl.Pipeline(parallelize_gpt(tiny_moe(3), 2, mesh), "1f1b", microbatches=2, loss_fn=gpt_loss,
                                parallel=mesh, precision=precision)
        opt = pipe.optimizer(torch.optim.AdamW, lr=1e-2)
        losses = _synthetic_steps(pipe, opt, 3)
        shards = [m for s in pipe.local_stages().values() for m in s.modules() if isinstance(m, ExpertParallel)]
        out[name] = {"losses": losses, "dtypes": sorted({str(u.dtype) + "/" + str(u.main.dtype)
                                                         for z in opt.zero.values() for u in z.units
                                                         if u.module in shards and u.main is not None})}
        pipe.close()
    return out


def hf_train_equal_here(*args: Any) -> dict[str, Any]:
    """`hf_train_equal` on this rank of a pool's world (`pool.run(fn, world, …)` passes no rank)."""
    return hf_train_equal(dist.get_rank(), *args)


def tp_train_equal(dp: int, tp: int, ep: int, sp: bool, schedule: str, zero: int = 0, steps: int = 2,
                   M: int = 4, device: str | None = None) -> list[str]:
    """The MoE GPT tensor-parallel (models/gpt/tp.py: each MoE block whole on its tp rank's share of the tokens,
    parallel/moe_tp.py) at dp × pp × tp (pp = world / (dp·tp)), experts over ep, `steps` SGD steps, against the
    whole model accumulating the same dp·M microbatches: each step's loss, then every element of every parameter —
    each rank's tp slices and expert rows put back in the dense layout by index (tests/dense_index.py), every
    element held by some rank, copies equal.  The problems found."""
    from dense_index import gather_dense, index_model
    from reference_once import on_rank_zero

    from pipedsl.models.gpt.parallelize import tp_gpt_loss

    pp = dist.get_world_size() // (dp * tp)
    on_cuda = device is not None and torch.device(device).type == "cuda"
    mesh = ParallelMesh(ParallelConfig(dp=dp, pp=pp, tp=tp, ep=ep), device_type="cuda" if on_cuda else None)
    program = pipedsl.load(schedule).compile(P=pp, M=M)
    S = program.num_stages
    model = tiny_moe(max(S - 1, 2))
    ref = copy.deepcopy(model)
    stages = parallelize_gpt(copy.deepcopy(model), S, mesh, sequence_parallel=sp)
    pipe = pipedsl.Pipeline(stages, program=program, loss_fn=tp_gpt_loss(mesh), parallel=mesh.with_zero(zero),
                            device=device)
    ref.to(pipe.device)
    opt = pipe.optimizer(torch.optim.SGD, lr=LR)
    gen = torch.Generator().manual_seed(1)
    batches = [synthetic_batch(MB * M * dp, 8, 32, gen) for _ in range(steps)]
    got = []
    for x, y in batches:
        got.append(pipe.step(x, y))
        opt.step()
        opt.zero_grad()

    def one_process() -> list[float]:
        """The whole model accumulating the same dp·M microbatches: each step's loss."""
        ref_opt, wants = torch.optim.SGD(ref.parameters(), lr=LR), []
        for x, y in batches:
            want = 0.0
            for xm, ym in zip(x.to(pipe.device).chunk(M * dp), y.to(pipe.device).chunk(M * dp)):
                part = gpt_loss(ref(xm), ym) / (M * dp)
                part.backward()
                want += part.item()
            wants.append(want)
            ref_opt.step()
            ref_opt.zero_grad()
        return wants

    problems: list[str] = []
    for step, (loss, want) in enumerate(zip(got, on_rank_zero(one_process, ref), strict=True)):
        if abs(loss - want) > LOSS_RTOL * abs(want):
            problems.append(f"rank {dist.get_rank()} step {step}: loss {loss!r} != one process {want!r}")
    index, n = index_model(model)
    index_stages = parallelize_gpt(index, S, mesh, sequence_parallel=sp)  # the same slices and expert rows
    got = gather_dense({s: {k: v.cpu() for k, v in named.items()} for s, named in opt.stage_parameters().items()},
                       index_stages, n)
    want_params = torch.cat([p.detach().cpu().reshape(-1) for p in ref.parameters()]).double()
    err = float((got["values"] - want_params).abs().max())
    if got["uncovered"] or err > PARAM_ATOL or got["spread"] > PARAM_ATOL:
        problems.append(f"rank {dist.get_rank()}: parameters max |parallel - one process| = {err:.3g}, "
                        f"{got['uncovered']} elements held by no rank, copies differing by {got['spread']:.3g}")
    pipe.close()
    return problems
