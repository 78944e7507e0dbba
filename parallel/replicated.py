"""Which parameters are tensor-parallel copies: the same values and gradients on every rank of a group.

A global gradient norm must count each element of the model once (Megatron-LM's
`param_is_not_tensor_parallel_duplicate`).  A tensor-parallel layer marks the parameters it
keeps whole on every rank of a group — 1-D: LayerNorms, a row-parallel bias, position
embeddings, over the tp group; 3-D: biases and LayerNorm vectors over a q² plane of the cube —
with `mark_replicated(p, group)`; the norm then counts them on the group's first rank only.
Unmarked parameters are this rank's own shard (counted on every rank).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Partial

_ATTR = "_pipedsl_tp_duplicate"  # a plain bool: survives deepcopy and pickling


def mark_replicated(params: nn.Parameter | nn.Module | Iterable[nn.Parameter] | None,
                    group: ProcessGroup | None) -> None:
    """Record that `params` (a parameter, every parameter of a module, or a list) are copies over `group`."""
    if params is None or dist.get_world_size(group) == 1:  # group None: the default (world) group
        return
    if isinstance(params, nn.Module):
        params = params.parameters()
    elif isinstance(params, nn.Parameter):
        params = [params]
    duplicate = dist.get_rank(group) != 0
    for p in params:
        if p is not None:
            setattr(p, _ATTR, duplicate)


def is_duplicate(p: nn.Parameter) -> bool:
    """True on every rank but the first of the group `p` is replicated over (count it elsewhere)."""
    return getattr(p, _ATTR, False)


# ------------------------------------------------------------------------ copies whose gradients are summed once a step

_SUM_LATER = "_pipedsl_tp_sum_later"  # on the module: its parameters' objects may be swapped (`module.to`), it is not
_PARAM_SUM_LATER = "_pipedsl_sequence_parallel"  # on a parameter (tp1d's layers): a plain bool, survives deepcopy


def sum_grads_later(module: nn.Module) -> None:
    """Mark `module`'s own weights as copies over tp applied to this rank's part of the data (a sequence shard,
    its attention heads): each rank's gradient is a partial sum.  DTensor would all-reduce it in every backward;
    marked, it stays partial and the pipeline sums it over tp once per step (runtime/finalize.py,
    Megatron's one all-reduce of the LayerNorm gradients)."""
    setattr(module, _SUM_LATER, True)


def sums_grads_later(module: nn.Module) -> bool:
    return getattr(module, _SUM_LATER, False)


def param_sum_grad_later(p: nn.Parameter) -> None:
    """`sum_grads_later` for one parameter (tp1d's layers, whose parameters are never swapped)."""
    setattr(p, _PARAM_SUM_LATER, True)


def summed_later(module: nn.Module) -> set[str]:
    """The names of `module`'s weights whose tp sum waits for the step end: marked one by one
    (`param_sum_grad_later`, 1-D tp's layers) or owned by a module marked `sum_grads_later` (DTensor tp,
    parallel/tp_hf.py)."""
    owned = {id(p) for m in module.modules() if sums_grads_later(m) for p in m.parameters(recurse=False)}
    return {n for n, p in module.named_parameters()
            if p.requires_grad and (getattr(p, _PARAM_SUM_LATER, False) or id(p) in owned)}


def partial_local(grad: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient as this rank's local part of a sum over its mesh (no communication)."""
    if not isinstance(grad, DTensor):
        return grad
    if not all(p.is_partial() for p in grad.placements):
        grad = grad.redistribute(placements=[Partial()] * len(grad.placements))  # local: a share of a copy
    return grad.to_local()


class FromLocalSummedLater(torch.autograd.Function):
    """`DTensor.from_local(local, mesh, placements, …)` whose backward hands `local` its partial gradient as it is
    (`partial_local`), where from_local's would all-reduce it: for weights marked `sum_grads_later`."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, mesh: Any, placements: tuple, shape: torch.Size,
                stride: tuple[int, ...]) -> DTensor:
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return partial_local(grad), None, None, None, None
