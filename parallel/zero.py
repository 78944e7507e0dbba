"""ZeRO over a data-parallel group (Rajbhandari et al., SC'20) with flat, padded per-rank buffers.

`ZeroOptimizer(module, torch.optim.Adam, group=dp_group, stage=2, lr=1e-3)` takes over the
module's parameters.  They are packed, per *unit* (a submodule; by default the whole module,
or every child for stage 3), into one flat fp32 buffer padded to a multiple of the group
size N, so rank r owns the contiguous slice [r·S, (r+1)·S) of every unit, S = padded/N.  The
module's parameters become views of that buffer, recreated at every forward so gradients
land in one contiguous flat gradient.  The user's optimizer class runs on the owned slices
only, which equals running it on the whole model for any elementwise optimizer (SGD, Adam,
AdamW, …; not LAMB or Adafactor, whose updates use per-tensor norms).

    stage 0   plain data parallel: full gradients all-reduced and averaged, full optimizer
    stage 1   optimizer state sharded: gradients reduce-scattered into the owned slice of the
              (kept) full gradient buffer, step on the slice, updated slices all-gathered
    stage 2   + gradients sharded: only the [S] slice of gradients is kept between steps
    stage 3   + parameters sharded: a unit's full parameters exist only from just before its
              forward (or backward) until just after it, gathered from the slices; the next
              unit in execution order is prefetched asynchronously

Gradient accumulation over M microbatches (pipelines): `reduce="step"` (the default) sums
the microbatches' gradients locally and reduces once, in `reduce_gradients()`, the hook the
pipeline runtime calls at REDUCE_GRAD after the stage's last backward.  It moves the same
bytes per step as data parallel (not M times them) and overlaps with the rest of the
cooldown (DESIGN §8); its price is that a full-size gradient buffer lives from the first
backward to the reduction, so stages 2 and 3 save gradient memory only between steps.
`reduce="microbatch"` reduce-scatters every unit's gradient right after its backward, for
every microbatch, into the [S] slice and frees the full one: true stage-2/3 gradient memory
(one unit's full gradient at a time) for M× the reduce-scatter traffic, on the critical path.

Gradients are averaged over the group (divided by N), like DDP; the runtime scales each
microbatch's loss by 1/M, so the result is the mean over the global batch.

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

Split backward (I/W, zero-bubble schedules) under stage 3: I regathers through the usual
pre-backward hooks; W reads saved views of the parameters, so the pipeline calls
`before_weight_pass` (gather every unit) and `after_weight_pass` (free them) around each W.
Not yet handled: reduce="microbatch" with stage replicas on other ranks (`Pipeline` refuses
it, with the reason), mixed dtypes, frozen parameters, non-elementwise optimizers.

Under a fake-tensor mode (the pipeline's shape handshake) the hooks only install views:
no gathers, no change of state.

Checkpoints (runtime/checkpoint.py): `shard_state()` is this rank's slices of parameters and
optimizer state with the `layout()` that gives them meaning; `load_shard_state()` puts them
back under the same layout (then `sync_parameters()`, collective), `load_full_state()` takes
full tensors by name and keeps this rank's slices (resharding to another dp size or stage).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._guards import detect_fake_mode
from torch.distributed import ProcessGroup
from torch.utils._pytree import tree_flatten

from .comm import all_gather_into, all_reduce, group_rank, group_size, reduce_scatter_into
from .config import REDUCE_MODES, ParallelConfigError


@dataclass(frozen=True)
class _Entry:
    """One original parameter: where it lived and where it sits in its unit's flat buffer."""

    name: str  # qualified name in the wrapped module
    owner: nn.Module
    attr: str
    shape: torch.Size
    offset: int
    numel: int


