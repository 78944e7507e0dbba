"""How a step's loss is normalised: one `LossPolicy` per pipeline, given to every stage it builds.

The last stage multiplies each microbatch's loss before its backward by

    reduction="microbatch"   1/M: the loss function's mean, so the step's gradient is the mean of the
                             microbatches' (averaged over dp by the dp reduction)
    reduction="token"        dp/N: the microbatch's summed token losses, N the targets != ignore_index
                             of the *global* batch, so dp's averaging gives sum/N however unevenly
                             padding falls (Megatron's and torchtitan's per-token normalisation)

and, under fp16, by this step's loss scale (`precision.LossScaling` owns it; the pipeline hands it
over when a step starts).  The executor weighs the losses it reports with the same factor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pipedsl.errors import PipeRuntimeError
from pipedsl.runtime.launch.errors import RankFailure

LOSS_REDUCTIONS = ("microbatch", "token")


class LossPolicy:
    """The last stage's loss multipliers for the current step (see the module docstring)."""

    def __init__(self, reduction: str = "microbatch", num_microbatches: int = 1, ignore_index: int = -100) -> None:
        if reduction not in LOSS_REDUCTIONS:
            raise PipeRuntimeError(f"loss_reduction must be one of {', '.join(map(repr, LOSS_REDUCTIONS))}, "
                                   f"got {reduction!r}")
        self.reduction, self.ignore_index = reduction, ignore_index
        self.sums = reduction == "token"  # the loss function's value is summed (per-token losses or a sum)
        self.factor = 1.0 / num_microbatches  # per-token mode: dp / N, set each step by `count_tokens`
        self.loss_scale = 1.0  # fp16's dynamic loss scale this step
        self.tokens: int | None = None  # per-token mode: the last step's N (ranks holding the last stage)

    def reduce(self, loss: Any) -> Any:
        """The loss function's value as the microbatch's loss: summed in the per-token mode."""
        return loss.sum() if self.sums and isinstance(loss, torch.Tensor) else loss

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """What the backward starts from: the loss × the factor (× the fp16 loss scale)."""
        scaled = loss * self.factor
        return scaled * self.loss_scale if self.loss_scale != 1.0 else scaled

    def count_tokens(self, targets: Any, dp: int, group: dist.ProcessGroup | None, rank: int,
                     device: torch.device) -> None:
        """Per-token mode, on a rank holding the last stage: N from this step's targets — the global batch, or
        (`group`: batch="local") this replica's share summed over the dp group — and the factor dp/N."""
        t = targets[0] if isinstance(targets, (tuple, list)) and targets else targets
        if not isinstance(t, torch.Tensor):
            raise PipeRuntimeError(f"rank {rank}: loss_reduction='token' counts the targets that are not "
                                   f"ignore_index={self.ignore_index}, but this rank (which holds the last stage) "
                                   f"got targets of type {type(t).__name__}; pass a tensor (or a tuple whose first "
                                   f"element is the token targets)")
        n = (t != self.ignore_index).sum().reshape(1).to(device, torch.int64)
        if group is not None:
            try:
                dist.all_reduce(n, group=group)
            except Exception as err:  # noqa: BLE001
                raise RankFailure(f"rank {rank}: summing the token count over dp failed: {err}", rank,
                                  peer_failure=True) from err
        self.tokens = int(n)
        self.factor = dp / max(self.tokens, 1)  # no token at all: the loss and gradients are 0
