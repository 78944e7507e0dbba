"""`PipelineOptimizer`: the optimizer of one rank's pipeline stages, with or without ZeRO.

Made by `Pipeline.optimizer(torch.optim.Adam, lr=…)`, it follows the pipeline's
`ParallelConfig.zero`:

    zero 0   one `optimizer_class` over the local stages' parameters; the pipeline itself
             averages gradients over the dp group at each stage's REDUCE_GRAD
    zero ≥ 1 one `ZeroOptimizer` per local stage over the dp group (`zero_reduce` "step" or
             "microbatch"); its `reduce_gradients(async_op=True)` is the stage's REDUCE_GRAD
             hook and is waited at the step end

`step()` then `zero_grad()` after every `pipe.step`.  `stage_parameters()` gives each local
stage's parameters by their original names (ZeRO's flat buffers unpacked; collective for
ZeRO-3), e.g. for a checkpoint or to compare with a reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .zero import MemoryReport, ZeroOptimizer

if TYPE_CHECKING:  # pragma: no cover
    from pipedsl.runtime.pipeline import Pipeline


class PipelineOptimizer:
    """step() / zero_grad() for every stage this rank holds (see the module docstring)."""

    def __init__(self, pipe: Pipeline, optimizer_class: Callable[..., torch.optim.Optimizer], **kwargs: Any) -> None:
        cfg = pipe.parallel
        self.zero_stage = cfg.zero if cfg is not None else 0
        self.zero: dict[int, ZeroOptimizer] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self._modules = pipe.local_stages()
        if self.zero_stage == 0:
            self.optimizer = optimizer_class(list(pipe.parameters()), **kwargs)
            return
        assert pipe.mesh is not None and cfg is not None
        for s, module in sorted(self._modules.items()):  # the same order on every dp peer
            self.zero[s] = ZeroOptimizer(module, optimizer_class, group=pipe.mesh.dp_group, stage=cfg.zero,
                                         reduce=cfg.zero_reduce, **kwargs)
        pipe.register_reduce_grad_hook(self._reduce)
        if cfg.zero == 3:  # split backward: W reads saved views of parameters ZeRO-3 frees after forwards
            for s, zero in sorted(self.zero.items()):
                pipe.register_weight_pass_hook(s, zero.before_weight_pass, zero.after_weight_pass)

    def _reduce(self, stage: int, module: torch.nn.Module) -> ZeroOptimizer:
        zero = self.zero[stage]
        zero.reduce_gradients(async_op=True)
        return zero  # its wait() completes the reduction at the step end

    def step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
        for _, zero in sorted(self.zero.items()):
            zero.step()

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        for zero in self.zero.values():
            zero.zero_grad()

    def stage_parameters(self) -> dict[int, dict[str, torch.Tensor]]:
        """{stage: {parameter name: a copy of its values on this rank}} (collective over dp for ZeRO-3)."""
        out = {}
        for s, module in sorted(self._modules.items()):
            if s in self.zero:
                out[s] = self.zero[s].state_dict_full()
            else:
                out[s] = {k: v.detach().clone() for k, v in module.named_parameters()}
        return out

    def memory(self) -> dict[int, MemoryReport]:
        """ZeRO's per-stage memory report (empty without ZeRO)."""
        return {s: z.memory() for s, z in sorted(self.zero.items())}
