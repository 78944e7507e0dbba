"""`PipelineOptimizer`: the optimizer of one rank's pipeline stages, with or without ZeRO.

Made by `Pipeline.optimizer(torch.optim.Adam, lr=…)` through the pipeline's data-parallel
strategy (runtime/data_parallel.py), which decides what it steps:

    replicated  one `optimizer_class` over the local stages' parameters; the pipeline averages
                gradients over the dp group at each stage's REDUCE_GRAD
    flat        one `ZeroOptimizer` per local stage over the dp group: ZeRO 1-3 (`zero_reduce`
                "step" or "microbatch"), or ZeRO 0 with bf16/fp16 parameters and fp32 main
                parameters; its reduction is the stage's REDUCE_GRAD hook, waited at the step end

`step()` then `zero_grad()` after every `pipe.step`.  `step()` does what a training step
needs in the right order: under fp16 it unscales the gradients (unless `pipe.clip_grad_norm_`
already did), skips the update on every rank if any rank overflowed, and grows or backs off
the loss scale; with an `lr_schedule` it sets the learning rate of the pipeline's step
(`pipe.steps`, restored by checkpoints) first.  `stage_parameters()` gives each local
stage's parameters by their original names (ZeRO's flat buffers unpacked; collective for
ZeRO-3), e.g. for a checkpoint or to compare with a reference.

    opt = pipe.optimizer(torch.optim.AdamW, lr=3e-4)
    opt.lr_schedule = LRSchedule("cosine", lr=3e-4, warmup=100, total=10_000)
    loss = pipe.step(x, y); pipe.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from pipedsl.errors import PipeRuntimeError
from pipedsl.parallel.weight_decay import NO_DECAY_KINDS, exempt_names
from pipedsl.parallel.zero import MemoryReport, ZeroOptimizer, unique_bytes
from pipedsl.runtime.data_parallel import Flat, HeldStages, Replicated

LR_SCHEDULES = ("constant", "cosine", "linear", "wsd")
WSD_DECAY = 0.1  # wsd without `decay`: the last tenth of the steps after the warmup decays


@dataclass(frozen=True)
class LRSchedule:
    """Linear warmup over `warmup` steps from lr/warmup to `lr`, then: constant; a cosine decay to `min_lr` at step
    `total` (GPT-3 / Megatron-LM's); a linear decay to `min_lr` at `total`; or warmup-stable-decay (`wsd`, MiniCPM's):
    `lr` until the last `decay` steps (default a tenth of those after the warmup), then linear to `min_lr` at
    `total`.  A pure function of the step."""

    kind: str = "constant"
    lr: float = 1e-3
    warmup: int = 0
    total: int = 0
    min_lr: float = 0.0
    decay: int = 0

    def __post_init__(self) -> None:
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"lr schedule must be one of {', '.join(map(repr, LR_SCHEDULES))}, got {self.kind!r}")
        if self.warmup < 0 or (self.kind != "constant" and self.total <= self.warmup):
            raise ValueError(f"a {self.kind} lr schedule needs 0 <= warmup < total, got warmup={self.warmup}, "
                             f"total={self.total}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must be in [0, lr={self.lr:g}], got {self.min_lr:g}")
        if self.decay < 0 or (self.kind == "wsd" and self.decay > self.total - self.warmup):
            raise ValueError(f"a wsd schedule decays over at most the {self.total - self.warmup} steps after the "
                             f"warmup, got decay={self.decay}")

    def __call__(self, step: int) -> float:
        """The learning rate of step `step` (1-based: the first step is 1)."""
        if step <= self.warmup:
            return self.lr * step / self.warmup
        if self.kind == "constant":
            return self.lr
        span = self.total - self.warmup
        if self.kind == "wsd":
            decay = self.decay or max(1, round(WSD_DECAY * span))
            start = self.total - decay
            return self.lr if step <= start else self._linear(min(1.0, (step - start) / decay))
        progress = min(1.0, (step - self.warmup) / span)
        if self.kind == "linear":
            return self._linear(progress)
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def _linear(self, progress: float) -> float:
        return self.lr + (self.min_lr - self.lr) * progress


class OptimizedPipeline(HeldStages, Protocol):
    """What the optimizer reads of its pipeline (`Pipeline` is one): besides the stages, the data-parallel
    strategy that builds it, the step count (for the lr schedule) and fp16's unscale / update around a step."""

    data_parallel: Replicated | Flat
    steps: int

    @property
    def dp(self) -> int: ...

    def unscale_(self) -> bool: ...

    def update_scale(self) -> None: ...


