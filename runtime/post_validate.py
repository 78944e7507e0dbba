"""Training steps, synchronous or post-validated (issue 48; the zero-bubble paper's optimizer post-validation).

A synchronous step ends with collectives over every rank — the global gradient norm for clipping, the inf/NaN
check, the loss — before any rank may step its optimizer, so step k+1's warm-up waits for step k's cool-down.
Post-validated, each rank steps as soon as its own part of step k is done, assuming the checks pass (no
clipping, finite gradients): it keeps a copy of what the step changes and issues the checks as asynchronous
all-reduces.  In step k+1 a rank needs their result, the verdict, only at its gate, before its first backward
(`pipedsl.steps.gates`); every rank has ended step k by then, so the verdict is in.  When it says step k should
have been clipped, or skipped for a gradient that is not finite, every rank undoes step k+1's forward work
(the executor's `StepRedoneError`), restores the copy, redoes step k as the synchronous step does, and runs step
k+1 again.  The parameters and optimizer state after every step equal the synchronous run's, bit for bit.

    steps = TrainingSteps(pipe, opt, max_norm=1.0, post_validate=True)
    for x, y in batches:
        report = steps.step(x, y)   # post-validated: the previous step's report (None after the first)
    report = steps.settle()         # the last step's; also before a checkpoint, an evaluation, reading weights

With clipping, or post-validated, both modes skip a step whose gradient norm is not finite (no update, as fp16
does for an overflow).  fp16's loss scale is updated with the optimistic step as if no rank overflowed (each
rank unscales its own gradients; a rank's overflow makes the global norm not finite) and put back when the step
is redone, so a redone step skips and backs the scale off as the synchronous one does.  Synchronous steps without
clipping compute no norm: the optimizer steps as it always did.  The copy costs one set of the rank's
parameters and optimizer state (ZeRO: what it holds).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from pipedsl.ir import Program
from pipedsl.runtime import clip
from pipedsl.runtime.executor import StepRedoneError
from pipedsl.runtime.finalize import running_stats
from pipedsl.runtime.launch.errors import RankFailure
from pipedsl.runtime.precision import LossScaler, LossScaling
from pipedsl.runtime.recompute import rng_state, set_rng_state
from pipedsl.steps import gates

if TYPE_CHECKING:  # pragma: no cover
    from pipedsl.runtime.optim import PipelineOptimizer


class SteppedPipeline(Protocol):
    """What a training step reads and runs of its pipeline (`Pipeline` is one): its program and place, its
    training pass (gated) and its step count, fp16's loss scaling, the gradients and the group of their norm."""

    program: Program
    rank: int
    device: torch.device
    steps: int
    loss_scaling: LossScaling

    @property
    def scaler(self) -> LossScaler | None: ...

    def local_stages(self) -> dict[int, nn.Module]: ...

    def step(self, inputs: Any, targets: Any = None) -> float: ...

    def unscale_(self) -> bool: ...

    def gradients(self) -> clip.Gradients: ...

    def _norm_group(self) -> dist.ProcessGroup | None: ...

    def _stepped(self) -> list[torch.Tensor]: ...

    def _check_open(self, what: str) -> None: ...

    def _failures_told(self) -> AbstractContextManager[None]: ...

    def _train_pass(self, inputs: Any, targets: Any, on_loss: Callable[[torch.Tensor], None] | None = None,
                    gate: Callable[[], bool] | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class StepReport:
    """What one training step did: its mean loss, the global gradient norm before clipping, whether clipping
    scaled the gradients, whether the update was skipped (a norm that is not finite, or fp16's overflow), whether a
    post-validated step was redone (rolled back, then clipped or skipped), and its learning rate."""

    step: int
    loss: float
    grad_norm: float | None  # None: synchronous steps without clipping do not compute it
    clipped: bool
    skipped: bool
    redone: bool = False
    lr: float | None = None  # the learning rate the step used


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


class _Copy:
    """What an optimizer step changes on this rank — the stepped tensors, the model's flat buffers, the
    optimizers' state — copied before an optimistic step, into buffers reused from step to step."""

    def __init__(self, opt: PipelineOptimizer) -> None:
        tensors: list[torch.Tensor] = []
        storages: set[int] = set()
        for zero in opt.zero.values():  # the model's whole buffers first: slices of them are then copied with them
            for u in zero.units:
                if u.trainable:
                    t = _local(u.shard if u.frees else u.flat)
                    tensors.append(t)
                    storages.add(t.untyped_storage().data_ptr())
        for o in opt.optimizers:  # the optimizers' own tensors, but for slices of the buffers above
            for group in o.param_groups:
                tensors += [t for p in group["params"] for t in [_local(p)]
                            if t.untyped_storage().data_ptr() not in storages]
        self._optimizers = opt.optimizers
        self._tensors = tensors
        self._saved: list[torch.Tensor] = []
        self._state: list[dict[Any, dict[str, Any]]] = []

    def take(self) -> None:
        with torch.no_grad():
            if not self._saved:
                self._saved = [t.clone() for t in self._tensors]
            else:
                for t, s in zip(self._tensors, self._saved):
                    s.copy_(t)
            old = self._state or [{} for _ in self._optimizers]
            self._state = [{p: {k: _kept(v, old[i].get(p, {}).get(k)) for k, v in st.items()}
                            for p, st in o.state.items()} for i, o in enumerate(self._optimizers)]

    def restore(self) -> None:
        with torch.no_grad():
            for t, s in zip(self._tensors, self._saved):
                t.copy_(s)
            for o, saved in zip(self._optimizers, self._state):
                for p in [p for p in o.state if p not in saved]:
                    del o.state[p]  # made by the step being undone (the optimizer's first)
                for p, st in saved.items():
                    live = o.state[p]
                    for k, v in st.items():
                        if isinstance(v, torch.Tensor) and isinstance(live.get(k), torch.Tensor):
                            live[k].copy_(v)
                        else:
                            live[k] = v.clone() if isinstance(v, torch.Tensor) else v


def _kept(value: Any, buffer: torch.Tensor | None) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if buffer is not None and buffer.shape == value.shape and buffer.dtype == value.dtype:
        return buffer.copy_(value)
    return value.clone()


@dataclass
class _Verdict:
    """A post-validated step's checks in flight: the norm's and the loss's all-reduces."""

    step: int
    norm: torch.Tensor
    norm_work: Any
    loss: torch.Tensor
    loss_work: Any
    pipelines: int
    scale: dict[str, Any] | None  # fp16: the loss scale's state before the step updated it
    lr: float | None = None


class TrainingSteps:
    """`step(inputs, targets)`: forward, backward, clipping by the global norm (`max_norm`, None: none), the
    optimizer's step and zero_grad — synchronous, or post-validated (see the module docstring)."""

    def __init__(self, pipe: SteppedPipeline, opt: PipelineOptimizer, max_norm: float | None = None,
                 norm_type: float = 2.0, post_validate: bool = False) -> None:
        if post_validate:
            gates(pipe.program)  # a program whose forwards before the gates are no consistent cut: refused now
        self.pipe, self.opt = pipe, opt
        self.max_norm = max_norm
        self.norm_type = clip.check_norm_type(norm_type)
        self.post_validate = post_validate
        self._copy = _Copy(opt) if post_validate else None
        self._pending: _Verdict | None = None
        self._report: StepReport | None = None  # the verdict's, once the gate has read it
        self._stats = [b for module in pipe.local_stages().values() for b in running_stats(module)]
        self.redone = 0  # post-validated steps rolled back and redone so far
        # more state a pass changes that an undone pass must give back: each called at a gated pass's start
        # returns what restores it (the trainer's expert-load counts: ExpertLoad.mark)
        self.pass_state: list[Callable[[], Callable[[], None]]] = []

    # ------------------------------------------------------------ synchronous

    def step(self, inputs: Any, targets: Any = None) -> StepReport | None:
        """One training step.  Synchronous: its report.  Post-validated: the previous step's (None after the
        first); collective like `Pipeline.step`."""
        if not self.post_validate:
            return self._synchronous(inputs, targets)
        return self._post_validated(inputs, targets)

    def _synchronous(self, inputs: Any, targets: Any) -> StepReport:
        pipe = self.pipe
        loss = pipe.step(inputs, targets)
        if self.max_norm is None:  # no global norm to wait for: the optimizer's step as it always was
            stepped = self.opt.step()
            self.opt.zero_grad()
            return StepReport(pipe.steps, loss, None, False, not stepped, lr=self._lr())
        pipe.unscale_()
        grads = pipe.gradients()
        norm = clip.global_norm(grads.counted, self.norm_type, pipe._norm_group(), pipe.device)
        return self._apply(norm, grads, pipe.steps, loss, redone=False)

    def _clips(self, norm: torch.Tensor) -> bool:
        """Whether clipping scales gradients of this global norm (a finite one): `clip.clip_`'s factor below 1."""
        return self.max_norm is not None and float(self.max_norm / (norm + 1e-6)) < 1.0

    def _apply(self, norm: torch.Tensor, grads: clip.Gradients, step: int, loss: float, redone: bool) -> StepReport:
        """The synchronous step's end given the global norm: clip, step (or skip), zero the gradients."""
        finite = bool(torch.isfinite(norm))
        clipped = finite and self._clips(norm)
        if clipped:
            clip.clip_(grads.stepped, norm, float(self.max_norm))
        # fp16: the optimizer's step itself skips an overflowed step and backs the loss scale off
        stepped = self.opt.step() if finite or self.pipe.scaler is not None else self._skip()
        self.opt.zero_grad()
        return StepReport(step, loss, float(norm), clipped, not stepped, redone, self._lr())

    def _lr(self) -> float | None:
        optimizers = self.opt.optimizers
        return optimizers[0].param_groups[0]["lr"] if optimizers else None

    def _skip(self) -> bool:
        for _, zero in sorted(self.opt.zero.items()):
            zero.step(skip=True)  # completes the reduction and frees gathered stage-3 buffers
        return False

    # ------------------------------------------------------------ post-validated

    def _post_validated(self, inputs: Any, targets: Any) -> StepReport | None:
        pipe = self.pipe
        pipe._check_open("step()")
        self._report = None
        gated = self._pending is not None  # this pass may be undone: what it changes besides, kept
        rng = rng_state() if gated else None
        stats = [(b, b.clone()) for b in self._stats] if gated else []
        restores = [mark() for mark in self.pass_state] if gated else []
        with pipe._failures_told():
            try:
                loss_sum = pipe._train_pass(inputs, targets, gate=self._gate if gated else None)
            except StepRedoneError:
                assert rng is not None
                set_rng_state(rng)
                with torch.no_grad():
                    for b, saved in stats:
                        b.copy_(saved)
                for restore in restores:
                    restore()
                loss_sum = pipe._train_pass(inputs, targets)
            report = self._report
            pipe.steps += 1
            self._optimistic_step(loss_sum)
        return report

    def _optimistic_step(self, loss_sum: torch.Tensor) -> None:
        """Issue the checks, keep a copy, step as if they pass (no clipping, finite gradients)."""
        pipe = self.pipe
        group = pipe._norm_group()
        scale = pipe.loss_scaling.state_dict()  # fp16: as it was before this step's update
        pipe.loss_scaling.unscale_assuming_no_overflow_(pipe._stepped, pipe.device)  # the norm tells, later
        grads = pipe.gradients()
        norm, norm_work = clip.start_global_norm(grads.counted, self.norm_type, group, pipe.device, async_op=True)
        loss = loss_sum.to(pipe.device, dtype=torch.float64, copy=True).reshape(1)
        loss_work = dist.all_reduce(loss, group=group, async_op=True)
        pipelines = dist.get_world_size(group) // pipe.program.num_ranks
        self._pending = _Verdict(pipe.steps, norm, norm_work, loss, loss_work, pipelines, scale)
        assert self._copy is not None
        self._copy.take()
        self.opt.step()
        self._pending.lr = self._lr()

    def _verdict(self) -> tuple[_Verdict, torch.Tensor, float]:
        v = self._pending
        assert v is not None
        try:
            v.norm_work.wait()
            v.loss_work.wait()
        except Exception as err:  # noqa: BLE001
            raise RankFailure(f"rank {self.pipe.rank}: the checks of step {v.step} (gradient norm, loss) failed: "
                              f"{err}", self.pipe.rank, peer_failure=True) from err
        return v, clip.finish_global_norm(v.norm, self.norm_type), float(v.loss[0]) / v.pipelines

    def _gate(self) -> bool:
        """At step k+1's gate: step k's verdict.  True: the optimistic step stands (its gradients are zeroed for
        step k+1's backward); False: it must be redone, after step k+1's forward work is undone."""
        v, norm, loss = self._verdict()
        if math.isfinite(float(norm)) and not self._clips(norm):
            self._pending = None
            self.opt.zero_grad()
            self._report = StepReport(v.step, loss, float(norm), False, False, lr=v.lr)
            return True
        self._redo(v, norm, loss)
        return False

    def _redo(self, v: _Verdict, norm: torch.Tensor, loss: float) -> None:
        """Undo step k's optimistic update and do it as the synchronous step: clipped, or skipped."""
        assert self._copy is not None
        self._copy.restore()
        self.pipe.loss_scaling.redo(not math.isfinite(float(norm)), v.scale)  # fp16: the scale as before the step
        self._pending = None
        self.redone += 1
        self._report = self._apply(norm, self.pipe.gradients(), v.step, loss, redone=True)

    def settle(self) -> StepReport | None:
        """The last step's report, its verdict read and its step redone if it must be: the parameters and the
        optimizer state are then the synchronous run's.  Call before a checkpoint, an evaluation or reading the
        weights; collective (every rank).  None when nothing is pending (synchronous steps, or settled)."""
        if self._pending is None:
            return None
        with self.pipe._failures_told():
            self._gate()
        return self._report

