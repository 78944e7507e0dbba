"""Point-to-point channels: `isend`/`irecv`-style messages with reusable receive buffers.

Everything here is keyed by *program* ranks (0 … P−1 of the pipeline group).  Messages carry
no metadata: both ends know every tensor's shape and dtype from `TensorMeta`, so a receive is
posted into buffers taken from a pool keyed by (shape, dtype).  Messages between a pair of
ranks match in issue order, which the program's per-pair order makes correct.

Two transports behind one interface (`post_recv` → a receive with `ready`/`wait`, `send`,
`push_all`, `wait_sends`):

- on CPU between processes of one machine, Unix-domain sockets (socket_p2p.py): one system call
  per message and side, no transport thread — gloo's per-call hand-over to its thread was most of
  the runtime's CPU per op.  `PIPEDSL_P2P=dist` turns it off.
- otherwise torch.distributed, one tag-0 `isend`/`irecv` per tensor (NCCL on GPUs, gloo between
  machines).  On gloo, messages travel on two process groups of their own, one per direction:
  gloo keeps one socket and one lock per pair of ranks and group, and when both directions share
  it an `isend`/`irecv` call now and then waits for the transport thread handling the other
  direction — 2–6 ms stalls, about one call in ten; with a group per direction, none.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import socket_p2p
from .groups import PipelineGroups

# A fixed-size int64 vector describes one message (count, then dtype, ndim, dims per tensor).
META_LEN = 64
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64]


class TensorMeta(NamedTuple):
    """Shape and dtype of one tensor of a message (a named tuple: hashed per message, in C)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMeta:
        return cls(tuple(t.shape), t.dtype)

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex

    def __str__(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}"


def describe(metas: tuple[TensorMeta, ...]) -> str:
    return ", ".join(map(str, metas)) if len(metas) != 1 else str(metas[0])


def encode_meta(metas: tuple[TensorMeta, ...]) -> torch.Tensor:
    out = [len(metas)]
    for m in metas:
        out += [_DTYPES.index(m.dtype), len(m.shape), *m.shape]
    if len(out) > META_LEN:
        raise ValueError(f"a stage message of {len(metas)} tensors is too large to describe")
    return torch.tensor(out + [0] * (META_LEN - len(out)), dtype=torch.int64)


def decode_meta(v: torch.Tensor) -> tuple[TensorMeta, ...]:
    vals = v.tolist()
    n, pos, metas = vals[0], 1, []
    for _ in range(n):
        dtype, ndim = _DTYPES[vals[pos]], vals[pos + 1]
        metas.append(TensorMeta(tuple(vals[pos + 2:pos + 2 + ndim]), dtype))
        pos += 2 + ndim
    return tuple(metas)


class BufferPool:
    """Receive buffers, allocated once per (shape, dtype) and handed out again after release."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._free: dict[TensorMeta, list[torch.Tensor]] = defaultdict(list)
        self.allocated = 0

    def take(self, meta: TensorMeta) -> torch.Tensor:
        free = self._free[meta]
        if free:
            return free.pop()
        self.allocated += 1
        return torch.empty(meta.shape, dtype=meta.dtype, device=self.device)

    def give(self, t: torch.Tensor) -> None:
        self._free[TensorMeta.of(t)].append(t)


class Recv:
    """A posted receive of one message through torch.distributed: its buffers and the works to wait on."""

    __slots__ = ("buffers", "works", "peer")

    def __init__(self, buffers: list[torch.Tensor], works: list, peer: int) -> None:
        self.buffers, self.works, self.peer = buffers, works, peer

    def ready(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        self.works = []
        return self.buffers


class DistTransport:
    """Messages as one `isend`/`irecv` per tensor (NCCL; gloo between machines)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int, groups: PipelineGroups) -> None:
        self._global = groups.members  # program rank -> global rank
        self._sends: list[tuple[object, torch.Tensor]] = []
        up = down = group
        if size > 1 and dist.get_backend(group) == "gloo":
            up, down = (groups.new(range(size)) for _ in range(2))
        # messages from a lower to a higher rank on `up`, the others on `down`
        self._send_group = [up if peer > rank else down for peer in range(size)]
        self._recv_group = [down if peer > rank else up for peer in range(size)]

    def post_recv(self, peer: int, buffers: list[torch.Tensor]) -> Recv:
        src, group = self._global[peer], self._recv_group[peer]
        return Recv(buffers, [dist.irecv(b, src=src, group=group, tag=0) for b in buffers], peer)

    def send(self, peer: int, tensors: list[torch.Tensor]) -> None:
        dst, group = self._global[peer], self._send_group[peer]
        for t in tensors:
            self._sends.append((dist.isend(t, dst=dst, group=group, tag=0), t))

    def push_all(self) -> None:
        """Drop the sends that have completed."""
        if self._sends:
            self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]

    def wait_sends(self) -> None:
        sends, self._sends = self._sends, []
        for w, _ in sends:
            w.wait()

    def close(self) -> None:
        self._sends = []