class PipelineOptimizer:
    """step() / zero_grad() for every stage this rank holds (see the module docstring)."""

    def __init__(self, pipe: OptimizedPipeline, optimizer_class: Callable[..., torch.optim.Optimizer],
                 no_decay: Collection[str] = (), **kwargs: Any) -> None:
        self._pipe = pipe
        self.lr_schedule: LRSchedule | None = None
        self._modules = pipe.local_stages()
        unknown = set(no_decay) - set(NO_DECAY_KINDS)
        if unknown or isinstance(no_decay, str):
            raise PipeRuntimeError(f"no_decay takes some of {', '.join(NO_DECAY_KINDS)}, got {no_decay!r}")
        exempt = {s: exempt_names(m, no_decay, pipe.ties.separate(s)) for s, m in self._modules.items()}
        # the pipeline's data-parallel strategy makes it: one torch optimizer over the parameters, or a ZeroOptimizer
        # per stage over flat buffers (ZeRO 1-3, or fp32 main parameters beside low-precision ones)
        self.optimizer: torch.optim.Optimizer | None
        self.optimizer, self._decay = pipe.data_parallel.build(pipe, optimizer_class, kwargs, exempt)
        self.zero: dict[int, ZeroOptimizer] = pipe.data_parallel.zero

    def step(self) -> bool:
        """Unscale and check (fp16), set the scheduled lr, step unless some rank overflowed, update the loss
        scale; returns whether the parameters were updated (the same on every rank).  Collective."""
        skip = self._pipe.unscale_()
        if self.lr_schedule is not None:
            self.set_lr(self.lr_schedule(self._pipe.steps))
        if self.optimizer is not None and not skip:
            if self._decay is not None:
                self._decay.apply(self.optimizer)
            self.optimizer.step()
        for _, zero in sorted(self.zero.items()):
            zero.step(skip=skip)
        self._pipe.update_scale()
        return not skip

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of this object itself: the lr schedule (the torch optimizers' state is saved with
        the stages it belongs to)."""
        return asdict(self.lr_schedule) if self.lr_schedule is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            self.lr_schedule = LRSchedule(**state)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers underneath (one, or one per ZeRO stage)."""
        own = [self.optimizer] if self.optimizer is not None else []
        return own + [z.optimizer for _, z in sorted(self.zero.items())]

    def set_lr(self, lr: float) -> None:
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            # over dp the gradients are views of the reduction's buckets (reduce.py's GradBuckets): zeroed in place,
            # they stay so (a parameter without one is reduced as zeros anyway, so no optimizer skips it)
            self.optimizer.zero_grad(set_to_none=self._pipe.dp == 1)
        for zero in self.zero.values():
            zero.zero_grad()

    def stage_parameters(self, main: bool = False) -> dict[int, dict[str, torch.Tensor]]:
        """{stage: {parameter name: a copy of its values on this rank}} (collective over dp for ZeRO-3); `main`:
        the fp32 main parameters where the model holds low-precision ones (collective over dp).  Tensor-parallel
        DTensor parameters stay DTensors (this rank's shard; `full_tensor()` gathers them over tp)."""
        out = {}
        for s, module in sorted(self._modules.items()):
            if s in self.zero:
                out[s] = self.zero[s].state_dict_full(main)
            else:
                out[s] = {k: v.detach().clone() for k, v in module.named_parameters()}
        return out

    def memory(self) -> dict[int, MemoryReport]:
        """ZeRO's per-stage memory report (empty without ZeRO)."""
        return {s: z.memory() for s, z in sorted(self.zero.items())}

    def measured_bytes(self) -> MemoryReport:
        """Bytes of every parameter, gradient, main-parameter and optimizer-state tensor this rank holds now,
        each storage once (what `pipedsl.plan.memory.model_states` predicts)."""
        reports = list(self.memory().values())
        if self.optimizer is not None:
            params = list(self._pipe.parameters())
            state = [v for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
            reports.append(MemoryReport(unique_bytes(params), unique_bytes(p.grad for p in params),
                                        unique_bytes(state), sum(p.numel() for p in params),
                                        sum(p.numel() for p in params), 0))
        fields = ("params", "grads", "optimizer", "numel", "padded_numel", "peak_grads", "main")
        return MemoryReport(*(sum(getattr(r, f) for r in reports) for f in fields))
