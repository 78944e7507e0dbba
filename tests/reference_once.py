"""A multi-rank equality test's one-process reference, trained on one rank and sent to the others.

Each rank of a pool case compares what it holds with the whole model trained in one process.  Trained on every rank,
that is one identical run a rank (eight at 8 ranks, about a quarter of a rank's CPU in the MoE cases); `on_rank_zero`
trains it once and gives every rank its results and the trained weights.  The reference itself is unchanged: the
same model, batches, steps and optimizer, in one process with no pipeline."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist
from torch import nn

T = TypeVar("T")


def on_rank_zero(train: Callable[[], T], model: nn.Module) -> T:
    """`train()` (which trains `model`, the reference copy) on rank 0 of the default group; every rank gets its
    result back, and `model` holds the trained weights and buffers on every rank.  What is sent travels on the CPU
    (benchmarks/gpu_check.py runs these cases on a GPU): `train()` returns host values."""
    box: list[object] = [None]
    if dist.get_rank() == 0:
        box = [(train(), {k: v.detach().cpu() for k, v in model.state_dict().items()})]
    dist.broadcast_object_list(box, src=0)
    result, state = box[0]  # type: ignore[misc]
    if dist.get_rank() != 0:
        model.load_state_dict(state)
    return result
