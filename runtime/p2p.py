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

import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from pipedsl.errors import PipeRuntimeError
from pipedsl.nccl_model import LAYOUT, LAYOUTS, communicator_name
from pipedsl.runtime import socket_p2p
from pipedsl.runtime.groups import PipelineGroups
from pipedsl.runtime.launch.errors import RankFailure

# A fixed-size int64 vector describes one message (count, then dtype, ndim, dims per tensor).
META_LEN = 64
OPENING_BYTES = 256  # a step's opening message: its shapes' 8-byte fingerprint, then their description (cut to fit)
OPENING_TAG = 1  # over torch.distributed the openings' tag (the data's is 0)
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

    def trim(self, keep: set[TensorMeta]) -> int:
        """Drop the free buffers of every shape not in `keep` (the shapes no cached executor receives any more);
        how many.  Without it a run whose shapes change keeps a set of buffers per shape it ever saw."""
        gone = [meta for meta in self._free if meta not in keep]
        dropped = sum(len(self._free.pop(meta)) for meta in gone)
        self.allocated -= dropped
        return dropped


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


class StagedRecv:
    """A receive into host buffers, copied into device buffers when waited for (gloo cannot reach GPU memory)."""

    __slots__ = ("inner", "pool", "wire_pool", "peer")

    def __init__(self, inner: Recv | socket_p2p.SocketRecv, pool: BufferPool, wire_pool: BufferPool) -> None:
        self.inner, self.pool, self.wire_pool, self.peer = inner, pool, wire_pool, inner.peer

    def ready(self) -> bool:
        return self.inner.ready()

    def wait(self) -> list[torch.Tensor]:
        out = []
        for host in self.inner.wait():
            out.append(self.pool.take(TensorMeta.of(host)).copy_(host))  # from pageable memory: host is free after
            self.wire_pool.give(host)
        return out


P2P_MODES = ("auto", "dist", "nccl", "rendezvous")  # PIPEDSL_P2P's values (docs/runtime.md, "NCCL")


def p2p_mode() -> str:
    """`PIPEDSL_P2P`: `auto` (sockets on one machine's CPUs, else torch.distributed), `dist` (torch.distributed),
    `nccl` (the NCCL code path's communicators and issue order, gloo carrying the bytes), `rendezvous` (that, with
    NCCL's semantics emulated: runtime/rendezvous.py)."""
    mode = os.environ.get("PIPEDSL_P2P", "auto")
    if mode not in P2P_MODES:
        raise PipeRuntimeError(f"PIPEDSL_P2P={mode!r} is not one of {', '.join(P2P_MODES)}")
    return mode


