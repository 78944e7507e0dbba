"""Mechanisms for pipeline stages made tensor-parallel with torch's DTensor API (`parallelize_module`).

A model's plan — which module is split how — is the model's own (models/hf/parallelize.py for Hugging Face
decoders); what any such stage needs besides its plan is here, naming no model's modules:

- `hook_grads`, a stage pre-hook: each DTensor weight's gradient gets the weight's own placements as soon as
  it is computed.  DTensor does not give them: a replicated weight used on sharded activations (sequence-parallel
  norms, per-head q/k norms) receives a `Partial` gradient, which would all-reduce it in every backward; such a
  weight is marked `sum_grads_later` instead (parallel/replicated.py), keeps each rank's partial sum through the
  step's microbatches, and the pipeline sums it over tp once per step (`SequenceParallelGradSum`, one all-reduce
  per stage), as Megatron's SP all-reduces the LayerNorm gradients once.  A vocabulary-split embedding receives
  a `Replicate` [V, C] gradient (DTensor's embedding backward), sliced to the rank's rows.  Global norms count a
  replicated weight once over the tp group (runtime/clip.py).
- Stage boundaries carry plain tensors (the runtime sends no DTensors): with sequence parallelism a stage takes
  and gives the local sequence shard [mb, T/t, C]; `shard_input` wraps the received shard with
  `DTensor.from_local`, `local_output` returns `to_local()`, and `sequence_divides` refuses, on the stage that
  takes the tokens, a sequence that tp does not divide.

ZeRO (1–3, and 0 with bf16 parameters over fp32 main parameters) takes the DTensor parameters as their local
shards, the way FSDP2's `fully_shard` composes with torch's TP: every dp replica at one tp coordinate has the
same shard shapes, so its flat buffers line up over dp; the views it installs before each forward are wrapped
back into DTensors with `DTensor.from_local`, whose backward gives the gradient the weight's placements exactly
as `hook_grads`' hooks do (parallel/zero.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from pipedsl.parallel.config import ParallelConfigError
from pipedsl.parallel.replicated import partial_local, sums_grads_later

_HOOKED = "_pipedsl_grad_like_param"  # on the parameter object; moves away with its old payload under swap_tensors


def _grad_like_param(p: nn.Parameter, later: bool) -> None:
    """Give a DTensor weight's gradient the weight's own placements, as soon as it is computed.

    `later` (weights marked `sum_grads_later`): the partial gradient is kept as this rank's local part, labelled
    with the weight's placements without communication, and the pipeline sums it over tp once per step; otherwise
    it is redistributed at once.  Optimizers, clipping and the dp reduction then see each rank's shard, or the
    whole gradient of a copy.
    """
    placements = tuple(p.placements)

    def hook(g: torch.Tensor) -> torch.Tensor:
        if not isinstance(g, DTensor) or tuple(g.placements) == placements:
            return g
        if later:
            return DTensor.from_local(partial_local(g), g.device_mesh, placements, run_check=False,
                                      shape=g.shape, stride=g.stride())
        return g.redistribute(placements=placements)
    p.register_hook(hook)
    setattr(p, _HOOKED, True)


def hook_grads(stage: nn.Module, args: tuple) -> None:
    """Pre-hook: (re)install the gradient hooks of the stage's DTensor weights before each forward.

    `module.to(device)` — which `Pipeline` calls — swaps a DTensor parameter's payload
    (`torch.utils.swap_tensors`) and with it the gradient accumulator its hooks hang on, so hooks
    installed once at parallelisation would be lost; a marker attribute travels with the payload.
    """
    for m in stage.modules():
        for p in m.parameters(recurse=False):
            if isinstance(p, DTensor) and not getattr(p, _HOOKED, False):
                _grad_like_param(p, sums_grads_later(m))


def sequence_divides(t: int) -> Callable:
    """Pre-hook for the stage that takes the tokens [mb, T]: sequence parallelism needs T % t == 0."""
    def hook(stage: nn.Module, args: tuple) -> None:
        ids = args[0]
        if ids.shape[1] % t:
            raise ParallelConfigError(f"sequence parallelism needs the sequence length ({ids.shape[1]}) "
                                      f"divisible by tp={t}")
    return hook


def shard_input(tp_mesh: DeviceMesh) -> Callable:
    """Pre-hook: a received hidden-state shard [mb, T/t, C] becomes a DTensor sharded on the sequence."""
    def hook(stage: nn.Module, args: tuple) -> tuple | None:
        h = args[0]
        if isinstance(h, DTensor):
            return None
        return (DTensor.from_local(h, tp_mesh, [Shard(1)], run_check=False), *args[1:])
    return hook


def local_output(stage: nn.Module, args: tuple, out: Any) -> Any:
    """Post-hook: what leaves a stage is a plain tensor (the runtime sends no DTensors)."""
    if isinstance(out, tuple):
        return tuple(o.to_local() if isinstance(o, DTensor) else o for o in out)
    return out.to_local() if isinstance(out, DTensor) else out
