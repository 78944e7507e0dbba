"""The whole model's gradient norm across pipeline, tensor and data-parallel ranks; clipping; fp16 unscaling.

A pipeline's gradients are spread over ranks, and some exist more than once: a stage's
copies on other ranks (Chimera replicas) hold the same summed gradient after REDUCE_GRAD,
tied weights hold the same summed gradient on every holding rank, tensor-parallel
LayerNorms and biases are whole on every rank of their group (parallel/replicated.py), and
without ZeRO every data-parallel replica holds the same averaged gradients.  A
`clip_grad_norm_` per rank would see one stage only (the bug Megatron-LM's and DeepSpeed's
trackers keep showing).  So, as Megatron's `get_grad_norm_fp32` does, each rank sums the
p-th powers of the gradient elements it *owns* — every element of the model is owned by
exactly one rank — and one all-reduce over the world gives the norm everywhere:

- a stage's elements are owned by the rank holding its replica-0 copy;
- a tie's by that rank for the tie's first stage (the other copies are skipped);
- a tensor-parallel copy by the first rank of its group; a DTensor parameter (torch's tensor
  parallelism, parallel/tp_hf.py) by each rank for its local shard, and along every mesh
  dimension it is `Replicate` on, by that dimension's first rank only (counted once);
- without ZeRO, by data-parallel replica 0; with ZeRO 1-3 each dp rank owns its slice of
  every flat buffer (the gradients the ZeroOptimizer steps with after the reduce-scatter);
- an expert shard (parallel/expert.py) by each rank of the first ep group (its edp rank 0),
  with ZeRO by each rank for its slice.

Clipping then scales every gradient the rank's optimizer steps with (copies included) by the
same factor, `max_norm / (norm + 1e-6)` clamped to 1, as `torch.nn.utils.clip_grad_norm_`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from pipedsl.errors import PipeRuntimeError
from pipedsl.ir import Program
from pipedsl.parallel.expert import ExpertParallel, expert_parameters
from pipedsl.parallel.replicated import is_duplicate


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view of its storage: scaling it in place scales the DTensor), else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


def dtensor_owner(p: torch.Tensor) -> bool:
    """False for a DTensor whose elements this rank holds as a copy: `Replicate` on a mesh dimension
    where this rank is not at coordinate 0.  (Shards are counted by every rank: each holds its own.)"""
    if not isinstance(p, DTensor):
        return True
    coord = p.device_mesh.get_coordinate() or []
    return all(c == 0 for c, pl in zip(coord, p.placements) if not isinstance(pl, Shard))


@dataclass
class Gradients:
    """This rank's gradients: every tensor its optimizer steps with, and the views it counts in the norm."""

    stepped: list[torch.Tensor]
    counted: list[torch.Tensor]


class GradientOwnership:
    """Which parameters of each local stage this rank counts in global norms (decided once, at init,
    before ZeRO replaces the stages' parameters by flat buffers: kept by name)."""

    def __init__(self, program: Program, rank: int, modules: dict[int, nn.Module],
                 ties: Sequence[Sequence[tuple[int, str]]], dp_rank: int, zero: int) -> None:
        self.modules = modules
        self.zero, self.dp_rank = zero, dp_rank
        self.dp_owner = zero > 0 or dp_rank == 0  # without ZeRO, dp replica 0 counts the replicated gradients
        tied = {(s, name) for tie in ties for s, name in tie}
        first = {min(tie, key=lambda m: m[0]) for tie in ties}  # a tie is counted in its first stage
        self.counted: dict[int, set[str]] = {}
        # expert shards (parallel/expert.py) are replicated over their edp group only: its first rank counts them
        self.experts = {s: {name for name, p in module.named_parameters() if id(p) in ids}
                        for s, module in modules.items()
                        for ids in [{id(p) for p in expert_parameters(module)}]}
        groups = [m.edp_group for module in modules.values() for m in module.modules() if isinstance(m, ExpertParallel)]
        self.edp_owner = zero > 0 or not groups or dist.get_rank(groups[0]) == 0
        for s, module in modules.items():
            owner = program.placement[(0, s)] == rank
            self.counted[s] = {name for name, p in module.named_parameters()
                               if owner and p.requires_grad and not is_duplicate(p) and dtensor_owner(p)
                               and ((s, name) not in tied or (s, name) in first)}

    def gradients(self, zero_optimizers: dict) -> Gradients:
        """The current gradients; stages in `zero_optimizers` ({stage: ZeroOptimizer}) by their owned slices."""
        stepped: list[torch.Tensor] = []
        counted: list[torch.Tensor] = []
        seen: set[int] = set()
        for s, module in sorted(self.modules.items()):
            names = self.counted[s]
            z = zero_optimizers.get(s)
            if z is not None:
                owns = z.stage > 0 or self.dp_rank == 0  # a stage-0 flat buffer is whole on every dp replica
                for grad, entries in z.owned_gradients():
                    stepped.append(grad)
                    counted += [grad[lo:hi] for name, lo, hi in entries
                                if name in names and (self.edp_owner if name in self.experts[s] else owns)]
                continue
            for name, p in module.named_parameters():
                if p.grad is None or id(p) in seen:
                    continue
                seen.add(id(p))
                grad = _local(p.grad)
                stepped.append(grad)
                if name in names and (self.edp_owner if name in self.experts[s] else self.dp_owner):
                    counted.append(grad)
        return Gradients(stepped, counted)