class Channels:
    """Tag-0 point-to-point messages between the ranks of one pipeline group.

    On CPU, between processes of one machine, over Unix-domain sockets (socket_p2p.py: a fraction
    of gloo's CPU per message); otherwise through torch.distributed."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, groups: PipelineGroups) -> None:
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.pool = BufferPool(device)
        self.sent_bytes = 0  # payload of every data message sent so far (activations and gradients)
        sockets = socket_p2p.connect(group, self.rank, self.size, groups.timeout) if device.type == "cpu" else None
        # gloo's message groups are made only where no pipeline uses sockets: making a group is collective over
        # every process that makes groups together, so they all decide alike
        if device.type == "cpu" and groups.everywhere(sockets is not None):
            self.transport: DistTransport | socket_p2p.SocketTransport = sockets
        else:
            if sockets is not None:
                sockets.close()
            self.transport = DistTransport(group, self.rank, self.size, groups)
        self.kind = "socket" if isinstance(self.transport, socket_p2p.SocketTransport) else "dist"

    # ------------------------------------------------------------ data

    def post_recv(self, peer: int, metas: tuple[TensorMeta, ...]) -> Recv | socket_p2p.SocketRecv:
        return self.transport.post_recv(peer, [self.pool.take(m) for m in metas])

    def send(self, peer: int, tensors: list[torch.Tensor], payload: bool = True) -> None:
        """Start sending; the tensors are kept alive until the send completes.  `payload`: counted in `sent_bytes`
        (not a discovery step's shape message)."""
        out = []
        for t in tensors:
            t = t.detach()
            if not t.is_contiguous():
                t = t.contiguous()
            if payload:
                self.sent_bytes += t.numel() * t.element_size()
            out.append(t)
        self.transport.send(peer, out)

    def reap_sends(self) -> None:
        """Move sends on (cheap; called between compute ops)."""
        self.transport.push_all()

    def wait_sends(self) -> None:
        self.transport.wait_sends()

    def all_reduce(self, t: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None,
                   async_op: bool = False) -> Any:
        """Reduce a small tensor (`op`: "sum" or "max") over the pipeline's ranks, in place; with `async_op` a
        handle to `wait()` on.  Over the sockets gathered by rank 0 and sent back, reduced in rank order
        (the same bits on every rank), run at `wait()` — call that between steps, on every rank alike;
        otherwise `dist.all_reduce` on `group` (default: the pipeline's)."""
        if isinstance(self.transport, socket_p2p.SocketTransport) and t.device.type == "cpu":
            work = _SocketReduce(self.transport, t, op)
            if not async_op:
                work.wait()
            return work
        return dist.all_reduce(t, op=_OPS[op], group=group if group is not None else self.group, async_op=async_op)

    def close(self) -> None:
        self.transport.close()


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class _SocketReduce:
    """An all-reduce over the socket transport, run when waited for; reduced in rank order (the same bits on every
    rank, whatever the timing)."""

    def __init__(self, transport: socket_p2p.SocketTransport, t: torch.Tensor, op: str) -> None:
        self.transport, self.t, self.op, self.done = transport, t, op, False

    def wait(self) -> bool:
        if not self.done:
            self.done = True
            self.t.copy_(self.transport.all_reduce(self.t.contiguous(), self._combine))
        return True

    def _combine(self, parts: list[torch.Tensor]) -> torch.Tensor:
        out = parts[0].clone()
        for part in parts[1:]:
            out = out + part if self.op == "sum" else torch.maximum(out, part)
        return out

