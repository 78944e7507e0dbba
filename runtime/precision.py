"""Mixed precision for pipelines: autocast compute, fp32 weights and gradients, half-size messages.

    pipe = pipedsl.Pipeline(stages, "1f1b", microbatches=8, loss_fn=F.cross_entropy, precision="bf16")
    loss = pipe.step(x, y)
    pipe.clip_grad_norm_(1.0)        # fp16: unscales first (once per step)
    opt.step(); opt.zero_grad()      # opt = pipe.optimizer(...): fp16 skips a step that overflowed

The policy, in the terms of torch FSDP2's `MixedPrecisionPolicy(param_dtype, reduce_dtype,
output_dtype)` and of Megatron-LM's fp32 main parameters and gradients:

- **compute** (FSDP2's `param_dtype`): each stage's forward, and the loss, run under
  `torch.autocast(dtype)`, so matmuls and convolutions run in bf16/fp16 on weights cast per op.
  The parameters themselves stay fp32: they *are* Megatron's fp32 main parameters (no second,
  low-precision copy is kept between steps, so there is nothing to keep in sync, and ZeRO's
  flat buffers, tensor-parallel shards, tied weights and checkpoints are unchanged).
- **gradients** (FSDP2's `reduce_dtype`, Megatron's `accumulate_allreduce_grads_in_fp32`):
  the backward of autocast's casts delivers fp32 gradients to the fp32 parameters, so
  gradients accumulate over the microbatches in fp32 and are reduced (stage replicas, ties,
  data parallel, ZeRO reduce-scatter) in fp32.
- **stage outputs** (FSDP2's `output_dtype`): every floating-point output of a stage is cast
  to the compute dtype, so the activations sent to the next stage *and* the gradients sent
  back are bf16/fp16: half the point-to-point bytes of fp32 (`Channels.sent_bytes`, measured
  in benchmarks/precision.py).  The cast happens at every stage boundary, also between two
  stages on one rank, so the pipeline computes exactly what one process computes when it runs
  the stages in sequence under the same policy (`run_stages`).
- **fp16** has a narrow range: the loss is multiplied by a dynamic scale before the backward
  (`LossScaler`, growth and backoff as `torch.amp.GradScaler`).  After the step the gradients
  are unscaled and checked for inf/NaN on every rank, and one all-reduce (MAX) of the found-inf
  flag over every pipeline, tensor- and data-parallel rank makes them all skip the step
  together and back the scale off (`Pipeline.unscale_`).  bf16 has fp32's range and needs no
  scaling.

Low-precision parameters (`MixedPrecision("bf16", params="bf16")`, Megatron's `Float16Module` +
distributed optimizer, FSDP2's bf16 parameters over fp32 shards): the model holds bf16
parameters and the optimizer fp32 main copies, sharded by ZeRO, in `ZeroOptimizer`'s flat
buffers (parallel/zero.py); gradients accumulate and are reduced in fp32 (`grads`, default) or in
bf16.  Autocast still wraps the forward (norms and softmax stay fp32).  Bytes per parameter and
tolerances: docs/training-state.md.  fp16 loss scaling has one owner, `LossScaling`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipedsl.errors import PipeRuntimeError
from pipedsl.runtime import clip

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class MixedPrecision:
    """A precision policy: compute dtype (autocast), the dtype of stage outputs, loss scaling (fp16).

    `MixedPrecision("bf16")` is what `precision="bf16"` means; the loss-scaling fields follow
    `torch.amp.GradScaler`'s defaults and only apply to fp16 (`loss_scaling=None`: on for fp16).
    """

    compute: str = "fp32"
    output: str | None = None  # the dtype of stage outputs sent on; default: the compute dtype
    params: str = "fp32"  # the model's parameters: fp32 (autocast mode) or the compute dtype (fp32 main copies)
    grads: str | None = None  # accumulation and reduction over microbatches; default fp32 (Megatron's)
    loss_scaling: bool | None = None
    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        for what, name in (("compute", self.compute), ("output", self.output)):
            if name is not None and name not in DTYPES:
                raise PipeRuntimeError(f"precision {what}={name!r}: expected one of {', '.join(map(repr, DTYPES))}")
        if self.params not in ("fp32", self.compute):
            raise PipeRuntimeError(f"precision params={self.params!r}: the parameters are held in fp32 (autocast) or "
                                   f"in the compute dtype {self.compute!r}")
        if self.grads is not None and self.grads not in ("fp32", self.params):
            raise PipeRuntimeError(f"precision grads={self.grads!r}: gradients accumulate in fp32 or in the "
                                   f"parameters' dtype {self.params!r}")
        if not (self.init_scale > 0 and self.growth_factor > 1 and 0 < self.backoff_factor < 1
                and self.growth_interval >= 1):
            raise PipeRuntimeError(f"loss scaling needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 "
                                   f"and growth_interval >= 1, got {self.init_scale}, {self.growth_factor}, "
                                   f"{self.backoff_factor}, {self.growth_interval}")

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.compute]

    @property
    def output_dtype(self) -> torch.dtype:
        return DTYPES[self.output or self.compute]

    @property
    def keeps_main(self) -> bool:
        """Low-precision parameters: the optimizer steps fp32 main copies (sharded by ZeRO) and writes them back."""
        return self.params != "fp32"

    @property
    def param_dtype(self) -> torch.dtype:
        return DTYPES[self.params]

    @property
    def grad_dtype(self) -> torch.dtype:
        return DTYPES[self.grads or "fp32"]

    @property
    def scales_loss(self) -> bool:
        return self.compute == "fp16" if self.loss_scaling is None else self.loss_scaling

    def autocast(self, device: torch.device | str) -> contextlib.AbstractContextManager:
        """The context a stage's forward (and the loss) runs in."""
        if self.compute == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(torch.device(device).type, dtype=self.dtype)

    def cast_outputs(self, outputs: list[Any]) -> list[Any]:
        """Floating-point stage outputs in the output dtype and contiguous, as a message arrives: the next
        stage computes on the same layout whether it runs on this rank or another (a low-precision
        kernel's rounding depends on the layout)."""
        dt = self.output_dtype
        if self.compute == "fp32" and self.output is None:
            return outputs
        return [t.to(dt).contiguous()
                if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in outputs]


