"""Worker-side checks of mixed precision and global gradient clipping (run on the session pool; shared
by tests/runtime/test_precision.py and tests/parallel/test_clip.py).

The model is one no other test trains: a 1-D convolution stack (conv in, residual conv blocks
with GroupNorm, a flattening classifier head), optionally with a weight tied between the
first and the last stage.  The reference is the same stages in one process under the same
policy (`run_stages`: autocast per stage, outputs cast at every boundary), M microbatches
with the loss scaled 1/M, torch's `clip_grad_norm_` and, for fp16, `torch.amp.GradScaler`.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn

import pipedsl
from pipedsl.runtime.precision import MixedPrecision, run_stages

CHANNELS, LENGTH, CLASSES = 8, 12, 5
LR, MOMENTUM = 0.05, 0.9
SCHEDULE_PARAMS = {"hanayo": {"W": 1}}


class ConvIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, CHANNELS, 3, padding=1)
        self.mix = nn.Linear(CHANNELS, CHANNELS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [mb, 3, L] -> [mb, C, L]
        h = F.gelu(self.conv(x))
        return self.mix(h.transpose(1, 2)).transpose(1, 2)


class ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(2, CHANNELS)
        self.conv1 = nn.Conv1d(CHANNELS, 2 * CHANNELS, 3, padding=1)
        self.conv2 = nn.Conv1d(2 * CHANNELS, CHANNELS, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [mb, C, L]
        return x + self.conv2(F.silu(self.conv1(self.norm(x))))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(CHANNELS, CHANNELS)
        self.out = nn.Linear(CHANNELS * LENGTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [mb, C, L] -> [mb, classes]
        h = self.mix(x.transpose(1, 2))  # [mb, L, C]
        return self.out(h.flatten(1))


def conv_stages(num_stages: int, tied: bool = False, seed: int = 0) -> list[nn.Module]:
    """`num_stages` stages (>= 2): conv in, residual blocks, head; `tied`: head.mix is stage 0's mix."""
    torch.manual_seed(seed)
    stages = [ConvIn(), *(ConvBlock() for _ in range(num_stages - 2)), Head()]
    if tied:
        stages[-1].mix.weight = stages[0].mix.weight
    return stages


def batches(steps: int, n: int, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 3, LENGTH, generator=g), torch.randint(0, CLASSES, (n,), generator=g))
            for _ in range(steps)]


def _params(stages: list[nn.Module]) -> list[nn.Parameter]:
    seen, out = set(), []
    for m in stages:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def reference(stages: list[nn.Module], data, M: int, policy: MixedPrecision, max_norm: float | None,
              norm_type: float = 2.0, loss_fn=F.cross_entropy) -> dict:
    """One process: losses, norms, loss scales after each step, and the final stages."""
    stages = copy.deepcopy(stages)
    params = _params(stages)
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    scaler = torch.amp.GradScaler("cpu", init_scale=policy.init_scale, growth_interval=policy.growth_interval) \
        if policy.scales_loss else None
    losses, norms, scales = [], [], []
    for x, y in data:
        total = 0.0
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            loss = run_stages(stages, xm, policy, loss_fn, ym) * (1.0 / M)
            (scaler.scale(loss) if scaler else loss).backward()
            total += loss.item()
        losses.append(total)
        if scaler:
            scaler.unscale_(opt)
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)))
        if scaler:
            scaler.step(opt)
            scaler.update()
            scales.append(float(scaler.get_scale()))
        else:
            opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms, "scales": scales, "stages": stages}


def _max_error(pipe: pipedsl.Pipeline, ref_stages: list[nn.Module]) -> tuple[float, float]:
    """max |pipeline - reference| over this rank's stage parameters, and the reference's magnitude."""
    err, mag = 0.0, 0.0
    for s, module in pipe.local_stages().items():
        want = dict(ref_stages[s].named_parameters())
        for name, p in module.named_parameters():
            err = max(err, float((p.detach() - want[name].detach()).abs().max()))
            mag = max(mag, float(want[name].detach().abs().max()))
    return err, mag


