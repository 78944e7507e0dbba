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

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

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
