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
- at the step end, after the last backward, the copies' gradients are summed over every rank
  holding one — averaged over the data-parallel replicas in the same all-reduce — so every
  copy steps with the whole model's gradient and the copies stay equal.  The per-stage
  reductions (stage replicas, data parallelism) leave tied parameters to this one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipedsl.errors import PipeRuntimeError
from pipedsl.ir import Program

from .groups import PipelineGroups

Tie = tuple[tuple[int, str], ...]  # ((stage, parameter name in that stage's module), ...)


def find_ties(stages: Sequence[nn.Module]) -> list[Tie]:
    """Parameters that appear in more than one stage module, by (stage, name), in stage order."""
    where: dict[int, list[tuple[int, str]]] = {}
    for s, module in enumerate(stages):
        for name, p in module.named_parameters():
            where.setdefault(id(p), []).append((s, name))
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


class TieReducer:
    """The gradient all-reduce of each tie over the ranks holding it (and their dp replicas)."""

    def __init__(self, ties: list[Tie], program: Program, rank: int, modules: dict[int, nn.Module],
                 groups: PipelineGroups, dp: int) -> None:
        """`modules` are this rank's stage modules; each tie's group spans the pipeline ranks holding
        it in every data-parallel replica (at this rank's tensor-parallel coordinate)."""
        self.dp = dp
        self.names = list(ties)  # every tie of the model (the same on every rank)
        self.ties: list[tuple[list[nn.Parameter], dist.ProcessGroup | None, int]] = []
        self.skip: set[int] = set()  # ids of tied parameters on this rank: other reductions leave them alone
        self.problem: str | None = None  # the first tie this rank cannot resolve (see `Pipeline._ties`)
        self.shapes: dict[int, str] = {}  # tie index -> this rank's copy's shape and dtype (checked across ranks)
        made = []
        for tie in ties:  # every group first, on every rank in the same order: creating them is collective
            stages = {s for s, _ in tie}
            holders = sorted({r for (_, s), r in program.placement.items() if s in stages})
            group = groups.new(holders, across_dp=True) if len(holders) * dp > 1 else None
            made.append((holders, group, groups.source_rank(program.placement[(0, min(stages))])))
        for k, (tie, (holders, group, source)) in enumerate(zip(ties, made)):
            if rank not in holders:
                continue
            try:
                local = _local_copies(tie, modules)
            except PipeRuntimeError as err:
                self.problem = self.problem or f"rank {rank}: {err.message}"
                continue
            self.ties.append((local, group, source))
            self.skip.update(id(p) for p in local)
            self.shapes[k] = f"{list(local[0].shape)} {str(local[0].dtype).removeprefix('torch.')}"

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

    def broadcast(self) -> None:
        """Every copy starts from the first stage's copy (replica 0, dp replica 0)."""
        with torch.no_grad():
            for local, group, source in self.ties:
                if group is not None:
                    dist.broadcast(local[0].data, src=source, group=group)
                for p in local[1:]:
                    p.copy_(local[0])

    def reduce(self) -> None:
        """After the last backward: each copy's gradient becomes the sum over the copies (mean over dp)."""
        works = []
        for local, group, _ in self.ties:
            total = None
            for p in local:
                if p.grad is not None:
                    total = p.grad.clone() if total is None else total.add_(p.grad)
            if total is None:
                total = torch.zeros_like(local[0])
            work = dist.all_reduce(total, group=group, async_op=True) if group is not None else None
            works.append((local, total, work))
        for local, total, work in works:
            if work is not None:
                work.wait()
                if self.dp > 1:
                    total.div_(self.dp)
            for k, p in enumerate(local):
                p.grad = total if k == 0 else total.clone()


def _local_copies(tie: Tie, modules: dict[int, nn.Module]) -> list[nn.Parameter]:
    """The distinct parameter objects of `tie` on this rank (one when its stages share the object)."""
    local: list[nn.Parameter] = []
    for s, name in tie:
        if s in modules:
            p = _parameter(modules[s], s, name)
            if all(p is not q for q in local):
                local.append(p)
    if len({(tuple(p.shape), p.dtype) for p in local}) > 1:
        shapes = ", ".join(f"{list(p.shape)} {str(p.dtype).removeprefix('torch.')}" for p in local)
        raise PipeRuntimeError(f"the tied parameters {_label(tie)} differ: {shapes}")
    return local


def _label(tie: Tie) -> str:
    return " = ".join(f"stage {s} {name}" for s, name in tie)


def _parameter(module: nn.Module, stage: int, name: str) -> nn.Parameter:
    try:
        p = module.get_parameter(name)
    except AttributeError:
        names = [n for n, _ in module.named_parameters()]
        raise PipeRuntimeError(f"ties: stage {stage} has no parameter {name!r} (it has {', '.join(names[:6])}"
                               f"{' …' if len(names) > 6 else ''})") from None
    if not p.requires_grad:
        raise PipeRuntimeError(f"ties: stage {stage} parameter {name!r} does not require grad")
    return p