def train_pipeline(schedule: str, P: int, M: int, policy: MixedPrecision, data, max_norm: float | None,
                   tied: bool = False, norm_type: float = 2.0) -> tuple[pipedsl.Pipeline, dict]:
    prog = pipedsl.load(schedule).compile(P=P, M=M, **SCHEDULE_PARAMS.get(schedule, {}))
    stages = conv_stages(prog.num_stages, tied)
    ref = reference(stages, data, M, policy, max_norm, norm_type)
    pipe = pipedsl.Pipeline(copy.deepcopy(stages), program=prog, loss_fn=F.cross_entropy, precision=policy)
    opt = pipe.optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)
    losses, norms, scales, stepped = [], [], [], []
    for x, y in data:
        losses.append(pipe.step(x, y))
        if max_norm is not None:
            before = float(pipe.grad_norm(norm_type))  # the same norm, without clipping
            norms.append(float(pipe.clip_grad_norm_(max_norm, norm_type)))
            assert before == norms[-1] or not math.isfinite(before), (before, norms[-1])
        stepped.append(opt.step())
        opt.zero_grad()
        scales.append(pipe.scaler.scale if pipe.scaler is not None else None)
    err, mag = _max_error(pipe, ref["stages"])
    fp32 = reference(stages, data, M, MixedPrecision(), max_norm, norm_type)
    err32, _ = _max_error(pipe, fp32["stages"])
    return pipe, {"losses": losses, "norms": norms, "scales": scales, "stepped": stepped, "error": err,
                  "magnitude": mag, "error_vs_fp32": err32, "ref": {k: v for k, v in ref.items() if k != "stages"},
                  "moved": max(float((a - b).abs().max()) for a, b in zip(_params(stages), _params(ref["stages"])))}


def every_schedule_job(P: int, M: int, steps: int) -> dict:
    """Every built-in schedule under bf16 and fp16 with clipping, and under fp32 with clipping (2 and inf);
    plus Chimera and 1F1B with a tied weight, and the P2P bytes of 1F1B in each precision."""
    data = batches(steps, 4 * M)
    out: dict = {}
    for name in pipedsl.builtin_names():
        for prec in ("bf16", "fp16"):
            _, out[(name, prec, 2.0)] = train_pipeline(name, P, M, MixedPrecision(prec), data, max_norm=0.5)
        _, out[(name, "fp32", math.inf)] = train_pipeline(name, P, M, MixedPrecision(), data, max_norm=0.05,
                                                         norm_type=math.inf)
    for name in ("1f1b", "chimera"):
        _, out[(name, "tied", 2.0)] = train_pipeline(name, P, M, MixedPrecision("bf16"), data, max_norm=0.5, tied=True)
    for prec in ("fp32", "bf16", "fp16"):
        pipe, _ = train_pipeline("1f1b", P, M, MixedPrecision(prec), data[:1], max_norm=None)
        out[("bytes", prec)] = pipe.channels.sent_bytes
    return out


def overflow_job(P: int, M: int, steps: int) -> dict:
    """fp16 with a loss scale so large that the backward overflows: every rank skips the same steps and the
    scale backs off until it fits, like torch.amp.GradScaler on one process."""
    data = batches(steps, 4 * M)
    policy = MixedPrecision("fp16", init_scale=2.0 ** 20, growth_interval=2)
    pipe, res = train_pipeline("1f1b", P, M, policy, data, max_norm=1.0)
    res["skipped"] = pipe.scaler.skipped
    res["rank"] = dist.get_rank()
    return res


def resume_job(directory: str) -> dict:
    """fp16 (a loss scale that overflows at step 1 and grows after 2 clean steps) with a warmup + cosine lr
    schedule: 4 steps straight, against 2 steps, a checkpoint, and a fresh pipeline resumed for steps 3-4."""
    from pipedsl.runtime import checkpoint
    from pipedsl.runtime.optim import LRSchedule

    P, M = 2, 4
    data = batches(4, 4 * M)
    policy = MixedPrecision("fp16", init_scale=2.0 ** 20, growth_interval=2)
    prog = pipedsl.load("1f1b").compile(P=P, M=M)

    def run(stages, steps, save_at=None, load=False):
        pipe = pipedsl.Pipeline(stages, program=prog, loss_fn=F.cross_entropy, precision=policy)
        opt = pipe.optimizer(torch.optim.SGD, lr=LR, momentum=MOMENTUM)
        if load:
            checkpoint.load(pipe, directory, opt)
        else:
            opt.lr_schedule = LRSchedule("cosine", lr=LR, warmup=1, total=4)
        losses, scales, lrs = [], [], []
        for step in steps:
            x, y = data[step - 1]
            losses.append(pipe.step(x, y))
            pipe.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            scales.append(pipe.scaler.scale)
            lrs.append(opt.optimizers[0].param_groups[0]["lr"])
            if step == save_at:
                checkpoint.save(pipe, directory, step, opt)
        params = {s: {k: v.detach().clone() for k, v in m.named_parameters()} for s, m in pipe.local_stages().items()}
        return {"losses": losses, "scales": scales, "lrs": lrs, "params": params,
                "scaler": pipe.scaler.state_dict(), "schedule": opt.lr_schedule}

    straight = run(conv_stages(prog.num_stages), range(1, 5), save_at=2)
    resumed = run(conv_stages(prog.num_stages, seed=99), range(3, 5), load=True)
    same = all(torch.equal(straight["params"][s][k], v) for s, named in resumed["params"].items()
               for k, v in named.items())
    return {"straight": {k: v for k, v in straight.items() if k != "params"},
            "resumed": {k: v for k, v in resumed.items() if k != "params"}, "same_params": same}
