"""Activation recomputation: keep a region's inputs, recompute what its backward reads.

A *region* is one call of a function (the whole stage for `recompute="full"`, each module a
predicate selects for `"selective"`).  While it runs forward, every tensor autograd saves in
it is replaced by a slot number (`saved_tensors_hooks`), so only the region's inputs and the
graph's nodes stay alive.  The first time a backward reads a slot, the region runs again —
same inputs, same RNG state (dropout masks), same autocast state, grad enabled — and every
tensor it saves is kept, in order, for the rest of the graph's life.  That is torch's
non-reentrant `torch.utils.checkpoint` with one change the split backward needs: the
recomputed tensors belong to the *region*, not to one backward call, so I (which recomputes)
and W (which reads the same tensors again, in another `autograd.backward`) share them — torch's
checkpoint keys them by graph task and would recompute for W.  Between I and W only what the
W graph keeps is alive (the split backward drops the nodes above its boundary), as without
recomputation.

Why not Megatron's reentrant recompute (forward under `no_grad`, a second graph built in the
backward): the split backward's weight plan is derived from the forward's graph structure
(stage.py), which the unpack-triggered scheme leaves in place.

Collectives inside a region (tensor-parallel layers, ZeRO-3 gathers) run again at
recomputation; every tp and dp peer runs the same program and autograd visits the nodes in the
same order, so they stay matched.  ZeRO-3 frees parameters after each unit's forward: the
stage runs its weight-pass hooks (gather everything, keep it until the backward ends) around a
backward that may recompute.  Modules that update state in forward (BatchNorm running
statistics) update it again at recomputation, as with torch's and Megatron's checkpointing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

RECOMPUTE_MODES = ("full", "selective")
ModulePredicate = Callable[[nn.Module], bool]


class RecomputeError(RuntimeError):
    """A region saved a different number of tensors when it ran again (it is not deterministic)."""


class Recorder(Protocol):
    """What a region reports its memory to (stage.py's `ActivationToken`)."""

    def add(self, t: torch.Tensor) -> None:
        """A tensor the region keeps (its inputs)."""

    def add_recomputed(self, saved: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
        """What a recomputation saved."""


class Region:
    """One recomputable call: its function, inputs, RNG and autocast state, and once needed its saved tensors."""

    __slots__ = ("fn", "args", "kwargs", "recorder", "rng", "autocast", "count", "saved", "policy", "read")

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, recorder: Recorder | None,
                 policy: Recompute) -> None:
        self.fn, self.args, self.kwargs, self.recorder, self.policy = fn, args, kwargs, recorder, policy
        self.rng = _rng_state()
        self.autocast = _autocast_state()
        self.count = 0
        self.saved: list[torch.Tensor | None] | None = None
        self.read: set[int] | None = None  # while a split backward's I marks what W reads (`drop_unread`)
        if recorder is not None:
            for t in _tensors(args, kwargs):
                recorder.add(t)  # the region's inputs are what it keeps

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor) -> tuple[Region, int]:
        k = self.count
        self.count += 1
        return self, k

    def tensor(self, k: int) -> torch.Tensor:
        if self.saved is None:
            self._recompute()
        assert self.saved is not None
        if self.read is not None:
            self.read.add(k)
        t = self.saved[k]
        if t is None:
            raise RuntimeError("pipedsl: W read a recomputed tensor its I had dropped as unread; please report this "
                               "with the model")
        return t

    def drop_unread(self) -> None:
        """After I marked what W reads (`read`): let go of the rest of what the recomputation saved."""
        if self.saved is not None and self.read is not None:
            self.saved = [t if k in self.read else None for k, t in enumerate(self.saved)]
        self.read = None

    def _recompute(self) -> None:
        saved: list[torch.Tensor] = []
        seen: list[torch.Tensor] = []  # as saved (a detached view no longer shows it views a parameter)

        def keep(t: torch.Tensor) -> int:
            seen.append(t)
            saved.append(t.detach())  # detached: a saved output must not own its grad_fn (a cycle)
            return len(saved) - 1

        args = tuple(_fresh(a) for a in self.args)
        kwargs = {k: _fresh(v) for k, v in self.kwargs.items()}
        _reruns.depth = getattr(_reruns, "depth", 0) + 1
        try:
            with _restored_rng(self.rng), torch.enable_grad(), _autocast(self.autocast), \
                    torch.autograd.graph.saved_tensors_hooks(keep, _never), self.policy.recomputing():
                self.fn(*args, **kwargs)
        finally:
            _reruns.depth -= 1
        if len(saved) != self.count:
            raise RecomputeError(f"recomputing {_name(self.fn)} saved {len(saved)} tensors for backward, its forward "
                                 f"saved {self.count}: the region must run the same operations again (no "
                                 f"data-dependent control flow or state changed by its forward)")
        self.saved = saved
        if self.recorder is not None:
            self.recorder.add_recomputed(seen, _tensors(self.args, self.kwargs))


_reruns = threading.local()  # .depth: regions running again now, in this thread (an F&B pair's halves are two)


def is_recomputing() -> bool:
    """True while a region runs its forward a second time, in this thread: statistics a forward counts (an MoE
    router's tokens per expert) skip it, as they would count every recomputed microbatch twice."""
    return getattr(_reruns, "depth", 0) > 0


