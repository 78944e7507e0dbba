"""How long each unit of a model (the embedding, a block, the head) takes to run forward, on this rank's stages,
and what it leaves saved for its backward: what `pipedsl train --schedule auto` re-partitions from (plan/partition.py's
`unit_costs`, plan/recut.py's memory caps).

A unit's saved bytes are what the rank's `ActivationCounter` counted while its forward ran.  A stage's first unit
finds its input counted already (the stage keeps it for the backward), so those bytes are added: each unit's
figure then includes its input, as a block's does in the middle of a stage (its first norm saves it), and a stage
of any cut keeps the sum of its units' figures.  Under recomputation the units keep next to nothing of what their
backward needs again, so no bytes are reported then.

A stage offers its units with `units()` — (index in the whole model's unit list, module): models/split.py's
`SequentialStage`, the HF causal stages.  Forward pre- and post-hooks time each unit's training forwards (not a
recomputed one, not evaluation): on the CPU by the clock (with one intra-op thread by the thread's CPU time, which
other processes' load does not stretch), on a GPU by a pair of CUDA events on the current stream, read when the
times are asked for (after the profile steps).  Never a device-wide wait inside a step: under NCCL a
synchronize waits for every stream, a point-to-point send whose receive the peer has not reached included, and
the pipeline would hang.  `close()` removes the hooks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from pipedsl.runtime.recompute import is_recomputing
from pipedsl.runtime.split_backward import storage_key
from pipedsl.runtime.stage import ActivationCounter


class UnitClock:
    """Forward seconds of every unit of `stages` ({stage: module with `units()`}), per call, until `close()`."""

    def __init__(self, stages: Mapping[int, nn.Module], counter: ActivationCounter | None = None) -> None:
        self.seconds: dict[int, list[float]] = {}  # unit -> seconds a call, as read (`_read`)
        self._pending: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []  # GPU calls: (unit, start, end)
        self.saved: dict[int, list[int]] = {}  # unit -> bytes its forward left saved, a call (with `counter`)
        self.held = {s: [u for u, _ in m.units()] for s, m in sorted(stages.items())}  # type: ignore[operator]
        # unit -> its parameters (their states move with it when a cut moves it)
        self.params = {u: sum(p.numel() for p in module.parameters())
                       for stage in stages.values() for u, module in stage.units()}  # type: ignore[operator]
        self._counter = counter if counter is not None and counter.count_bytes else None
        self._firsts = {units[0] for s, units in self.held.items() if units}
        self._started: dict[int, tuple[Any, int]] = {}  # unit -> (start: time or CUDA event, counted bytes then)
        self._hooks: list[Any] = []
        for stage in stages.values():
            for index, module in stage.units():  # type: ignore[operator]
                self._hooks.append(module.register_forward_pre_hook(self._pre(index)))
                self._hooks.append(module.register_forward_hook(self._post(index)))

    @staticmethod
    def supports(stages: Iterable[nn.Module]) -> bool:
        """Whether every stage offers its units."""
        return all(callable(getattr(s, "units", None)) for s in stages)

    def _pre(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if torch.is_grad_enabled() and not is_recomputing():
                counted = 0
                if self._counter is not None:
                    counted = self._counter.live_bytes
                    if index in self._firsts:  # the stage counted its input before this unit ran
                        counted -= _bytes(args, self._counter.counted)
                self._started[index] = (_mark(module), counted)
        return hook

    def _post(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            start = self._started.pop(index, None)
            if start is not None:
                end = _mark(module)
                if isinstance(end, float):
                    self.seconds.setdefault(index, []).append(end - start[0])
                else:  # read after the steps, not now
                    self._pending.append((index, start[0], end))
                if self._counter is not None:
                    self.saved.setdefault(index, []).append(max(self._counter.live_bytes - start[1], 0))
        return hook

    def medians(self) -> dict[int, float]:
        """{unit: its median forward seconds a call} over what was timed."""
        self._read()
        return {u: statistics.median(v) for u, v in sorted(self.seconds.items())}

    def _read(self) -> None:
        """The GPU calls' seconds from their events: each end event waited for alone (not the device), after the
        profile steps."""
        pending, self._pending = self._pending, []
        for index, start, end in pending:
            end.synchronize()
            self.seconds.setdefault(index, []).append(start.elapsed_time(end) / 1000.0)

    def saved_bytes(self) -> dict[int, float]:
        """{unit: the median bytes its forward left saved, input included} (none without a byte-counting counter)."""
        return {u: float(statistics.median(v)) for u, v in sorted(self.saved.items())}

    def report(self) -> tuple[dict[int, float], dict[int, list[int]], dict[int, float], dict[int, int]]:
        """(`medians()`, {stage: its units}, `saved_bytes()`, {unit: its parameters}): this rank's part of what
        plan/recut.py's `choose_cut` takes."""
        return self.medians(), self.held, self.saved_bytes(), dict(self.params)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _bytes(args: Any, counted: set[int]) -> int:
    """The bytes of the distinct storages among the tensors of `args` that the activation has `counted` already (the
    stage's inputs; not what the stage computed before its first unit, such as rotary tables)."""
    seen: dict[int, int] = {}
    for t in args if isinstance(args, (tuple, list)) else (args,):
        if isinstance(t, torch.Tensor):
            key_n = storage_key(t)
            if key_n is not None and key_n[0] in counted:
                seen[key_n[0]] = key_n[1]
    return sum(seen.values())


def _mark(module: nn.Module) -> float | torch.cuda.Event:
    """Now: for a module on the CPU, this thread's CPU time when it is torch's only intra-op thread (a unit preempted
    by another process on a busy machine is not a costly unit; with more threads their work is not this thread's, so
    the clock); for one on a GPU, a timing event recorded on the current stream."""
    if not _on_gpu(module):
        return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _on_gpu(module: nn.Module) -> bool:
    t = next(module.parameters(), None)
    return t is not None and t.is_cuda