class _Unit:
    """The flat, padded buffer of one submodule's parameters and this rank's slice of it."""

    def __init__(self, index: int, module: nn.Module, entries: list[_Entry], group: ProcessGroup,
                 stage: int, dtype: torch.dtype) -> None:
        self.index, self.module, self.entries, self.stage = index, module, entries, stage
        self.group, self.n, self.rank = group, group_size(group), group_rank(group)
        self.numel = sum(e.numel for e in entries)
        self.padded = -(-max(self.numel, 1) // self.n) * self.n
        self.size = self.padded // self.n  # S: this rank's slice
        self.dtype = dtype
        full = torch.zeros(self.padded, dtype=dtype)
        with torch.no_grad():
            for e in entries:
                full[e.offset:e.offset + e.numel].copy_(getattr(e.owner, e.attr).detach().reshape(-1))
        self.flat = nn.Parameter(full)  # [padded]; the module's parameters are views of it
        own = slice(self.rank * self.size, (self.rank + 1) * self.size)
        self.own = own
        if stage == 0:
            self.shard: nn.Parameter | None = None
        elif stage in (1, 2):
            self.shard = nn.Parameter(self.flat.data[own])  # [S], shares the flat buffer's storage
        else:
            self.shard = nn.Parameter(full[own].clone())  # [S], the only persistent copy
        self.shard_grad: torch.Tensor | None = None
        if stage >= 2:
            self.shard_grad = torch.zeros(self.size, dtype=dtype)
        if stage <= 1:
            self.flat.grad = torch.zeros_like(full)  # persistent full gradient buffer
        self.gathered = stage != 3
        self.pending: dist.Work | None = None
        self.reduced_this_step = False
        if stage == 3:
            self._free()

    # ---------------------------------------------------------------- stage-3 storage

    def _storage_alias(self) -> torch.Tensor:
        # a fresh tensor on the flat buffer's storage: writing through it does not bump the version
        # counter that autograd checks on the views saved for backward
        return torch.empty(0, dtype=self.dtype).set_(self.flat.untyped_storage(), 0, (self.padded,))

    def _free(self) -> None:
        self.flat.untyped_storage().resize_(0)
        self.gathered = False

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

    # ---------------------------------------------------------------- views

    def install_views(self) -> None:
        """Point the module's parameter names at views of the flat buffer (a new autograd edge per forward)."""
        for e in self.entries:
            setattr(e.owner, e.attr, self.flat.narrow(0, e.offset, e.numel).view(e.shape))

    # ---------------------------------------------------------------- gradients

    def full_grad(self) -> torch.Tensor:
        g = self.flat.grad
        return g if g is not None else torch.zeros(self.padded, dtype=self.dtype)

    def reduce_scatter_grad(self, accumulate: bool) -> None:
        """Sum the full gradient over the group into this rank's slice (averaged), free the full one."""
        assert self.shard_grad is not None
        out = torch.empty(self.size, dtype=self.dtype)
        reduce_scatter_into(out, self.full_grad(), self.group)
        out.div_(self.n)
        if accumulate:
            self.shard_grad.add_(out)
        else:
            self.shard_grad.copy_(out)
        self.flat.grad = None


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held by one rank (each storage counted once), and the parameter counts behind them."""

    params: int
    grads: int
    optimizer: int
    numel: int  # Ψ: parameters of the wrapped module
    padded_numel: int  # Σ padded unit sizes
    peak_grads: int  # largest gradient bytes seen since the last `reset_peak()`

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


class ZeroOptimizer:
    """ZeRO stage 0–3 for `module` over `group`, running `optimizer_class(**optimizer_kwargs)` on owned slices.

    Call pattern per step: forward/backward for every microbatch, `reduce_gradients()`
    (REDUCE_GRAD), `step()`, `zero_grad()`.  `units` (stage 3 default: every child module
    with parameters, plus the root's own) sets the granularity of gathering and of
    `reduce="microbatch"` reductions.  Every rank of `group` must make the same calls.
    """

    def __init__(self, module: nn.Module, optimizer_class: Callable[..., torch.optim.Optimizer], *,
                 group: ProcessGroup | None, stage: int = 2, reduce: str = "step",
                 units: Iterable[nn.Module] | None = None, prefetch: bool = True, **optimizer_kwargs) -> None:
        if stage not in (0, 1, 2, 3):
            raise ParallelConfigError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
        if reduce not in REDUCE_MODES:
            raise ParallelConfigError(f"reduce must be one of {', '.join(map(repr, REDUCE_MODES))}, got {reduce!r}")
        if reduce == "microbatch" and stage < 2:
            raise ParallelConfigError(f"reduce='microbatch' only helps stages 2 and 3 (stage {stage} keeps the full "
                                      f"gradient buffer anyway); use reduce='step'")
        self.module, self.group, self.stage, self.reduce, self.prefetch = module, group, stage, reduce, prefetch
        params = [p for p in module.parameters()]
        if not params:
            raise ParallelConfigError("the module has no parameters to shard")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ParallelConfigError(f"ZeroOptimizer keeps one flat buffer dtype per unit; the module mixes {dtypes}")
        if any(not p.requires_grad for p in params):
            raise ParallelConfigError("frozen parameters (requires_grad=False) are not supported by ZeroOptimizer")
        dtype = dtypes.pop()
        if units is None:
            per_child = stage == 3 or reduce == "microbatch"
            units = [c for c in module.children() if any(True for _ in c.parameters())] if per_child else []
        unit_modules = [m for m in units if m is not module] + [module]
        self.units = self._build_units(unit_modules, group, dtype)
        self.numel = sum(u.numel for u in self.units)
        opt_params = [u.flat if stage == 0 else u.shard for u in self.units]
        self.optimizer = optimizer_class(opt_params, **optimizer_kwargs)
        self._order: list[int] = []  # units in forward execution order (recorded on the first forward)
        self._recorded = False
        self._in_weight_pass = False  # inside a split backward's W (the units stay gathered until it ends)
        self._pending_reduce: list[tuple[dist.Work, Callable[[], None]]] = []
        self._peak_grads = 0
        self._hooks = []
        for u in self.units:
            self._hooks.append(u.module.register_forward_pre_hook(self._make_pre_forward(u)))
            self._hooks.append(u.module.register_forward_hook(self._make_post_forward(u)))
            self._hooks.append(u.flat.register_post_accumulate_grad_hook(self._make_post_backward(u)))
            if stage != 3:
                u.install_views()
        self._hooks.append(module.register_forward_hook(self._end_of_forward))
        self._note_memory()

    def _build_units(self, unit_modules: list[nn.Module], group: ProcessGroup, dtype: torch.dtype) -> list[_Unit]:
        names = {id(m): n for n, m in self.module.named_modules()}
        for m in unit_modules:
            if id(m) not in names:
                raise ParallelConfigError(f"unit {type(m).__name__} is not a submodule of the wrapped module")
        seen: set[int] = set()
        plan: list[tuple[nn.Module, list[_Entry]]] = []
        for um in unit_modules:  # every entry is planned before any module is changed
            entries: list[_Entry] = []
            offset = 0
            prefix = names[id(um)]
            for qual, p in um.named_parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                owner_path, _, attr = qual.rpartition(".")
                owner = um.get_submodule(owner_path) if owner_path else um
                full_name = f"{prefix}.{qual}" if prefix else qual
                entries.append(_Entry(full_name, owner, attr, p.shape, offset, p.numel()))
                offset += p.numel()
            if entries:
                plan.append((um, entries))
        units: list[_Unit] = []
        for um, entries in plan:
            unit = _Unit(len(units), um, entries, group, self.stage, dtype)
            for e in entries:
                del e.owner._parameters[e.attr]
            um.register_parameter("_zero_flat", unit.flat)
            units.append(unit)
        return units

    # ------------------------------------------------------------------ hooks

    def _make_pre_forward(self, u: _Unit):
        def hook(module: nn.Module, args) -> None:
            if detect_fake_mode() is not None:  # shape inference (the pipeline's handshake): no data, no gathers
                u.install_views()
                return
            if not self._recorded and u.index not in self._order:
                self._order.append(u.index)
            if self.stage == 3:
                u.gather()
                u.wait()
                self._prefetch(u, +1)
            u.install_views()
        return hook

    def _make_post_forward(self, u: _Unit):
        def hook(module: nn.Module, args, output) -> None:
            # inside a weight pass (or a backward that recomputes a forward, runtime/recompute.py) the
            # saved views must stay valid until the pass ends
            if self.stage != 3 or detect_fake_mode() is not None or self._in_weight_pass:
                return
            u.release()
            if torch.is_grad_enabled():
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(self._make_pre_backward(u))
        return hook

    def _make_pre_backward(self, u: _Unit):
        def hook(grad: torch.Tensor) -> None:
            u.gather()
            u.wait()
            self._prefetch(u, -1)
        return hook

    def _make_post_backward(self, u: _Unit):
        def hook(flat: torch.Tensor) -> None:
            self._note_memory()
            if self.reduce == "microbatch":
                u.reduce_scatter_grad(accumulate=True)
                u.reduced_this_step = True
            if not self._in_weight_pass:
                u.release()
        return hook

    def before_weight_pass(self) -> None:
        """Split backward (W): every unit gathered, for W reads saved views of the parameters; collective."""
        self._in_weight_pass = True
        for u in self.units:
            u.gather()

    def after_weight_pass(self) -> None:
        self._in_weight_pass = False
        for u in self.units:
            u.release()

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
        """The flat buffers autograd differentiates (what a pipeline stage should treat as its weights)."""
        return (u.flat for u in self.units)

    def reduce_gradients(self, async_op: bool = False) -> None:
        """Average gradients over the group (REDUCE_GRAD); with `async_op`, `step()` or `wait()` completes it."""
        if self.reduce == "microbatch":
            return
        for u in self.units:
            if self.stage == 0:
                g = u.full_grad()
                work = all_reduce(g, self.group, async_op=True)

                def average(g: torch.Tensor = g, u: _Unit = u) -> None:
                    g.div_(u.n)
                self._pending_reduce.append((work, average))
            elif self.stage == 1:
                out = torch.empty(u.size, dtype=u.dtype)
                work = reduce_scatter_into(out, u.full_grad(), self.group, async_op=True)

                def finish(u: _Unit = u, out: torch.Tensor = out) -> None:
                    grad_slice = u.flat.grad[u.own]
                    grad_slice.copy_(out).div_(u.n)
                    u.shard.grad = grad_slice  # a view: no extra memory
                self._pending_reduce.append((work, finish))
            else:
                out = torch.empty(u.size, dtype=u.dtype)
                work = reduce_scatter_into(out, u.full_grad(), self.group, async_op=True)

                def finish(u: _Unit = u, out: torch.Tensor = out) -> None:
                    u.shard_grad.copy_(out).div_(u.n)
                    u.flat.grad = None
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

    def owned_gradients(self) -> list[tuple[torch.Tensor, list[tuple[str, int, int]]]]:
        """After the reduction, per unit: the gradient `step()` uses — this rank's [S] slice (stage 0: the
        whole buffer) — and the parameters in it as (name, start, end) within that tensor (padding is in
        none).  What a global gradient norm counts and clipping or unscaling scales (runtime/clip.py)."""
        self.wait()
        out = []
        for u in self.units:
            if self.stage == 0:
                grad, lo = u.full_grad(), 0
            elif self.stage == 1:
                grad, lo = u.full_grad()[u.own], u.own.start
            else:
                grad, lo = u.shard_grad, u.own.start
            hi = lo + grad.numel()
            entries = [(e.name, max(e.offset, lo) - lo, min(e.offset + e.numel, hi) - lo) for e in u.entries
                       if e.offset < hi and e.offset + e.numel > lo]
            out.append((grad, entries))
        return out

    def step(self, skip: bool = False) -> None:
        """Run the optimizer on this rank's slices, then give every rank the updated parameters.  `skip`
        (an fp16 overflow, decided on every rank alike): complete the reduction, change nothing."""
        self.wait()
        for u in self.units:
            u.wait()  # a prefetch still in flight
            if self.stage >= 2:
                u.shard.grad = u.shard_grad
            if self.stage == 3 and u.gathered:
                u.release()  # its values are about to go stale (skip: regathered at the next forward anyway)
        if skip:
            return
        self.optimizer.step()
        if self.stage in (1, 2):
            for u in self.units:
                all_gather_into(u.flat.data, u.shard.detach().clone(), self.group)

    def zero_grad(self) -> None:
        for u in self.units:
            if self.stage <= 1:
                u.flat.grad.zero_()
            else:
                u.shard_grad.zero_()
                u.flat.grad = None
            u.reduced_this_step = False

    # ------------------------------------------------------------------ inspection

    @contextmanager
    def full_parameters(self) -> Iterator[dict[str, torch.Tensor]]:
        """Every original parameter by qualified name, at full size (gathers stage-3 slices; collective)."""
        gathered = []
        for u in self.units:
            if not u.gathered:
                u.gather()
                gathered.append(u)
        try:
            yield {e.name: u.flat.detach()[e.offset:e.offset + e.numel].view(e.shape)
                   for u in self.units for e in u.entries}
        finally:
            for u in gathered:
                u.release()

    def state_dict_full(self) -> dict[str, torch.Tensor]:
        """A dense copy of the parameters (collective for stage 3)."""
        with self.full_parameters() as params:
            return {k: v.clone() for k, v in params.items()}

    # ------------------------------------------------------------------ checkpoints

    def layout(self) -> list[dict[str, Any]]:
        """Per unit: its entries [name, shape, offset, numel], numel, padded size, dp size `n` and dtype —
        what a saved slice means, and what must match to restore slices directly."""
        return [{"entries": [[e.name, list(e.shape), e.offset, e.numel] for e in u.entries], "numel": u.numel,
                 "padded": u.padded, "n": u.n, "dtype": str(u.dtype).removeprefix("torch.")} for u in self.units]

    def _opt_params(self) -> list[nn.Parameter]:
        return [u.flat if self.stage == 0 else u.shard for u in self.units]

    def shard_state(self, optimizer: bool = True) -> dict[str, Any]:
        """This rank's slice [r·S, (r+1)·S) of every unit's parameters and (with `optimizer`) optimizer state,
        plus the layout to reassemble full tensors: a checkpoint part.  No communication; copies (a slice of
        stage 1/2 shares the full buffer's storage, which torch.save would write whole)."""
        out: dict[str, Any] = {"stage": self.stage, "rank": group_rank(self.group), "layout": self.layout(),
                               "optimizer": type(self.optimizer).__name__ if optimizer else None}
        params = self._opt_params()
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

            unit: dict[str, Any] = {"params": piece(p)}
            if sd is not None:
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
            order = {id(p): i for i, p in enumerate(self._opt_params())}
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
            full = torch.zeros(u.padded, dtype=u.dtype)
            for e in u.entries:
                if e.name not in params:
                    raise ValueError(f"no saved values for parameter {e.name!r}")
                t = params[e.name]
                if tuple(t.shape) != tuple(e.shape):
                    raise ValueError(f"parameter {e.name!r} is saved as {list(t.shape)}, here {list(e.shape)}")
                full[e.offset:e.offset + e.numel].copy_(t.reshape(-1))
            fulls.append(full)
            states.append(None if state is None else self._pack_state(u, state))
        own = [full if self.stage == 0 else full[u.own].clone() for u, full in zip(self.units, fulls)]
        opt_state = None
        if state is not None:
            current = self.optimizer.state_dict()
            order = {id(p): i for i, p in enumerate(self._opt_params())}
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
                flat = torch.zeros(u.padded, dtype=next(v for v in vals if isinstance(v, torch.Tensor)).dtype)
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
                all_gather_into(u.flat.data, u.shard.detach().clone(), self.group)

    def _grad_bytes(self) -> int:
        return _unique_bytes(t for u in self.units for t in (u.flat.grad, u.shard_grad, u.shard.grad if u.shard is
                                                              not None else None))

    def _note_memory(self) -> None:
        self._peak_grads = max(self._peak_grads, self._grad_bytes())

    def reset_peak(self) -> None:
        self._peak_grads = self._grad_bytes()

    def memory(self) -> MemoryReport:
        """Bytes of parameters, gradients and optimizer state this rank holds right now."""
        params = _unique_bytes(t for u in self.units for t in (u.flat, u.shard))
        opt = _unique_bytes(v for st in self.optimizer.state.values() for v in st.values()
                            if isinstance(v, torch.Tensor))
        return MemoryReport(params, self._grad_bytes(), opt, self.numel, sum(u.padded for u in self.units),
                            max(self._peak_grads, self._grad_bytes()))


def memory_report(zero: ZeroOptimizer) -> MemoryReport:
    """Bytes of parameters, gradients and optimizer state held by this rank (see `ZeroOptimizer.memory`)."""
    return zero.memory()


def _unique_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
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
