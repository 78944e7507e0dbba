"""The Unix-socket transport (runtime/socket_p2p.py), in one process over socket pairs, and against
torch.distributed's point-to-point path in a pipeline."""

from __future__ import annotations

import os
import resource
import socket
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import pipedsl
from pipedsl.runtime.p2p import _SocketSum
from pipedsl.runtime.socket_p2p import SocketTransport


def _pair(timeout: float = 20.0) -> tuple[SocketTransport, SocketTransport]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for s in (a, b):
        s.setblocking(False)
    return SocketTransport({1: a}, timeout), SocketTransport({0: b}, timeout)


def test_every_dtype_and_empty_tensors_arrive_bit_exact() -> None:
    """bf16, fp16, int64, bool, float64, complex64 and an empty tensor sent over a socket pair arrive in their dtype,
    equal to what was sent bit for bit."""
    a, b = _pair()
    g = torch.Generator().manual_seed(0)
    sent = [torch.randn(3, 5, generator=g).to(torch.bfloat16), torch.randn(7, generator=g).half(),
            torch.randint(-5, 5, (4, 2), generator=g), torch.rand(6, generator=g) > 0.5, torch.empty(0, 3),
            torch.randn(2, 2, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.complex64)]
    recv = b.post_recv(0, [torch.empty_like(t) for t in sent])
    a.send(1, sent)
    got = recv.wait()
    for s, r in zip(sent, got):
        assert s.dtype == r.dtype and torch.equal(s.view(-1).view(torch.uint8) if s.numel() else s,
                                                  r.view(-1).view(torch.uint8) if r.numel() else r)


def test_messages_keep_their_order_and_a_late_receive_finds_its_message() -> None:
    a, b = _pair()
    for i in range(5):
        a.send(1, [torch.full((4,), float(i))])
    recvs = [b.post_recv(0, [torch.empty(4)]) for _ in range(5)]
    assert [float(r.wait()[0][0]) for r in reversed(recvs)] == [4.0, 3.0, 2.0, 1.0, 0.0]


def test_a_message_larger_than_the_socket_buffer_flows_while_its_sender_does_something_else() -> None:
    a, b = _pair()
    x = torch.arange(6 << 20, dtype=torch.float32)
    a.send(1, [x])  # returns at once; the writer thread sends the rest without `a` being called again
    assert a.backlog
    assert torch.equal(b.post_recv(0, [torch.empty_like(x)]).wait()[0], x)
    a.wait_sends()
    assert not a.backlog


def test_messages_larger_than_the_socket_buffer_cross_both_ways_at_once() -> None:
    """Both ranks send 24 MB to each other before either receives: sends never block and the bytes arrive intact."""
    a, b = _pair()
    n = 6 << 20
    x, y = torch.arange(n, dtype=torch.float32), -torch.arange(n, dtype=torch.float32)
    out: dict[str, torch.Tensor] = {}

    def other() -> None:
        b.send(0, [y])
        out["b"] = b.post_recv(0, [torch.empty(n)]).wait()[0]
        b.wait_sends()

    t = threading.Thread(target=other)
    a.send(1, [x])  # returns at once with most of it queued
    assert a.backlog
    t.start()
    got = a.post_recv(1, [torch.empty(n)]).wait()[0]
    a.wait_sends()
    t.join(30)
    assert torch.equal(got, y) and torch.equal(out["b"], x) and not a.backlog


