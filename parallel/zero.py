"""ZeRO over a data-parallel group (Rajbhandari et al., SC'20) with flat, padded per-rank buffers.

`ZeroOptimizer(module, torch.optim.Adam, group=dp_group, stage=2, lr=1e-3)` takes over the
module's parameters.  They are packed, per *unit* (a submodule; by default the whole module,
or every child for stage 3), into one flat fp32 buffer padded to a multiple of the group
size N, so rank r owns the contiguous slice [r·S, (r+1)·S) of every unit, S = padded/N.  The
module's parameters stay its parameters, their storage moved into that buffer (Megatron's layout),
and each one's `.grad` is its slice of the unit's flat gradient, where autograd accumulates in
place; a post-accumulate hook adds what it could not (the first gradient of a step, another
dtype).  So a backward costs what it costs without ZeRO, and a split backward's W computes each
weight's gradient alone.  The user's optimizer class runs on the owned slices
only, which equals running it on the whole model for any elementwise optimizer (SGD, Adam,
AdamW, …; LAMB, Adafactor, LBFGS, Muon and the like, whose updates use per-tensor statistics, are
refused by name).

    stage 0   plain data parallel: full gradients all-reduced and averaged, full optimizer
    stage 1   optimizer state sharded: gradients reduce-scattered into the owned slice of the
              (kept) full gradient buffer, step on the slice, updated slices all-gathered
    stage 2   + gradients sharded: only the [S] slice of gradients is kept between steps
    stage 3   + parameters sharded: a unit's full parameters exist only from just before its
              forward (or backward) until just after it, gathered from the slices; the next
              unit in execution order is prefetched asynchronously

Units must be modules that *run*, yet a stage need not call every submodule: a Hugging Face
stage loops over its decoder layers in a `ModuleDict` it never calls.  So a unit is entered
when the first of its modules — the unit module or any descendant holding its parameters —
starts its forward, and left when that one's forward ends (pre- and post-forward hooks on all
of them); a unit whose module never runs is still gathered around each descendant that does,
only more often.  The default stage-3 units are the module's children, looking inside
containers without a forward of their own (`ModuleList`, `ModuleDict`), so an HF stage's
units are its embedding, each decoder layer and its head; the root's own parameters form the
last unit, entered for the whole forward (the wrapped module must be the one called).

Gradient accumulation over M microbatches (pipelines): `reduce="step"` (the default) sums
the microbatches' gradients locally and reduces once, in `reduce_gradients()`, the hook the
pipeline runtime calls at REDUCE_GRAD after the stage's last backward.  It moves the same
bytes per step as data parallel (not M times them) and overlaps with the rest of the
cooldown (parallel/README.md); its price is that a full-size gradient buffer lives from the first
backward to the reduction, so stages 2 and 3 save gradient memory only at the step.
`reduce="microbatch"` reduce-scatters every unit's gradient right after its backward, for
every microbatch, into the [S] slice and frees the full one: true stage-2/3 gradient memory
(one unit's full gradient at a time) for M× the reduce-scatter traffic, on the critical path.

Gradients are averaged over the group (divided by N), like DDP; the runtime scales each
microbatch's loss by 1/M, so the result is the mean over the global batch.

Low-precision parameters (`param_dtype=torch.bfloat16`, Megatron's distributed optimizer): the
flat buffers hold bf16 values and each trainable unit keeps `main`, fp32 copies of this rank's
slice (of the whole buffer at stage 0) made from the original values, which the optimizer steps;
after the step they are rounded into the flat buffer (stage 3: the bf16 shard) and all-gathered
as bf16.  Gradients accumulate in `grad_dtype`: fp32 (each backward's bf16 gradient is added into
the unit's fp32 flat gradient, Megatron's `main_grad`, by the hook) or bf16 (in place, converted to
fp32 for the step).
Bytes per parameter for every stage and mode: docs/training-state.md.

Frozen parameters (`requires_grad=False`: a frozen base under trainable adapters) go into a
second buffer per unit with no gradient, no optimizer state and no reduction, so they cost
neither traffic nor optimizer memory and no optimizer (weight decay included) ever touches
them; stage 3 shards and gathers them like the rest.  In backward they are needed until the
gradient has passed the unit's inputs and, if the unit also has trainable parameters, until
those are accumulated (a frozen matrix may feed an adapter's gradient): an identity autograd
function on the inputs reports the first, as FSDP2's post-backward does, the gradient
accumulation the second.  When neither can report, the buffer stays gathered until the
unit's next forward ends or the step does.  A stage with no trainable parameter steps nothing.

`separate=` names parameters that get a unit of their own: a weight tied to another stage
(runtime/ties.py) thus has the same layout — one entry, padded alike — in every stage's
optimizer, so the copies' reduced slices line up and can be summed slice by slice.  A
parameter held by modules of two units (a tie within one stage) gets one too, entered by
either.

Why not torch's FSDP2 (`fully_shard`) for stage 3: it runs on CPU/gloo in torch 2.13 and the
tests use it as an oracle (ZeRO-3 here equals it after 3 Adam steps), but (1) it shards every
parameter separately along dim 0 as a DTensor, so a rank holds no flat padded buffer and the
per-rank layout and byte counts differ from the paper's; (2) its reductions live inside its
post-backward hooks: reducing once at REDUCE_GRAD, after the stage's last backward, means
turning gradient sync off for the other microbatches and then running the hooks by hand
through private state, as torch.distributed.pipelining's stage does
(`fully_shard.state(m)._fsdp_param_groups[i].post_backward()`), instead of one public call;
(3) it has no stage 1 or 2, so stages would use two implementations with different memory
accounting.  One flat-buffer implementation keeps all four stages, their memory and their
traffic on the formulas (benchmarks/parallel_memory_comm.py).

DTensor parameters (torch's tensor parallelism, parallel/tp_hf.py) go in as their local shards, as
FSDP2 composes with TP: the flat buffers, slices, optimizer state and checkpoint layouts are those
of this tp rank's shards (the same shapes on every dp peer).  They do not stay parameters: the flat
buffer is registered on the unit's module instead, and each forward installs views of it, wrapped
back with `DTensor.from_local` (the parameter's mesh, placements and global shape), whose backward
redistributes the gradient to the weight's placements and hands the flat buffer its local part
(weights marked `sum_grads_later`: their partial part, summed over tp at the step end).
ZeRO-3 frees the storage under those views like any other.

Split backward (I/W, zero-bubble schedules) under stage 3: I regathers through the usual
pre-backward hooks; W reads saved views of the parameters, so the pipeline calls
`before_weight_pass` (gather every unit) and `after_weight_pass` (free them) around each W.
Not yet handled: reduce="microbatch" with stage replicas on other ranks (`Pipeline` refuses
it, with the reason), mixed dtypes, non-elementwise optimizers.

Under a fake-tensor mode (the pipeline's shape handshake) the hooks only install views:
no gathers, no change of state.

Checkpoints (runtime/checkpoint/state.py, parallel/zero_checkpoint.py): `shard_state()` is this rank's
slices of parameters and optimizer state with the `layout()` that gives them meaning; `load_shard_state()` puts them
back under the same layout (then `sync_parameters()`, collective), `load_full_state()` takes
full tensors by name and keeps this rank's slices (resharding to another dp size or stage).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._guards import detect_fake_mode
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from pipedsl.parallel.comm import all_gather_into, all_reduce, group_rank, group_size, reduce_scatter_into
from pipedsl.parallel.config import REDUCE_MODES, RESHARD_MODES, ParallelConfigError
from pipedsl.parallel.replicated import FromLocalSummedLater, sums_grads_later
from pipedsl.parallel.weight_decay import merged, split_decay


@dataclass(frozen=True)
class _Entry:
    """One original parameter: where it lived and where it sits in its unit's flat buffer."""

    name: str  # qualified name in the wrapped module (the first, as named_parameters() gives it)
    owner: nn.Module
    attr: str
    shape: torch.Size
    offset: int
    numel: int
    aliases: tuple[tuple[nn.Module, str], ...] = ()  # other modules holding the same parameter
    also: tuple[str, ...] = ()  # its other qualified names (state_dict lists every one)
    dtensor: _DTensorSpec | None = None  # a DTensor parameter's: shape and numel above are its local shard's

    def places(self) -> Iterator[tuple[nn.Module, str]]:
        yield self.owner, self.attr
        yield from self.aliases

    def as_param(self, local: torch.Tensor) -> torch.Tensor:
        """`local` (this entry's values in the flat buffer, shaped) as the module holds it: a DTensor parameter
        becomes a DTensor again, whose backward hands the flat buffer its local gradient."""
        if self.dtensor is None:
            return local
        spec = self.dtensor
        if sums_grads_later(self.owner):  # a partial gradient, summed over tp once a step (replicated.py)
            return FromLocalSummedLater.apply(local, spec.mesh, spec.placements, spec.shape, spec.stride)
        return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                                  stride=spec.stride)


