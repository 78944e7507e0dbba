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
from torch.autograd.graph import GradientEdge, Node

from pipedsl.parallel.expert import ExpertParallel, fixed_size
from pipedsl.parallel.zero import is_flat_buffer
from pipedsl.runtime.loss import LossPolicy
from pipedsl.runtime.overlap import PairOverlap
from pipedsl.runtime.p2p import TensorMeta
from pipedsl.runtime.precision import MixedPrecision
from pipedsl.runtime.recompute import Recompute

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


class Saved:
    """One tensor autograd saved, as the pack hook hands it to autograd: the token keeps the activation
    counted while autograd holds it; `tensor` is None once I dropped it (W never reads it)."""

    __slots__ = ("token", "tensor")

    def __init__(self, token: ActivationToken, tensor: torch.Tensor) -> None:
        self.token = token
        self.tensor: torch.Tensor | None = tensor


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
        self._plans: dict[tuple, _WeightPlan] = {}  # graph signature -> plan
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
            self._param_nodes = {n: i for i, n in enumerate(map(_grad_node, self.params)) if n is not None}
        return self._param_nodes

    def _plan(self, graph: _Graph, inputs: dict[Node, int]) -> _WeightPlan:
        """The split-backward plan for this graph's structure, derived on its first sight."""
        plan = self._plans.get(graph.signature)
        if plan is None:
            if len(self._plans) >= _MAX_PLANS:  # a stage whose graph keeps changing shape
                self._plans.pop(next(iter(self._plans)))
            early = self._early()
            pinned = {i for i, p in enumerate(self.params) if is_flat_buffer(p)}
            plan = self._plans[graph.signature] = _WeightPlan(graph, inputs, self.param_nodes, early or set(),
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
        saving = torch.autograd.graph.saved_tensors_hooks(pack, _unpack) if hooked else _NO_HOOKS
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
        inputs = {n: k for k, n in enumerate(map(_grad_node, want)) if n is not None}
        graph = _Graph([_grad_node(t) for t in outs], inputs, self.param_nodes)
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
            _drop_unread(act, [graph.nodes[k] for k in plan.weight_nodes])
        counter = self.counter
        if counter.count_bytes and act.saved is not None and self.recompute is None:
            counted, held = act.token.nbytes, _pending_w_bytes(act)  # type: ignore[attr-defined]
            if counter.measure_w_shares and counted:
                counter.w_shares.append(held / counted)
            act.token.recount(held)  # type: ignore[attr-defined]
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


def storage_key(t: Any) -> tuple[int, int] | None:
    """(storage address, bytes) of an activation tensor; None for parameters and views of them.

    Runs for every tensor autograd saves: a plain tensor (almost all of them) is told apart by its
    type alone, since `isinstance(t, nn.Parameter)` goes through Parameter's metaclass."""
    plain = type(t) is torch.Tensor and (t._base is None or type(t._base) is torch.Tensor)
    if not plain and (not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter)
                      or isinstance(t._base, nn.Parameter)):
        return None
    if not plain:
        t = getattr(t, "_local_tensor", t)  # a DTensor keeps its local shard (its numel is the global one)
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # a tensor without a plain storage
        return id(t), t.numel() * t.element_size()


_READ: set[int] | None = None  # while `_drop_unread` reads W's nodes: the ids of the `Saved` they hold


def _unpack(saved: Saved) -> torch.Tensor:
    t = saved.tensor
    if t is None:
        raise RuntimeError("pipedsl: W read a tensor its I had dropped as unread; please report this with the model")
    if _READ is not None:
        _READ.add(id(saved))
    return t


def _pending_w_bytes(act: Activation) -> int:
    """After I: the bytes W still holds — the stage inputs, the saved tensors it reads and the gradients captured for
    it, each storage once.  A kept tensor counts where the forward counted its storage (a parameter's, saved
    detached, is not)."""
    token = act.token
    held: dict[int, int] = {}
    kept = [s.tensor for s in act.saved or () if s.tensor is not None] + list(act.inputs)
    for t in kept:
        key_n = storage_key(t) if isinstance(t, torch.Tensor) else None
        if key_n is not None and key_n[0] in token.storages:  # type: ignore[attr-defined]
            held[key_n[0]] = key_n[1]
    for _, gs, _, _ in act.boundary or ():
        for g in gs:
            key_n = storage_key(g) if isinstance(g, torch.Tensor) else None
            if key_n is not None:
                held[key_n[0]] = key_n[1]
    return sum(held.values())


