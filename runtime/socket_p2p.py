"""Point-to-point messages between the processes of one machine over Unix-domain sockets.

On CPU, gloo's `isend`/`irecv` cost more than the work they move for small stages: every call
hands the message to gloo's transport thread and back (lock, condition variable, thread wake-up),
and `is_completed` polls it.  Measured on this repository's op_cpu benchmark that is most of the
runtime's CPU per op.  Here a message is one `sendmsg` of a small header and its tensors' bytes,
straight from the tensors' memory, and one `recvmsg_into` straight into the receive buffers: no
thread hand-over, no copy, no polling.  Sockets are non-blocking, so no rank ever blocks in a send,
as with `isend`: what the kernel does not take at once (more than the socket buffer,
`net.core.wmem_max`) is queued and sent by a writer thread while the rank goes on.

A connection per pair of ranks carries both directions; each direction is a byte stream, so
messages between a pair arrive in send order (the program's per-pair order).  Abstract-namespace
addresses (Linux): nothing is left on the file system, and the kernel frees the names with the
process.  `connect` returns None where this cannot be used (another OS, ranks on other machines,
or in another network namespace): the caller then keeps torch.distributed.
"""

from __future__ import annotations

import os
import secrets
import select
import socket
import struct
import sys
import threading
import time
from collections import deque
from datetime import timedelta
from itertools import islice

import torch
import torch.distributed as dist

from pipedsl.runtime.tracer import host_id  # who shares abstract socket names: one kernel (boot) and host name

_HEADER = struct.Struct("<q")  # the message's payload bytes: checked against what the receiver expects
_HELLO = struct.Struct("<q")  # a connecting rank's program rank
_SOCKET_BUFFER = 4 << 20  # asked per direction (capped at net.core.wmem_max); the writer thread sends the rest
_MAX_IOV = 512  # buffers per sendmsg/recvmsg (the kernel's limit is 1024)
_WRITER_IDLE = 1.0  # seconds the writer thread waits for more to send before it ends