def policy(precision: str | MixedPrecision | None) -> MixedPrecision:
    """`Pipeline(precision=…)`: "fp32" (default), "bf16", "fp16" or a `MixedPrecision`."""
    if precision is None:
        return MixedPrecision()
    if isinstance(precision, MixedPrecision):
        return precision
    if isinstance(precision, str) and precision in DTYPES:
        return MixedPrecision(precision)
    raise PipeRuntimeError(f"precision must be one of {', '.join(map(repr, DTYPES))} or a MixedPrecision, "
                           f"got {precision!r}")


def run_stages(stages: Sequence[nn.Module], inputs: Any, precision: str | MixedPrecision,
               loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, target: Any = None,
               device: torch.device | str = "cpu") -> Any:
    """One process, the stages in sequence under the pipeline's policy: autocast per stage, outputs cast
    at every boundary, the loss under the last stage's autocast.  The reference a pipeline equals."""
    pol = policy(precision)
    x = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
    for k, stage in enumerate(stages):
        with pol.autocast(device):
            out = stage(*x)
            if k == len(stages) - 1:
                return out if loss_fn is None else loss_fn(out, target)
        x = pol.cast_outputs(list(out) if isinstance(out, (tuple, list)) else [out])
    raise PipeRuntimeError("run_stages needs at least one stage")


class LossScaler:
    """Dynamic loss scale with `torch.amp.GradScaler`'s rule: back off on overflow, grow after
    `growth_interval` clean steps.  The state is the same on every rank (the overflow verdict is
    global), saved and restored by runtime/checkpoint/state.py."""

    def __init__(self, pol: MixedPrecision) -> None:
        self.scale = float(pol.init_scale)
        self.growth_factor, self.backoff_factor = pol.growth_factor, pol.backoff_factor
        self.growth_interval = pol.growth_interval
        self.growth_tracker = 0  # clean steps since the last change
        self.skipped = 0  # steps skipped for overflow, in total

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.skipped = int(state.get("skipped", 0))



class LossScaling:
    """The one owner of fp16 loss scaling: the dynamic scale and this step's unscale / overflow verdict.

    The pipeline multiplies each step's loss by `begin_step()`; before the optimizer reads the
    gradients, `unscale_` divides them once and decides, for every rank of the world at once,
    whether the step overflowed; `update()` (after the optimizer step or its skip) grows or backs
    off the scale, once.  Without loss scaling every call is a no-op and the scale is 1.
    """

    def __init__(self, pol: MixedPrecision) -> None:
        self.scaler = LossScaler(pol) if pol.scales_loss else None
        self.found_inf = False  # this step's global overflow verdict
        self._scaled = False  # the step's gradients still carry the scale
        self._update_due = False

    def begin_step(self) -> float:
        """The factor this step's loss is multiplied by."""
        if self.scaler is None:
            return 1.0
        self._scaled = self._update_due = True
        self.found_inf = False
        return self.scaler.scale

    def unscale_(self, gradients: Callable[[], list[torch.Tensor]], group: Any, device: torch.device) -> bool:
        """Divide `gradients()` (the tensors the optimizer steps) by the scale, once a step; whether any rank
        overflowed.  Collective over `group` when there is something to unscale."""
        if self.scaler is not None and self._scaled:
            self.found_inf = clip.unscale_(gradients(), self.scaler.scale, group, device)
            self._scaled = False
        return self.found_inf

    def unscale_assuming_no_overflow_(self, gradients: Callable[[], list[torch.Tensor]],
                                      device: torch.device) -> None:
        """Post-validated steps (post_validate.py): divide this step's gradients by the scale without the
        world's overflow verdict, which the step's gradient norm gives later (not finite: some rank overflowed)."""
        if self.scaler is not None and self._scaled:
            clip.unscale_(gradients(), self.scaler.scale, None, device, reduce=False)
            self._scaled = False
            self.found_inf = False

    def redo(self, found_inf: bool, state: dict[str, Any] | None) -> None:
        """Post-validated steps: back to a step's end before its optimizer step — the scale as it was (`state`),
        the gradients unscaled, the verdict `found_inf` — so that the step is redone as the synchronous one."""
        if self.scaler is None:
            return
        if state is not None:
            self.scaler.load_state_dict(state)
        self._scaled, self._update_due, self.found_inf = False, True, found_inf

    def update(self, gradients: Callable[[], list[torch.Tensor]], group: Any, device: torch.device) -> None:
        """After the optimizer step (or its skip): grow or back off the scale, once a step."""
        if self.scaler is not None and self._update_due:
            self.unscale_(gradients, group, device)
            self.scaler.update(self.found_inf)
            self._update_due = False

    def state_dict(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state is not None:
            self.scaler.load_state_dict(state)