def check_norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if not (norm_type > 0 or math.isinf(norm_type)) or math.isnan(norm_type):
        raise PipeRuntimeError(f"norm_type must be positive or inf, got {norm_type}")
    return norm_type


def global_norm(counted: list[torch.Tensor], norm_type: float, group: dist.ProcessGroup | None,
                device: torch.device) -> torch.Tensor:
    """The p-norm over every rank's counted gradients (one all-reduce over `group`); fp32, as torch's."""
    total, _ = start_global_norm(counted, norm_type, group, device)
    return finish_global_norm(total, norm_type)


def start_global_norm(counted: list[torch.Tensor], norm_type: float, group: dist.ProcessGroup | None,
                      device: torch.device, async_op: bool = False) -> tuple[torch.Tensor, dist.Work | None]:
    """`global_norm`'s all-reduce, issued: the reduced total ([1]) and, with `async_op`, its work to wait for
    before `finish_global_norm` (post_validate.py's verdict)."""
    p = check_norm_type(norm_type)
    norms = torch._foreach_norm(counted, p) if counted else []
    if math.isinf(p):
        local = torch.stack([n.float() for n in norms]).max() if norms else torch.zeros((), device=device)
        # a NaN as inf: a MAX all-reduce need not carry a NaN over another rank's finite maximum
        local = torch.nan_to_num(local, nan=math.inf)
        total = local.to(device=device, dtype=torch.float32).reshape(1)
        return total, dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group, async_op=async_op)
    # the sum of |g|^p in float64: ranks' partial sums add up without fp32 rounding
    local = torch.stack([n.double() for n in norms]).pow(p).sum() if norms else torch.zeros((), dtype=torch.float64)
    total = local.to(device=device, dtype=torch.float64).reshape(1)
    return total, dist.all_reduce(total, group=group, async_op=async_op)


def finish_global_norm(total: torch.Tensor, norm_type: float) -> torch.Tensor:
    p = check_norm_type(norm_type)
    return total[0] if math.isinf(p) else total[0].pow(1.0 / p).float()


def clip_(stepped: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale the gradients by min(1, max_norm / (norm + 1e-6)): torch.nn.utils.clip_grad_norm_'s factor."""
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    if stepped:
        torch._foreach_mul_(stepped, coef.to(stepped[0].device))


def unscale_(stepped: list[torch.Tensor], scale: float, group: dist.ProcessGroup | None,
             device: torch.device, reduce: bool = True) -> bool:
    """Divide the gradients by the loss scale; True if any rank of `group` found an inf or NaN (one
    all-reduce of the flag, so every rank makes the same skip decision; without `reduce`, this rank's
    finding: post-validated steps learn the others' from the gradient norm)."""
    found = torch.zeros(1, dtype=torch.float32, device=device)
    inv = torch.full((1,), 1.0 / scale, dtype=torch.float32, device=device)
    by_device: dict[tuple, list[torch.Tensor]] = {}
    for g in stepped:
        by_device.setdefault((g.device, g.dtype), []).append(g)
    for grads in by_device.values():
        flag = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv.to(grads[0].device))
        found += flag.to(device)
    if reduce:
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return bool(found.item() > 0)