def test_descriptors_above_1024_wait_and_send_like_any_other() -> None:
    """A long-lived process that built many pipelines has socket descriptors past select()'s limit of 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft <= 2100:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    high = []
    for s, fd in ((a, 2000), (b, 2001)):
        os.dup2(s.fileno(), fd)
        s.close()
        high.append(socket.socket(fileno=fd))
    try:
        for s in high:
            s.setblocking(False)
        ta, tb = SocketTransport({1: high[0]}, 20.0), SocketTransport({0: high[1]}, 20.0, rank=1)
        x = torch.arange(6 << 20, dtype=torch.float32)  # larger than the socket buffer: the writer thread polls too
        recv = tb.post_recv(0, [torch.empty_like(x)])
        ta.send(1, [x])
        assert torch.equal(recv.wait()[0], x)
        ta.wait_sends()
    finally:
        for s in high:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_message_of_the_wrong_size_is_a_named_error() -> None:
    a, b = _pair()
    a.send(1, [torch.zeros(3)])
    with pytest.raises(ConnectionError, match="rank 0 sent a message of 12 bytes where 16 bytes were expected"):
        b.post_recv(0, [torch.empty(4)]).wait()


def test_a_closed_peer_and_a_silent_peer_are_named_errors() -> None:
    a, b = _pair(timeout=0.3)
    with pytest.raises(TimeoutError, match="no message from rank 0 within 0.3 s"):
        b.post_recv(0, [torch.empty(4)]).wait()
    a.close()
    with pytest.raises(ConnectionError, match="connection to rank 0 was closed"):
        b.post_recv(0, [torch.empty(4)]).wait()


def test_a_peer_that_closes_while_a_large_send_is_queued_is_a_named_error() -> None:
    a, b = _pair()
    a.send(1, [torch.zeros(6 << 20)])
    b.close()
    with pytest.raises(ConnectionError, match="connection to rank 1 was closed"):
        a.wait_sends()


def test_a_sum_over_the_loss_ranks_is_taken_in_rank_order_on_every_rank() -> None:
    """Ranks 0, 1 and 3 hold the values; rank 2 is not one of them (what it has is not added).  1e16 + 1
    rounds to 1e16, so rank order, (1e16 + 1) - 1e16, gives 0 where any other order gives 1."""
    P = 4
    socks: dict[int, dict[int, socket.socket]] = {r: {} for r in range(P)}
    for r in range(P):
        for q in range(r + 1, P):
            socks[r][q], socks[q][r] = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for links in socks.values():
        for s in links.values():
            s.setblocking(False)
    transports = [SocketTransport(socks[r], 20.0, rank=r) for r in range(P)]
    values = {0: [1e16, 3.0], 1: [1.0, 0.0], 2: [5.0, 7.0], 3: [-1e16, 1.0]}
    got: dict[int, list] = {}

    def run(r: int, holders: list[int]) -> None:
        channels = SimpleNamespace(transport=transports[r], rank=r)
        out = []
        for _ in range(2):  # a second sum on the same links: the first left nothing behind
            t = torch.tensor(values[r], dtype=torch.float64)
            _SocketSum(channels, t, holders).wait()
            out.append(t)
        got[r] = out

    threads = [threading.Thread(target=run, args=(r, [0, 1, 3])) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(torch.equal(x, torch.tensor([0.0, 4.0], dtype=torch.float64)) for r in range(P) for x in got[r]), got


# ------------------------------------------------------------------ in a pipeline, against torch.distributed


def _train(rank: int, transport: str) -> dict:
    os.environ["PIPEDSL_P2P"] = transport
    torch.manual_seed(0)
    modules = [torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()) for _ in range(4)]
    with pipedsl.Pipeline(modules, "interleaved", microbatches=4, loss_fn=F.mse_loss) as pipe:
        opt = pipe.optimizer(torch.optim.SGD, lr=0.1)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
        losses = []
        for _ in range(3):
            losses.append(float(pipe.step(x, y)))
            opt.step()
            opt.zero_grad()
        return {"kind": pipe.channels.kind, "losses": losses,
                "params": [p.detach().clone() for p in pipe.parameters()]}


def test_a_pipeline_trains_the_same_over_sockets_and_over_gloo() -> None:
    """Interleaved 1F1B over Unix sockets: the losses of 3 SGD steps and every parameter equal the same run over gloo's
    point-to-point path, bit for bit."""
    sock = pipedsl.launch(_train, 2, "auto", threads=1, timeout=120)
    gloo = pipedsl.launch(_train, 2, "dist", threads=1, timeout=120)
    assert [r["kind"] for r in sock] == ["socket"] * 2 and [r["kind"] for r in gloo] == ["dist"] * 2
    for s, g in zip(sock, gloo):
        assert s["losses"] == g["losses"]
        assert all(torch.equal(p, q) for p, q in zip(s["params"], g["params"]))


def test_a_staged_receive_hands_out_device_buffers_and_returns_the_host_ones() -> None:
    """Ranks sharing a GPU over gloo receive into host buffers (`Channels.wire`); waiting copies each into a
    buffer of the device's pool and gives the host buffer back for the next message.  (The device pool is a
    CPU one here: the copy and the two pools' bookkeeping are what is checked; gpu_check.py runs it on a GPU.)"""
    from pipedsl.runtime.p2p import BufferPool, StagedRecv, TensorMeta

    a, b = _pair()
    device_pool, wire_pool = BufferPool(torch.device("cpu")), BufferPool(torch.device("cpu"))
    metas = [TensorMeta((3, 4), torch.float32), TensorMeta((5,), torch.int64)]
    sent = [torch.randn(3, 4), torch.arange(5)]
    for step in range(2):
        host = [wire_pool.take(m) for m in metas]
        recv = StagedRecv(b.post_recv(0, host), device_pool, wire_pool)
        a.send(1, sent)
        a.wait_sends()
        got = recv.wait()
        assert all(torch.equal(x, y) for x, y in zip(got, sent)) and recv.peer == 0
        assert not any(g.data_ptr() == h.data_ptr() for g in got for h in host)  # copies, not the host buffers
        for g in got:
            device_pool.give(g)
        assert wire_pool.allocated == 2 and device_pool.allocated == 2, step  # both pools reuse their buffers
    a.close()
    b.close()
