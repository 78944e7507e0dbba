"""Compute ops timed on the GPU: CUDA events, read after the step and put on the host's clock.

On a GPU the host returns from a compute op as soon as its kernels are queued, so the executor's host stamps
(`time.perf_counter()` around each instruction) time the queueing, not the work: a measured timeline drawn from
them shows the host running ahead and every bubble in the wrong place.  Here each compute op also records an
event on the current stream where its host start and end are stamped (the start again after the op's inputs
are waited for: under NCCL that wait only orders the stream, so the event marks when the stream reached the op).
After the step, `times` reads them without a device-wide wait: an anchor event recorded then and waited for
completes when the stream has run everything before it, so its device time is the host time the wait returns,
and every event's host time is the anchor's less the device time between them (`Event.elapsed_time`).  Events
are made once per instruction, for this step and the one before, and reused.

The other instructions (messages, gradient reductions, the step's end) keep their host stamps, moved no earlier
than the end of the compute op before them: the host reaches a send while the op that made its payload may still
run, but the bytes leave only after it (a staging copy, or NCCL's wait on the compute stream, is ordered behind
it on the stream); a reduction likewise waits for the gradients, and a receive or the step's end leaves the
device idle only once that op is done.  Drawn from the host stamp alone, a send overlapped its own producer on
the H200 (every built-in's timeline, 2026-11-28).  So the costs `Cost.fit` reads off a GPU's timeline count a
send or a reduction from when its input existed, not the host's wait for the compute before it.

On the CPU with one intra-op thread (`launch(threads=1)`, every rank's default) the host's clock times the work,
but also the time other processes held the core: on a loaded machine a 0.1 ms embedding forward preempted once
reads as a scheduler slice, and the costs `pipedsl train --schedule auto` re-cuts from called a lopsided cut
balanced (tests/trainer/test_train_hf.py's re-cut test, once a suite run).  There `ThreadStamps` times each
compute op by the thread's CPU time too (the op runs on this thread: torch's CPU autograd runs a backward on the
thread that calls it); `Pipeline.timeline(cpu_work=True)` ends each op its CPU seconds after its start, no later
than the host's end (the rest of its wall time the rank waited for a core: idle in that timeline).  Not by
default: a stage that sleeps in place of work (the benchmarks' stand-in for a device) takes no CPU time.  An
overlapped pair's halves run on two threads: it keeps its host stamps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pipedsl.ir import Op


class _Bank:
    """One step's events: a start and an end per instruction, and which were recorded."""

    def __init__(self, n: int, make: Callable[[], Any]) -> None:
        self.starts = [make() for _ in range(n)]
        self.ends = [make() for _ in range(n)]
        self.recorded = [False] * n


class DeviceStamps:
    """A start and an end event per instruction of one rank's stream (`events` makes them: CUDA's by default), in
    two banks: this step's and the previous one's (`Pipeline.timeline(steps=2)` draws both)."""

    clock = "device events"

    def __init__(self, n: int, device: torch.device, events: Callable[[], Any] | None = None) -> None:
        make = events or (lambda: torch.cuda.Event(enable_timing=True))
        self.device = device
        self._make = make
        self._banks = [_Bank(n, make), _Bank(n, make)]
        self._current = 0

    @property
    def starts(self) -> list[Any]:
        return self._banks[self._current].starts

    @property
    def ends(self) -> list[Any]:
        return self._banks[self._current].ends

    def begin(self) -> None:
        """A step begins: the other bank records it, this one keeps the step before."""
        self._current ^= 1
        bank = self._banks[self._current]
        bank.recorded = [False] * len(bank.recorded)

    def cancel(self) -> None:
        """The step begun is undone (a post-validated rerun): the bank of the step before is current again."""
        self._current ^= 1

    def start(self, i: int) -> None:
        bank = self._banks[self._current]
        bank.starts[i].record()
        bank.recorded[i] = True

    def end(self, i: int) -> None:
        self._banks[self._current].ends[i].record()

    def times(self, host_starts: Sequence[float], host_ends: Sequence[float],
              now: Callable[[], float] = time.perf_counter, previous: bool = False) -> tuple[list[float], list[float]]:
        """The step's (`previous`: the step before's) start and end of every instruction on the host's clock: the
        recorded ones from their events (anchored as the module docstring says), the others as stamped, none before
        the end of the recorded one before it."""
        bank = self._banks[self._current ^ previous]
        starts, ends = list(host_starts), list(host_ends)
        picked = [i for i, r in enumerate(bank.recorded) if r]
        if not picked:
            return starts, ends
        for i in picked:  # events on other streams (an overlapped pair's threads) are not behind the anchor
            bank.starts[i].synchronize()
            bank.ends[i].synchronize()
        anchor = self._make()
        anchor.record()
        anchor.synchronize()
        at = now()
        for i in picked:
            starts[i] = at - bank.starts[i].elapsed_time(anchor) / 1e3
            ends[i] = at - bank.ends[i].elapsed_time(anchor) / 1e3
        ready = -float("inf")  # the device end of the last compute op so far, in program order
        for i, recorded in enumerate(bank.recorded):
            if recorded:
                ready = max(ready, ends[i])
            else:  # a message, reduction or step end: not before the compute op before it (the module docstring)
                starts[i] = max(starts[i], ready)
                ends[i] = max(ends[i], starts[i])
        return starts, ends


class ThreadStamps:
    """Each compute op's CPU seconds on this thread, for this step and the one before (the module docstring);
    the interface of `DeviceStamps`.  `ops`: the rank's stream's ops, which say what is timed."""

    clock = "thread CPU time"

    def __init__(self, ops: Sequence[Op]) -> None:
        self._timed = [op in (Op.F, Op.B, Op.I, Op.W) for op in ops]  # not OVERLAP: its halves run on two threads
        self._banks = [[-1.0] * len(ops), [-1.0] * len(ops)]  # seconds an op (-1: not timed this step)
        self._started = [0.0] * len(ops)
        self._current = 0

    def begin(self) -> None:
        self._current ^= 1
        self._banks[self._current] = [-1.0] * len(self._timed)

    def cancel(self) -> None:
        self._current ^= 1

    def start(self, i: int) -> None:
        """(Again when the op's inputs have arrived: waiting takes no CPU time, so either start counts the same.)"""
        if self._timed[i]:
            self._started[i] = time.thread_time()

    def end(self, i: int) -> None:
        if self._timed[i]:
            self._banks[self._current][i] = time.thread_time() - self._started[i]

    def times(self, host_starts: Sequence[float], host_ends: Sequence[float],
              previous: bool = False) -> tuple[list[float], list[float]]:
        """The step's (`previous`: the step before's) instructions: a timed op ends its CPU seconds after its start,
        no later than the host's end; the others as stamped."""
        seconds = self._banks[self._current ^ previous]
        ends = [min(end, start + cpu) if cpu >= 0 else end for start, end, cpu in zip(host_starts, host_ends, seconds)]
        return list(host_starts), ends


def compute_stamps(ops: Sequence[Op], device: torch.device) -> DeviceStamps | ThreadStamps | None:
    """How a rank's compute ops are timed besides the host's clock: by CUDA events on a GPU, by the thread's CPU
    time on the CPU with one intra-op thread, else (several threads share an op) not."""
    if device.type == "cuda":
        return DeviceStamps(len(ops), device)
    return ThreadStamps(ops) if device.type == "cpu" and torch.get_num_threads() == 1 else None
