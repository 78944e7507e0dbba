"""REDUCE_GRAD: gradient reduction between the replica copies of a stage, plus user hooks.

With replicas (Chimera) every stage has copies on several ranks; each copy accumulates the
gradients of the microbatches routed through it, and at the stage's REDUCE_GRAD the copies
all-reduce (sum) so every copy holds the gradient of the whole batch.  Copies on one rank
share one module, so only ranks need reducing, never copies.

Groups are built once, at init, deterministically on every rank: one process group per set
of ranks holding a stage.  Several stages may share a set (Chimera P=4: stages 0 and 3 both
live on ranks {0, 3}); collectives on one group must be issued in the same order on all its
members, so a set's stages are reduced in ascending stage order — each as soon as it and
every lower stage of its set are ready — asynchronously, waited at the step end.

`add_hook(fn)`: `fn(stage, module)` runs once per local stage module after its gradients are
complete *and* reduced between replicas; it may return a handle with `.wait()` (e.g. an async
data-parallel all-reduce), which is waited at OPTIMIZER_STEP.  Hooks run at points fixed by
the program, never by timing — a stage without copies on other ranks at its REDUCE_GRAD, a
replicated one at the step end (after its replica reduction) — so every data-parallel peer,
running the same program, calls them in the same order and they may issue collectives.

`DataParallelReducer` is such a hook: the averaging all-reduce of a stage's gradients over a
data-parallel group (the pipeline's dp reduction without ZeRO), in place on buckets whose views are
the parameters' `.grad`s (`GradBuckets`).  Tied parameters are reduced
last, at the step end, once those handles are complete (ties.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from pipedsl.ir import Program
from pipedsl.parallel.expert import expert_parameters, reduction_of
from pipedsl.parallel.zero import zero_gradient
from pipedsl.runtime.groups import PipelineGroups
from pipedsl.runtime.ties import TieReducer

Hook = Callable[[int, nn.Module], object]


class GradReducer:
    def __init__(self, program: Program, rank: int, modules: dict[int, nn.Module], groups: PipelineGroups,
                 ties: TieReducer | None = None) -> None:
        self.rank = rank
        self.modules = modules
        self.ties = ties  # parameters shared between stages: reduced by it at the step end, skipped here
        self.skip = ties.skip if ties is not None else set()
        self.hooks: list[Hook] = []
        self._copies = {s: 0 for s in modules}
        for (_, s), r in program.placement.items():
            if r == rank:
                self._copies[s] += 1
        holders: dict[int, tuple[int, ...]] = {}
        for s in range(program.num_stages):
            ranks = tuple(sorted({program.placement[(c, s)] for c in range(program.num_replicas)}))
            if len(ranks) > 1:
                holders[s] = ranks
        self.key_of = holders  # stage -> ranks holding its copies (only stages with copies on >1 rank)
        self.stages_of: dict[tuple[int, ...], list[int]] = {}
        for s, key in holders.items():
            self.stages_of.setdefault(key, []).append(s)
        self.groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for key in self.stages_of:  # first-appearance order: the same on every rank
            g = groups.new(key)
            if rank in key:
                self.groups[key] = g
        self._src = {s: groups.global_rank(program.placement[(0, s)]) for s in holders}  # replica 0's copy
        self._flat: dict[int, list[torch.Tensor]] = {}

    def add_hook(self, hook: Hook) -> None:
        self.hooks.append(hook)

    def broadcast_replicas(self) -> None:
        """Make every copy of a replicated stage start from the weights of replica 0's copy."""
        for key, stages in self.stages_of.items():
            if key not in self.groups:
                continue
            for s in stages:
                for t in [*self.modules[s].parameters(), *self.modules[s].buffers()]:
                    dist.broadcast(t.data, src=self._src[s], group=self.groups[key])

    # ------------------------------------------------------------ per step

    def start_step(self) -> None:
        self._left = dict(self._copies)
        self._ready: set[int] = set()
        self._next = {key: 0 for key in self.groups}
        self._inflight: list[tuple[int, object, list, list]] = []
        self._handles: list[object] = []

    def on_reduce_grad(self, stage: int, replica: int) -> None:
        self._left[stage] -= 1
        if self._left[stage]:
            return
        key = self.key_of.get(stage)
        if key is None:
            self._run_hooks(stage)
            return
        self._ready.add(stage)
        order, k = self.stages_of[key], self._next[key]
        while k < len(order) and order[k] in self._ready:
            self._issue(order[k], self.groups[key])
            k += 1
        self._next[key] = k
        if not self.hooks:  # with hooks, completion (and so the hook) waits for the step end: a fixed point
            self._poll()

    def _issue(self, stage: int, group: dist.ProcessGroup) -> None:
        works, flats, groups = flat_all_reduce(_grads(self.modules[stage], self.skip), self._flat, stage, group)
        self._inflight.append((stage, works, flats, groups))

    def _complete(self, item: tuple[int, object, list, list]) -> None:
        stage, works, flats, groups = item
        for w in works:
            w.wait()
        for flat, gs in zip(flats, groups):
            o = 0
            for g in gs:
                n = g.numel()
                g.copy_(flat[o:o + n].view_as(g))
                o += n
        self._run_hooks(stage)

    def _poll(self) -> None:
        while self._inflight and all(w.is_completed() for w in self._inflight[0][1]):
            self._complete(self._inflight.pop(0))

    def _run_hooks(self, stage: int) -> None:
        for hook in self.hooks:
            handle = hook(stage, self.modules[stage])
            if handle is not None:
                self._handles.append(handle)

    def finish(self) -> None:
        """At OPTIMIZER_STEP: every reduction and hook handle complete."""
        for key, k in self._next.items():
            if k != len(self.stages_of[key]):  # pragma: no cover - the validator rules this out
                raise RuntimeError(f"stage {self.stages_of[key][k]} never reached REDUCE_GRAD")
        while self._inflight:
            self._complete(self._inflight.pop(0))
        handles, self._handles = self._handles, []
        for h in handles:
            h.wait()
        if self.ties is not None:  # last: under ZeRO it sums the copies' slices the dp reduce-scatter made
            self.ties.reduce()