class DistTransport:
    """Messages as one `isend`/`irecv` per tensor (NCCL; gloo between machines), on the communicators `layout`
    names (pipedsl/nccl_model.py's `LAYOUTS`).

    On NCCL a send waits for its receive and each communicator has one stream a rank, so the layout is what the
    validator proved hang-free (`nccl_model.LAYOUT`: a group per directed edge of the program, made here for
    every edge, eagerly and in one order on every process: lazily made point-to-point communicators hung
    multi-node starts, torch PR 160210).  With `layout=None` (gloo), two groups by direction of rank order:
    gloo keeps one socket and lock per pair and group, and both directions on one stalled calls 2–6 ms."""

    names_operations = False  # whether a stuck operation's report needs the instruction that issued it

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int, groups: PipelineGroups,
                 edges: Sequence[tuple[int, int]] = (), layout: str | None = None) -> None:
        self._global = groups.members  # program rank -> global rank
        self._sends: list[tuple[object, torch.Tensor]] = []
        self.rank, self.layout = rank, layout
        self.record: list[dict[str, Any]] | None = None  # PIPEDSL_P2P_RECORD: every operation, in issue order
        self.at: str | None = None  # the instruction issuing the next operation (set by the executor when recording)
        if layout is None:
            up = down = group
            if size > 1 and dist.get_backend(group) == "gloo":
                up, down = (groups.new(range(size)) for _ in range(2))
            # messages from a lower to a higher rank on `up`, the others on `down`
            self._send_group = {peer: up if peer > rank else down for peer in range(size)}
            self._recv_group = {peer: down if peer > rank else up for peer in range(size)}
            return
        comm_of = LAYOUTS[layout]
        made: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for src, dst in sorted(edges):
            comm = comm_of(src, dst)
            if comm not in made:
                made[comm] = groups.new(comm if comm else range(size))  # `group` layout: one for every peer
        self._send_group = {dst: made[comm_of(src, dst)] for src, dst in edges if src == rank}
        self._recv_group = {src: made[comm_of(src, dst)] for src, dst in edges if dst == rank}
        self._names = {(src, dst): communicator_name(layout, comm_of(src, dst)) for src, dst in edges}

    def communicator(self, src: int, dst: int) -> str:
        """The name of the communicator a message from `src` to `dst` travels on."""
        return self._names[(src, dst)] if self.layout is not None else ("up" if dst > src else "down")

    def _note(self, kind: str, peer: int, tensors: list[torch.Tensor]) -> None:
        src, dst = (self.rank, peer) if kind == "send" else (peer, self.rank)
        self.record.append({"comm": self.communicator(src, dst), "kind": kind, "peer": peer, "at": self.at,
                            "shapes": [list(t.shape) for t in tensors]})

    def post_recv(self, peer: int, buffers: list[torch.Tensor]) -> Any:
        if self.record is not None:
            self._note("recv", peer, buffers)
        return self._irecv(peer, buffers)

    def send(self, peer: int, tensors: list[torch.Tensor]) -> None:
        if self.record is not None:
            self._note("send", peer, tensors)
        self._isend(peer, tensors)

    def _irecv(self, peer: int, buffers: list[torch.Tensor]) -> Any:
        """The receive, issued (what an emulation of another transport replaces: runtime/rendezvous.py)."""
        src, group = self._global[peer], self._recv_group[peer]
        return Recv(buffers, [dist.irecv(b, src=src, group=group, tag=0) for b in buffers], peer)

    def _isend(self, peer: int, tensors: list[torch.Tensor]) -> None:
        """The send, issued; kept until it completes (`push_all`, `wait_sends`)."""
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

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, groups: PipelineGroups,
                 edges: Sequence[tuple[int, int]] = ()) -> None:
        """`edges`: the (src, dst) program ranks the program sends along — NCCL's communicators, one per edge."""
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.pool = BufferPool(device)  # the buffers a receive hands out (on the device)
        # gloo moves host memory only: a GPU's messages over gloo (ranks sharing one GPU) go through the CPU
        self.wire = torch.device("cpu") if device.type != "cpu" and dist.get_backend(group) == "gloo" else device
        self._wire_pool = BufferPool(self.wire) if self.wire != device else None
        self.sent_bytes = 0  # payload of every data message sent so far (activations and gradients)
        on_cpu = self.wire.type == "cpu"
        mode = p2p_mode()
        self.transport: DistTransport | socket_p2p.SocketTransport
        nccl = dist.get_backend(group) == "nccl" or mode in ("nccl", "rendezvous")  # NCCL's code path, or emulated
        if nccl:  # NCCL's layout, proven (nccl_model)
            layout = os.environ.get("PIPEDSL_P2P_LAYOUT", LAYOUT) if mode != "auto" else LAYOUT  # a test's control
            if mode == "rendezvous":
                from pipedsl.runtime.rendezvous import RendezvousTransport

                self.transport = RendezvousTransport(group, self.rank, self.size, groups, edges, layout)
            else:
                self.transport = DistTransport(group, self.rank, self.size, groups, edges, layout)
        else:
            sockets = socket_p2p.connect(group, self.rank, self.size, groups.timeout) if on_cpu else None
            # gloo's message groups are made only where no pipeline uses sockets: making a group is collective over
            # every process that makes groups together, so they all decide alike
            if on_cpu and groups.everywhere(sockets is not None):
                self.transport = sockets
            else:
                if sockets is not None:
                    sockets.close()
                self.transport = DistTransport(group, self.rank, self.size, groups)
        self.kind = "socket" if isinstance(self.transport, socket_p2p.SocketTransport) else "dist"
        self._record_to = os.environ.get("PIPEDSL_P2P_RECORD") if isinstance(self.transport, DistTransport) else None
        if self._record_to:  # this pipeline's record starts its rank's file
            self.transport.record = []
            self._record_path().parent.mkdir(parents=True, exist_ok=True)
            self._record_path().write_text("")
        self._flushed = 0  # record entries written so far
        # each operation is named by its instruction (`label`): for the record, and for what a stuck rendezvous reports
        self.labelled = bool(self._record_to) or getattr(self.transport, "names_operations", False)
        self.opening: tuple[int, str, dict[int, Any]] | None = None  # this step's openings from peers, not checked
        self._said: dict[int, str] = {}  # the openings checked so far (`settle(peer)`): each rank's shapes in words
        self._differs = False  # one of them differs from this rank's
        self._opening_sends: list = []  # torch.distributed: this step's opening sends, waited once all are checked
        self._members = list(groups.members)  # program rank -> global rank
        # the openings' all-reduce on host tensors: under NCCL reading a device tensor's result waited for the GPU to
        # drain the previous step's optimizer at every step's start (a gloo group beside it, as torch's checkpoints do)
        self._opening_group = groups.new(range(self.size), backend="gloo") if nccl and self.size > 1 else group

    # ------------------------------------------------------------ data

    def post_recv(self, peer: int, metas: tuple[TensorMeta, ...],
                  label: str | None = None) -> Recv | socket_p2p.SocketRecv | StagedRecv:
        """`label`: the receive's instruction, for the record and a stuck rendezvous's report (`labelled`)."""
        if self.labelled:
            self.transport.at = label
        if self._wire_pool is None:
            return self.transport.post_recv(peer, [self.pool.take(m) for m in metas])
        return StagedRecv(self.transport.post_recv(peer, [self._wire_pool.take(m) for m in metas]), self.pool,
                          self._wire_pool)

    def send(self, peer: int, tensors: list[torch.Tensor], payload: bool = True, label: str | None = None) -> None:
        """Start sending; the tensors are kept alive until the send completes.  `payload`: counted in `sent_bytes`
        (not a discovery step's shape message); `label` as `post_recv`'s."""
        if self.labelled:
            self.transport.at = label
        out = []
        for t in tensors:
            t = t.detach()
            if not t.is_contiguous():
                t = t.contiguous()
            if t.device != self.wire:
                t = t.to(self.wire)  # synchronous: the copy is what travels
            if payload:
                self.sent_bytes += t.numel() * t.element_size()
            out.append(t)
        self.transport.send(peer, out)

    def trim(self, keep: set[TensorMeta]) -> None:
        """Drop the pooled receive buffers of shapes not in `keep` (`BufferPool.trim`), device and wire; the
        fixed-size openings and shape messages stay."""
        keep = keep | {TensorMeta((OPENING_BYTES,), torch.uint8), TensorMeta((META_LEN,), torch.int64)}
        self.pool.trim(keep)
        if self._wire_pool is not None:
            self._wire_pool.trim(keep)

    def reap_sends(self) -> None:
        """Move sends on (cheap; called between compute ops)."""
        self.transport.push_all()

    def wait_sends(self) -> None:
        self.transport.wait_sends()
        self._flush_record()

    def _flush_record(self) -> None:
        """`PIPEDSL_P2P_RECORD`: what this rank issued since the last flush (a step's end), appended to its file,
        one operation a line, in issue order (runtime/comm_record.py reads them)."""
        if not self._record_to:
            return
        import json

        new, self._flushed = self.transport.record[self._flushed:], len(self.transport.record)
        with self._record_path().open("a") as out:
            out.writelines(json.dumps(entry) + "\n" for entry in new)

    def _record_path(self) -> Path:
        return Path(self._record_to) / f"rank{dist.get_rank()}.jsonl"

    # ------------------------------------------------------------ a step's opening and its loss

    def open_step(self, key: int, description: str, wait: bool) -> None:
        """Start a step whose microbatch shapes have the fingerprint `key` (`description`: them in words).

        Every rank must pass the same shapes: a rank with others would send and expect other messages.
        Over the sockets each rank sends every peer an opening message (the fingerprint and the
        description, `OPENING_BYTES`) and, unless `wait`, goes on at once: `settle` checks the
        peers' openings before the step first waits for a peer's message, and at its end.  So no
        rank waits for the others to start — a rank that ends a step early (the last stage of a V)
        starts the next one at once, as torch's runtime does.  That is safe because a rank waits
        for a peer only after every opening has arrived, and a rank sends its openings before
        anything else: each rank finds a disagreement by itself, and none waits for one that
        stopped.  `wait`: check now (a rank meeting a new shape learns it with every peer, in a
        `Discovery` step).  Over torch.distributed the same messages go as host tensors over gloo (under
        NCCL a gloo group of their own: NCCL's point-to-point calls between every pair of ranks would
        open a connection per pair, and reading a device tensor waits for the GPU), tagged apart from
        the data.  Alone in its group, nothing to agree on."""
        if self.size == 1:
            return
        text = key.to_bytes(8, "little", signed=True) + description.encode()[:OPENING_BYTES - 8]
        opening = torch.frombuffer(bytearray(text.ljust(OPENING_BYTES, b"\0")), dtype=torch.uint8)
        peers = [peer for peer in range(self.size) if peer != self.rank]
        if self.kind != "socket":  # host messages over gloo, tagged apart from the data (OPENING_TAG)
            recvs = {}
            for peer in peers:
                buf = torch.empty(OPENING_BYTES, dtype=torch.uint8)
                work = self._guard(lambda: dist.irecv(buf, src=self._members[peer],  # noqa: B023 - called at once
                                                      group=self._opening_group, tag=OPENING_TAG))
                recvs[peer] = Recv([buf], [work], peer)
            self._opening_sends = [self._guard(lambda: dist.isend(opening, dst=self._members[peer],  # noqa: B023
                                                                  group=self._opening_group, tag=OPENING_TAG))
                                   for peer in peers]
        else:
            meta = (TensorMeta((OPENING_BYTES,), torch.uint8),)
            recvs = {peer: self.post_recv(peer, meta) for peer in peers}
            for peer in peers:
                self.transport.send(peer, [opening])
        self.opening = (key, description, recvs)
        if wait:
            self.settle()

    def settle(self, peer: int | None = None) -> None:
        """Check this step's openings from every peer (waiting for them), once: a `RankFailure` naming every rank's
        shapes if any differs from this rank's.  Nothing to do when they are checked (or never sent).

        `peer`: check that peer's opening only, the others later — before a receive from it in a post-validated
        step's forward work, where waiting for every peer's opening would wait for every rank to end the previous
        step (post_validate.py; the others are checked as they arrive, `settle_arrived`, and at the step's end).  A
        peer whose shapes differ is found before anything is received from it, and then every opening is waited
        for to name each rank's shapes."""
        if self.opening is None:
            return
        key, description, recvs = self.opening
        said = self._said
        said[self.rank] = description
        for q in list(recvs) if peer is None else [peer] if peer in recvs else []:
            recv = recvs.pop(q)
            buf = self._guard(lambda: recv.wait()[0])  # noqa: B023 - called at once
            raw = buf.cpu().numpy().tobytes()
            if self.kind == "socket":
                self.pool.give(buf)
            said[q] = raw[8:].rstrip(b"\0").decode(errors="replace")
            if int.from_bytes(raw[:8], "little", signed=True) != key:
                self._differs = True
        if recvs and self._differs:
            self.settle()  # every rank's shapes, to name them
        elif not recvs:
            self.opening, self._said, differs, self._differs = None, {}, self._differs, False
            sends, self._opening_sends = self._opening_sends, []
            for work in sends:
                self._guard(work.wait)
            if differs:
                raise _disagreement(self.rank, [said[r] for r in range(self.size)])

    def settle_arrived(self) -> bool:
        """Check the openings that have arrived, without waiting (as `settle(peer)` each); True once every one is
        checked.  A gated pass polls it while it waits for a peer's message: a rank whose shapes differ may stop
        before sending that message, and its opening is how this rank learns it."""
        if self.opening is None:
            return True
        for q in [q for q, recv in self.opening[2].items() if recv.ready()]:
            self.settle(q)
            if self.opening is None:
                break
        return self.opening is None

    def _guard(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as err:  # noqa: BLE001
            raise RankFailure(f"rank {self.rank}: agreeing on this step's input shapes failed: {err}", self.rank,
                              peer_failure=True) from err

    def sum_over(self, t: torch.Tensor, holders: Sequence[int], group: dist.ProcessGroup | None = None,
                 async_op: bool = False) -> Any:
        """Sum a small tensor, zero outside the ranks `holders`, over the pipeline's ranks, in place; with `async_op`
        a handle to `wait()` on.  Over the sockets each holder sends its `t` to every other rank when waited for
        (call that at the step's end, on every rank: the messages follow the step's) and the sum is taken in
        rank order (the same bits everywhere); no rank waits for one that is not a holder.  Otherwise
        `dist.all_reduce` on `group` (default: the pipeline's)."""
        if self.kind == "socket" and t.device.type == "cpu":
            work = _SocketSum(self, t, holders)
            if not async_op:
                work.wait()
            return work
        return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group if group is not None else self.group,
                               async_op=async_op)

    def close(self) -> None:
        self._flush_record()
        self.transport.close()


def _disagreement(rank: int, described: list[str]) -> RankFailure:
    shapes = "; ".join(f"rank {r}: {d}" for r, d in enumerate(described))
    return RankFailure(f"the pipeline's ranks passed inputs of different shapes this step ({shapes}): every rank "
                       f"must pass the same batch (its microbatch shapes decide what each rank sends and receives)",
                       rank)


class _SocketSum:
    """`Channels.sum_over` over the sockets, run when waited for."""

    def __init__(self, channels: Channels, t: torch.Tensor, holders: Sequence[int]) -> None:
        self.channels, self.t, self.holders, self.done = channels, t, holders, False

    def wait(self) -> bool:
        if self.done:
            return True
        self.done = True
        transport, rank, t = self.channels.transport, self.channels.rank, self.t.contiguous()
        recvs = {h: transport.post_recv(h, [torch.empty_like(t)]) for h in self.holders if h != rank}
        if rank in self.holders:
            for peer in transport.links:
                transport.send(peer, [t])
        parts = [t if h == rank else recvs[h].wait()[0] for h in self.holders]
        out = parts[0].clone()
        for part in parts[1:]:
            out = out + part
        transport.wait_sends()
        self.t.copy_(out)
        return True
