"""The collectives pipedsl.parallel uses, each counted, and the autograd operators built on them.

Every collective of the package goes through the functions below, which check shapes
before calling c10d (gloo aborts the *process* on a mismatch) and record the bytes each rank
sends into the active `CommCounter`, if any (`with count_comm() as c: …`), with the wall time spent
inside the call (a blocking collective's wait for its peers included; an async one's issue only).  The count is
the volume of the bandwidth-optimal (ring) algorithm for the tensors actually passed:

    all-reduce of n bytes on P ranks      2 (P-1)/P · n
    all-gather to n bytes (output)        (P-1)/P · n
    reduce-scatter of n bytes (input)     (P-1)/P · n
    all-to-all                            the rows sent to other ranks

which is what the formulas in the literature count; gloo may choose another algorithm on
the wire.  A group of one rank moves nothing and costs nothing.

The autograd operators are the conjugate pairs of Megatron-LM (Shoeybi et al. 2019) and
their gather/scatter relatives used by 3-D parallelism:

    copy_to_group       f: identity forward, all-reduce backward
    reduce_from_group   g: all-reduce forward, identity backward
    all_reduce_autograd    all-reduce forward and backward (a sum every rank then uses differently)
    gather_along        all-gather forward, reduce-scatter backward (each rank uses the whole differently)
    gather_replicated   all-gather forward, keep-own-slice backward (every rank then computes the same)
    scatter_along       reduce-scatter forward, all-gather backward
    split_along         this rank's slice forward, all-gather backward
    exchange_rows       all-to-all forward, the transposed all-to-all backward (expert parallelism's
                        dispatch and combine, parallel/expert.py)

Sequence parallelism (Korthikanti et al. 2022) uses the last four along the sequence dimension,
as Megatron-LM's mappings: `gather_along` is its gather_from_sequence_parallel_region (before a
column-parallel layer), `scatter_along` its reduce_scatter_to_sequence_parallel_region (after a
row-parallel one), `split_along` its scatter_to_sequence_parallel_region (a whole tensor every
rank holds, cut to the rank's shard).
"""

from __future__ import annotations

import contextvars
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from pipedsl.errors import PipeRuntimeError


class CollectiveShapeError(PipeRuntimeError):
    """A collective called with tensors whose sizes cannot match across the group."""


