"""Worker-side checks of low-precision parameters with fp32 main parameters (shared by test_main_params.py).

The model is precision_cases' 1-D convolution stack.  The reference is one process under the
same policy, written out here rather than taken from the runtime: the stages' parameters cast to
bf16/fp16, an fp32 copy of each that the optimizer steps, every microbatch's low-precision
gradient added into an fp32 accumulator (grads="fp32", Megatron-LM's default) or accumulated by
autograd in the parameters' dtype and converted once (grads="bf16", the ZeRO paper's), fp16's
loss scale divided out of the fp32 gradients, torch's `clip_grad_norm_` on them, and the stepped
fp32 values rounded back into the model.
"""

from __future__ import annotations

import copy
import functools
import math

import precision_cases as cases
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

import pipedsl
from pipedsl.parallel import ParallelConfig, ParallelMesh
from pipedsl.plan.memory import model_states, state_bytes
from pipedsl.runtime import checkpoint
from pipedsl.runtime.precision import MixedPrecision, run_stages

MAX_NORM = 0.5


def reference(stages, data, M: int, pol: MixedPrecision, max_norm: float | None = MAX_NORM, dp: int = 1,
              loss_fn=F.cross_entropy, optimizer=None) -> dict:
    """One process: the losses, norms and final (model, main) parameters of `data`'s steps; each global batch
    is dp·M microbatches, each loss scaled 1/(dp·M) (the pipeline's 1/M, averaged over dp)."""
    stages = copy.deepcopy(stages)
    params = cases._params(stages)
    main = [p.detach().float().clone() for p in params]  # fp32, also when the model came in bf16
    for p in params:
        p.data = p.data.to(pol.param_dtype)
    opt = (optimizer(main, lr=cases.LR) if optimizer is not None else
           torch.optim.SGD(main, lr=cases.LR, momentum=cases.MOMENTUM))
    scale = pol.init_scale if pol.scales_loss else 1.0
    n = dp * M
    losses, norms = [], []
    for x, y in data:
        acc = [torch.zeros_like(m) for m in main]
        total = 0.0
        for xm, ym in zip(x.chunk(n), y.chunk(n)):
            loss = run_stages(stages, xm, pol, loss_fn, ym) * (1.0 / n)
            (loss * scale).backward()
            total += loss.item()
            if pol.grad_dtype == torch.float32:
                for a, p in zip(acc, params):
                    a.add_(p.grad)
                    p.grad = None
        for m, a, p in zip(main, acc, params):
            m.grad = (a if pol.grad_dtype == torch.float32 else p.grad.float()) / scale
            p.grad = None
        losses.append(total)
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(main, max_norm)))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for m, p in zip(main, params):
                p.copy_(m)
    return {"losses": losses, "norms": norms, "stages": stages,
            "main": [{k: m for (k, _), m in zip(s.named_parameters(), main[o:o + len(list(s.parameters()))])}
                     for s, o in _offsets(stages)]}


def _offsets(stages):
    """Each stage with the index of its first parameter in `cases._params(stages)` (no ties here)."""
    o = 0
    for s in stages:
        yield s, o
        o += len(list(s.parameters()))


def _compare(pipe, opt, ref: dict) -> dict:
    """Max |pipeline − reference| of the model's parameters (also in units in the last place of each tensor's
    largest element) and of the fp32
    main parameters, over this rank's stages."""
    model = opt.stage_parameters()
    main = opt.stage_parameters(main=True)
    err = ulps = main_err = 0.0
    for s, named in model.items():
        want = dict(ref["stages"][s].named_parameters())
        for k, v in named.items():
            w = want[k].detach()
            d = (v.float() - w.float()).abs()
            err = max(err, float(d.max()))
            spacing = torch.finfo(w.dtype).eps * float(w.float().abs().max())  # a unit in the last place, at scale
            ulps = max(ulps, float(d.max()) / max(spacing, 1e-30))
            main_err = max(main_err, float((main[s][k] - ref["main"][s][k].detach()).abs().max()))
    dtypes = {str(p.dtype) for m in pipe.local_stages().values() for p in m.parameters()}
    return {"err": err, "ulps": ulps, "main_err": main_err, "dtypes": sorted(dtypes)}


def _train(pipe, opt, data, max_norm: float | None = MAX_NORM) -> dict:
    losses, norms, stepped = [], [], []
    for x, y in data:
        losses.append(pipe.step(x, y))
        if max_norm is not None:
            norms.append(float(pipe.clip_grad_norm_(max_norm)))
        stepped.append(opt.step())
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "stepped": stepped}