class DataParallelReducer:
    """A REDUCE_GRAD hook: average a stage's gradients over `group` (async; `.wait()` at the step end).

    One all-reduce per stage and dtype, in place on the bucket whose views are the gradients (`GradBuckets`;
    DTensor parameters' local gradients through a flat copy), divided by the group size on completion (like
    DDP): with the runtime's 1/M loss scale, the gradient of the mean loss over the global batch.
    """

    def __init__(self, group: dist.ProcessGroup, skip: set[int] | None = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.skip = skip or set()  # tied parameters: their own reduction averages them over dp
        self._buckets: dict[int, GradBuckets] = {}  # per stage: its plain parameters' gradients, reduced in place
        self._copied: dict[int, list[nn.Parameter]] = {}  # per stage: DTensor parameters, reduced through a copy
        self._flat: dict[int, list[torch.Tensor]] = {}

    def __call__(self, stage: int, module: nn.Module) -> _AveragedReduction | None:
        if self.size == 1:
            return None
        buckets = self._buckets.get(stage)
        if buckets is None:  # plain tensors: their .grad views of the buckets; DTensors through a flat copy
            skip = self.skip | {id(p) for p in expert_parameters(module)}  # expert shards: ExpertReducer's
            params = [p for p in module.parameters() if p.requires_grad and id(p) not in skip]
            buckets = self._buckets[stage] = GradBuckets([p for p in params if not isinstance(p, DTensor)])
            self._copied[stage] = [p for p in params if isinstance(p, DTensor)]
        flats = buckets.bind()
        works = [dist.all_reduce(flat, group=self.group, async_op=True) for flat in flats]
        more, copies, groups = flat_all_reduce(_grads_of(self._copied[stage], set()), self._flat, stage, self.group) \
            if self._copied[stage] else ([], [], [])
        return _AveragedReduction(works + more, flats + copies, [[] for _ in flats] + groups, self.size)


class ExpertReducer:
    """A REDUCE_GRAD hook for a stage's expert shards (parallel/expert.py): summed over the ranks holding the same
    experts and divided by dp — each shard's gradient already sums its ep peers' tokens."""

    def __init__(self) -> None:
        self._shards: dict[int, tuple[list[nn.Parameter], tuple] | None] = {}  # per stage, found once
        self._flat: dict[int, list[torch.Tensor]] = {}

    def __call__(self, stage: int, module: nn.Module) -> _AveragedReduction | None:
        if stage not in self._shards:
            reduction = reduction_of(module)
            self._shards[stage] = None if reduction is None else (expert_parameters(module), reduction)
        found = self._shards[stage]
        if found is None:
            return None
        params, (group, dp) = found
        works, flats, groups = flat_all_reduce(_grads_of(params, set()), self._flat, stage, group)
        return _AveragedReduction(works, flats, groups, dp)


def _grads(module: nn.Module, skip: set[int]) -> list[torch.Tensor]:
    """The gradients to reduce, every trainable parameter's (zeros where none: every rank must send the
    same layout), except the `skip`ped tied parameters, which their own reduction handles."""
    return _grads_of(module.parameters(), skip)


def _grads_of(params: Iterable[nn.Parameter], skip: set[int]) -> list[torch.Tensor]:
    """`_grads` of the parameters `params`."""
    grads = []
    for p in params:
        if not p.requires_grad or id(p) in skip:
            continue
        held = zero_gradient(p)  # ZeRO's: its slice of the unit's flat gradient (fp32 under bf16 parameters)
        if held is not None:
            grads.append(held)
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        # a DTensor's (parallel/tp_hf.py) local shard: each tp rank reduces its own over dp
        grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
    return grads


class GradBuckets:
    """One flat gradient buffer per dtype and device whose views are the parameters' `.grad`s (DDP's
    gradient_as_bucket_view): autograd accumulates into them in place and the all-reduce runs on the buffer
    itself, so no flat copy doubles the gradients' memory.  `bind()` before each reduction: a `.grad` that is
    not its view any more (an optimizer's `zero_grad(set_to_none=True)`, then autograd's first gradient) is
    copied in and bound again; None becomes zeros (every rank must send the same layout)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        by: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        for p in params:
            by.setdefault((p.dtype, p.device), []).append(p)
        self.buckets: list[tuple[torch.Tensor, list[nn.Parameter], list[torch.Tensor]]] = []
        for (dtype, device), ps in by.items():
            flat = torch.zeros(sum(p.numel() for p in ps), dtype=dtype, device=device)
            views, at = [], 0
            for p in ps:
                views.append(flat[at:at + p.numel()].view_as(p))
                at += p.numel()
            self.buckets.append((flat, ps, views))

    def bind(self) -> list[torch.Tensor]:
        """Every parameter's gradient in its bucket; the buckets."""
        with torch.no_grad():
            for _, ps, views in self.buckets:
                for p, view in zip(ps, views):
                    g = p.grad
                    if g is not None and g.data_ptr() == view.data_ptr():
                        continue
                    if g is None:
                        view.zero_()
                    else:
                        view.copy_(g)
                    p.grad = view
        return [flat for flat, _, _ in self.buckets]


def flat_all_reduce(grads: list[torch.Tensor], cache: dict[int, list[torch.Tensor]], key: int,
                    group: dist.ProcessGroup) -> tuple[list, list[torch.Tensor], list[list[torch.Tensor]]]:
    """Async sum-all-reduce of `grads` through one flat buffer per dtype (kept in `cache[key]`
    between steps): the works, the buffers, and the gradients grouped as the buffers are."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    flats = cache.get(key)
    if flats is None:
        flats = cache[key] = [torch.empty(sum(g.numel() for g in gs), dtype=dt, device=gs[0].device)
                              for dt, gs in by_dtype.items()]
    works = []
    for flat, gs in zip(flats, by_dtype.values()):
        torch.cat([g.reshape(-1) for g in gs], out=flat)
        works.append(dist.all_reduce(flat, group=group, async_op=True))
    return works, flats, list(by_dtype.values())


class _AveragedReduction:
    __slots__ = ("works", "flats", "grads", "n")

    def __init__(self, works: list, flats: list[torch.Tensor], grads: list[list[torch.Tensor]], n: int) -> None:
        self.works, self.flats, self.grads, self.n = works, flats, grads, n

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        for flat, gs in zip(self.flats, self.grads):
            flat.div_(self.n)
            o = 0
            for g in gs:
                k = g.numel()
                g.copy_(flat[o:o + k].view_as(g))
                o += k