@dataclass(frozen=True)
class _DTensorSpec:
    """Where a DTensor parameter's local shard sits in the whole tensor (torch's tensor parallelism)."""

    mesh: Any
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]

    @staticmethod
    def of(p: torch.Tensor) -> _DTensorSpec | None:
        if not isinstance(p, DTensor):
            return None
        return _DTensorSpec(p.device_mesh, tuple(p.placements), p.shape, tuple(p.stride()))


def _local(p: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what ZeRO packs and shards over dp), else `p`."""
    return p.to_local() if isinstance(p, DTensor) else p


# a parameter (or flat buffer) ZeRO holds -> a weak reference to its unit: the unit refers to its parameters, so a
# strong value would keep every key (and the unit's buffers) alive after the optimizer is gone
_UNIT_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _unit_of(p: torch.Tensor) -> _Unit | None:
    ref = _UNIT_OF.get(p)
    return None if ref is None else ref()


def zero_gradient(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient `p` accumulates into when ZeRO holds it — its slice of its unit's flat gradient, allocated
    if the step has none yet (fp32 under bf16 parameters) — else None.  What a reduction of `p`'s gradient
    outside ZeroOptimizer (a stage's replicas, runtime/reduce.py) must reduce."""
    unit = _unit_of(p)
    return None if unit is None or not unit.trainable else unit.gradient(p)


def is_flat_buffer(p: torch.Tensor) -> bool:
    """Whether `p` is a unit's flat buffer registered as a parameter (its DTensor parameters are views of it): 1-D,
    it holds matrices, so its gradient is no vector's (runtime/stage.py computes vectors' gradients in I, a split
    backward's first half)."""
    return getattr(p, "holds_views", False)


