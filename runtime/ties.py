"""Weights shared between stages (tied embeddings): one logical parameter, a copy per holding rank.

GPT-2 and most language models use the token embedding again as the output projection.  Cut
into stages, the embedding lives on the first stage and the projection on the last — usually
on different ranks — so each rank's copy sees only its own use's gradient, and the copies
drift apart.  Megatron-LM keeps an "embedding group" of the first and last pipeline ranks and
all-reduces the word-embedding gradient over it before the optimizer step; `TieReducer` does
the same for any parameter shared between stages:

- ties are found in the stage list (one `Parameter` object in several stage modules) or named
  with `Pipeline(..., ties=[[(0, "wte.weight"), (3, "lm_head.weight")]])`;
- at construction every copy takes the values of the copy of the tie's first stage (broadcast);
- at the step end, after the last backward and after the data-parallel reductions, the copies'
  gradients are summed over every rank holding one, so every copy steps with the whole model's
  gradient and the copies stay equal.  The per-stage reductions (stage replicas, data
  parallelism) leave tied parameters to this one.

Without ZeRO the sum also averages over the data-parallel replicas, in one all-reduce over the
holding ranks of every replica.  Under ZeRO 1-3 each stage's `ZeroOptimizer` keeps its copy in
a unit of its own (`separate=`), so every copy has the same flat layout and dp rank r owns the
same slice [r·S, (r+1)·S) of each; the optimizer's reduce-scatter has already averaged every
copy over dp into that slice, and the tie adds the copies' slices up over the holding ranks of
one dp replica.  That is Megatron's order turned around (it all-reduces the full embedding
gradient over the embedding group, then reduce-scatters over dp) for the same sum: the
all-reduce moves 1/dp of the weight instead of all of it, and the reduce-scatter stays the
asynchronous one at REDUCE_GRAD.  The summed slice is written where the optimizer reads it, so
each copy steps once, with equal gradients and equal optimizer state: the copies stay bitwise
equal, also two copies on one rank (zb-v holds the first and the last stage on rank 0: one
parameter object in both stage modules, but a copy in each stage's optimizer, as a stage's
ZeRO state is its own — checkpoints keep it by stage).  Global norms count the first stage's
copy only (clip.py).

Frozen ties (a frozen embedding under trainable adapters) are only broadcast: nothing sums
gradients they do not have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from pipedsl.errors import PipeRuntimeError
from pipedsl.ir import Program
from pipedsl.runtime.groups import PipelineGroups

Tie = tuple[tuple[int, str], ...]  # ((stage, parameter name in that stage's module), ...)


def find_ties(stages: Sequence[nn.Module]) -> list[Tie]:
    """Parameters that appear in more than one stage module, by (stage, name), in stage order.

    Stage modules that each hold every parameter of the pipeline are refused: a wrapper around the
    whole model (one that runs only its part in `forward`) would make every weight a "tie", keep
    the whole model on every rank and sum every gradient over the ranks."""
    where: dict[int, list[tuple[int, str]]] = {}
    for s, module in enumerate(stages):
        for name, p in module.named_parameters():
            where.setdefault(id(p), []).append((s, name))
    whole = [s for s, module in enumerate(stages)
             if len({id(p) for p in module.parameters()}) == len(where) > 1]
    if len(whole) > 1 and len(stages) > 1:
        raise PipeRuntimeError(f"stages {whole[0]} and {whole[1]} each hold every parameter of the model "
                               f"({len(where)} tensors, e.g. {where[next(iter(where))][0][1]!r}): a stage module must "
                               f"hold only its own part (split_module, split_sequential or a module of just those "
                               f"layers), not wrap the whole model")
    return [tuple(v) for v in where.values() if len({s for s, _ in v}) > 1]


def check_ties(ties: Sequence[Sequence[tuple[int, str]]], num_stages: int) -> list[Tie]:
    """`ties=` as given by the user, checked: each a list of at least two (stage, name) on different stages."""
    out = []
    for k, tie in enumerate(ties):
        try:
            members = tuple((int(s), str(name)) for s, name in tie)
        except (TypeError, ValueError):
            raise PipeRuntimeError(f"ties[{k}] must be a list of (stage, parameter name) pairs, got {tie!r}") from None
        if len({s for s, _ in members}) < 2:
            raise PipeRuntimeError(f"ties[{k}] = {list(members)} must name parameters of at least two stages")
        for s, _ in members:
            if not 0 <= s < num_stages:
                raise PipeRuntimeError(f"ties[{k}] names stage {s}, but the program has stages 0 … {num_stages - 1}")
        out.append(members)
    return out


@dataclass
class _Held:
    """A tie this rank holds copies of: the distinct parameter objects here and the group summing them."""

    tie: Tie
    copies: list[nn.Parameter]
    group: dist.ProcessGroup | None
    source: int  # global rank of the copy every copy starts from
    frozen: bool
    zero: list[tuple[Any, str]] = field(default_factory=list)  # ZeRO: (stage's ZeroOptimizer, name), a unit each


class TieReducer:
    """The gradient sum of each tie over the ranks holding it (without ZeRO: and their dp replicas)."""

    def __init__(self, ties: list[Tie], program: Program, rank: int, modules: dict[int, nn.Module],
                 groups: PipelineGroups, dp: int, zero: int = 0, flat: bool | None = None) -> None:
        """`modules` are this rank's stage modules; each tie's group spans the pipeline ranks holding
        it — without ZeRO in every data-parallel replica, with ZeRO in this one — at this rank's
        tensor-parallel coordinate.  `flat`: the stages' parameters go into ZeroOptimizer's flat buffers
        (ZeRO 1-3, or zero=0 with fp32 main parameters; default: zero > 0)."""
        self.dp, self.zero = dp, zero
        self.flat = bool(zero) if flat is None else flat
        self.names = list(ties)  # every tie of the model (the same on every rank)
        self.held: list[_Held] = []
        self.skip: set[int] = set()  # ids of tied parameters on this rank: other reductions leave them alone
        self.problem: str | None = None  # the first tie this rank cannot resolve (see `Pipeline._ties`)
        self.shapes: dict[int, str] = {}  # tie index -> this rank's copy's shape and dtype (checked across ranks)
        made = []
        for tie in ties:  # every group first, on every rank in the same order: creating them is collective
            stages = {s for s, _ in tie}
            holders = sorted({r for (_, s), r in program.placement.items() if s in stages})
            first = program.placement[(0, min(stages))]
            if self.flat:
                group = groups.new(holders) if len(holders) > 1 else None
                made.append((holders, group, groups.global_rank(first)))
            else:
                group = groups.new(holders, across_dp=True) if len(holders) * dp > 1 else None
                made.append((holders, group, groups.source_rank(first)))
        for k, (tie, (holders, group, source)) in enumerate(zip(ties, made)):
            if rank not in holders:
                continue
            try:
                local = _local_copies(tie, modules)
                if self.flat:
                    _check_unshared(tie, modules, zero)
            except PipeRuntimeError as err:
                self.problem = self.problem or f"rank {rank}: {err.message}"
                continue
            frozen = not local[0].requires_grad
            self.held.append(_Held(tie, local, group, source, frozen))
            if not frozen:
                self.skip.update(id(p) for p in local)
            self.shapes[k] = f"{list(local[0].shape)} {str(local[0].dtype).removeprefix('torch.')}" + \
                (" frozen" if frozen else "")

    def agree(self, group: dist.ProcessGroup | None, size: int) -> None:
        """Raise the same error on every rank if any rank cannot resolve a tie or two copies differ in shape:
        only the holding ranks can check, and a mismatched broadcast would crash or hang the others."""
        mine = (self.problem, self.shapes)
        every: list = [None] * size
        dist.all_gather_object(every, mine, group=group)
        problem = next((p for p, _ in every if p), None)
        if problem is None:
            for k, tie in enumerate(self.names):
                seen = {(r, shapes[k]) for r, (_, shapes) in enumerate(every) if k in shapes}
                if len({shape for _, shape in seen}) > 1:
                    copies = ", ".join(f"rank {r}: {shape}" for r, shape in sorted(seen))
                    problem = f"the tied parameters {_label(tie)} differ ({copies})"
                    break
        if problem:
            raise PipeRuntimeError(problem)

    def describe(self) -> str:
        return "; ".join(map(_label, self.names))

    def separate(self, stage: int) -> list[str]:
        """The names of local `stage`'s trainable tied parameters: the ones ZeRO must give a unit of their own."""
        return [name for held in self.held if not held.frozen for s, name in held.tie if s == stage]

    def use_zero(self, zeros: dict[int, Any]) -> None:
        """ZeRO has taken the stages' parameters over ({stage: ZeroOptimizer}, made with `separate=`): from
        now on a copy is its stage's unit of the tied parameter, whose reduced slice `reduce` sums."""
        for held in self.held:
            if held.frozen:
                continue
            units: set[int] = set()
            held.zero = []
            for s, name in held.tie:
                if s in zeros:
                    unit = zeros[s].separate_unit(name)
                    if id(unit) not in units:
                        units.add(id(unit))
                        held.zero.append((zeros[s], name))
                        # replica reductions leave the copy to the tie
                        self.skip.update([id(unit.flat), *(id(p) for _, p in unit.leaves)])

    def broadcast(self) -> None:
        """Every copy starts from the first stage's copy (replica 0; without ZeRO, dp replica 0)."""
        with torch.no_grad():
            for held in self.held:
                local = held.copies
                if held.group is not None:
                    dist.broadcast(_local(local[0].data), src=held.source, group=held.group)
                for p in local[1:]:
                    p.copy_(local[0])

    def reduce(self) -> None:
        """After the last backward and the dp reductions: each copy's gradient becomes the sum over the copies
        (without ZeRO: the mean over dp in the same all-reduce)."""
        if self.flat:
            self._reduce_slices()
            return
        works = []
        for held in self.held:
            if held.frozen:
                continue
            local, total = held.copies, None
            for p in local:
                if p.grad is not None:
                    total = p.grad.clone() if total is None else total.add_(p.grad)
            if total is None:
                total = torch.zeros_like(local[0])
            work = dist.all_reduce(_local(total), group=held.group, async_op=True) if held.group is not None else None
            works.append((local, total, work))
        for local, total, work in works:
            if work is not None:
                work.wait()
                if self.dp > 1:
                    total.div_(self.dp)
            for k, p in enumerate(local):
                p.grad = total if k == 0 else total.clone()

    def _reduce_slices(self) -> None:
        """ZeRO: the copies' reduced slices (each already the dp mean of its copy) summed over the holders of
        this dp replica, written back where each stage's optimizer reads them."""
        works = []
        for held in self.held:
            if held.frozen:
                continue
            if not held.zero:
                raise PipeRuntimeError(f"the tie {_label(held.tie)} has no ZeRO copies: make the optimizer with "
                                       f"pipe.optimizer(...)")
            slices = [z.separate_gradient(name) for z, name in held.zero]
            total = slices[0].clone()
            for g in slices[1:]:
                total.add_(g)
            work = dist.all_reduce(_local(total), group=held.group, async_op=True) if held.group is not None else None
            works.append((slices, total, work))
        for slices, total, work in works:
            if work is not None:
                work.wait()
            for g in slices:
                g.copy_(total)


