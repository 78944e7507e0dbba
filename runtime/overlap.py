"""Overlap of an F&B pair's expert all-to-alls with the other half's compute (DualPipe's point).

An overlapped pair `F(m, s) & B(m', s')` runs the forward of one microbatch and the backward of
another.  With expert parallelism each MoE layer exchanges tokens (parallel/expert.py): the
forward dispatches and combines, the backward sends the gradients back the same two ways.  Run
one after the other, every exchange is time the rank waits.  Here the two halves run as two
coroutines, each on a thread of its own (the same two for every pair: `_Carrier`), *exactly one
running at any time*: where a half waits for an exchange (`parallel.comm`'s exchange waiter), it
hands over to the other, whose compute fills the wait; when it gets the turn back, its exchange
has arrived or is waited for.  Either half ending hands over for good.

Why coroutines and not pieces: an MoE layer's backward runs inside autograd's engine, which
cannot be stopped between nodes, and an exchange is in the middle of every layer, forward and
backward.  A thread per half keeps both call stacks, and the strict hand-over keeps one compute
thread, so no op ever runs concurrently with another (torchtitan's threaded DualPipeV let them
race and did not compose with activation checkpointing).

What keeps the result bit-identical to running F then B:
- each half computes exactly the ops it would alone, in the same order, on one thread at a time;
- the random-number state is per half: swapped out and in at every hand-over, so a recomputed
  region's restored dropout masks, and the forward's own draws, are those of the sequential run;
  after the pair the generator is where the forward left it, as after F then B;
- grad mode, autocast and saved-tensor hooks are thread-local in torch and entered by each half
  itself; a recomputation is noticed per thread (runtime/recompute.py).

Every rank of an ep group hands over at the same exchanges in the same order (their programs are
the same), so their collectives are issued in the same order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from pipedsl.parallel import comm
from pipedsl.runtime.recompute import RngState, rng_state, set_rng_state


class _Carrier:
    """A thread that lives across pairs and runs one half at a time.  Not a thread per half: torch keeps DTensor's
    sharding-propagation cache per thread (`LocalLRUCache`), so a fresh thread propagated every op of a
    tensor-parallel half anew, each step (~40 % of such a rank's CPU time)."""

    def __init__(self, name: str) -> None:
        self._job: Callable[[], None] | None = None
        self._given = threading.Semaphore(0)
        self.idle = threading.Event()  # set between jobs: the last one has returned, the thread touches nothing
        self.idle.set()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def start(self, job: Callable[[], None]) -> None:
        self.idle.clear()
        self._job = job
        self._given.release()

    def _loop(self) -> None:
        while True:
            self._given.acquire()
            job, self._job = self._job, None
            try:
                job()  # a half's `_main`, which keeps its own error
            finally:
                self.idle.set()


_callers = threading.local()  # each calling thread's two carriers (a forked child's are gone: made again)


def _carriers() -> tuple[_Carrier, _Carrier]:
    """The calling thread's forward and backward carriers, made on its first pair."""
    pair = getattr(_callers, "carriers", None)
    if pair is None or not all(c.thread.is_alive() for c in pair):
        pair = _callers.carriers = (_Carrier("pipedsl-pair-forward"), _Carrier("pipedsl-pair-backward"))
    return pair


class _Half:
    """One coroutine: its carrier thread, its turn (a semaphore), its random-number state, its outcome."""

    def __init__(self, name: str, fn: Callable[[], Any], pair: PairOverlap, carrier: _Carrier) -> None:
        self.name, self.fn, self.pair, self.carrier = name, fn, pair, carrier
        self.turn = threading.Semaphore(0)
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.rng: RngState | None = None

    def _main(self) -> None:
        if self.pair.device is not None:  # a thread starts on GPU 0: its kernels and RNG are the caller's GPU's
            torch.cuda.set_device(self.pair.device)
        self.turn.acquire()
        self.pair.enter(self)
        try:
            self.result = self.fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            self.error = err
        finally:
            self.done = True
            self.pair.leave(self)


class PairOverlap:
    """Runs `forward()` and `backward()` as two coroutines handing over at exchanges; `run` returns both results."""

    handovers = 0  # in this process, every pair's: what tests and benchmarks check overlap by

    def __init__(self) -> None:
        self.halves: list[_Half] = []
        self.current: _Half | None = None
        self.finished = threading.Event()
        self.device: int | None = None  # the caller's CUDA device, which both halves' threads take

    def run(self, forward: Callable[[], Any], backward: Callable[[], Any],
            first: str = "forward") -> tuple[Any, Any]:
        """Both halves' results; `first` ("forward" or "backward") starts.  Which is better depends on where the
        exchanges sit: a forward with a counts exchange before its dispatch (dropless) waits less starting first;
        with fixed-size exchanges the backward, whose first exchange comes at once, starts (`fixed_size`)."""
        self.device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else None
        forward_carrier, backward_carrier = _carriers()
        f, b = _Half("forward", forward, self, forward_carrier), _Half("backward", backward, self, backward_carrier)
        self.halves = [f, b]
        f.rng = b.rng = rng_state()  # both start from here (the backward draws nothing but recomputation's own)
        for half in self.halves:
            half.carrier.start(half._main)
        with comm.exchange_waiter(self.wait):
            (f if first == "forward" else b).turn.release()
            self.finished.wait()
        for half in self.halves:
            half.carrier.idle.wait()
        set_rng_state(f.rng)  # as after F then B: the forward's draws taken
        for half in self.halves:
            if half.error is not None:
                raise half.error
        return f.result, b.result

    # ------------------------------------------------------------ hand-over

    def enter(self, half: _Half) -> None:
        self.current = half
        set_rng_state(half.rng)

    def leave(self, half: _Half) -> None:
        """`half` stops running (ended, or waits): the other takes the turn, or, both ended, the caller wakes."""
        half.rng = rng_state()
        other = self._other(half)
        if not other.done:
            other.turn.release()
        elif half.done:
            self.finished.set()

    def _other(self, half: _Half) -> _Half:
        return self.halves[1] if half is self.halves[0] else self.halves[0]

    def wait(self, work: Any, ready_at: float) -> None:
        """An exchange issued by the running half: hand over while it travels, then complete it."""
        half = self.current
        here = threading.current_thread()
        # autograd runs a GPU tensor's backward on its device thread while the backward half waits in backward():
        # that thread stands for the backward half (it used to wait here without handing over, and the overlap
        # shrank to the forward's first exchange)
        if half is None or (here is not half.carrier.thread
                            and (half.name != "backward" or here is self.halves[0].carrier.thread)):
            comm.default_exchange_wait(work, ready_at)
            return
        if not self._other(half).done:
            PairOverlap.handovers += 1
            self.leave(half)
            half.turn.acquire()
            self.enter(half)
        comm.default_exchange_wait(work, ready_at)