class _Unit:
    """The flat, padded buffer of one submodule's parameters (its trainable or its frozen ones) and this
    rank's slice of it."""

    def __init__(self, index: int, module: nn.Module, entries: list[_Entry], group: ProcessGroup,
                 stage: int, dtype: torch.dtype, trainable: bool = True,
                 hooked: Iterable[nn.Module] = (), param_dtype: torch.dtype | None = None,
                 grad_dtype: torch.dtype | None = None, divisor: int | None = None,
                 params: list[nn.Parameter] | None = None, reshard_after_use: bool = True) -> None:
        self.index, self.module, self.entries, self.stage = index, module, entries, stage
        self.trainable = trainable
        self.hooked = list(hooked) or [module]  # the modules whose forward enters the unit
        self.entry: nn.Module | None = None  # the hooked module whose forward is running (the unit is entered)
        self.partner: _Unit | None = None  # the other buffer (trainable / frozen) of the same modules
        self.waiting = 0  # frozen, stage 3: reports still due before its backward is over (see the docstring)
        self.inputs_report = False  # frozen, stage 3: this forward's inputs report when the gradient passed them
        self.group, self.n, self.rank = group, group_size(group), group_rank(group)
        self.divisor = divisor or self.n  # the reduced sum over the group divided by it: the mean gradient
        self.own_group = divisor is not None  # an expert shard's: sliced over the ranks holding the same experts
        self.numel = sum(e.numel for e in entries)
        self.padded = -(-max(self.numel, 1) // self.n) * self.n
        self.size = self.padded // self.n  # S: this rank's slice
        # low-precision parameters (`param_dtype`): the flat buffer holds them, the optimizer steps fp32 main
        # copies of this rank's slice (made from the original values, not the rounded ones)
        self.dtype = param_dtype or dtype
        self.main_dtype = torch.float32 if param_dtype is not None and trainable else None
        self.grad_dtype = grad_dtype or self.dtype  # gradients accumulate and are reduced in it
        self.device = getattr(entries[0].owner, entries[0].attr).device if entries else torch.device("cpu")
        source = torch.zeros(self.padded, dtype=self.main_dtype or dtype, device=self.device)
        with torch.no_grad():
            for e in entries:
                source[e.offset:e.offset + e.numel].copy_(_local(getattr(e.owner, e.attr).detach()).reshape(-1))
        full = source.to(self.dtype)
        # the module's parameters stay its parameters, their storage moved into the flat buffer (Megatron's
        # layout), so autograd treats each as the leaf it is: its gradient lands in its own slice of `grad`,
        # and a split backward's W computes it alone.  DTensor parameters are the exception: each forward makes
        # them again as DTensors over views of `flat` (`install_views`), whose gradients autograd sums into it.
        self.leaves = [(e, p) for e, p in zip(entries, params or []) if e.dtensor is None]
        self.viewed = [e for e in entries if e.dtensor is not None]
        self.flat = nn.Parameter(full, requires_grad=trainable and bool(self.viewed))  # [padded]
        if self.viewed:
            self.flat.holds_views = True  # see `is_flat_buffer`
        with torch.no_grad():
            for e, p in self.leaves:
                p.data = self.flat.data.narrow(0, e.offset, e.numel).view(e.shape)
                p.grad = None
        self._grad: torch.Tensor | None = None  # the full gradient [padded] in `grad_dtype` (property `grad`)
        self._grad_views: dict[int, torch.Tensor] = {}  # id(leaf) -> its slice of `_grad`, made once per buffer
        self.arrived: set[int] = set()  # the leaves (and `flat`) whose gradient this backward has accumulated
        self.expected = {id(p) for _, p in self.leaves} | ({id(self.flat)} if self.flat.requires_grad else set())
        for _, p in self.leaves:
            _UNIT_OF[p] = weakref.ref(self)
        if self.flat.requires_grad:
            _UNIT_OF[self.flat] = weakref.ref(self)
        own = slice(self.rank * self.size, (self.rank + 1) * self.size)
        self.own = own
        self.main: nn.Parameter | None = None
        if self.main_dtype is not None:
            self.main = nn.Parameter(source if stage == 0 else source[own].clone())
        del source
        if stage == 0:
            self.shard: nn.Parameter | None = None
        elif stage in (1, 2) or self.n == 1:  # a group of one: stage 3's slice is the whole buffer, never freed
            self.shard = nn.Parameter(self.flat.data[own], requires_grad=trainable)  # [S], the flat buffer's storage
        else:
            self.shard = nn.Parameter(full[own].clone(), requires_grad=trainable)  # [S], the only persistent copy
        self.shard_grad: torch.Tensor | None = None
        if stage >= 2 and trainable:
            self.shard_grad = torch.zeros(self.size, dtype=self.grad_dtype, device=self.device)
        if stage <= 1 and trainable:
            self.grad = torch.zeros(self.padded, dtype=self.grad_dtype, device=self.device)  # persistent, full
        self.frees = stage == 3 and self.n > 1  # stage 3 frees the full buffer between uses
        self.reshard_after_use = reshard_after_use  # off (reshard="step"): gathered from first use to the reduction
        self.gathered = not self.frees
        self.pending: dist.Work | None = None
        if self.frees:
            self._free()

    # ---------------------------------------------------------------- stage-3 storage

    def _storage_alias(self) -> torch.Tensor:
        # a fresh tensor on the flat buffer's storage: writing through it does not bump the version
        # counter that autograd checks on the views saved for backward
        return torch.empty(0, dtype=self.dtype, device=self.device).set_(self.flat.untyped_storage(), 0, (self.padded,))

    def _free(self) -> None:
        if not self.frees:
            return
        self.flat.untyped_storage().resize_(0)
        self.gathered = False
        self.waiting = 0

    def gather(self, async_op: bool = False) -> None:
        """Stage 3: rebuild the full buffer from every rank's slice (no-op when present or in flight)."""
        if self.gathered or self.pending is not None:
            return
        self.flat.untyped_storage().resize_(self.padded * self.flat.element_size())
        assert self.shard is not None
        self.pending = all_gather_into(self._storage_alias(), self.shard.detach(), self.group, async_op=True)
        if not async_op:
            self.wait()

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        self.gathered = True

    def release(self) -> None:
        if self.stage == 3:
            self.wait()
            self._free()

    def used(self) -> None:
        """A forward, backward or W of the unit is over: stage 3 frees it again, unless it stays gathered until the
        step's reduction (`reshard_after_use` off)."""
        if self.reshard_after_use:
            self.release()

    def reported(self) -> None:
        """A frozen unit's backward report (inputs passed, partner accumulated): freed after the last one due."""
        if self.waiting > 0:
            self.waiting -= 1
            if self.waiting == 0 and self.entry is None:
                self.used()

    # ---------------------------------------------------------------- views

    def install_views(self) -> None:
        """Point the module's DTensor parameters' names at views of the flat buffer (a new autograd edge per
        forward); the other parameters hold their storage in it for good."""
        for e in self.viewed:
            view = e.as_param(self.flat.narrow(0, e.offset, e.numel).view(e.shape))
            for owner, attr in e.places():
                setattr(owner, attr, view)

    # ---------------------------------------------------------------- gradients

    @property
    def separate_grad(self) -> bool:
        """Gradients accumulate in another dtype than the parameters' (fp32 under bf16 parameters)."""
        return self.trainable and self.grad_dtype != self.dtype

    @property
    def grad(self) -> torch.Tensor | None:
        """The full gradient accumulated so far, [padded] in `grad_dtype`; None before the first one of a step
        (stages 2, 3: after the reduction)."""
        return self._grad

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        """Set the full gradient; in the parameters' dtype, each parameter's `.grad` becomes its slice of it, so
        autograd accumulates there in place (DDP's gradient-as-bucket-view)."""
        self._grad = value
        self._grad_views = {} if value is None else {
            id(p): value.narrow(0, e.offset, e.numel).view(e.shape) for e, p in self.leaves}
        if self.separate_grad:
            return
        for _, p in self.leaves:
            p.grad = self._grad_views.get(id(p))
        if self.viewed:
            self.flat.grad = value

    def gradient(self, p: torch.Tensor) -> torch.Tensor:
        """Leaf `p`'s slice of the full gradient (`flat`: all of it), which is allocated at the first need."""
        if self._grad is None:
            self.grad = torch.zeros(self.padded, dtype=self.grad_dtype, device=self.device)
        if p is self.flat:
            return self._grad
        return self._grad_views[id(p)]

    def accumulated(self, p: torch.Tensor) -> bool:
        """After autograd accumulated `p`'s gradient (a leaf, or `flat`): make sure it is in the full gradient,
        where autograd did not add it in place — the first of a step, when `.grad` was unbound; another dtype
        (fp32 main gradients of bf16 parameters).  True when every trainable leaf has arrived in this backward
        call: a split backward's I and W (each a call or several) never complete a unit, and what one call
        left incomplete (a parameter without a gradient) is forgotten at its end."""
        g = p.grad
        into = self.gradient(p)  # binds every `.grad` to its slice when the full gradient is new
        if g is not None and g is not into and g.data_ptr() != into.data_ptr():
            into.add_(g)
            p.grad = into if into.dtype == p.dtype else None
        if not self.arrived:
            torch.autograd.Variable._execution_engine.queue_callback(self.arrived.clear)
        self.arrived.add(id(p))
        if self.arrived < self.expected:
            return False
        self.arrived.clear()
        return True

    def full_grad(self) -> torch.Tensor:
        g = self.grad
        return g if g is not None else torch.zeros(self.padded, dtype=self.grad_dtype, device=self.device)

    def reduce_held(self) -> None:
        """reduce="microbatch": the full gradient held so far, if any, reduce-scattered into (added to) this rank's
        slice and freed — when a backward completed the unit, after a W, and at REDUCE_GRAD for what is left."""
        if self.trainable and self._grad is not None:
            self.reduce_scatter_grad(accumulate=True)

    def reduce_scatter_grad(self, accumulate: bool) -> None:
        """Sum the full gradient over the group into this rank's slice (averaged), free the full one."""
        assert self.shard_grad is not None
        out = torch.empty(self.size, dtype=self.grad_dtype, device=self.device)
        reduce_scatter_into(out, self.full_grad(), self.group, overwrite=True)
        out.div_(self.divisor)
        if accumulate:
            self.shard_grad.add_(out)
        else:
            self.shard_grad.copy_(out)
        self.grad = None


class _InputsPassed(torch.autograd.Function):
    """Identity on a module's inputs whose backward runs once the gradient has passed the whole module
    (FSDP2's RegisterPostBackwardFunction): the report a frozen unit, which accumulates no gradient, needs."""

    @staticmethod
    def forward(ctx: Any, report: Callable[[], None], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.report = report
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.report()
        return (None, *grads)


def default_units(module: nn.Module) -> list[nn.Module]:
    """The module's children with parameters, looking inside containers without a forward of their own
    (`ModuleList`, `ModuleDict`: looped over, never called), so that every unit is a module that runs."""
    out: list[nn.Module] = []
    for child in module.children():
        if not any(True for _ in child.parameters()):
            continue
        if type(child).forward is nn.Module.forward:  # a container; a ParameterList's parameters stay with its parent
            out += default_units(child)
        else:
            out.append(child)
    return out


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held by one rank (each storage counted once), and the parameter counts behind them."""

    params: int
    grads: int
    optimizer: int
    numel: int  # Ψ: parameters of the wrapped module
    padded_numel: int  # Σ padded unit sizes
    peak_grads: int  # largest gradient bytes seen since the last `reset_peak()`
    main: int = 0  # fp32 main parameters (low-precision parameters only)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.main


class ZeroOptimizer:
    """ZeRO stage 0–3 for `module` over `group`, running `optimizer_class(**optimizer_kwargs)` on owned slices.

    Call pattern per step: forward/backward for every microbatch, `reduce_gradients()`
    (REDUCE_GRAD), `step()`, `zero_grad()`.  `units` (stage 3 and reduce="microbatch" default:
    `default_units(module)`, plus the root's own) sets the granularity of gathering and of
    `reduce="microbatch"` reductions; `separate` names parameters that get a unit of their own
    (weights tied to another stage).  `groups` gives modules (each a unit) their own group and divisor: expert
    shards reduce over the ranks holding the same experts and divide by dp (parallel/expert.py).  Every rank of
    `group` must make the same calls.

    `reshard` (stage 3): "unit" frees a unit's gathered parameters after each forward and backward, so one unit
    is full at a time (the paper's stage 3; 2M gathers a unit a step over M microbatches); "step" keeps each
    unit gathered from its first use in a step until `reduce_gradients()` (one gather a unit a step, the
    stage's full parameters held through the step; torch's pipelining schedules unshard and reshard FSDP
    stages so).
    """

    def __init__(self, module: nn.Module, optimizer_class: Callable[..., torch.optim.Optimizer], *,
                 group: ProcessGroup | None, stage: int = 2, reduce: str = "step",
                 units: Iterable[nn.Module] | None = None, prefetch: bool = True, reshard: str = "unit",
                 separate: Iterable[str] = (),
                 param_dtype: torch.dtype | None = None, grad_dtype: torch.dtype | None = None,
                 groups: Iterable[tuple[nn.Module, ProcessGroup | None, int]] = (), no_decay: Collection[str] = (),
                 **optimizer_kwargs) -> None:
        if stage not in (0, 1, 2, 3):
            raise ParallelConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
        if reduce not in REDUCE_MODES:
            raise ParallelConfigError(f"reduce must be one of {', '.join(map(repr, REDUCE_MODES))}, got {reduce!r}")
        if reduce == "microbatch" and stage < 2:
            raise ParallelConfigError(f"reduce='microbatch' only helps stages 2 and 3 (stage {stage} keeps the full "
                                      f"gradient buffer anyway); use reduce='step'")
        if reshard not in RESHARD_MODES:
            raise ParallelConfigError(f"reshard must be one of {', '.join(map(repr, RESHARD_MODES))}, got {reshard!r}")
        self.module, self.group, self.stage, self.reduce, self.prefetch = module, group, stage, reduce, prefetch
        self.reshard = reshard
        params = [p for p in module.parameters()]
        if not params:
            raise ParallelConfigError("the module has no parameters to shard")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ParallelConfigError(f"ZeroOptimizer keeps one flat buffer dtype per unit; the module mixes {dtypes}")
        dtype = dtypes.pop()
        if param_dtype is not None and not dtype.is_floating_point:
            raise ParallelConfigError(f"param_dtype={param_dtype} needs floating-point parameters, got {dtype}")
        name = _class_name(optimizer_class)
        if name in _NOT_ELEMENTWISE:
            raise ParallelConfigError(f"{name} computes per-tensor statistics: on ZeRO's flat "
                                      f"slices its update would differ from one process; use an elementwise optimizer "
                                      f"(SGD, Adam, AdamW, ...) or fp32 parameters without ZeRO")
        self.param_dtype, self.grad_dtype = param_dtype, grad_dtype
        # what checkpoints describe a parameter as: its main parameters' fp32 with low-precision parameters (a
        # stage partition does not change with the precision mode), else the module's own dtype
        self.dtype = torch.float32 if param_dtype is not None else dtype
        if units is None:
            units = default_units(module) if stage == 3 or reduce == "microbatch" else []
        groups = list(groups)
        self._groups = {id(m): (g, divisor) for m, g, divisor in groups}  # unit module -> its own group
        units = [m for m in units if id(m) not in self._groups]
        unit_modules = [m for m, _, _ in groups] + [m for m in units if m is not module] + [module]
        self.units = self._build_units(unit_modules, group, dtype, separate)
        self.main = param_dtype is not None  # the optimizer steps fp32 main copies of the owned slices
        self.numel = sum(u.numel for u in self.units)
        # weight decay on element ranges of the flat buffers when some parameters are exempt (weight_decay.py)
        optimizer_kwargs, self.decay = split_decay(optimizer_class, optimizer_kwargs) if no_decay else \
            (optimizer_kwargs, None)
        if self.decay is not None:
            self.decay.spans = self._decayed_spans(set(no_decay))
        # one explicit group: a stage whose parameters are all frozen still has an optimizer (stepping nothing)
        self.optimizer = optimizer_class([{"params": [self._param_of(u) for u in self.units if u.trainable]}],
                                         **optimizer_kwargs)
        if self.decay is not None:
            self.decay.hold(self.optimizer)
        self._order: list[int] = []  # units in forward execution order (recorded on the first forward)
        self._recorded = False
        self._in_weight_pass = False  # inside a split backward's W (the units stay gathered until it ends)
        self._pending_reduce: list[tuple[dist.Work, Callable[[], None]]] = []
        self._peak_grads = 0
        self._hooks = []
        at: dict[int, tuple[nn.Module, list[_Unit]]] = {}  # hooked module -> the units it enters
        for u in self.units:
            for m in u.hooked:
                at.setdefault(id(m), (m, []))[1].append(u)
        for m, us in at.values():
            self._hooks.append(m.register_forward_pre_hook(self._make_pre_forward(us), with_kwargs=True))
            self._hooks.append(m.register_forward_hook(self._make_post_forward(us), always_call=True))
        for u in self.units:
            if u.trainable:
                done = self._make_post_backward(u)
                self._hooks += [p.register_post_accumulate_grad_hook(done) for _, p in u.leaves]
                if u.flat.requires_grad:
                    self._hooks.append(u.flat.register_post_accumulate_grad_hook(done))
            if stage != 3:
                u.install_views()
        self._hooks.append(module.register_forward_hook(self._end_of_forward))
        self._note_memory()

    def _build_units(self, unit_modules: list[nn.Module], group: ProcessGroup, dtype: torch.dtype,
                     separate: Iterable[str]) -> list[_Unit]:
        """Each parameter goes to the innermost unit module holding it, trainable and frozen ones apart; one in
        `separate` (if trainable), or held in two units' modules, to a unit of its own.  A unit is entered by
        its unit module and every module between it and the parameters' holders (the root unit: by the root)."""
        root = self.module
        path_of: dict[int, str] = {}
        for path, m in root.named_modules():
            path_of.setdefault(id(m), path)
        for m in unit_modules:
            if id(m) not in path_of:
                raise ParallelConfigError(f"unit {type(m).__name__} is not a submodule of the wrapped module")
        unit_at = {path_of[id(m)]: k for k, m in enumerate(unit_modules)}  # the root is '' (and last)
        own_ids = set()
        for name in separate:
            try:
                own_ids.add(id(root.get_parameter(name)))
            except AttributeError:
                raise ParallelConfigError(f"separate: the module has no parameter {name!r}") from None

        def enclosing(path: str) -> int:
            parts = path.split(".") if path else []
            return next(unit_at[p] for k in range(len(parts), -1, -1) if (p := ".".join(parts[:k])) in unit_at)

        def chain(k: int, path: str) -> list[nn.Module]:
            """The modules from unit module k down to the one at `path` (the root unit: the root alone)."""
            if unit_modules[k] is root:
                return [root]
            start = path_of[id(unit_modules[k])]
            rest = path[len(start):].lstrip(".").split(".") if path != start else []
            out, at = [unit_modules[k]], start
            for part in filter(None, rest):
                at = f"{at}.{part}" if at else part
                out.append(root.get_submodule(at))
            return out

        # every parameter once, in named_parameters() order, with every (module, attribute) holding it
        found: dict[int, tuple[nn.Parameter, list[tuple[str, nn.Module, str]], list[str]]] = {}
        places_seen: set[tuple[int, str]] = set()
        for path, m in root.named_modules(remove_duplicate=False):
            for attr, p in m._parameters.items():
                if p is None:
                    continue
                qual = f"{path}.{attr}" if path else attr
                _, places, quals = found.setdefault(id(p), (p, [], []))
                quals.append(qual)
                if (id(m), attr) not in places_seen:
                    places_seen.add((id(m), attr))
                    places.append((path, m, attr))
        for p, _, quals in found.values():
            if _unit_of(p) is not None:  # its storage is in another optimizer's flat buffer (stage 3: maybe freed)
                raise ParallelConfigError(f"parameter {quals[0]!r} is held by another ZeroOptimizer already: give "
                                          f"each module its own copy of a parameter they share")
        groups: dict[tuple[int, int, int], list[tuple[nn.Parameter, list, list[str], list[int]]]] = {}
        for p, places, quals in found.values():
            homes = [enclosing(path) for path, _, _ in places]
            alone = len(set(homes)) > 1 or (id(p) in own_ids and p.requires_grad)
            kind = 1 if alone else 0 if p.requires_grad else 2  # 0 trainable, 1 a unit of its own, 2 frozen
            groups.setdefault((homes[0], kind, id(p) if alone else 0), []).append((p, places, quals, homes))
        units: list[_Unit] = []
        buffers: dict[tuple[int, int], _Unit] = {}  # (unit module, trainable 0 / frozen 2) -> its unit
        for (k, kind, _), members in sorted(groups.items(), key=lambda kv: kv[0][:2]):
            entries, hooked, offset = [], {}, 0
            for p, places, quals, homes in members:
                (_, owner, attr), *others = places
                local = _local(p)
                entries.append(_Entry(quals[0], owner, attr, local.shape, offset, local.numel(),
                                      tuple((m, a) for _, m, a in others), tuple(quals[1:]), _DTensorSpec.of(p)))
                offset += local.numel()
                for (path, _, _), home in zip(places, homes):
                    hooked.update((id(m), m) for m in chain(home, path))
            own_group, divisor = self._groups.get(id(unit_modules[k]), (group, None))
            u = _Unit(len(units), unit_modules[k], entries, own_group, self.stage, dtype, trainable=kind != 2,
                      hooked=hooked.values(), param_dtype=self.param_dtype, grad_dtype=self.grad_dtype,
                      divisor=divisor, params=[p for p, *_ in members], reshard_after_use=self.reshard == "unit")
            units.append(u)
            if kind != 1:
                buffers[(k, kind)] = u
        for (k, kind), u in buffers.items():  # a unit module's trainable and frozen buffers are partners
            if kind == 2 and (k, 0) in buffers:
                u.partner, buffers[(k, 0)].partner = buffers[(k, 0)], u
        for u in units:  # every entry is planned before any module is changed
            if not u.viewed:
                continue  # its parameters stay where they are, their storage in the flat buffer
            for e in u.viewed:
                for owner, attr in e.places():
                    del owner._parameters[attr]
            name, n = "_zero_flat", 0
            while hasattr(u.module, name):
                n += 1
                name = f"_zero_flat{n}"
            u.module.register_parameter(name, u.flat)
        return units

    def _decayed_spans(self, exempt: set[str]) -> list[tuple[torch.Tensor, list[tuple[int, int]]]]:
        """Each trainable unit's stepped tensor with the ranges of it that hold decayed parameters (entries none of
        whose names is `exempt`), clipped to this rank's slice; padding is never decayed."""
        spans = []
        for u in self.units:
            if not u.trainable:
                continue
            lo, n = (0, u.padded) if self.stage == 0 else (u.own.start, u.size)
            ranges = merged((max(e.offset, lo) - lo, min(e.offset + e.numel, lo + n) - lo) for e in u.entries
                            if e.name not in exempt and not exempt.intersection(e.also))
            if ranges:
                spans.append((self._param_of(u), ranges))
        return spans

    # ------------------------------------------------------------------ hooks

    def _make_pre_forward(self, units: list[_Unit]):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            entering = [u for u in units if u.entry is None]
            if not entering:
                return None  # already inside the unit's forward (an outer module entered it)
            fake = detect_fake_mode() is not None  # shape inference (the pipeline's handshake): no data, no gathers
            for u in entering:
                u.entry = module
                if not fake:
                    if not self._recorded and u.index not in self._order:
                        self._order.append(u.index)
                    if self.stage == 3:
                        u.gather()
                        u.wait()
                        self._prefetch(u, +1)
                u.install_views()
            frozen = [u for u in entering if not u.trainable]
            for u in frozen:
                u.inputs_report = False
            if self.stage != 3 or fake or self._in_weight_pass or not frozen or not torch.is_grad_enabled():
                return None
            return self._report_inputs_passed(frozen, args, kwargs)
        return hook

    def _report_inputs_passed(self, frozen: list[_Unit], args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Route the inputs that need a gradient through `_InputsPassed`, which reports to the frozen units."""
        leaves, spec = tree_flatten((args, kwargs))
        need = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        for u in frozen:
            u.inputs_report = bool(need)
        if not need:
            return None

        def report() -> None:
            if not self._in_weight_pass:  # W (or a recomputing backward) frees everything itself when it ends
                for u in frozen:
                    u.reported()
        passed = _InputsPassed.apply(report, *(leaves[i] for i in need))
        for i, t in zip(need, passed):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    def _make_post_forward(self, units: list[_Unit]):
        def hook(module: nn.Module, args, output) -> None:
            leaving = [u for u in units if u.entry is module]
            for u in leaving:
                u.entry = None
            # inside a weight pass (or a backward that recomputes a forward, runtime/recompute.py) the
            # saved views must stay valid until the pass ends
            if not leaving or self.stage != 3 or detect_fake_mode() is not None or self._in_weight_pass:
                return
            for u in leaving:
                u.used()
            if output is None or not torch.is_grad_enabled():  # None: the forward raised (always_call)
                return
            due = {u.index: (u.partner is not None) + u.inputs_report for u in leaving if not u.trainable}
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._make_pre_backward(leaving, due))
        return hook

    def _make_pre_backward(self, units: list[_Unit], due: dict[int, int]):
        def hook(grad: torch.Tensor) -> None:
            for u in units:
                if not u.trainable and u.waiting == 0:
                    u.waiting = due[u.index]  # the reports that free it again (0: its next forward or the step)
                u.gather()
                u.wait()
                self._prefetch(u, -1)
        return hook

    def _make_post_backward(self, u: _Unit):
        # weak references: torch keeps a parameter's post-accumulate hooks where the garbage collector cannot see
        # them, so a hook holding the optimizer (which holds the parameter) would keep both alive for good
        owner, unit = weakref.ref(self), weakref.ref(u)

        def hook(p: torch.Tensor) -> None:
            zero, u = owner(), unit()
            if zero is None or u is None or not u.accumulated(p):
                return  # gone, or more of the unit's gradients to come in this backward
            zero._note_memory()
            if zero.reduce == "microbatch":
                u.reduce_held()
            if not zero._in_weight_pass:
                u.used()
                if u.partner is not None:
                    u.partner.reported()
        return hook

    def before_weight_pass(self) -> None:
        """Split backward (W): every unit gathered, for W reads saved views of the parameters; collective."""
        self._in_weight_pass = True
        for u in self.units:
            u.gather()

    def after_weight_pass(self) -> None:
        """After W: reduce="microbatch" reduce-scatters the microbatch's gradients (I and W complete no unit on
        their own); every unit freed."""
        self._in_weight_pass = False
        for u in self.units:
            if self.reduce == "microbatch":
                u.reduce_held()
            u.used()

    def _end_of_forward(self, module: nn.Module, args, output) -> None:
        if detect_fake_mode() is None:
            self._recorded = True  # the forward order of the units is known from now on

    def _prefetch(self, u: _Unit, direction: int) -> None:
        if not self.prefetch or not self._recorded or u.index not in self._order:
            return
        pos = self._order.index(u.index) + direction
        if 0 <= pos < len(self._order):
            self.units[self._order[pos]].gather(async_op=True)

    # ------------------------------------------------------------------ the step

    def parameters(self) -> Iterator[nn.Parameter]:
        """The flat buffers (frozen ones too) that stand for the module's parameters now."""
        return (u.flat for u in self.units)

    def reduce_gradients(self, async_op: bool = False) -> None:
        """Average gradients over the group (REDUCE_GRAD); with `async_op`, `step()` or `wait()` completes it.
        reshard="step": the stage's units, gathered since their first use, are freed (its step's last backward
        is over)."""
        if self.reshard == "step":
            for u in self.units:
                u.release()
        if self.reduce == "microbatch":
            for u in self.units:  # a unit some parameter of which had no gradient in a backward: never complete
                u.reduce_held()
            return
        for u in self.units:
            if not u.trainable:
                continue
            if self.stage == 0:
                g = u.full_grad()
                work = all_reduce(g, u.group, async_op=True)

                def average(g: torch.Tensor = g, u: _Unit = u) -> None:
                    g.div_(u.divisor)
                self._pending_reduce.append((work, average))
            elif self.stage == 1:
                out = torch.empty(u.size, dtype=u.grad_dtype, device=u.device)
                work = reduce_scatter_into(out, u.full_grad(), u.group, async_op=True, overwrite=True)

                def finish(u: _Unit = u, out: torch.Tensor = out) -> None:
                    grad_slice = u.grad[u.own]
                    grad_slice.copy_(out).div_(u.divisor)
                    if u.main is None:
                        u.shard.grad = grad_slice  # a view: no extra memory
                self._pending_reduce.append((work, finish))
            else:
                out = torch.empty(u.size, dtype=u.grad_dtype, device=u.device)
                work = reduce_scatter_into(out, u.full_grad(), u.group, async_op=True, overwrite=True)

                def finish(u: _Unit = u, out: torch.Tensor = out) -> None:
                    u.shard_grad.copy_(out).div_(u.divisor)
                    u.grad = None
                self._pending_reduce.append((work, finish))
        if not async_op:
            self.wait()

    def wait(self) -> None:
        """Complete reductions started with `reduce_gradients(async_op=True)`."""
        pending, self._pending_reduce = self._pending_reduce, []
        for work, finish in pending:
            if work is not None:
                work.wait()
            finish()
        self._note_memory()

    def _owned(self, u: _Unit) -> tuple[torch.Tensor, int]:
        """A trainable unit's reduced gradient as `step()` uses it — this rank's [S] slice (stage 0: the whole
        buffer), a view into what the optimizer reads — and where it starts in the flat buffer.  With main
        parameters it is their `.grad`: that view, or its fp32 copy when gradients were reduced in bf16."""
        if self.stage == 0:
            grad, lo = u.full_grad(), 0
        elif self.stage == 1:
            grad, lo = u.full_grad()[u.own], u.own.start
        else:
            assert u.shard_grad is not None
            grad, lo = u.shard_grad, u.own.start
        if u.main is None:
            return grad, lo
        if u.main.grad is None:
            u.main.grad = grad if grad.dtype == u.main.dtype else grad.to(u.main.dtype)
        return u.main.grad, lo

    def owned_gradients(self) -> list[tuple[torch.Tensor, list[tuple[str, int, int]]]]:
        """After the reduction, per trainable unit: the gradient `step()` uses — this rank's [S] slice (stage 0:
        the whole buffer) — and the parameters in it as (name, start, end) within that tensor (padding is in
        none).  What a global gradient norm counts and clipping or unscaling scales (runtime/clip.py)."""
        self.wait()
        out = []
        for u in self.units:
            if not u.trainable:
                continue
            grad, lo = self._owned(u)
            hi = lo + grad.numel()
            entries = [(e.name, max(e.offset, lo) - lo, min(e.offset + e.numel, hi) - lo) for e in u.entries
                       if e.offset < hi and e.offset + e.numel > lo]
            out.append((grad, entries))
        return out

    def separate_gradient(self, name: str) -> torch.Tensor:
        """After the reduction: this rank's reduced slice of the `separate` unit of parameter `name` — the
        tensor `step()` reads, so writing into it (ties.py sums a tie's copies there) is what gets stepped."""
        self.wait()
        return self._owned(self.separate_unit(name))[0]

    def separate_unit(self, name: str) -> _Unit:
        for u in self.units:
            if len(u.entries) == 1 and u.trainable and name in (u.entries[0].name, *u.entries[0].also):
                return u
        raise KeyError(f"{name!r} has no unit of its own (pass it in separate=)")

    def step(self, skip: bool = False) -> None:
        """Run the optimizer on this rank's slices, then give every rank the updated parameters.  `skip`
        (an fp16 overflow, decided on every rank alike): complete the reduction, change nothing."""
        self.wait()
        for u in self.units:
            u.wait()  # a prefetch still in flight
            if u.main is not None:
                self._owned(u)  # binds the main parameters' gradient
            elif self.stage >= 2 and u.trainable:
                u.shard.grad = u.shard_grad
            elif self.stage == 0 and u.trainable:
                u.flat.grad = u.full_grad()  # the optimizer steps the whole buffer
            if self.stage == 3 and u.gathered:
                u.release()  # its values are about to go stale (skip: regathered at the next forward anyway)
        if skip:
            return
        if self.decay is not None:
            self.decay.apply(self.optimizer)
        self.optimizer.step()
        with torch.no_grad():
            for u in self.units:  # the stepped main parameters, rounded into the model's (Megatron's copy-back)
                if u.main is not None:
                    (u.flat if self.stage == 0 else u.shard).copy_(u.main)
                    if u.grad_dtype != u.main.dtype:
                        u.main.grad = None  # an fp32 copy of a bf16 gradient: dead once stepped
        if self.stage in (1, 2):
            for u in self.units:
                if u.trainable:
                    all_gather_into(u.flat.data, u.shard.detach().clone(), u.group)

    def zero_grad(self) -> None:
        for u in self.units:
            if not u.trainable:
                continue
            if self.stage <= 1:
                u.grad.zero_()
            else:
                u.shard_grad.zero_()
                u.grad = None
            if u.main is not None:
                u.main.grad = None  # rebound to this step's reduced gradient by `_owned`

    # ------------------------------------------------------------------ inspection

    @contextmanager
    def full_parameters(self) -> Iterator[dict[str, torch.Tensor]]:
        """Every original parameter by qualified name, at full size (gathers stage-3 slices; collective); a DTensor
        parameter as a DTensor over this tp rank's shard, as the module held it."""
        gathered = []
        for u in self.units:
            if not u.gathered:
                u.gather()
                gathered.append(u)
        try:
            yield {e.name: e.as_param(u.flat.detach()[e.offset:e.offset + e.numel].view(e.shape))
                   for u in self.units for e in u.entries}
        finally:
            for u in gathered:
                u.release()

    def state_dict_full(self, main: bool = False) -> dict[str, torch.Tensor]:
        """A dense copy of the parameters (collective for stage 3); `main`: of the fp32 main parameters where
        there are some (collective over the group for stages 1-3)."""
        if not main or not self.main:
            with self.full_parameters() as params:
                return {k: v.clone() for k, v in params.items()}
        out = {}
        if any(u.main is None for u in self.units):  # frozen units have no main copy: their model values, one gather
            with self.full_parameters() as params:
                out.update({e.name: params[e.name].clone() for u in self.units if u.main is None for e in u.entries})
        for u in self.units:
            if u.main is None:
                continue
            full = u.main.detach()
            if self.stage > 0:
                full = torch.empty(u.padded, dtype=u.main.dtype, device=u.main.device)
                all_gather_into(full, u.main.detach(), u.group)
            out.update({e.name: e.as_param(full[e.offset:e.offset + e.numel].view(e.shape).clone()) for e in u.entries})
        return out

    # ------------------------------------------------------------------ checkpoints

    def layout(self) -> list[dict[str, Any]]:
        """Per unit: its entries [name, shape, offset, numel], numel, padded size, dp size `n` and dtype —
        what a saved slice means, and what must match to restore slices directly — and for DTensor
        parameters, whose entries are local shards, the whole shape and the placements."""
        out = []
        for u in self.units:  # the keys a unit of trainable parameters never has are added only when needed,
            # so such layouts stay what they were (their checkpoints still restore slices directly)
            entries = [[e.name, list(e.shape), e.offset, e.numel, *([list(e.also)] if e.also else [])]
                       for e in u.entries]
            # DTensor parameters: the entries are this tp rank's shards; the whole tensors' shapes and placements
            dtensors = {e.name: {"shape": list(e.dtensor.shape), "placements": [str(p) for p in e.dtensor.placements]}
                        for e in u.entries if e.dtensor is not None}
            out.append({"entries": entries, "numel": u.numel, "padded": u.padded, "n": u.n,
                        "dtype": str(u.dtype).removeprefix("torch."), **({} if u.trainable else {"frozen": True}),
                        **({"main": str(u.main.dtype).removeprefix("torch.")} if u.main is not None else {}),
                        **({"dtensors": dtensors} if dtensors else {}), **({"edp": True} if u.own_group else {})})
        return out

    def _model_of(self, u: _Unit) -> nn.Parameter:
        """What holds this rank's values of unit `u` in the model's dtype."""
        return u.flat if self.stage == 0 else u.shard

    def _param_of(self, u: _Unit) -> nn.Parameter:
        """What the optimizer steps for unit `u`: its fp32 main parameters, or the model's own values."""
        return u.main if u.main is not None else self._model_of(u)

    def shard_state(self, optimizer: bool = True) -> dict[str, Any]:
        """This rank's slice [r·S, (r+1)·S) of every unit's parameters and (with `optimizer`) optimizer state,
        plus the layout to reassemble full tensors: a checkpoint part.  No communication; copies (a slice of
        stage 1/2 shares the full buffer's storage, which torch.save would write whole)."""
        out: dict[str, Any] = {"stage": self.stage, "rank": group_rank(self.group), "layout": self.layout(),
                               "optimizer": type(self.optimizer).__name__ if optimizer else None}
        params = [self._param_of(u) for u in self.units]
        sd = self.optimizer.state_dict() if optimizer else None
        index = {}
        if sd is not None:
            for gi, (group, saved) in enumerate(zip(self.optimizer.param_groups, sd["param_groups"])):
                for p, idx in zip(group["params"], saved["params"]):
                    index[id(p)] = (gi, idx)
            out["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
        units = []
        for u, p in zip(self.units, params):
            whole = self.stage == 0  # the optimizer runs on the full flat buffer: keep this rank's slice

            def piece(t: torch.Tensor, whole: bool = whole, u: _Unit = u) -> torch.Tensor:
                return (t.detach()[u.own] if whole else t.detach()).clone()

            unit: dict[str, Any] = {"params": piece(self._model_of(u))}
            if u.main is not None:
                unit["main"] = piece(u.main)
            if sd is not None and u.trainable:
                gi, idx = index[id(p)]
                sharded, scalar = {}, {}
                for k, v in sd["state"].get(idx, {}).items():
                    if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0:
                        sharded[k] = piece(v)
                    else:
                        scalar[k] = v.clone() if isinstance(v, torch.Tensor) else v
                unit.update(group=gi, sharded=sharded, scalar=scalar)
            units.append(unit)
        out["units"] = units
        return out

    def load_shard_state(self, state: dict[str, Any]) -> None:
        """Restore this rank's slices saved by `shard_state` under the same layout (same units, same dp size,
        same rank), bit for bit.  Local only: stages 1 and 2 then need `sync_parameters()` on every rank of
        the group to rebuild the full buffers.  Raises ValueError saying what differs; nothing is changed then."""
        if self.stage == 0:
            raise ValueError("ZeRO stage 0 keeps a full copy on every rank: restore it with load_full_state")
        if state["layout"] != self.layout():
            raise ValueError(_layout_difference(state["layout"], self.layout()))
        if state["rank"] != group_rank(self.group):
            raise ValueError(f"the slices are dp rank {state['rank']}'s, this is dp rank {group_rank(self.group)}")
        opt_state = None
        if state.get("optimizer") is not None:
            if state["optimizer"] != type(self.optimizer).__name__:
                raise ValueError(f"the saved optimizer is {state['optimizer']}, this one is "
                                 f"{type(self.optimizer).__name__}")
            current = self.optimizer.state_dict()
            saved_state = {}
            order = {id(self._param_of(u)): i for i, u in enumerate(self.units)}
            for group, cur in zip(self.optimizer.param_groups, current["param_groups"]):
                for p, idx in zip(group["params"], cur["params"]):
                    unit = state["units"][order[id(p)]]
                    st = {**unit["sharded"], **unit["scalar"]}
                    if st:
                        saved_state[idx] = st
            groups = [{**{k: v for k, v in cur.items() if k != "params"}, **state["groups"][0], "params": cur["params"]}
                      for cur in current["param_groups"]]
            opt_state = {"state": saved_state, "param_groups": groups}
        with torch.no_grad():
            for u, unit in zip(self.units, state["units"]):
                u.wait()
                if self.stage == 3 and u.gathered:
                    u.release()  # the full values are about to go stale
                u.shard.data.copy_(unit["params"])
                if u.main is not None:
                    u.main.data.copy_(unit["main"])
        if opt_state is not None:
            self.optimizer.load_state_dict(opt_state)

    def load_full_state(self, params: dict[str, torch.Tensor], state: dict[str, dict[str, Any]] | None = None,
                        hyper: dict[str, Any] | None = None) -> None:
        """Take full-size values by parameter name (`params`; `state`: each parameter's optimizer state, whose
        tensors of the parameter's shape are elementwise and other entries scalars, equal within a unit) and
        keep this rank's slices: resharding from any dp size or ZeRO stage.  No communication (every rank
        passes the same full values).  `hyper` replaces the optimizer's hyperparameters.  Raises ValueError
        (nothing changed) when a name is missing or the state is not elementwise."""
        fulls, states = [], []
        for u in self.units:
            full = torch.zeros(u.padded, dtype=u.main_dtype or u.dtype, device=u.device)  # main: the exact values
            for e in u.entries:
                if e.name not in params:
                    raise ValueError(f"no saved values for parameter {e.name!r}")
                t = params[e.name]
                if tuple(t.shape) != tuple(e.shape):
                    raise ValueError(f"parameter {e.name!r} is saved as {list(t.shape)}, here {list(e.shape)}")
                full[e.offset:e.offset + e.numel].copy_(t.reshape(-1))
            fulls.append(full)
            states.append(None if state is None or not u.trainable else self._pack_state(u, state))
        own = [full if self.stage == 0 else full[u.own].clone() for u, full in zip(self.units, fulls)]
        opt_state = None
        if state is not None:
            current = self.optimizer.state_dict()
            order = {id(self._param_of(u)): i for i, u in enumerate(self.units)}
            saved_state = {}
            for group, cur in zip(self.optimizer.param_groups, current["param_groups"]):
                for p, idx in zip(group["params"], cur["params"]):
                    st = states[order[id(p)]]
                    if st:
                        saved_state[idx] = {k: (v if self.stage == 0 or k not in st["_sharded"] else
                                                v[self.units[order[id(p)]].own].clone())
                                            for k, v in st.items() if k != "_sharded"}
            groups = [{**{k: v for k, v in cur.items() if k != "params"}, **(hyper or {}), "params": cur["params"]}
                      for cur in current["param_groups"]]
            opt_state = {"state": saved_state, "param_groups": groups}
        with torch.no_grad():
            for u, full, mine in zip(self.units, fulls, own):
                u.wait()
                if u.main is not None:
                    u.main.data.copy_(mine)
                if self.stage == 3:
                    if u.gathered:
                        u.release()
                    u.shard.data.copy_(mine)
                else:
                    u.flat.data.copy_(full)  # stages 1, 2: the shard is a view of it
        if opt_state is not None:
            self.optimizer.load_state_dict(opt_state)

    @staticmethod
    def _pack_state(u: _Unit, state: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """One unit's optimizer state, full size [padded], from per-parameter state (see load_full_state)."""
        per = [state.get(e.name, {}) for e in u.entries]
        keys = set().union(*per)
        if not keys:
            return {}
        out: dict[str, Any] = {"_sharded": set()}
        for k in sorted(keys):
            if any(k not in st for st in per):
                missing = next(e.name for e, st in zip(u.entries, per) if k not in st)
                raise ValueError(f"optimizer state {k!r} is missing for parameter {missing!r} but present for "
                                 f"others of its unit")
            vals = [st[k] for st in per]
            elementwise = [isinstance(v, torch.Tensor) and v.dim() > 0 for v in vals]
            if any(elementwise):
                first = next(v for v in vals if isinstance(v, torch.Tensor))
                flat = torch.zeros(u.padded, dtype=first.dtype, device=first.device)
                for e, v in zip(u.entries, vals):
                    if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(e.shape):
                        shape = list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                        raise ValueError(f"optimizer state {k!r} of parameter {e.name!r} is {shape}, not the "
                                         f"parameter's shape {list(e.shape)}: only elementwise optimizer state "
                                         f"(Adam, AdamW, SGD momentum) can be resharded")
                    flat[e.offset:e.offset + e.numel].copy_(v.reshape(-1))
                out[k] = flat
                out["_sharded"].add(k)
            else:
                first = vals[0]
                same = all(torch.equal(torch.as_tensor(v), torch.as_tensor(first)) if isinstance(first, torch.Tensor)
                           else v == first for v in vals)
                if not same:
                    raise ValueError(f"optimizer state {k!r} differs between the parameters of one unit "
                                     f"({', '.join(e.name for e in u.entries[:3])}, …): it cannot be one value")
                out[k] = first.clone() if isinstance(first, torch.Tensor) else first
        return out

    def sync_parameters(self) -> None:
        """After `load_shard_state`: every rank's slice all-gathered into the full buffers (stages 1, 2; as at the
        end of `step()`).  Collective over the group; nothing to do for stage 3 (gathered at the next forward)."""
        if self.stage in (1, 2):
            for u in self.units:
                all_gather_into(u.flat.data, u.shard.detach().clone(), u.group)

    def _grad_bytes(self) -> int:
        def grads(u: _Unit) -> tuple[torch.Tensor | None, ...]:
            return (u.grad, u.flat.grad, u.shard_grad,
                    u.shard.grad if u.shard is not None else None, u.main.grad if u.main is not None else None)
        return unique_bytes(t for u in self.units for t in grads(u))

    def _note_memory(self) -> None:
        self._peak_grads = max(self._peak_grads, self._grad_bytes())

    def reset_peak(self) -> None:
        self._peak_grads = self._grad_bytes()

    def memory(self) -> MemoryReport:
        """Bytes of parameters, gradients and optimizer state this rank holds right now."""
        params = unique_bytes(t for u in self.units for t in (u.flat, u.shard))
        opt = unique_bytes(v for st in self.optimizer.state.values() for v in st.values()
                            if isinstance(v, torch.Tensor))
        main = unique_bytes(u.main for u in self.units)
        return MemoryReport(params, self._grad_bytes(), opt, self.numel, sum(u.padded for u in self.units),
                            max(self._peak_grads, self._grad_bytes()), main)


def memory_report(zero: ZeroOptimizer) -> MemoryReport:
    """Bytes of parameters, gradients and optimizer state held by this rank (see `ZeroOptimizer.memory`)."""
    return zero.memory()


_NOT_ELEMENTWISE = {"Adafactor", "LBFGS", "Lamb", "LAMB", "FusedLAMB", "Muon", "Shampoo", "SparseAdam"}


def _class_name(optimizer_class: Callable[..., Any]) -> str:
    """The optimizer class's name, also through a functools.partial (checked against `_NOT_ELEMENTWISE`: the
    optimizers known to use per-tensor statistics — norms, factored moments, matrices)."""
    return getattr(getattr(optimizer_class, "func", optimizer_class), "__name__", "")


def unique_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """The bytes of the storages behind `tensors`, each counted once (views and aliases share one)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        seen[s.data_ptr() if s.nbytes() else id(s)] = s.nbytes()
    return sum(seen.values())


def _layout_difference(saved: list[dict[str, Any]], here: list[dict[str, Any]]) -> str:
    """What differs between two `ZeroOptimizer.layout()`s, in one line."""
    if len(saved) != len(here):
        return f"the saved slices have {len(saved)} unit(s), this optimizer {len(here)}"
    for i, (a, b) in enumerate(zip(saved, here)):
        for k in ("n", "padded", "numel", "dtype", "entries"):
            if a[k] != b[k]:
                what = {"n": "dp size", "padded": "padded size", "numel": "parameter count", "dtype": "dtype",
                        "entries": "parameters"}[k]
                detail = "" if k == "entries" else f" ({a[k]} saved, {b[k]} here)"
                return f"unit {i}: a different {what}{detail}"
    return "the layouts differ"
