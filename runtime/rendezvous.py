"""NCCL's point-to-point semantics on CPU processes (`PIPEDSL_P2P=rendezvous`): a program checked as NCCL will run
it, before any GPU is booked (docs/runtime.md, "NCCL").

What differs from gloo, and what this transport reproduces with gloo carrying the bytes:

- **a stream per communicator and rank**: the operations a rank issues on one communicator run one at a time, in
  issue order, on a thread of their own — not on the rank's Python thread, which goes on issuing (CUDA calls
  do not block);
- **a rendezvous**: a send completes only when its receive is reached — the receiving stream acknowledges each
  message once it has it, and the sending stream waits for that acknowledgement before it runs its next
  operation, whatever the message's size (NCCL lets a large send block until the peer's stream reaches the
  receive);
- **the communicators of the NCCL code path**: `DistTransport`'s layout (`nccl_model.LAYOUT`, one per directed
  edge), or, as a negative control, another (`PIPEDSL_P2P_LAYOUT=pair`: torch's default of one stream per pair
  of ranks).

A receive or a send that does not complete within the group's timeout fails naming the instruction that waits,
its communicator, and what that communicator's stream is stuck at: the hang a GPU run would show, as an error.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from pipedsl.runtime.groups import PipelineGroups
from pipedsl.runtime.launch.errors import RankFailure
from pipedsl.runtime.p2p import DistTransport

DATA, ACK = 0, 1  # tags: a message's tensors, and the receiving stream's acknowledgement of them
rendezvous_count = 0  # messages this process has sent by rendezvous (a check that the emulation carried them)


class _Operation:
    """One send or receive on a stream: done when its rendezvous has happened (or `error` says why not)."""

    __slots__ = ("run", "label", "sending", "done", "error")

    def __init__(self, run: Callable[[], None], label: str, sending: bool) -> None:
        self.run, self.label, self.sending = run, label, sending
        self.done = threading.Event()
        self.error: BaseException | None = None


class _Stream:
    """One communicator's stream on this rank: a thread running its operations one at a time, in issue order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: queue.Queue[_Operation | None] = queue.Queue()
        self.head: _Operation | None = None  # the operation running now: what a stuck report names
        self.thread = threading.Thread(target=self._run, name=f"pipedsl-stream-{name}", daemon=True)
        self.thread.start()

    def put(self, op: _Operation) -> _Operation:
        self.ops.put(op)
        return op

    def _run(self) -> None:
        failed: BaseException | None = None
        while (op := self.ops.get()) is not None:
            if failed is not None:  # an aborted communicator runs nothing more, as NCCL's does
                op.error = failed
                op.done.set()
                continue
            self.head = op
            try:
                op.run()
                self.head = None
            except BaseException as err:  # noqa: BLE001 - reported by whoever waits; the head stays named
                op.error = failed = err
            op.done.set()

    def close(self) -> None:
        self.ops.put(None)


class RendezvousRecv:
    """A posted receive: its buffers, filled by the stream when the rendezvous happens."""

    __slots__ = ("buffers", "op", "peer", "transport")

    def __init__(self, buffers: list[torch.Tensor], op: _Operation, peer: int, transport: RendezvousTransport) -> None:
        self.buffers, self.op, self.peer, self.transport = buffers, op, peer, transport

    def ready(self) -> bool:
        return self.op.done.is_set()

    def wait(self) -> list[torch.Tensor]:
        self.transport.finish(self.op, "receive", self.peer)
        return self.buffers


class RendezvousTransport(DistTransport):
    """`DistTransport`'s communicators, each run as NCCL runs it (the module docstring)."""

    names_operations = True  # a stuck rendezvous names the instructions at the heads of its streams

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int, groups: PipelineGroups,
                 edges: Sequence[tuple[int, int]], layout: str) -> None:
        super().__init__(group, rank, size, groups, edges, layout)
        timeout = groups.timeout if groups.timeout is not None else timedelta(minutes=30)
        self.timeout = timeout.total_seconds()
        self._streams: dict[str, _Stream] = {}
        self._pending: list[tuple[_Operation, int]] = []  # sends not known to be done, with their peers

    def _stream(self, src: int, dst: int) -> _Stream:
        name = self.communicator(src, dst)
        stream = self._streams.get(name)
        if stream is None:
            stream = self._streams[name] = _Stream(name)
        return stream

    def _irecv(self, peer: int, buffers: list[torch.Tensor]) -> RendezvousRecv:
        src, group = self._global[peer], self._recv_group[peer]

        def run() -> None:
            for b in buffers:
                dist.recv(b, src=src, group=group, tag=DATA)
            dist.send(torch.ones(1, dtype=torch.uint8), dst=src, group=group, tag=ACK)  # reached: the send may end

        label = f"{self.at or 'a receive'} from rank {peer}"
        return RendezvousRecv(buffers, self._stream(peer, self.rank).put(_Operation(run, label, False)), peer, self)

    def _isend(self, peer: int, tensors: list[torch.Tensor]) -> None:
        dst, group = self._global[peer], self._send_group[peer]

        def run() -> None:
            global rendezvous_count
            for t in tensors:
                dist.send(t, dst=dst, group=group, tag=DATA)
            dist.recv(torch.empty(1, dtype=torch.uint8), src=dst, group=group, tag=ACK)  # its receive was reached
            rendezvous_count += 1

        label = f"{self.at or 'a send'} to rank {peer}"
        self._pending.append((self._stream(self.rank, peer).put(_Operation(run, label, True)), peer))

    def push_all(self) -> None:
        if self._pending:
            self._pending = [(op, peer) for op, peer in self._pending if not op.done.is_set()]

    def wait_sends(self) -> None:
        pending, self._pending = self._pending, []
        for op, peer in pending:
            self.finish(op, "send", peer)

    def finish(self, op: _Operation, what: str, peer: int) -> None:
        """Wait for `op`'s rendezvous; past the timeout, or when its stream failed (a peer that timed out first
        closes its connections), a `RankFailure` naming it, its communicator and what that stream is stuck at."""
        src, dst = (self.rank, peer) if what == "send" else (peer, self.rank)
        name = self.communicator(src, dst)
        done = op.done.wait(self.timeout)
        head = self._streams[name].head
        stuck = ""
        if head is not None and head is not op:
            verb = "its receive" if head.sending else "its send"
            stuck = f"; that stream is stuck at {head.label}, waiting for rank {peer} to reach {verb}"
        if not done:
            raise RankFailure(f"rank {self.rank}: {op.label} did not complete within {self.timeout:g} s under NCCL's "
                              f"semantics (PIPEDSL_P2P=rendezvous) on communicator {name}{stuck}: on GPUs this "
                              f"program hangs", self.rank, peer=peer)
        if op.error is not None:
            raise RankFailure(f"rank {self.rank}: {op.label} failed under NCCL's semantics (PIPEDSL_P2P=rendezvous) "
                              f"on communicator {name}{stuck}: {op.error}", self.rank, peer=peer,
                              peer_failure=True) from op.error

    def close(self) -> None:
        deadline = time.monotonic() + 1.0  # a stream stuck in a rendezvous is a daemon: not waited for long
        for stream in self._streams.values():
            stream.close()
        for stream in self._streams.values():
            stream.thread.join(max(0.0, deadline - time.monotonic()))
        self._streams = {}
        super().close()