# dtypes numpy has no type for, read as integers of their size
_AS_INTEGERS = {torch.bfloat16: torch.int16, torch.complex32: torch.int32}
_AS_INTEGERS.update({getattr(torch, name): torch.uint8 for name in ("float8_e4m3fn", "float8_e5m2")
                     if hasattr(torch, name)})


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (any dtype; ~2 µs, a few times less than through
    a uint8 view)."""
    if t.numel() == 0:
        return memoryview(b"")
    alias = _AS_INTEGERS.get(t.dtype)
    return memoryview((t if alias is None else t.view(alias)).numpy()).cast("B")


def _consume(views: deque[memoryview], n: int) -> None:
    """Drop the first `n` bytes of a queue of byte views (sent or received)."""
    while n:
        first = views[0]
        if n >= len(first):
            n -= len(first)
            views.popleft()
        else:
            views[0] = first[n:]
            n = 0


class SocketRecv:
    """A posted receive: the header and the buffers its bytes are read into, in order."""

    __slots__ = ("buffers", "peer", "_views", "_header", "_expected", "_link", "_checked", "done")

    def __init__(self, buffers: list[torch.Tensor], peer: int, link: Link, payload: list[memoryview]) -> None:
        self.buffers, self.peer, self._link = buffers, peer, link
        self._header = bytearray(_HEADER.size)
        self._expected = sum(len(v) for v in payload)
        self._views: deque[memoryview] = deque([memoryview(self._header), *(v for v in payload if len(v))])
        self._checked = False
        self.done = False

    def ready(self) -> bool:
        if not self.done:
            self._link.read()
        return self.done

    def wait(self) -> list[torch.Tensor]:
        if not self.done:
            self._link.wait_for(self)
        return self.buffers

    def _advance(self, n: int) -> None:
        """`n` more bytes arrived; the size header is checked as soon as it is complete."""
        _consume(self._views, n)
        if not self._checked and (not self._views or self._views[0].obj is not self._header):
            self._checked = True
            self._check_header()
        self.done = not self._views

    def _check_header(self) -> None:
        (sent,) = _HEADER.unpack(self._header)
        if sent != self._expected:
            raise ConnectionError(f"rank {self.peer} sent a message of {sent} bytes where {self._expected} bytes "
                                  f"were expected (the two ranks disagree on this message's tensors)")


class Link:
    """The connection to one peer: its queue of unsent bytes and its queue of posted receives.

    `out` is non-empty exactly while the link is in its transport's `backlog`; both change only
    under the transport's lock (the writer thread drains `out`)."""

    __slots__ = ("sock", "peer", "out", "recvs", "owner")

    def __init__(self, sock: socket.socket, peer: int, owner: SocketTransport) -> None:
        self.sock, self.peer, self.owner = sock, peer, owner
        self.out: deque[memoryview] = deque()  # bytes not yet taken by the kernel, in order
        self.recvs: deque[SocketRecv] = deque()  # posted and not yet complete, in post order

    # ---------------------------------------------------------------- sending

    def send(self, views: list[memoryview]) -> None:
        owner = self.owner
        # without a writer thread (only this thread starts one) nothing else touches `out`: no lock needed
        if owner._writer is not None or owner.failure is not None or self.out:
            with owner.lock:
                owner.raise_failure()
                if self.out:  # behind queued bytes: the writer thread sends it in order
                    self.out.extend(views)
                    return
        try:  # nothing queued, so the writer leaves this socket alone
            n = self.sock.sendmsg(views) if len(views) <= _MAX_IOV else 0
        except BlockingIOError:
            n = 0
        except OSError as err:
            raise self._lost(err) from err
        if n < sum(len(v) for v in views):
            with owner.lock:
                self.out.extend(views)
                _consume(self.out, n)
                owner.queue(self)

    def push(self) -> None:
        """Give the kernel as much of the queued bytes as it takes now (under the transport's lock)."""
        out = self.out
        while out:
            views = list(islice(out, _MAX_IOV))
            try:
                n = self.sock.sendmsg(views)
            except BlockingIOError:
                return
            except OSError as err:
                raise self._lost(err) from err
            _consume(self.out, n)
            if n < sum(len(v) for v in views):
                return

    # ---------------------------------------------------------------- receiving

    def read(self) -> None:
        """Read what has arrived into the posted receives, in order, without blocking."""
        recvs = self.recvs
        while recvs:
            head = recvs[0]
            try:
                n = self.sock.recvmsg_into(list(islice(head._views, _MAX_IOV)))[0]
            except BlockingIOError:
                return
            except OSError as err:
                raise self._lost(err) from err
            if n == 0:
                raise self._lost(None)
            head._advance(n)
            if head.done:
                recvs.popleft()
            else:
                return  # the rest has not arrived yet

    def wait_for(self, recv: SocketRecv) -> None:
        """Block until `recv` is complete (queued sends go on meanwhile, in the writer thread)."""
        owner = self.owner
        deadline = time.monotonic() + owner.timeout
        while True:
            self.read()
            if recv.done:
                return
            owner.raise_failure()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no message from rank {self.peer} within {owner.timeout:g} s "
                                   f"(the process group's timeout)")
            _poll([self.sock], select.POLLIN, min(left, 1.0))

    def _lost(self, err: OSError | None) -> ConnectionError:
        why = f": {err}" if err is not None else ""
        return ConnectionError(f"the connection to rank {self.peer} was closed (its process ended or failed){why}")


