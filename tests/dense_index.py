"""Parallel parameters back in the dense layout, by index: a copy of the dense model whose every element holds its
own number, cut exactly as the weights are (tensor-parallel slices, expert rows), tells where each local element
of a rank belongs — so a check compares every element of every parameter with one process's, whatever the layout."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn


def index_model(model: nn.Module) -> tuple[nn.Module, int]:
    """A copy of the dense model whose parameters hold their element numbers (exact in fp32 below 2^24)."""
    idx = copy.deepcopy(model)
    n = 0
    with torch.no_grad():
        for p in idx.parameters():
            p.copy_(torch.arange(n, n + p.numel(), dtype=torch.float32).view_as(p))
            n += p.numel()
    assert n < 2 ** 24
    return idx, n


def gather_dense(values: dict[int, dict[str, torch.Tensor]], index_stages, n: int) -> dict:
    """Collective over the world: every rank's shards back in the dense layout (mean over copies)."""
    total, count = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    hi, lo = torch.full((n,), -torch.inf, dtype=torch.float64), torch.full((n,), torch.inf, dtype=torch.float64)
    for s, named in values.items():
        index = dict(index_stages[s].named_parameters())
        assert named.keys() == index.keys(), (sorted(named), sorted(index))
        for name, v in named.items():
            i = index[name].detach().reshape(-1).round().long()
            v = v.detach().reshape(-1).double()
            total.index_add_(0, i, v)
            count.index_add_(0, i, torch.ones_like(v))
            hi.scatter_reduce_(0, i, v, "amax")
            lo.scatter_reduce_(0, i, v, "amin")
    dist.all_reduce(total)
    dist.all_reduce(count)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return {"values": total / count.clamp(min=1), "uncovered": int((count == 0).sum()),
            "spread": float((hi - lo)[count > 0].max())}