@dataclass
class CommCounter:
    """Bytes sent by this rank, by (collective, group label), the number of calls and the seconds inside them."""

    sent: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    def by_op(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (op, _), n in self.sent.items():
            out[op] += n
        return dict(out)

    def by_group(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (_, g), n in self.sent.items():
            out[g] += n
        return dict(out)

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def add(self, op: str, group: ProcessGroup | None, nbytes: float, seconds: float = 0.0) -> None:
        key = (op, _label(group))
        self.sent[key] += int(round(nbytes))
        self.calls[key] += 1
        self.seconds[key] += seconds


_COUNTER: contextvars.ContextVar[CommCounter | None] = contextvars.ContextVar("pipedsl_comm_counter", default=None)


@contextmanager
def count_comm() -> Iterator[CommCounter]:
    """Count the bytes this rank sends in every pipedsl.parallel collective inside the block."""
    counter = CommCounter()
    token = _COUNTER.set(counter)
    try:
        yield counter
    finally:
        _COUNTER.reset(token)


def _label(group: ProcessGroup | None) -> str:
    if group is None:
        return "world"
    desc = getattr(group, "group_desc", "") or ""
    return desc.removeprefix("mesh_") or f"group{dist.get_process_group_ranks(group)}"


def _counted(op: str, group: ProcessGroup | None, nbytes: float, call: Callable[[], dist.Work | None]
             ) -> dist.Work | None:
    """`call()`, recorded into the active counter with its bytes and the seconds it took."""
    counter = _COUNTER.get()
    if counter is None:
        return call()
    start = time.perf_counter()
    work = call()
    counter.add(op, group, nbytes, time.perf_counter() - start)
    return work


def group_size(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return dist.get_rank(group)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------- collectives


def all_reduce(t: torch.Tensor, group: ProcessGroup | None, op: ReduceOp.RedOpType = ReduceOp.SUM,
               async_op: bool = False) -> dist.Work | None:
    """In place; counted as 2 (P-1)/P of the tensor's bytes."""
    p = group_size(group)
    if p == 1:
        return None
    return _counted("all_reduce", group, 2 * (p - 1) / p * _nbytes(t),
                    lambda: dist.all_reduce(t, op=op, group=group, async_op=async_op))


# torch 2.13's names for the flat collectives; before it they were `all_gather_into_tensor` and `reduce_scatter_tensor`
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(out: torch.Tensor, t: torch.Tensor, group: ProcessGroup | None,
                    async_op: bool = False) -> dist.Work | None:
    """`out` (contiguous, P× the numel of `t`) receives every rank's `t` in group-rank order."""
    p = group_size(group)
    if out.numel() != p * t.numel() or out.dtype != t.dtype:
        raise CollectiveShapeError(f"all-gather of {t.numel()} {t.dtype} elements on {p} ranks needs an output of "
                                   f"{p * t.numel()}, got {out.numel()} {out.dtype}")
    if p == 1:
        out.view(-1).copy_(t.reshape(-1))
        return None
    return _counted("all_gather", group, (p - 1) * _nbytes(t),  # gloo: flat
                    lambda: _all_gather_single(out.view(-1), t.reshape(-1), group=group, async_op=async_op))


def reduce_scatter_into(out: torch.Tensor, t: torch.Tensor, group: ProcessGroup | None,
                        async_op: bool = False, overwrite: bool = False) -> dist.Work | None:
    """`out` (contiguous) receives this rank's 1/P slice of the sum of every rank's `t`, flattened (group-rank
    order).  `overwrite`: `t` is the caller's to change (a gradient buffer about to be dropped or zeroed); on gloo it
    is then summed in place by an all-reduce, which gloo runs faster than its own reduce-scatter: 1.3-1.5x less time
    on this repository's 2-core machine at 2 and 4 ranks and 2-4 M floats (ZeRO's reductions in
    benchmarks/zero_speed.py).  Counted as the reduce-scatter it stands for (NCCL's bytes)."""
    p = group_size(group)
    if t.numel() != p * out.numel() or out.dtype != t.dtype:
        raise CollectiveShapeError(f"reduce-scatter of {t.numel()} {t.dtype} elements on {p} ranks gives "
                                   f"{t.numel() / p:g} per rank, the output holds {out.numel()} {out.dtype}")
    if p == 1:
        out.copy_(t.reshape(out.shape))
        return None
    nbytes = (p - 1) / p * _nbytes(t)  # counted as the reduce-scatter either way (NCCL's bytes)
    if overwrite and t.is_contiguous() and dist.get_backend(group) == "gloo":
        mine = t.view(p, -1)[group_rank(group)]
        work = _counted("reduce_scatter", group, nbytes, lambda: dist.all_reduce(t, group=group, async_op=True))
        done = _Then(work, lambda: out.view(-1).copy_(mine))
        if async_op:
            return done  # type: ignore[return-value]
        done.wait()
        return None
    return _counted("reduce_scatter", group, nbytes,  # gloo: flat
                    lambda: _reduce_scatter_single(out.view(-1), t.reshape(-1), group=group, async_op=async_op))


class _Then:
    """A collective's work, then a local step on its result when it is waited for (once)."""

    def __init__(self, work: dist.Work, then: Callable[[], Any]) -> None:
        self.work, self.then = work, then

    def wait(self, timeout: Any = None) -> bool:
        if self.then is not None:
            self.work.wait()
            self.then, then = None, self.then
            then()
        return True

    def is_completed(self) -> bool:
        return self.then is None or self.work.is_completed()


# ------------------------------------------------------------------ the expert exchanges' waits

_latency = 0.0  # seconds added to every exchange (`exchange_latency`): a test transport's fixed delay
_waiter: Callable[[dist.Work, float], None] | None = None


def default_exchange_wait(work: dist.Work, ready_at: float) -> None:
    """Complete an exchange: its work, then whatever is left of the injected latency."""
    work.wait()
    left = ready_at - time.perf_counter()
    if left > 0:
        time.sleep(left)


@contextmanager
def exchange_waiter(wait: Callable[[dist.Work, float], None]) -> Iterator[None]:
    """Within: `wait(work, ready_at)` completes every exchange (`all_to_all_rows`) — runtime/overlap.py hands the
    turn to the other half of an F&B pair there."""
    global _waiter
    before, _waiter = _waiter, wait
    try:
        yield
    finally:
        _waiter = before


@contextmanager
def exchange_latency(seconds: float) -> Iterator[None]:
    """Within: every exchange takes at least `seconds` from its issue (a fixed network delay, for tests and
    benchmarks of what overlap hides)."""
    global _latency
    before, _latency = _latency, seconds
    try:
        yield
    finally:
        _latency = before


def all_to_all_rows(t: torch.Tensor, send: list[int], recv: list[int], group: ProcessGroup | None) -> torch.Tensor:
    """Rows of `t` to every rank of the group: the first send[0] rows to rank 0, the next send[1] to rank 1, …;
    returns the rows received, recv[r] from rank r, in rank order.  Counted as the bytes leaving this rank.
    An exchange: issued asynchronously and completed by the current waiter (`exchange_waiter`)."""
    p, me = group_size(group), group_rank(group)
    if len(send) != p or len(recv) != p or sum(send) != t.shape[0]:
        raise CollectiveShapeError(f"all-to-all on {p} ranks of a tensor with {t.shape[0]} rows: send sizes "
                                   f"{send} and receive sizes {recv} need one entry per rank, the send sizes summing "
                                   f"to the rows")
    out = t.new_empty((sum(recv), *t.shape[1:]))
    row = t[0].numel() * t.element_size() if t.shape[0] else 0
    # gloo moves host memory only: a GPU's rows go through the CPU (ranks sharing one GPU over gloo)
    staged = t.device.type != "cpu" and dist.get_backend(group) == "gloo"
    src, dst = (t.contiguous().cpu(), out.cpu()) if staged else (t.contiguous(), out)
    ready_at = time.perf_counter() + _latency
    work = _counted("all_to_all", group, (sum(send) - send[me]) * row,
                    lambda: dist.all_to_all_single(dst, src, output_split_sizes=recv, input_split_sizes=send,
                                                   group=group, async_op=True))
    (_waiter or default_exchange_wait)(work, ready_at)
    if staged:
        out.copy_(dst)
    return out


def all_gather(t: torch.Tensor, group: ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's `t` along `dim` (group-rank order).

    The shards are gathered as they are, [P, *t.shape], then folded into `dim`: one copy for a
    `dim` other than 0 (the sequence of [b, s, h] activations), none for dim 0, and a contiguous result."""
    p = group_size(group)
    if p == 1:
        return t
    dim %= t.dim()
    out = torch.empty((p, *t.shape), dtype=t.dtype, device=t.device)
    all_gather_into(out, t, group)
    return out.movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter(t: torch.Tensor, group: ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """This rank's 1/P slice along `dim` of the sum over the group (contiguous; one copy of `t` for a `dim`
    other than 0, to lay the P slices out one after another)."""
    p = group_size(group)
    if p == 1:
        return t
    dim %= t.dim()
    if t.shape[dim] % p:
        raise CollectiveShapeError(f"reduce-scatter along dim {dim} of size {t.shape[dim]} over {p} ranks: "
                                   f"not divisible")
    slices = t.unflatten(dim, (p, t.shape[dim] // p)).movedim(dim, 0)  # [P, ..., n/P, ...]
    out = torch.empty(slices.shape[1:], dtype=t.dtype, device=t.device)
    reduce_scatter_into(out, slices, group)
    return out


def chunk_of(t: torch.Tensor, group: ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """This rank's 1/P slice of `t` along `dim` (no communication)."""
    p = group_size(group)
    if t.shape[dim] % p:
        raise CollectiveShapeError(f"cannot split dim {dim} of size {t.shape[dim]} over {p} ranks")
    return t.chunk(p, dim)[group_rank(group)].contiguous()


# ---------------------------------------------------------------------------------------- autograd operators


class _Collective(torch.autograd.Function):
    """A differentiable collective: `forward_fn` on the input, `backward_fn` on its gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_fn, backward_fn) -> torch.Tensor:
        ctx.backward_fn = backward_fn
        return forward_fn(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.backward_fn(grad), None, None


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t.view_as(t)


def _summed(group: ProcessGroup) -> Callable[[torch.Tensor], torch.Tensor]:
    """Out-of-place all-reduce (the autograd input must not change)."""
    def run(t: torch.Tensor) -> torch.Tensor:
        out = t.contiguous().clone()
        all_reduce(out, group)
        return out
    return run


def copy_to_group(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient backward (input of a column-parallel linear)."""
    return x if group_size(group) == 1 else _Collective.apply(x, _identity, _summed(group))


def reduce_from_group(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """g: all-reduce forward, identity backward (output of a row-parallel linear)."""
    return x if group_size(group) == 1 else _Collective.apply(x, _summed(group), _identity)


def all_reduce_autograd(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """A sum over the group that every rank then uses differently: all-reduce forward and backward."""
    return x if group_size(group) == 1 else _Collective.apply(x, _summed(group), _summed(group))


def gather_along(x: torch.Tensor, group: ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """All-gather along `dim` forward; reduce-scatter of the gradient backward."""
    return x if group_size(group) == 1 else _Collective.apply(x, partial(all_gather, group=group, dim=dim),
                                                       partial(reduce_scatter, group=group, dim=dim))


def exchange_rows(x: torch.Tensor, send: list[int], recv: list[int], group: ProcessGroup | None) -> torch.Tensor:
    """`all_to_all_rows` forward; its transpose (the gradients' rows sent back where they came from) backward."""
    return _Collective.apply(x, partial(all_to_all_rows, send=send, recv=recv, group=group),
                             partial(all_to_all_rows, send=recv, recv=send, group=group))


def gather_replicated(x: torch.Tensor, group: ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """All-gather along `dim` forward; the gradient of this rank's slice backward (downstream is replicated)."""
    return x if group_size(group) == 1 else _Collective.apply(x, partial(all_gather, group=group, dim=dim),
                                                       partial(chunk_of, group=group, dim=dim))


def scatter_along(x: torch.Tensor, group: ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Reduce-scatter along `dim` forward; all-gather of the gradient backward."""
    return x if group_size(group) == 1 else _Collective.apply(x, partial(reduce_scatter, group=group, dim=dim),
                                                       partial(all_gather, group=group, dim=dim))


def split_along(x: torch.Tensor, group: ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """This rank's slice along `dim` forward; all-gather of the gradient backward (the slices are disjoint)."""
    return x if group_size(group) == 1 else _Collective.apply(x, partial(chunk_of, group=group, dim=dim),
                                                       partial(all_gather, group=group, dim=dim))
