"""Worker side of test_post_validate.py: the same training run, synchronous and post-validated, in one world.

The GPT of test_pipeline_parallel.py trains STEPS steps twice from one seed — synchronous `TrainingSteps`, then
post-validated ones — with clipping at a norm that some steps exceed and an inf put into one gradient on one
rank at one step (both runs skip that step).  Returned per rank: both runs' reports, the final parameters and
optimizer state of each (gathered over dp for ZeRO), and how many steps the post-validated run redid.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist

import pipedsl
from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch
from pipedsl.models.gpt.parallelize import tp_gpt_loss
from pipedsl.parallel import ParallelConfig, ParallelMesh
from pipedsl.runtime.post_validate import TrainingSteps

GPT_CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)
STEPS = 20
INF_STEP = 7  # the step whose gradient gets an inf (on the last rank's first parameter)
SCHEDULE_PARAMS = {"hanayo": {"W": 1}, "zb-auto": {"mem": 4}}


def _batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [synthetic_batch(batch, GPT_CFG.block_size, GPT_CFG.vocab_size, gen) for _ in range(steps)]


def _run(rank: int, schedule: str, P: int, M: int, zero: int, dp: int, max_norm: float, post: bool,
         precision: str | None, tp: int) -> dict:
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    program = pipedsl.load(schedule).compile(P=P, M=M, **SCHEDULE_PARAMS.get(schedule, {}))
    if tp > 1:  # Megatron's 1-D split of the GPT (models/gpt/tp.py)
        mesh = ParallelMesh(ParallelConfig(dp=dp, pp=P, tp=tp, zero=zero))
        stages, loss_fn, parallel = copy.deepcopy(model).tp_stages(program.num_stages, mesh), tp_gpt_loss(mesh), mesh
    else:
        stages, loss_fn = copy.deepcopy(model).stages(program.num_stages), gpt_loss
        parallel = ParallelConfig(dp=dp, pp=P, zero=zero) if dp > 1 or zero else None
    pipe = pipedsl.Pipeline(stages, program=program, loss_fn=loss_fn, parallel=parallel, precision=precision)
    opt = pipe.optimizer(torch.optim.AdamW, lr=3e-2, eps=1e-4, weight_decay=0.1)
    step_no = [0]
    last = max(pipe.local_stages())
    if last == program.num_stages - 1:  # an inf in one gradient of one step, on the rank holding the last stage
        first = next(p for p in pipe.local_stages()[last].parameters() if p.requires_grad)
        first.register_hook(lambda g: g * float("inf") if step_no[0] == INF_STEP else g)
    steps = TrainingSteps(pipe, opt, max_norm=max_norm, post_validate=post)
    reports = []
    for i, (x, y) in enumerate(_batches(STEPS, 4 * M * dp)):  # (the same batch on every tp rank)
        step_no[0] = i + 1
        r = steps.step(x, y)
        if r is not None:
            reports.append(r)
    r = steps.settle()
    if r is not None:
        reports.append(r)
    drawn = pipe.timeline(steps=2) if post else None  # the last two steps, which overlap (collective)
    ordered = drawn is None or all(a.end <= b.start + 1e-9 for events in drawn.ranks
                                   for a, b in zip(events, events[1:]))  # an undone pass's stamps would not be
    params = opt.stage_parameters()
    state = [{k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
             for o in opt.optimizers for st in o.state.values()]
    out = {"reports": reports, "params": params, "state": state, "redone": steps.redone,
           "scale": pipe.loss_scaling.state_dict(), "ordered": ordered}
    pipe.close()
    return out


def sync_and_post(rank: int, schedule: str, P: int, M: int, zero: int = 0, dp: int = 1,
                  max_norm: float = 0.8, precision: str | None = None, tp: int = 1) -> dict:
    """Both runs on this rank, and what differs between them (empty: bit for bit equal)."""
    sync = _run(rank, schedule, P, M, zero, dp, max_norm, False, precision, tp)
    post = _run(rank, schedule, P, M, zero, dp, max_norm, True, precision, tp)
    problems = []
    if sync["scale"] != post["scale"]:
        problems.append(f"fp16's loss scale: {sync['scale']} synchronous, {post['scale']} post-validated")
    if len(sync["reports"]) != STEPS or len(post["reports"]) != STEPS:
        problems.append(f"reports: {len(sync['reports'])} synchronous, {len(post['reports'])} post-validated")
    for a, b in zip(sync["reports"], post["reports"]):
        same_norm = a.grad_norm == b.grad_norm or (math.isnan(a.grad_norm) and math.isnan(b.grad_norm))
        if (a.step, a.clipped, a.skipped) != (b.step, b.clipped, b.skipped) or not same_norm or not (
                abs(a.loss - b.loss) <= 1e-12 * max(1.0, abs(a.loss))):
            problems.append(f"step {a.step}: {a} vs {b}")
    for s, named in sync["params"].items():
        for name, v in named.items():
            if not torch.equal(v, post["params"][s][name]):
                problems.append(f"stage {s} {name}: max diff {(v - post['params'][s][name]).abs().max():.3g}")
    if len(sync["state"]) != len(post["state"]):
        problems.append("optimizer state differs in size")
    for a, b in zip(sync["state"], post["state"]):
        for k in a:
            if not torch.equal(a[k], b[k]):
                problems.append(f"optimizer state {k} differs")
                break
    if not post["ordered"]:
        problems.append("the last two steps' measured timeline is out of order on some rank")
    clipped = sum(r.clipped for r in sync["reports"])
    skipped = sum(r.skipped for r in sync["reports"])
    dist.barrier()
    return {"problems": problems, "clipped": clipped, "skipped": skipped, "redone": post["redone"],
            "steps": len(sync["reports"]), "scale": sync["scale"]}