def _drop_unread(act: Activation, weight_nodes: list[Node]) -> None:
    """After I: drop every tensor the activation's forward saved, and every tensor its recomputed regions saved
    again, except those W's nodes read (reading each node's saved tensors once marks them); the caller lets go of
    the list."""
    global _READ
    assert act.saved is not None
    _READ = read = set()
    for region in act.regions:  # what W reads of a recomputed region: marked by the region itself
        region.read = set()
    try:
        for node in weight_nodes:
            for name in _saved_names(node):
                getattr(node, name)
    finally:
        _READ = None
        for region in act.regions:
            region.drop_unread()
    act.regions = []
    for saved in act.saved:
        if id(saved) not in read:
            saved.tensor = None


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}
_UNREADABLE = frozenset({"CopySlices", "CppFunction"})  # nodes that hold saved tensors without naming them


def _saved_names(node: Node) -> tuple[str, ...]:
    """The attributes through which a node's saved tensors are read (each read unpacks them)."""
    names = _SAVED_NAMES.get(type(node))
    if names is None:
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            names = ("saved_tensors",)
        else:
            names = tuple("_saved_" + a[len("_raw_saved_"):] for a in dir(node) if a.startswith("_raw_saved_"))
        _SAVED_NAMES[type(node)] = names
    return names


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _grad_node(t: torch.Tensor) -> Node | None:
    """The node gradients of `t` flow into: its grad_fn, or (a leaf) its AccumulateGrad."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:
        return t.view_as(t).grad_fn.next_functions[0][0]
    return None


def _not_a_tensor(k: int, value: Any) -> str:
    hint = (": flatten it, or cut the model with pipedsl.models.split_module, whose stages pass any nesting of "
            "tensors as flat tuples" if isinstance(value, (dict, list, tuple)) else "")
    return f"stage output {k} is a {type(value).__name__}; a stage returns a tensor or a tuple of tensors{hint}"


class _Graph:
    """One backward graph, numbered breadth-first from the roots, with a structural signature.

    Two graphs with equal signatures have the same node kinds, the same edges and the same
    parameters and inputs at the same numbers, so a `_WeightPlan` computed for one holds for
    the other: the plan is derived once per stage structure, not once per microbatch.
    """

    __slots__ = ("nodes", "children", "roots", "signature")

    def __init__(self, roots: list[Node | None], inputs: dict[Node, int], params: dict[Node, int]) -> None:
        index: dict[Node, int] = {}
        nodes: list[Node] = []
        sig: list = []
        self.roots: list[int | None] = []
        for r in roots:
            if r is not None and r not in index:
                index[r] = len(nodes)
                nodes.append(r)
            self.roots.append(None if r is None else index[r])
        sig.append(tuple(self.roots))
        self.children: list[list[int]] = []
        i = 0
        while i < len(nodes):
            node = nodes[i]
            i += 1
            kids = []
            for fn, _ in node.next_functions:
                if fn is None:
                    continue
                j = index.get(fn)
                if j is None:
                    j = index[fn] = len(nodes)
                    nodes.append(fn)
                kids.append(j)
            self.children.append(kids)
            mark = params.get(node)
            if mark is None:
                mark = inputs.get(node, -1)
                mark = -1 if mark < 0 else -2 - mark
            sig.append((type(node), mark, *kids))
        self.nodes = nodes
        self.signature = tuple(sig)


class _WeightPlan:
    """Where W restarts: nodes on the input path with a branch that leads only to parameters.

    I runs every node on a path from the outputs to the inputs; W must run the rest — the
    parameter branches hanging off that path (and outputs that never reach an input).  The
    gradient entering each branching node is captured during I; W runs `autograd.grad` from
    those nodes to the parameters below their branches, one call per group of nodes that
    share parameters, so no node of I's path is recomputed (except between two nodes of one
    group, where a pre-hook pins the deeper node's gradient to I's value: no double count).
    Everything is in node numbers of a `_Graph`, so one plan serves every graph of its shape.
    """

    def __init__(self, graph: _Graph, inputs: dict[Node, int], params: dict[Node, int],
                 early: set[int] = frozenset(), chains: bool = False, pinned: set[int] = frozenset()) -> None:
        # torch.compile's regions: one backward node for inputs and weights alike, which cannot be split (decided
        # once per graph shape: the signature holds every node's type)
        self.opaque = any(type(n).__name__ == "CompiledFunctionBackward" for n in graph.nodes)
        children = graph.children
        targets_in = {k for k, n in enumerate(graph.nodes) if n in inputs}
        param_of = {k: params[n] for k, n in enumerate(graph.nodes) if n in params}
        on_path = _reaching(children, targets_in)
        to_param = _reaching(children, set(param_of))

        def params_below(starts: list[int]) -> set[int]:
            found, stack, visited = set(), list(starts), set(starts)
            while stack:
                node = stack.pop()
                if node in param_of:
                    found.add(param_of[node])
                for c in children[node]:
                    if to_param[c] and c not in visited:
                        visited.add(c)
                        stack.append(c)
            return found

        entries: list[tuple[str, int, set[int]]] = []
        for u, kids in enumerate(children):
            if on_path[u] and u not in targets_in:
                side = [c for c in kids if to_param[c] and not on_path[c]]
                if side:
                    entries.append(("node", u, params_below(side)))
        for k, r in enumerate(graph.roots):
            if r is not None and not on_path[r] and to_param[r]:
                entries.append(("root", k, params_below([r])))
        # the candidates (`early`) I computes: only where every entry reaching one moves to I whole, so W reaches
        # none of them again
        in_input = set().union(*(ps for kind, _, ps in entries if kind == "node")) & early
        changed = True
        while changed:
            changed = False
            for kind, _, ps in entries:
                if ps & in_input and (kind == "root" or not ps <= in_input):
                    in_input -= ps
                    changed = True
        groups = _merge_sharing([e for e in entries if not e[2] <= in_input])
        if chains:  # a group of several nodes on I's path: W would run I's path between them again; I runs it once
            shared = [g for g in groups if sum(kind == "node" for kind, _ in g[0]) > 1 and not set(g[1]) & pinned]
            in_input.update(*(pidx for _, pidx in shared))
            groups = [g for g in groups if g not in shared]
        self.early = sorted(in_input)
        self.groups = groups
        self.hooked = [u for members, _ in groups for kind, u in members if kind == "node"]
        self.weight_nodes = sorted(self._weight_nodes(graph, param_of))
        # a node W runs whose saved tensors Python cannot read (an in-place op on a view, a C++ autograd Function):
        # what W needs is unknown, so I drops nothing
        self.keeps_all = any(type(graph.nodes[k]).__name__ in _UNREADABLE for k in self.weight_nodes)

    def _weight_nodes(self, graph: _Graph, param_of: dict[int, int]) -> set[int]:
        """The nodes W runs: those on a path from a group's starts to one of the group's parameters (autograd
        runs no other node of a `backward(..., inputs=)`)."""
        run: set[int] = set()
        for members, pidx in self.groups:
            wanted = set(pidx)
            reach = _reaching(graph.children, {k for k, p in param_of.items() if p in wanted})
            starts = {u if kind == "node" else graph.roots[u] for kind, u in members}
            stack = [u for u in starts if u is not None and reach[u]]
            seen = set(stack)  # per group: a node another group ran may lead to this group's parameters
            while stack:
                for c in graph.children[stack.pop()]:
                    if reach[c] and c not in seen:
                        seen.add(c)
                        stack.append(c)
            run |= seen
        return run

    def weight_groups(self, nodes: list[Node], captured: dict[Node, tuple], outs: list[torch.Tensor],
                      gs: list) -> list[tuple]:
        """For W, per group: (roots, root gradients, parameter indices, clamps)."""
        out = []
        for members, pidx in self.groups:
            roots, grads, clamps = [], [], []
            for kind, anchor in members:
                if kind == "root":
                    roots.append(outs[anchor])
                    grads.append(gs[anchor])
                    continue
                node = nodes[anchor]
                g = captured.get(node)
                if g is None:
                    continue
                clamps.append((node, g))
                for k, gk in enumerate(g):
                    if gk is not None:
                        roots.append(GradientEdge(node, k))
                        grads.append(gk)
            if roots:
                out.append((roots, grads, pidx, clamps if len(clamps) > 1 else []))
        return out


def _merge_sharing(entries: list[tuple[str, int, set[int]]]) -> list[tuple[list[tuple[str, int]], list[int]]]:
    """Entries that share a parameter in one group (union-find): [(members, sorted parameters)]."""
    parent = list(range(len(entries)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for e, (_, _, ps) in enumerate(entries):
        for p in ps:
            if p in owner:
                parent[find(e)] = find(owner[p])
            else:
                owner[p] = e
    merged: dict[int, list[int]] = {}
    for e in range(len(entries)):
        merged.setdefault(find(e), []).append(e)
    groups = []
    for members in merged.values():
        pidx = set().union(*(entries[e][2] for e in members))
        if pidx:
            groups.append(([entries[e][:2] for e in members], sorted(pidx)))
    return groups


def _reaching(children: list[list[int]], targets: set[int]) -> list[bool]:
    """Per node: can some target be reached from it (targets included)?"""
    reach = [False] * len(children)
    state = [0] * len(children)  # 0 new, 1 on the stack, 2 done
    # iterative post-order DFS (graphs can be deep: no recursion)
    for start in range(len(children)):
        if state[start]:
            continue
        state[start] = 1
        stack = [(start, iter(children[start]))]
        while stack:
            node, it = stack[-1]
            child = next(it, None)
            if child is None:
                stack.pop()
                state[node] = 2
                reach[node] = node in targets or any(reach[c] for c in children[node])
                continue
            if not state[child]:
                state[child] = 1
                stack.append((child, iter(children[child])))
    return reach