def _local_copies(tie: Tie, modules: dict[int, nn.Module]) -> list[nn.Parameter]:
    """The distinct parameter objects of `tie` on this rank (one when its stages share the object)."""
    local: list[nn.Parameter] = []
    for s, name in tie:
        if s in modules:
            p = _parameter(modules[s], s, name)
            if all(p is not q for q in local):
                local.append(p)
    if len({(tuple(p.shape), p.dtype, p.requires_grad) for p in local}) > 1:
        shapes = ", ".join(f"{list(p.shape)} {str(p.dtype).removeprefix('torch.')}"
                           f"{'' if p.requires_grad else ' frozen'}" for p in local)
        raise PipeRuntimeError(f"the tied parameters {_label(tie)} differ: {shapes}")
    return local


def _check_unshared(tie: Tie, modules: dict[int, nn.Module], zero: int) -> None:
    """ZeRO keeps each stage's copy in that stage's own buffer, installed on the module holding the parameter:
    two local stages may share the Parameter (each gets a copy) but not the module holding it."""
    holder: dict[int, int] = {}
    for s, name in tie:
        if s in modules:
            path = name.rpartition(".")[0]
            owner = modules[s].get_submodule(path) if path else modules[s]
            t = holder.setdefault(id(owner), s)
            if t != s:
                raise PipeRuntimeError(f"{f'zero={zero}' if zero else 'fp32 main parameters'}: stages {t} and {s} "
                                       f"share the module holding the tied {name!r}; the optimizer's flat buffers "
                                       f"give each stage its own copy of the weight, which one module cannot hold: "
                                       f"tie the Parameter instead (head.weight = embedding.weight), as transformers "
                                       f"does")


def _label(tie: Tie) -> str:
    return " = ".join(f"stage {s} {name}" for s, name in tie)


def _parameter(module: nn.Module, stage: int, name: str) -> nn.Parameter:
    try:
        return module.get_parameter(name)
    except AttributeError:
        names = [n for n, _ in module.named_parameters()]
        raise PipeRuntimeError(f"ties: stage {stage} has no parameter {name!r} (it has {', '.join(names[:6])}"
                               f"{' …' if len(names) > 6 else ''})") from None


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (parallel/tp_hf.py: each tp rank's copies hold the same row block), else `t`;
    a view, so a collective on it updates the DTensor."""
    return t.to_local() if isinstance(t, DTensor) else t
