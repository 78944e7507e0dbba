"""The end of a step's gradient work, in one place (Megatron-LM's `finalize_model_grads`).

At each stage's REDUCE_GRAD, and waited at the step end in this order, a pipeline's gradients are:

1. summed between the stage's replica copies on other ranks (reduce.py's `GradReducer`, Chimera);
2. reduced over data parallelism by the pipeline's data-parallel strategy (data_parallel.py: an
   averaging all-reduce, or ZeRO's reduce-scatter into the owned slices);
3. summed over tensor parallelism for weights kept whole on every tp rank but applied to this
   rank's part of the data — sequence-parallel norms, row-parallel biases (`SequenceParallelGradSum`);
4. summed between the ranks holding a tied weight (ties.py), after the handles above.

Beside the gradients, running statistics (BatchNorm's mean, variance and count) are broadcast from
dp rank 0 to the other replicas at the same point (`RunningStatsBroadcast`), as DDP's
`broadcast_buffers` does: every replica then evaluates with the same statistics.

`install` wires them on a new pipeline (runtime/assembly.py); nothing else registers step-end reductions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.nn.modules.batchnorm import _NormBase

from pipedsl.parallel.comm import all_reduce
from pipedsl.parallel.config import ParallelConfigError
from pipedsl.parallel.replicated import summed_later

if TYPE_CHECKING:  # pragma: no cover - for the annotations
    from pipedsl.runtime.data_parallel import Flat, Replicated
    from pipedsl.runtime.reduce import GradReducer
    from pipedsl.runtime.ties import TieReducer


def install(reducer: GradReducer, ties: TieReducer, strategy: Replicated | Flat, modules: dict[int, nn.Module], *,
            tp: tuple[int, ProcessGroup | None], dp: tuple[int, ProcessGroup | None]) -> None:
    """Make the replicas agree, then register the step-end reductions on a new pipeline's `reducer`, in order:
    `strategy`'s dp reduction, the tp sums and the dp broadcast of running statistics of this rank's `modules`
    ({stage: module}); `tp`, `dp`: (size, group)."""
    reducer.broadcast_replicas()
    ties.broadcast()
    strategy.install(reducer, ties)
    tp_sum = SequenceParallelGradSum.for_stages(*tp, modules, strategy.zero)
    if tp_sum is not None:  # after the dp reduction: the same sum on the averaged gradients
        reducer.add_hook(tp_sum)
    stats = RunningStatsBroadcast.for_stages(*dp, modules)
    if stats is not None:
        reducer.add_hook(stats)


def running_stats(module: nn.Module) -> list[torch.Tensor]:
    """The running statistics a training forward updates: BatchNorm's mean, variance and count."""
    return [b for m in module.modules() if isinstance(m, _NormBase) and m.track_running_stats
            for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]


class RunningStatsBroadcast:
    """A REDUCE_GRAD hook: a stage's running statistics from dp rank 0 to the other replicas (DDP's
    `broadcast_buffers`), issued once its forwards of the step are done and waited at the step end.

    Each replica updates BatchNorm's running mean and variance from its own share of the batch, so
    without this the replicas drift apart (0.16 after a few steps in the issue's trial) and a
    checkpoint keeps only dp rank 0's.  Only normalisation modules that track running statistics
    are broadcast: other buffers (rotary tables, masks) do not change in a forward.
    """

    def __init__(self, group: ProcessGroup, buffers: dict[int, list[torch.Tensor]]) -> None:
        self.group, self.buffers = group, buffers
        self.src = dist.get_global_rank(group, 0)

    @classmethod
    def for_stages(cls, dp: int, group: ProcessGroup | None, modules: dict[int, nn.Module]
                   ) -> RunningStatsBroadcast | None:
        """The hook for these stages, or None without dp or without running statistics (the same on every replica)."""
        if dp == 1 or group is None:
            return None
        buffers = {s: running_stats(module) for s, module in modules.items()}
        return cls(group, buffers) if any(buffers.values()) else None

    def __call__(self, stage: int, module: nn.Module) -> _PendingBroadcast | None:
        tensors = self.buffers.get(stage)
        if not tensors:
            return None
        return _PendingBroadcast([dist.broadcast(t, src=self.src, group=self.group, async_op=True) for t in tensors])


class _PendingBroadcast:
    __slots__ = ("works",)

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class SequenceParallelGradSum:
    """A REDUCE_GRAD hook: sum over tp the gradients of the weights marked to be summed later (tp1d's
    `defer_grad_sum`, tp_hf's norms; Megatron's all-reduce of LayerNorm gradients under sequence parallelism),
    once per step and stage.

    Its handle's `wait()` runs at the step end after the data-parallel reduction's, on the gradients
    the optimizer steps: `.grad`, or a `ZeroOptimizer`'s owned slices, whose entries lie at the same
    offsets on every tp rank (the tp ranks' stages hold parameters of equal shapes).  Summing after the
    dp average is the same sum.  Names are taken now: ZeRO later replaces the parameters by views.
    """

    def __init__(self, group: ProcessGroup | None, modules: dict[int, nn.Module], zero: dict) -> None:
        self.group, self.zero = group, zero  # zero: {stage: ZeroOptimizer}, filled when the optimizer is made
        self.names = {s: summed_later(m) for s, m in modules.items()}

    @classmethod
    def for_stages(cls, tp: int, group: ProcessGroup | None, modules: dict[int, nn.Module],
                   zero: dict) -> SequenceParallelGradSum | None:
        """The hook for these stages, or None when none holds marked weights (every tp peer holds the same stages)."""
        if tp == 1:
            marked = sorted({f"stage {s}: {n}" for s, m in modules.items() for n in summed_later(m)})
            if marked:  # their gradients would stay partial sums: nobody sums them over tp
                raise ParallelConfigError(f"these stages are tensor-parallel: weights such as "
                                          f"{', '.join(marked[:3])} get partial gradients that the pipeline sums "
                                          f"over tp at each step's end, but the pipeline has no tp dimension: "
                                          f"pass parallel=mesh, the mesh the stages were split over")
            return None
        hook = cls(group, modules, zero)
        return hook if any(hook.names.values()) else None

    def __call__(self, stage: int, module: nn.Module) -> _PendingSum | None:
        return _PendingSum(self, stage, module) if self.names.get(stage) else None

    def gradients(self, stage: int, module: nn.Module) -> list[torch.Tensor]:
        names = self.names[stage]
        z = self.zero.get(stage)
        if z is not None:
            return [grad[lo:hi] for grad, entries in z.owned_gradients() for n, lo, hi in entries if n in names]
        grads = []
        for n, p in module.named_parameters():  # the same order on every tp rank
            if n in names:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)  # (to_local: a view)
        return grads


class _PendingSum:
    """Waited at the step end, after the handles registered before it (the dp reduction's)."""

    __slots__ = ("owner", "stage", "module")

    def __init__(self, owner: SequenceParallelGradSum, stage: int, module: nn.Module) -> None:
        self.owner, self.stage, self.module = owner, stage, module

    def wait(self) -> None:
        grads = [g for g in self.owner.gradients(self.stage, self.module) if g.numel()]
        if not grads:  # a ZeRO slice holding none of them: the same slice, so the same answer, on every tp peer
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce(flat, self.owner.group)
        o = 0
        for g in grads:
            g.copy_(flat[o:o + g.numel()].view_as(g))
            o += g.numel()
