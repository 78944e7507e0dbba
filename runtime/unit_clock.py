"""How long each unit of a model (the embedding, a block, the head) takes to run forward, on this rank's stages:
what `pipedsl train --schedule auto` re-partitions from (plan/partition.py's `unit_costs`).

A stage offers its units with `units()` — (index in the whole model's unit list, module): models/split.py's
`SequentialStage`, the HF causal stages.  Forward pre- and post-hooks time each unit's training forwards (not a
recomputed one, not evaluation); on a GPU the device is synchronised around each unit, so timing belongs to
profiling steps, not to training: `close()` removes the hooks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from pipedsl.runtime.recompute import is_recomputing


class UnitClock:
    """Forward seconds of every unit of `stages` ({stage: module with `units()`}), per call, until `close()`."""

    def __init__(self, stages: Mapping[int, nn.Module]) -> None:
        self.seconds: dict[int, list[float]] = {}
        self.held = {s: [u for u, _ in m.units()] for s, m in sorted(stages.items())}  # type: ignore[operator]
        self._started: dict[int, float] = {}
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
                _sync(module)
                self._started[index] = time.perf_counter()
        return hook

    def _post(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            start = self._started.pop(index, None)
            if start is not None:
                _sync(module)
                self.seconds.setdefault(index, []).append(time.perf_counter() - start)
        return hook

    def medians(self) -> dict[int, float]:
        """{unit: its median forward seconds a call} over what was timed."""
        return {u: statistics.median(v) for u, v in sorted(self.seconds.items())}

    def report(self) -> tuple[dict[int, float], dict[int, list[int]]]:
        """(`medians()`, {stage: its units}): this rank's part of what plan/recut.py's `choose_cut` takes."""
        return self.medians(), self.held

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _sync(module: nn.Module) -> None:
    t = next(module.parameters(), None)
    if t is not None and t.is_cuda:
        torch.cuda.synchronize(t.device)
