"""Point-to-point channels: tag-0 `isend`/`irecv` with reusable receive buffers.

Everything here is keyed by *program* ranks (0 … P−1 of the pipeline group) and translated
once to global ranks.  Messages carry no metadata: both ends know every tensor's shape and
dtype from `TensorMeta` exchanged once (`exchange_meta`), so a receive is one `irecv` per
tensor into a buffer taken from a pool keyed by (shape, dtype).  Tag 0 only: messages
between a pair of ranks match in issue order, which the program's per-pair order makes
correct on NCCL as on gloo.

On gloo, messages travel on two process groups of their own, one per direction: from a lower
to a higher rank on one, back on the other.  Gloo keeps one socket and one lock per pair of
ranks and group; when both directions share it, an `isend`/`irecv` call now and then waits
for the transport thread handling the other direction — 2–6 ms stalls, measured on an idle
machine, about one call in ten when two ranks exchange messages; with a group per direction,
none (max 0.2 ms).  Per-pair order is kept: all messages from a to b use one group.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .groups import PipelineGroups

# A fixed-size int64 vector describes one message (count, then dtype, ndim, dims per tensor).
_META_LEN = 64
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64]


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape and dtype of one tensor of a message."""

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
    if len(out) > _META_LEN:
        raise ValueError(f"a stage message of {len(metas)} tensors is too large to describe")
    return torch.tensor(out + [0] * (_META_LEN - len(out)), dtype=torch.int64)


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
    """A posted receive of one message: its buffers and the works to wait on."""

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


class Channels:
    """Tag-0 point-to-point messages between the ranks of one pipeline group."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, groups: PipelineGroups) -> None:
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._global = groups.members  # program rank -> global rank
        self.pool = BufferPool(device)
        self._sends: list[tuple[object, torch.Tensor]] = []
        self.sent_bytes = 0  # payload of every data message sent so far (activations and gradients)
        up = down = group
        if self.size > 1 and dist.get_backend(group) == "gloo":
            up, down = (groups.new(range(self.size)) for _ in range(2))
        # messages from a lower to a higher rank on `up`, the others on `down`
        self._send_group = [up if peer > self.rank else down for peer in range(self.size)]
        self._recv_group = [down if peer > self.rank else up for peer in range(self.size)]

    # ------------------------------------------------------------ data

    def post_recv(self, peer: int, metas: tuple[TensorMeta, ...]) -> Recv:
        src = self._global[peer]
        buffers = [self.pool.take(m) for m in metas]
        group = self._recv_group[peer]
        works = [dist.irecv(b, src=src, group=group, tag=0) for b in buffers]
        return Recv(buffers, works, peer)

    def send(self, peer: int, tensors: list[torch.Tensor]) -> None:
        """Start sending; the tensors are kept alive until the send completes."""
        dst, group = self._global[peer], self._send_group[peer]
        for t in tensors:
            t = t.detach()
            if not t.is_contiguous():
                t = t.contiguous()
            self.sent_bytes += t.numel() * t.element_size()
            self._sends.append((dist.isend(t, dst=dst, group=group, tag=0), t))

    def reap_sends(self) -> None:
        """Drop the sends that have completed (cheap; called between compute ops)."""
        if self._sends:
            self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]

    def wait_sends(self) -> None:
        sends, self._sends = self._sends, []
        for w, _ in sends:
            w.wait()

    # ------------------------------------------------------------ shapes (before the first step)

    def send_meta(self, peer: int, metas: tuple[TensorMeta, ...]) -> None:
        v = encode_meta(metas).to(self.device)
        dist.send(v, dst=self._global[peer], group=self.group, tag=0)

    def recv_meta(self, peer: int) -> tuple[TensorMeta, ...]:
        v = torch.empty(_META_LEN, dtype=torch.int64, device=self.device)
        dist.recv(v, src=self._global[peer], group=self.group, tag=0)
        return decode_meta(v.cpu())
