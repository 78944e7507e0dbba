"""How many tokens each expert of an MoE model received, and how many routings were dropped: the router
statistics a training run logs (load imbalance shows before the loss does).

They are counted where every MoE model in transformers' layout hands its routing over — the experts
module's `top_k_index` (parallel/expert.py's interface; an index ≥ E is a slot dropped for capacity)
— with forward pre-hooks, so any such model counts alike: the built-in GPT's, Mixtral's, Qwen3-MoE's,
sharded over ep or not (an `ExpertParallel` counts its own ranks' routings, before dispatch).  Only
training forwards count: not evaluation (no grad), not a recomputed forward (counted once already),
not shape inference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipedsl.parallel.expert import ExpertParallel, is_experts, routings
from pipedsl.runtime.recompute import is_recomputing


class ExpertLoad:
    """Routings per expert (summed over every MoE layer of `modules`) and dropped slots since the last `read`."""

    def __init__(self, modules: Iterable[nn.Module], num_experts: int, device: torch.device | str = "cpu") -> None:
        self.num_experts, self.device = num_experts, torch.device(device)
        self.layers = [m for root in modules for m in root.modules() if isinstance(m, ExpertParallel) or is_experts(m)]
        self._counts: torch.Tensor | None = None  # [E + 1]: the last entry counts dropped slots
        self._hooks = [m.register_forward_pre_hook(self._count, with_kwargs=True) for m in self.layers]

    def _count(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled() or is_recomputing():
            return
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        if getattr(index, "fake_mode", None) is not None:  # shape inference
            return
        E = self.num_experts
        counts = routings(index.detach(), E + 1)  # [E + 1]: the last entry the dropped slots
        self._counts = counts if self._counts is None else self._counts + counts

    def mark(self) -> Callable[[], None]:
        """What undoes the counting from now on (a post-validated step's undone forwards: runtime/post_validate.py)."""
        kept = None if self._counts is None else self._counts.clone()

        def restore() -> None:
            self._counts = kept
        return restore

    def read(self, reduce: bool = True, group: dist.ProcessGroup | None = None,
             async_op: bool = False) -> dict[str, Any] | Callable[[], dict[str, Any]]:
        """{"tokens_per_expert": [E], "dropped": slots, "imbalance": max / mean load}, summed over `group` (default
        the world) with `reduce` under torch.distributed — a collective: every rank of it calls, MoE layers or
        not — and reset.  `async_op`: the sum issued, and a function that waits for it and returns the dict."""
        counts = self._counts if self._counts is not None else torch.zeros(self.num_experts + 1, dtype=torch.int64,
                                                                            device=self.device)
        self._counts = None
        work = dist.all_reduce(counts, group=group, async_op=True) if reduce and dist.is_initialized() else None

        def result() -> dict[str, Any]:
            if work is not None:
                work.wait()
            return self._summary(counts)
        return result if async_op else result()

    @staticmethod
    def _summary(counts: torch.Tensor) -> dict[str, Any]:
        load = counts[:-1].tolist()
        mean = sum(load) / len(load) if load else 0.0
        return {"tokens_per_expert": load, "dropped": int(counts[-1]),
                "imbalance": max(load) / mean if mean else 0.0}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