def schedule_job(schedule: str, grads: str, compute: str = "bf16", steps: int = 3, module_dtype=None) -> dict:
    """One schedule on P=2 (no dp), M=4, SGD with momentum and global-norm clipping, against `reference`;
    `module_dtype`: the stages come in that dtype (a model loaded in bf16)."""
    P, M = 2, 4
    pol = MixedPrecision(compute, params=compute, grads=grads)
    prog = pipedsl.load(schedule).compile(P=P, M=M, **cases.SCHEDULE_PARAMS.get(schedule, {}))
    stages = cases.conv_stages(prog.num_stages)
    if module_dtype is not None:
        stages = [s.to(module_dtype) for s in stages]
    data = cases.batches(steps, 4 * M)
    ref = reference(stages, data, M, pol)
    pipe = pipedsl.Pipeline(copy.deepcopy(stages), program=prog, loss_fn=F.cross_entropy, precision=pol)
    opt = pipe.optimizer(torch.optim.SGD, lr=cases.LR, momentum=cases.MOMENTUM)
    got = _train(pipe, opt, data)
    # fp32 training ends elsewhere: the policy really ran (once a schedule)
    fp32 = reference(stages, data, M, MixedPrecision()) if grads == "fp32" else {"losses": []}
    out = {**got, **_compare(pipe, opt, ref), "ref_losses": ref["losses"], "ref_norms": ref["norms"],
           "fp32_losses": fp32["losses"], "scale": pipe.scaler.scale if pipe.scaler else None,
           "main_dtypes": sorted({str(u.main.dtype) for z in opt.zero.values() for u in z.units if u.main is not None})}
    pipe.close()
    return out


def every_schedule_job(steps: int = 3) -> dict:
    out = {(name, grads): schedule_job(name, grads, steps=steps)
           for name in pipedsl.builtin_names() for grads in ("fp32", "bf16")}
    for name in ("1f1b", "zb-h1"):
        out[(name, "fp16")] = schedule_job(name, "fp32", compute="fp16", steps=steps)
    out[("1f1b", "bf16-module")] = schedule_job("1f1b", "fp32", steps=steps, module_dtype=torch.bfloat16)
    return out


def refusals_job(directory: str) -> dict:
    """What main parameters refuse, on every rank alike: a checkpoint without the optimizer that holds the
    parameters, and an optimizer whose update uses per-tensor statistics."""
    prog = pipedsl.load("1f1b").compile(P=2, M=2)
    pol = MixedPrecision("bf16", params="bf16")
    out = {}
    pipe = pipedsl.Pipeline(cases.conv_stages(2), program=prog, loss_fn=F.cross_entropy, precision=pol)
    pipe.optimizer(torch.optim.SGD, lr=0.1)
    try:
        checkpoint.save(pipe, directory, 1)
    except checkpoint.CheckpointError as err:
        out["weights_only"] = str(err)
    pipe.close()
    pipe = pipedsl.Pipeline(cases.conv_stages(2), program=prog, loss_fn=F.cross_entropy, precision=pol)
    try:
        pipe.optimizer(torch.optim.Adafactor, lr=0.1)
    except Exception as err:  # noqa: BLE001
        out["adafactor"] = str(err)
    pipe.close()
    return out


def zero_job(zero: int, schedule: str, grads: str, steps: int = 3) -> dict:
    """dp2 × pp2 under ZeRO `zero` against `reference` over the global batch."""
    DP, PP, M = 2, 2, 4
    pol = MixedPrecision("bf16", params="bf16", grads=grads)
    prog = pipedsl.load(schedule).compile(P=PP, M=M, **cases.SCHEDULE_PARAMS.get(schedule, {}))
    stages = cases.conv_stages(prog.num_stages)
    data = cases.batches(steps, DP * M * 2)
    ref = reference(stages, data, M, pol, dp=DP)
    mesh = ParallelMesh(ParallelConfig(dp=DP, pp=PP, zero=zero))
    pipe = pipedsl.Pipeline(copy.deepcopy(stages), program=prog, loss_fn=F.cross_entropy, precision=pol,
                            parallel=mesh)
    opt = pipe.optimizer(torch.optim.SGD, lr=cases.LR, momentum=cases.MOMENTUM)
    got = _train(pipe, opt, data)
    out = {**got, **_compare(pipe, opt, ref), "ref_losses": ref["losses"], "ref_norms": ref["norms"]}
    pipe.close()
    return out


MODES = {"autocast": ("fp32", "fp32"), "megatron": ("bf16", "fp32"), "zero-paper": ("bf16", "bf16")}


def bytes_job() -> dict:
    """dp2 × pp2, Adam, every precision mode × ZeRO stage: the bytes of every parameter, gradient, main-parameter
    and optimizer-state tensor this rank holds after an optimizer step, against `model_states`."""
    DP, PP, M = 2, 2, 2
    out = {}
    for mode, (params, grads) in MODES.items():
        pol = MixedPrecision("bf16", params=params, grads=grads)
        for zero in range(4):
            prog = pipedsl.load("1f1b").compile(P=PP, M=M)
            pipe = pipedsl.Pipeline(cases.conv_stages(PP), program=prog, loss_fn=F.cross_entropy, precision=pol,
                                    parallel=ParallelMesh(ParallelConfig(dp=DP, pp=PP, zero=zero)))
            opt = pipe.optimizer(torch.optim.Adam, lr=1e-3)
            x, y = cases.batches(1, DP * M * 2)[0]
            pipe.step(x, y)
            opt.step()
            got = opt.measured_bytes()
            steps = sum(len(o.state) for o in opt.optimizers)  # Adam's step counter: one fp32 scalar a tensor
            want = model_states(got.padded_numel, DP, zero, state_bytes(params, grads, "adam"))
            out[(mode, zero)] = {"params": got.params, "grads": got.grads, "optimizer": got.optimizer + got.main,
                                 "want": (want.params, want.grads, want.optimizer + 4 * steps),
                                 "numel": got.numel, "padded": got.padded_numel}
            opt.zero_grad()
            pipe.close()
    return out


