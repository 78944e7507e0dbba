"""The stage wrapper: one model stage's forward, backward and split backward (I / W).

A forward creates an `Activation`: the stage's inputs (leaves that require grad, so the
backward yields the gradient to hand to the previous stage) and its outputs with their
autograd graph.  The last stage also computes the loss, scaled by 1/M so that gradients
accumulated over the M microbatches equal the gradient of the mean loss (per-token mode: the
microbatch's summed token losses scaled by dp/N, N the non-ignored tokens of the global batch,
set by the pipeline each step).

- `backward` (B): `autograd.backward` from the outputs; parameter gradients accumulate in
  `.grad`, the input gradient is returned; the graph is freed.
- `backward_input` (I): `autograd.grad` w.r.t. the inputs only.  Before running it, hooks are
  put on the graph's *boundary* nodes — the nodes on the input path that also feed a
  parameter — to capture the gradient flowing into them; the graph is retained.
- `backward_weight` (W): `autograd.grad` from those boundary nodes (with the captured
  gradients) to the parameters, so W repeats none of I's work; the graph is freed.
- After I, every saved tensor that W's nodes do not read is dropped (`StageOptions.release`):
  what stays until W is, as in Megatron-LM's zero-bubble W, the inputs of the layers with
  weights and the gradients entering them; attention's internals, activations' inputs and
  norms' statistics go at I.
- The graph algebra behind I and W (where W restarts, which nodes it runs, what it reads and
  holds) is runtime/split_backward.py's; here the passes run.

Live activations are counted honestly: every tensor the forward's autograd graph saves is
packed together with a token, and the token is also held by the `Activation`; an activation
is live until the executor released it *and* autograd freed everything it saved.  The token
also counts the bytes of what it keeps (see `ActivationCounter`): the forward's, until W, the unit
the compiler and the planners count memory in (what I drops and the gradients it captures for W
are not counted; docs/runtime.md, "Split backward's memory").

Recomputation (`recompute=`, see recompute.py): the forward's saved tensors inside a region
become slot numbers and are recomputed by the first backward that reads them; I recomputes,
W reuses I's recomputed tensors.  A backward that may recompute runs inside the weight-pass
hooks (ZeRO-3 keeps the parameters gathered through it).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node

from pipedsl.parallel.expert import ExpertParallel, fixed_size
from pipedsl.parallel.zero import is_flat_buffer
from pipedsl.runtime.loss import LossPolicy
from pipedsl.runtime.overlap import PairOverlap
from pipedsl.runtime.p2p import TensorMeta
from pipedsl.runtime.precision import MixedPrecision
from pipedsl.runtime.recompute import Recompute
from pipedsl.runtime.split_backward import (
    Graph,
    Saved,
    WeightPlan,
    drop_unread,
    grad_node,
    pending_w_bytes,
    storage_key,
    unpack,
)

LossFn = Callable[[Any, Any], torch.Tensor]
_NO_HOOKS = contextlib.nullcontext()
_MAX_PLANS = 16  # split-backward plans kept per stage (one per graph shape seen)


class ActivationCounter:
    """Microbatch-stage activations alive on this rank now, the peak since `reset`, and their bytes.

    The bytes of an activation are the storages its record keeps: the stage inputs, every
    tensor autograd saved outside a recomputed region, a region's inputs, and once a backward
    recomputed a region, what it saved again — each storage once, parameters (and views of
    them) not at all.  They count until the activation is dead (released and freed by autograd);
    a split backward's I, without recomputation, recounts them as what its pending W still holds
    (`Cost.wmem` of the activation: the schedules' memory model).  Under recomputation I drops as
    much, but the count stays whole until W: an upper bound.
    """

    def __init__(self, count_bytes: bool = True) -> None:
        self.count_bytes = count_bytes  # off: no hook on saved tensors, the byte fields stay 0
        self.live = 0
        self.peak = 0
        self.live_bytes = 0
        self.peak_bytes = 0
        self.largest_bytes = 0  # the most one activation counted at its forward's end, since `reset`
        self.counted: set[int] = set()  # the storages the newest activation counts (unit_clock.py reads them)
        # split backward: what each pending W held right after its I, as a share of its activation's bytes (the
        # last 256; --schedule auto searches with them); recorded when asked (`measure_w_shares`) — the bytes are
        # walked at every I whenever bytes are counted, to recount the activation
        self.w_shares: deque[float] = deque(maxlen=256)
        self.measure_w_shares = False

    def token(self) -> ActivationToken:
        self.live += 1
        if self.live > self.peak:
            self.peak = self.live
        token = ActivationToken(self)
        self.counted = token.storages  # the set itself: holding it keeps no activation alive
        return token

    def reset(self) -> None:
        self.peak = self.live
        self.peak_bytes = self.live_bytes
        self.largest_bytes = 0


class ActivationToken:
    """Held by an `Activation` and by everything its graph saved: alive while either is.

    Runs for every tensor autograd saves (`pack`), so it is kept lean: no finalizer registry
    (`__del__` gives the bytes back) and the counter's fields updated in place."""

    __slots__ = ("counter", "nbytes", "storages")

    def __init__(self, counter: ActivationCounter) -> None:
        self.counter = counter
        self.nbytes = 0  # bytes counted
        self.storages: set[int] = set()

    def __del__(self) -> None:
        counter = self.counter
        counter.live -= 1
        counter.live_bytes -= self.nbytes

    def add(self, t: torch.Tensor) -> None:
        """Count `t`'s storage once, unless it holds a parameter."""
        key_n = storage_key(t)
        if key_n is None or key_n[0] in self.storages:
            return
        self.storages.add(key_n[0])
        self._count(key_n[1])

    def add_recomputed(self, saved: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
        """Count what a recomputation saved, each storage once and not the region's (already counted) inputs.

        Not deduplicated against the rest of the record: a storage it counted may be freed by now
        (a backward releases saved tensors as it goes) and its address reused."""
        seen = {k[0] for k in map(storage_key, inputs) if k is not None}
        for t in saved:
            key_n = storage_key(t)
            if key_n is not None and key_n[0] not in seen:
                seen.add(key_n[0])
                self._count(key_n[1])

    def _count(self, n: int) -> None:
        counter = self.counter
        if not counter.count_bytes:
            return
        self.nbytes += n
        counter.live_bytes += n
        if counter.live_bytes > counter.peak_bytes:
            counter.peak_bytes = counter.live_bytes

    def recount(self, n: int) -> None:
        """The activation holds `n` bytes now (after I: what its pending W holds)."""
        self._count(n - self.nbytes)

    def pack(self, t: torch.Tensor) -> Saved:
        if self.counter.count_bytes:
            self.add(t)
        # detached: a saved *output* must not own its own grad_fn (a cycle autograd never frees)
        return Saved(self, t.detach())

    def packer(self, into: list[Saved]) -> Callable[[torch.Tensor], Saved]:
        """`pack`, also listing what it packed in `into` (held by the activation: by the token, it would be a
        cycle through the `Saved` objects, which hold the token)."""
        def pack(t: torch.Tensor) -> Saved:
            saved = self.pack(t)
            into.append(saved)
            return saved
        return pack


class Activation:
    """What a forward leaves for its backward."""

    __slots__ = ("inputs", "outputs", "grads", "token", "buffers", "boundary", "loss", "saved", "regions")

    def __init__(self, inputs: list, outputs: list[torch.Tensor], token: object, buffers: list) -> None:
        self.inputs = inputs
        self.outputs = outputs
        self.grads: list | None = None  # the output gradients, kept from I to W only if needed
        self.token = token
        self.buffers = buffers  # receive buffers to give back when released
        self.boundary: list | None = None  # split backward: [(node, captured grads)]
        self.loss: torch.Tensor | None = None
        self.saved: list[Saved] | None = None  # what its forward saved, where I drops what W does not read
        self.regions: list = []  # its recomputed regions (runtime/recompute.py), whose unread tensors I drops too


def as_list(value: Any) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


@dataclass(frozen=True)
class StageOptions:
    """What every stage of a pipeline runs under: the precision policy (autocast, output casts) and the device."""

    precision: MixedPrecision = MixedPrecision()
    device: torch.device | str = "cpu"
    overlap: bool = True  # an F&B pair's halves hand over at expert exchanges (runtime/overlap.py)
    release: bool = False  # I drops the saved tensors W does not read (programs with split backward)


class Stage:
    """One global stage of the model on this rank (replica copies on one rank share it)."""

    def __init__(self, module: nn.Module, index: int, num_stages: int, loss_fn: LossFn | None,
                 num_microbatches: int, counter: ActivationCounter, recompute: Recompute | None = None, *,
                 options: StageOptions | None = None, loss: LossPolicy | None = None) -> None:
        self.module = module
        self.recompute = recompute  # None: autograd keeps everything the forward saved
        self.index = index
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.loss_fn = loss_fn
        self.loss = loss if loss is not None else LossPolicy("microbatch", num_microbatches)  # the pipeline's, shared
        self.counter = counter
        self._params: list[nn.Parameter] | None = None
        self._param_nodes: dict[Node, int] | None = None
        self._plans: dict[tuple, WeightPlan] = {}  # graph signature -> plan
        # (before, after, early) around every W: e.g. ZeRO-3 gathers the parameters W reads (`add_weight_pass_hook`)
        self.weight_pass_hooks: list[tuple[Callable[[], None], Callable[[], None], bool]] = []
        options = options or StageOptions()
        self.precision, self.device = options.precision, options.device
        # I drops what W does not read: of what the stage packed (`Saved`) and what its recomputed regions saved again
        self.release = options.release
        self.overlap = options.overlap and has_exchanges(module)
        # which half of an overlapped pair starts, when this stage runs the forward (runtime/overlap.py)
        self.pair_first = "backward" if self.overlap and fixed_size(module) else "forward"

    def add_weight_pass_hook(self, before: Callable[[], None], after: Callable[[], None], early: bool = False) -> None:
        """Run `before()` and `after()` around every W; the split plans are derived again, since with such hooks
        I leaves every parameter's gradient to W (`_early`) — unless `early`: the hooks let I compute the
        gradients it computes without them (ZeRO-3's, whose units I's own hooks gather)."""
        self.weight_pass_hooks.append((before, after, early))
        self._plans.clear()

    @property
    def params(self) -> list[nn.Parameter]:
        if self._params is None:
            self._params = [p for p in self.module.parameters() if p.requires_grad]
        return self._params

    @property
    def param_nodes(self) -> dict[Node, int]:
        """Each parameter's AccumulateGrad node -> its index (held here, so the nodes stay the same)."""
        if self._param_nodes is None:
            self._param_nodes = {n: i for i, n in enumerate(map(grad_node, self.params)) if n is not None}
        return self._param_nodes

    def _plan(self, graph: Graph, inputs: dict[Node, int]) -> WeightPlan:
        """The split-backward plan for this graph's structure, derived on its first sight."""
        plan = self._plans.get(graph.signature)
        if plan is None:
            if len(self._plans) >= _MAX_PLANS:  # a stage whose graph keeps changing shape
                self._plans.pop(next(iter(self._plans)))
            early = self._early()
            pinned = {i for i, p in enumerate(self.params) if is_flat_buffer(p)}
            plan = self._plans[graph.signature] = WeightPlan(graph, inputs, self.param_nodes, early or set(),
                                                             chains=early is not None, pinned=pinned)
        return plan

    def _early(self) -> set[int] | None:
        """Parameters whose gradients I may compute with the input gradients: those with no matrix (norms'
        scales, biases: their gradient comes out of the kernel I runs anyway), where I drops what W does not
        read, so W keeps only the matrix multiplications' inputs and output gradients (Megatron-LM's
        zero-bubble W); and (`chains`) those reached from several nodes of I's path, such as T5's relative
        position bias, shared by every layer.  None: neither (without `release`, or under weight-pass hooks that
        do not allow it).  Under ZeRO the parameters stay parameters (parallel/zero.py): the same ones."""
        if not self.release or not all(early for _, _, early in self.weight_pass_hooks):
            return None
        return {i for i, p in enumerate(self.params) if p.dim() <= 1 and not is_flat_buffer(p)}

    # ------------------------------------------------------------ forward

    def forward(self, inputs: list[torch.Tensor], target: Any = None, buffers: list | None = None,
                run: Callable[[list], Any] | None = None) -> tuple[Activation, list[torch.Tensor]]:
        """Run the stage; returns the activation record and the outputs (or `[loss]` on the last stage).
        `run(inputs)` replaces `module(*inputs)` (an overlapped pair runs another backward inside it)."""
        if not self.is_first:
            inputs = [t.detach().requires_grad_() if _is_float(t) else t for t in inputs]
        token = self.counter.token()
        count_bytes = self.counter.count_bytes
        if count_bytes:
            for t in inputs:
                token.add(t)  # kept for the backward
        saved: list[Saved] | None = [] if self.release else None

        def plain(*xs: Any) -> tuple[Any, torch.Tensor | None]:
            return self._with_loss(self.module(*xs), target)

        def compute(*xs: Any) -> tuple[Any, torch.Tensor | None]:
            return plain(*xs) if run is None else self._with_loss(run(list(xs)), target)

        hooked = count_bytes or self.release
        pack = token.pack if saved is None else token.packer(saved)
        saving = torch.autograd.graph.saved_tensors_hooks(pack, unpack) if hooked else _NO_HOOKS
        with saving, self.precision.autocast(self.device):
            if self.recompute is None:
                out, loss = self._with_loss(self.module(*inputs) if run is None else run(inputs), target)
            else:  # recomputation re-runs the plain forward, never an overlapped pair's other backward
                out, loss = self.recompute.run(compute, tuple(inputs), token, again=plain)
                regions = self.recompute.take_regions()
            if self.is_last:
                scaled = self.loss.scaled(loss)
        if count_bytes and token.nbytes > self.counter.largest_bytes:
            self.counter.largest_bytes = token.nbytes
        if self.is_last:
            act = Activation(inputs, [scaled], token, buffers or [])
            act.loss, act.saved = loss.detach(), saved
            if self.recompute is not None:
                act.regions = regions
            return act, [scaled]
        outputs = self.precision.cast_outputs(as_list(out))
        for k, t in enumerate(outputs):
            if not isinstance(t, torch.Tensor):
                raise TypeError(_not_a_tensor(k, t))
        act = Activation(inputs, outputs, token, buffers or [])
        act.saved = saved
        if self.recompute is not None:
            act.regions = regions
        return act, outputs

    def _with_loss(self, out: Any, target: Any) -> tuple[Any, torch.Tensor | None]:
        """(out, the microbatch's loss as a 0-d tensor) on the last stage, (out, None) elsewhere."""
        if not self.is_last:
            return out, None
        loss = self.loss.reduce(out if self.loss_fn is None else self.loss_fn(out, target))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TypeError(f"the loss must be a scalar tensor, got {what}")
        return out, loss.reshape(())

    def evaluate(self, inputs: list[torch.Tensor], target: Any = None) -> Any:
        """Forward without autograd (evaluation): the outputs cast as for training, or on the last stage
        the loss (per-token mode: the microbatch's summed token losses), unscaled."""
        with torch.no_grad(), self.precision.autocast(self.device):
            out = self.module(*inputs)
            if not self.is_last:
                return self.precision.cast_outputs(as_list(out))
            loss = out if self.loss_fn is None else self.loss_fn(out, target)
        loss = self.loss.reduce(loss)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TypeError(f"the loss must be a scalar tensor, got {what}")
        return loss.reshape(())

    @contextlib.contextmanager
    def _weights_gathered(self, recomputes: bool) -> Iterator[None]:
        """The weight-pass hooks around a pass that reads saved parameter views (W), or may recompute a
        forward (a backward under recomputation: ZeRO-3 must not free parameters in the middle of it)."""
        hooks = self.weight_pass_hooks if recomputes else []
        for before, _, _ in hooks:
            before()
        try:
            yield
        finally:
            for _, after, _ in hooks:
                after()

    # ------------------------------------------------------------ backward

    def _roots(self, act: Activation, grads: list | None) -> tuple[list, list]:
        if self.is_last:
            return act.outputs, [None]
        outs, gs = [], []
        assert grads is not None
        g_iter = iter(grads)
        for t in act.outputs:
            if not _is_float(t):
                continue
            g = next(g_iter)
            if t.requires_grad:
                outs.append(t)
                gs.append(g)
        return outs, gs

    def _input_grads(self, act: Activation, got: list | None) -> list[torch.Tensor]:
        """One gradient per floating-point input (zeros where the input was unused)."""
        out = []
        got_iter = iter(got or [])
        for t in act.inputs:
            if not _is_float(t):
                continue
            g = next(got_iter, None) if got is not None else t.grad
            out.append(g if g is not None else torch.zeros_like(t))
        return out

    def backward(self, act: Activation, grads: list | None) -> list[torch.Tensor]:
        """Full backward (B): parameter gradients accumulate; returns the input gradients."""
        outs, gs = self._roots(act, grads)
        act.saved = None  # the graph's own references go as the backward runs
        if outs:
            with self._weights_gathered(self.recompute is not None):
                torch.autograd.backward(outs, gs)
        if self.is_first:
            return []
        return self._input_grads(act, None)

    def backward_input(self, act: Activation, grads: list | None) -> list[torch.Tensor]:
        """I: gradient w.r.t. the stage inputs only; keeps what `backward_weight` needs."""
        outs, gs = self._roots(act, grads)
        want = [t for t in act.inputs if _is_float(t) and t.requires_grad]
        if not outs or not want:  # nothing flows back (first stage): W does all the work
            act.outputs, act.grads = outs, gs  # the roots with a gradient (not integer outputs such as masks)
            return self._input_grads(act, [None] * len(want)) if want else []
        inputs = {n: k for k, n in enumerate(map(grad_node, want)) if n is not None}
        graph = Graph([grad_node(t) for t in outs], inputs, self.param_nodes)
        plan = self._plan(graph, inputs)
        if plan.opaque:  # a compiled region: one node makes input and weight gradients; split, it would run twice
            with self._weights_gathered(self.recompute is not None):
                torch.autograd.backward(outs, gs)  # I does B's work; W finds nothing left
            act.boundary, act.outputs, act.saved = [], [], None
            return self._input_grads(act, None)
        captured: dict[Node, tuple] = {}
        handles = [u.register_prehook(lambda g, u=u: captured.__setitem__(u, g))
                   for u in map(graph.nodes.__getitem__, plan.hooked)]
        try:
            with self._weights_gathered(self.recompute is not None):
                if plan.early:  # accumulated through their AccumulateGrad nodes, as W would (hooks run)
                    torch.autograd.backward(outs, gs, retain_graph=bool(plan.groups),
                                            inputs=want + [self.params[i] for i in plan.early])
                    got = [t.grad for t in want]
                    for t in want:  # the inputs live until W; their gradients go once sent
                        t.grad = None
                else:
                    got = torch.autograd.grad(outs, want, gs, retain_graph=True, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        act.boundary = plan.weight_groups(graph.nodes, captured, outs, gs)
        act.outputs = []  # what W needs lives on through the boundary nodes
        if self.release and not plan.keeps_all:
            assert act.saved is not None
            drop_unread(act.saved, act.regions, [graph.nodes[k] for k in plan.weight_nodes])
            act.regions = []
        counter = self.counter
        if counter.count_bytes and act.saved is not None and self.recompute is None:
            token: ActivationToken = act.token  # type: ignore[assignment]
            counted, held = token.nbytes, pending_w_bytes(act.saved, act.inputs, act.boundary or [], token.storages)
            if counter.measure_w_shares and counted:
                counter.w_shares.append(held / counted)
            token.recount(held)
        act.saved = None
        return self._input_grads(act, list(got))

    def backward_weight(self, act: Activation) -> None:
        """W: parameter gradients from what `backward_input` kept; frees the graph."""
        params = self.params
        if act.boundary is None:  # no input path: W is the whole backward
            outs = act.outputs
            groups = [(outs, act.grads, list(range(len(params))), [])] if outs and params else []
        else:
            groups = act.boundary
        act.boundary = act.grads = None
        act.outputs = []
        with self._weights_gathered(True):
            self._weight_grads(groups)

    def _weight_grads(self, groups: list[tuple]) -> None:
        params = self.params
        for k, (roots, root_grads, pidx, clamps) in enumerate(groups):
            # a boundary node reached again through another root of its group keeps I's gradient
            handles = [u.register_prehook(lambda _g, saved=saved: saved) for u, saved in clamps]
            try:  # accumulates into .grad directly, as a full backward would; the last group frees the graph
                torch.autograd.backward(roots, root_grads, retain_graph=k < len(groups) - 1,
                                        inputs=[params[i] for i in pidx])
            finally:
                for h in handles:
                    h.remove()

    # ------------------------------------------------------------ shapes

    def infer_outputs(self, metas: tuple[TensorMeta, ...], device: torch.device) -> tuple[TensorMeta, ...]:
        """Output shapes and dtypes for inputs of `metas`, without computing (fake tensors; a real forward on
        zeros for a module fake tensors cannot run).  The step that learns a new shape (discovery.py) calls
        it only when a forward failed: raising here means the stage cannot take inputs of these shapes."""
        saved = [b.detach().clone() for b in self.module.buffers()]
        try:
            try:
                from torch._subclasses.fake_tensor import FakeTensorMode
                with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad(), \
                        self.precision.autocast(device):
                    args = [mode.from_tensor(torch.zeros(m.shape, dtype=m.dtype, device=device)) for m in metas]
                    out = self.module(*args)
            except (ImportError, NotImplementedError, RuntimeError):  # a module fake tensors cannot run
                with torch.random.fork_rng(devices=[]), torch.no_grad(), self.precision.autocast(device):
                    out = self.module(*[torch.zeros(m.shape, dtype=m.dtype, device=device) for m in metas])
        finally:
            with torch.no_grad():
                for b, s in zip(self.module.buffers(), saved):
                    b.copy_(s)
        outs = self.precision.cast_outputs(as_list(out))
        for k, t in enumerate(outs):
            if not isinstance(t, torch.Tensor):
                raise TypeError(_not_a_tensor(k, t))
        return tuple(TensorMeta(tuple(t.shape), t.dtype) for t in outs)


def has_exchanges(module: nn.Module) -> bool:
    """Whether `module` exchanges tokens between ranks (expert parallelism): what an F&B pair can overlap."""
    return any(isinstance(m, ExpertParallel) for m in module.modules())


OVERLAP_HOOK = "overlapped_forward_backward"


def overlapped_forward_backward(fwd: Stage, inputs: list[torch.Tensor], target: Any, buffers: list | None,
                                bwd: Stage, act: Activation, grads: list | None
                                ) -> tuple[Activation, list[torch.Tensor], list[torch.Tensor]]:
    """An overlapped pair F&B: `fwd`'s forward together with `bwd`'s full backward of `act`.

    Returns the forward's activation and outputs and the backward's input gradients.  With expert
    parallelism in either module (and `StageOptions.overlap`), the halves run as two coroutines
    handing over at every expert exchange (runtime/overlap.py): the result is bit-identical to
    forward, then backward, which is what runs otherwise — unless both modules are of one class
    defining DeepSeek DualPipe's hook, called as `type(module0).overlapped_forward_backward(module0,
    inputs0, criterion0, labels0, module1, loss1, outputs1, output_grads1) -> (outputs0, loss0)`: run `module0` on
    `inputs0` and, interleaved as the user likes (e.g. one chunk's expert all-to-all behind the
    other's compute), the backward of `loss1` (the last stage: `loss1.backward()`) or of
    `outputs1` with `output_grads1`.  pipedsl passes `criterion0 = labels0 = None` and computes
    the last stage's loss itself after the hook, so `loss0` is ignored.
    """
    hook = getattr(type(fwd.module), OVERLAP_HOOK, None)
    if hook is None or type(fwd.module) is not type(bwd.module):
        if fwd.overlap or bwd.overlap:  # expert exchanges: each half's hidden behind the other's compute
            (act0, outs), input_grads = PairOverlap().run(lambda: fwd.forward(inputs, target, buffers),
                                                          lambda: bwd.backward(act, grads), fwd.pair_first)
            return act0, outs, input_grads
        act0, outs = fwd.forward(inputs, target, buffers)
        return act0, outs, bwd.backward(act, grads)
    outs1, grads1 = bwd._roots(act, grads)
    loss1 = outs1[0] if bwd.is_last else None

    def run(inputs0: list) -> Any:
        outputs0, _ = hook(fwd.module, inputs0, None, None, bwd.module, loss1,
                           None if bwd.is_last else outs1, None if bwd.is_last else grads1)
        return outputs0[0] if isinstance(outputs0, (list, tuple)) and len(outputs0) == 1 else outputs0

    act0, outs = fwd.forward(inputs, target, buffers, run=run)
    return act0, outs, [] if bwd.is_first else bwd._input_grads(act, None)


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _not_a_tensor(k: int, value: Any) -> str:
    hint = (": flatten it, or cut the model with pipedsl.models.split_module, whose stages pass any nesting of "
            "tensors as flat tuples" if isinstance(value, (dict, list, tuple)) else "")
    return f"stage output {k} is a {type(value).__name__}; a stage returns a tensor or a tuple of tensors{hint}"
