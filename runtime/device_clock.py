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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


class _Bank:
    """One step's events: a start and an end per instruction, and which were recorded."""

    def __init__(self, n: int, make: Callable[[], Any]) -> None:
        self.starts = [make() for _ in range(n)]
        self.ends = [make() for _ in range(n)]
        self.recorded = [False] * n


class DeviceStamps:
    """A start and an end event per instruction of one rank's stream (`events` makes them: CUDA's by default), in
    two banks: this step's and the previous one's (`Pipeline.timeline(steps=2)` draws both)."""

    def __init__(self, n: int, device: torch.device, events: Callable[[], Any] | None = None) -> None:
        make = events or (lambda: torch.cuda.Event(enable_timing=True))
        self.device = device
        self._make = make
        self._banks = [_Bank(n, make), _Bank(n, make)]
        self._current = 0

    @classmethod
    def for_device(cls, n: int, device: torch.device) -> DeviceStamps | None:
        """Stamps for a CUDA device; None elsewhere (the host's clock is the device's)."""
        return cls(n, device) if device.type == "cuda" else None

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