def checkpoint_job(directory: str) -> dict:
    """dp2 × pp2, bf16 parameters with fp32 main parameters under ZeRO-1: 4 steps straight, saving after 2;
    resumed under the same layout; resumed under ZeRO-3; and the autocast (fp32 parameters) run reading the
    main parameters, plus a main-parameter run resuming an autocast checkpoint."""
    DP, PP, M = 2, 2, 4
    data = cases.batches(4, DP * M * 2)
    prog = pipedsl.load("1f1b").compile(P=PP, M=M)
    megatron = MixedPrecision("bf16", params="bf16")

    def run(path: str, pol: MixedPrecision, zero: int, start: int, save_at: int = 0) -> dict:
        mesh = ParallelMesh(ParallelConfig(dp=DP, pp=PP, zero=zero))
        pipe = pipedsl.Pipeline(cases.conv_stages(PP, seed=5 if start else 0), program=prog,
                                loss_fn=F.cross_entropy, precision=pol, parallel=mesh)
        opt = pipe.optimizer(torch.optim.Adam, lr=1e-2)
        if start:
            checkpoint.load(pipe, path, opt)
        losses = {}
        for step in range(start + 1, 5):
            losses[step] = pipe.step(*data[step - 1])
            opt.step()
            opt.zero_grad()
            if step == save_at:
                checkpoint.save(pipe, path, step, opt)
        main = opt.stage_parameters(main=True)
        pipe.close()
        return {"losses": losses, "main": main}

    a, b = f"{directory}/megatron", f"{directory}/autocast"
    straight = run(a, megatron, 1, 0, save_at=2)
    same = run(a, megatron, 1, 2)
    zero3 = run(a, megatron, 3, 2)
    as_autocast = run(a, MixedPrecision("bf16"), 0, 2)
    run(b, MixedPrecision("bf16"), 0, 0, save_at=2)
    from_autocast = run(b, megatron, 1, 2)
    return {"straight": straight, "same": same, "zero3": zero3, "as_autocast": as_autocast,
            "from_autocast": from_autocast, "rank": dist.get_rank()}


def finite(xs) -> bool:
    return all(math.isfinite(x) for x in xs)


def tp_jobs(layouts) -> dict:
    return {layout: tp_job(*layout) for layout in layouts}


def tp_job(tp_mode: str, zero: int, steps: int = 3) -> dict:
    """The built-in GPT with tensor parallelism (1-D: dp2 × pp2 × tp2 under ZeRO `zero`; 3-D: tp8) and bf16
    parameters over fp32 main parameters, against the dense model in one process under the same policy; and
    the same layout in fp32, to show the tolerance tells the two apart."""
    from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch
    from pipedsl.models.gpt.parallelize import tp_gpt_loss

    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    dims = {"dp": 2, "pp": 2, "tp": 2} if tp_mode == "1d" else {"tp": 8, "tp_mode": "3d"}
    M = 2
    # eps 1e-4: the attention key bias has an exactly-zero gradient, whose rounding noise Adam with eps 1e-8
    # would turn into full steps (tests/parallel/test_pipeline_parallel.py)
    adam = functools.partial(torch.optim.Adam, eps=1e-4)
    gen = torch.Generator().manual_seed(1)
    data = [synthetic_batch(dims.get("dp", 1) * M * 4, cfg.block_size, cfg.vocab_size, gen) for _ in range(steps)]
    out = {}
    for name, pol in (("bf16", MixedPrecision("bf16", params="bf16")), ("fp32", MixedPrecision())):
        torch.manual_seed(0)
        model = GPT(cfg)
        ref = reference(model.stages(dims.get("pp", 1)), data, M, pol, max_norm=None, dp=dims.get("dp", 1),
                        loss_fn=gpt_loss, optimizer=adam)
        mesh = ParallelMesh(ParallelConfig(zero=zero, **dims))
        pipe = pipedsl.Pipeline(model.tp_stages(dims.get("pp", 1), mesh), "1f1b", microbatches=M,
                                loss_fn=tp_gpt_loss(mesh), parallel=mesh, precision=pol)
        opt = pipe.optimizer(adam, lr=cases.LR)
        got = _train(pipe, opt, data, max_norm=None)
        out[name] = {"losses": got["losses"], "ref_losses": ref["losses"]}
        pipe.close()
    return out