def _unpack(packed: tuple[Region, int]) -> torch.Tensor:
    region, k = packed
    return region.tensor(k)


def _never(_: int) -> torch.Tensor:  # pragma: no cover - recomputed graphs are never differentiated
    raise RuntimeError("a recomputed graph was differentiated")


class Recompute:
    """A stage's recomputation policy: `run(fn, args, recorder)` runs its forward under it.

    `"full"`: the whole forward is one region — only the stage inputs are kept.  `"selective"`:
    every call of a module that `predicate(module)` selects is a region (forward hooks on those
    modules; a selected module inside another region is part of that region).
    """

    def __init__(self, module: nn.Module, mode: str, predicate: ModulePredicate | None = None) -> None:
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {', '.join(map(repr, RECOMPUTE_MODES))} or None, got {mode!r}")
        self.mode = mode
        self._recorder: Recorder | None = None
        self._active = False  # inside this stage's forward (selective regions open only then)
        self._depth = 0  # regions open now (a selected module inside one is part of it)
        self._recomputing = 0
        self._open: list[tuple[nn.Module, contextlib.ExitStack]] = []
        self._made: list[Region] = []  # the regions the forward running now opened (`take_regions`)
        self.selected: list[str] = []
        if mode == "selective":
            if predicate is None:
                raise ValueError("recompute='selective' needs recompute_filter=predicate(module) -> bool "
                                 "(which modules to recompute)")
            for name, m in module.named_modules():
                if predicate(m):
                    self.selected.append(name or "<stage>")
                    m.register_forward_pre_hook(self._enter, with_kwargs=True)
                    m.register_forward_hook(self._exit, always_call=True)

    def run(self, fn: Callable[..., Any], args: tuple, recorder: Recorder | None,
            again: Callable[..., Any] | None = None) -> Any:
        """`fn(*args)` under the policy; `again(*args)` (default `fn`) is what a full recomputation runs."""
        if self.mode == "full":
            region = Region(again or fn, args, {}, recorder, self)
            self._made.append(region)
            with region.hooks():
                return fn(*args)
        self._recorder, self._active = recorder, True
        try:
            return fn(*args)
        finally:
            self._recorder, self._active = None, False
            while self._open:  # a module that raised: close what it opened
                self._open.pop()[1].close()
            self._depth = 0

    def take_regions(self) -> list[Region]:
        """The regions the last `run` opened: its activation keeps them, so that a split backward's I can drop what
        W does not read of what they recompute."""
        made, self._made = self._made, []
        return made

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        self._recomputing += 1
        try:
            yield
        finally:
            self._recomputing -= 1

    # ------------------------------------------------------------ selective: regions at module calls

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._depth += 1
        if not self._active or self._recomputing or self._depth > 1 or not torch.is_grad_enabled():
            return
        region = Region(_Call(module), args, kwargs, self._recorder, self)
        self._made.append(region)
        stack = contextlib.ExitStack()
        stack.enter_context(region.hooks())
        self._open.append((module, stack))

    def _exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._open and self._open[-1][0] is module and self._depth == 0:
            self._open.pop()[1].close()


class _Call:
    """Calls a module again at recomputation (its forward hooks run, e.g. ZeRO-3's gathers; ours stay closed)."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def _name(fn: Any) -> str:
    if isinstance(fn, _Call):
        return f"module {type(fn.module).__name__}"
    return "the stage"


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]


def _fresh(x: Any) -> Any:
    """An input for recomputation: detached from the forward's graph, requiring grad as it did (autograd
    saves different tensors depending on which inputs require grad)."""
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.requires_grad)
    return x


# ---------------------------------------------------------------- RNG and autocast state

RngState = tuple[torch.Tensor, list[torch.Tensor] | None]


def rng_state() -> RngState:
    """Every generator a forward may draw from: the CPU's, and each GPU's once CUDA is initialised (an overlapped
    pair's halves, overlap.py; a post-validated pass run again, post_validate.py)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: RngState) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])



def _rng_state() -> tuple[torch.Tensor, tuple[int, torch.Tensor] | None]:
    """A region's generators: the CPU's and the current GPU's (`_restored_rng` forks them around its replay)."""
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        dev = torch.cuda.current_device()
        cuda = (dev, torch.cuda.get_rng_state(dev))
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _restored_rng(state: tuple[torch.Tensor, tuple[int, torch.Tensor] | None]) -> Iterator[None]:
    """Run with the RNG as it was at the region's forward; the caller's RNG stream is left untouched."""
    cpu, cuda = state
    with torch.random.fork_rng(devices=[cuda[0]] if cuda else []):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda[1], cuda[0])
        yield


def _autocast_state() -> list[tuple[str, torch.dtype]]:
    out = []
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            out.append((device, torch.get_autocast_dtype(device)))
    return out


@contextlib.contextmanager
def _autocast(state: list[tuple[str, torch.dtype]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            enabled = any(d == device for d, _ in state)
            if enabled or torch.is_autocast_enabled(device):
                dtype = next((t for d, t in state if d == device), None)
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
        yield