class SocketTransport:
    """Non-blocking messages to and from every rank of one pipeline group on this machine.

    A message the kernel takes whole (anything up to the socket buffer) costs one system call on
    the caller's thread.  The rest of a larger one is queued and sent by a writer thread, started
    the first time that happens, so it flows while the rank computes, as gloo's does."""

    def __init__(self, links: dict[int, socket.socket], timeout: float, rank: int = 0) -> None:
        self.timeout = timeout
        self.rank = rank
        self.links = {peer: Link(sock, peer, self) for peer, sock in links.items()}
        self.lock = threading.Condition()
        self.backlog: set[Link] = set()  # links with bytes the kernel has not taken yet
        self.failure: ConnectionError | None = None  # the writer thread's, raised on the rank's next call
        self._views: dict[int, tuple[torch.Tensor, memoryview]] = {}  # receive buffer id -> (it, its bytes)
        self._writer: threading.Thread | None = None
        self._closing = False

    def post_recv(self, peer: int, buffers: list[torch.Tensor]) -> SocketRecv:
        """`buffers`: receive buffers that live as long as this transport (the channels' pool): their byte views
        are made once and kept with them."""
        link = self.links[peer]
        views = self._views
        payload = []
        for b in buffers:
            held = views.get(id(b))
            if held is None or held[0] is not b:
                held = views[id(b)] = (b, _bytes_of(b))
            payload.append(held[1])
        recv = SocketRecv(buffers, peer, link, payload)
        link.recvs.append(recv)
        return recv

    def send(self, peer: int, tensors: list[torch.Tensor]) -> None:
        """`tensors`: contiguous CPU tensors, not modified until `wait_sends` (they are sent from their memory)."""
        payload = [_bytes_of(t) for t in tensors]
        header = memoryview(_HEADER.pack(sum(len(v) for v in payload)))
        self.links[peer].send([header, *(v for v in payload if len(v))])

    def queue(self, link: Link) -> None:
        """`link` has queued bytes (under the lock): wake the writer, starting it if it is not running."""
        self.backlog.add(link)
        if self._writer is None:
            self._writer = threading.Thread(target=self._write, name="pipedsl-socket-writer", daemon=True)
            self._writer.start()
        self.lock.notify_all()

    def _write(self) -> None:
        """The writer thread: push every queued byte as the sockets take them.  It ends after a second with
        nothing to send (so a transport nobody closes is not kept alive by it); `queue` starts another."""
        lock = self.lock
        while True:
            with lock:
                if not self.backlog and not self._closing:
                    lock.wait(_WRITER_IDLE)
                if self._closing or not self.backlog:
                    self._writer = None
                    return
                socks = [link.sock for link in self.backlog]
            try:
                _poll(socks, select.POLLOUT, 0.5)
            except (OSError, ValueError):  # closed under us
                with lock:
                    self._writer = None
                return
            with lock:
                for link in list(self.backlog):
                    try:
                        link.push()
                    except ConnectionError as err:
                        self.failure = err
                        self.backlog.clear()
                    if not link.out:
                        self.backlog.discard(link)
                lock.notify_all()

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def push_all(self) -> None:
        """Nothing to do between compute ops: the writer thread sends what is queued."""

    def wait_sends(self) -> None:
        """Block until the kernel has taken every queued byte (the tensors may then change)."""
        deadline = time.monotonic() + self.timeout
        with self.lock:
            while self.backlog and self.failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    peers = sorted(link.peer for link in self.backlog)
                    raise TimeoutError(f"sends to rank(s) {peers} not taken within {self.timeout:g} s")
                self.lock.wait(min(left, 1.0))
            self.raise_failure()

    def close(self) -> None:
        with self.lock:
            self._closing = True
            self.lock.notify_all()
        if self._writer is not None:
            self._writer.join(timeout=2.0)
        for link in self.links.values():
            link.sock.close()
        self.links = {}


def _poll(socks: list[socket.socket], events: int, seconds: float) -> None:
    """Wait until one of `socks` is ready for `events` or `seconds` pass (poll: no limit on descriptor numbers,
    which select has at 1024 — a long-lived process that built many pipelines goes past it)."""
    poller = select.poll()
    for s in socks:
        poller.register(s, events)
    poller.poll(max(0, int(seconds * 1000)))


def connect(group: dist.ProcessGroup | None, rank: int, size: int,
            timeout: timedelta | None) -> SocketTransport | None:
    """Connect every pair of the group's ranks (collective), or None where they cannot all be connected.

    `PIPEDSL_P2P` other than `auto` keeps torch.distributed's point-to-point calls instead."""
    seconds = timeout.total_seconds() if timeout is not None else 1800.0
    usable = sys.platform.startswith("linux") and os.environ.get("PIPEDSL_P2P", "auto") == "auto" and size > 1
    listener = None
    address = None
    if usable:
        try:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address = f"\0pipedsl-{os.getpid()}-{secrets.token_hex(8)}"
            listener.bind(address)
            listener.listen(size)
        except OSError:
            listener, address = None, None
    everyone: list = [None] * size
    dist.all_gather_object(everyone, (host_id(), address), group=group)
    socks: dict[int, socket.socket] = {}
    ok = all(a is not None and m == everyone[0][0] for m, a in everyone)
    if ok:
        ok = _connect_all(listener, rank, size, [a for _, a in everyone], socks, min(seconds, 60.0))
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if listener is not None:
        listener.close()
    if not int(flag):
        for s in socks.values():
            s.close()
        return None
    for s in socks.values():
        s.setblocking(False)
    return SocketTransport(socks, seconds, rank)


def _connect_all(listener: socket.socket | None, rank: int, size: int, addresses: list[str],
                 socks: dict[int, socket.socket], seconds: float) -> bool:
    """Connect to every higher rank, then accept every lower one (connect does not wait for accept)."""
    assert listener is not None
    try:
        for peer in range(rank + 1, size):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            socks[peer] = s
            s.settimeout(seconds)
            s.connect(addresses[peer])
            s.sendall(_HELLO.pack(rank))
        listener.settimeout(seconds)
        for _ in range(rank):
            s, _ = listener.accept()
            s.settimeout(seconds)
            hello = _recv_exactly(s, _HELLO.size)
            (peer,) = _HELLO.unpack(hello)
            if not 0 <= peer < rank or peer in socks:
                s.close()
                return False
            socks[peer] = s
        for s in socks.values():
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
        return True
    except OSError:
        return False


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed during connection setup")
        data += chunk
    return data
