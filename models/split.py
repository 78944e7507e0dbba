"""Model splitting: cut a model into pipeline stages (one `nn.Module` per global stage).

- `split_sequential(seq, n)`: an `nn.Sequential` into `n` contiguous stages, balanced by
  layer count (`by="count"`), by parameter count (`by="params"`), by the FLOPs a token costs in each
  layer (`by="flops"`: the matmul weights, so a large-vocabulary head weighs what it costs and an
  embedding nothing; `matmul_weights`), or at explicit `points`
  (the indices where stages 1 … n−1 begin).  Each stage is a `SequentialStage`: a layer that
  returns a tuple (`(h, mask)`) feeds the next one its items as positional arguments, so
  several tensors can flow between layers and between stages.
- `split_gpt(embed, blocks, head, n)`: a GPT-style model — an embedding, a list of blocks,
  a head — into `n` stages: the embedding opens stage 0, the head closes the last stage,
  the blocks are spread between them: `by="count"` and `"params"` balance the embedding and
  the head as units like the blocks; `by="blocks"` gives every stage the same number of
  blocks, as Megatron-LM does and as `pipedsl plan` models a layout.  With interleaved
  schedules `n` is the number of chunks (P·V), not ranks.

Stages share the original modules (no copies): build the model the same way on every rank
(same seed), or build only your stages with a `stage -> module` callable.

Every stage these build knows its tensors' names in the whole model (`model_name`): unit i's
"rest" is "i.rest" whichever stage holds it.  Checkpoints record those names, which is what lets
a checkpoint load into another partition (another `by`, `points` or number of stages).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pipedsl.errors import PipeRuntimeError
from pipedsl.plan.partition import balanced_sizes, even_sizes


def split_sequential(seq: nn.Sequential, num_stages: int | None = None, *, by: str = "count",
                     points: Sequence[int] | None = None) -> list[nn.Sequential]:
    """`seq`'s layers as `num_stages` consecutive `SequentialStage`s (see the module docstring)."""
    layers = list(seq)
    bounds = _bounds(layers, num_stages, by, points)
    return [SequentialStage(*layers[a:b], first_unit=a) for a, b in zip(bounds, bounds[1:])]


class SequentialStage(nn.Sequential):
    """A stage of `split_sequential`: an `nn.Sequential` (layers "0", "1", …) whose layers pass tuples on.

    It takes any number of tensors; a layer that returns a tuple feeds the next layer those as positional
    arguments (`layer(*out)`), anything else as one (`layer(out)`).  Returns the last layer's output, with
    any tensor that shares memory with an input cloned (a layer passing a mask on as is).
    `first_unit`: the index of its first layer in the whole list, which names its tensors in the whole model."""

    def __init__(self, *layers: nn.Module, first_unit: int = 0) -> None:
        super().__init__(*layers)
        self.first_unit = first_unit

    def units(self) -> list[tuple[int, nn.Module]]:
        """(index in the whole model's unit list, layer) of each of this stage's layers: what a partition moves."""
        return [(self.first_unit + i, layer) for i, layer in enumerate(self)]

    def model_name(self, local: str) -> str | None:
        """The whole model's name of this stage's tensor `local` ("0.w" of a stage from unit 3: "3.w")."""
        head, _, rest = local.partition(".")
        return f"{int(head) + self.first_unit}.{rest}" if head.isdigit() and rest else None

    def forward(self, *inputs: Any) -> Any:
        out: Any = inputs[0] if len(inputs) == 1 else inputs
        for layer in self:
            out = layer(*out) if isinstance(out, tuple) else layer(out)
        if isinstance(out, tuple):
            return tuple(unshared(t, inputs) for t in out)
        return unshared(out, inputs)


def unshared(t: Any, inputs: Sequence[Any]) -> Any:
    """`t`, cloned if it is a tensor sharing memory with one of `inputs`: the pipeline reuses the buffers a stage
    received once the microbatch's backward is done, maybe before what the stage sent on was sent."""
    if isinstance(t, torch.Tensor) and any(isinstance(x, torch.Tensor) and _same_storage(t, x) for x in inputs):
        return t.clone()
    return t


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def split_gpt(embed: nn.Module, blocks: Sequence[nn.Module], head: nn.Module, num_stages: int, *,
              by: str = "count", points: Sequence[int] | None = None) -> list[nn.Sequential]:
    """A GPT-style model as `num_stages` stages: [embed, blocks…] … [blocks…, head]; `points`: where stages
    1 … n−1 begin among those units (a partition chosen elsewhere: measured costs, the planner)."""
    units = [embed, *blocks, head]
    if points is not None:
        bounds = _bounds(units, num_stages, by, points)
    elif by == "blocks":  # blocks evenly, the embedding before the first and the head after the last
        if not 1 <= num_stages <= len(blocks):
            raise PipeRuntimeError(f"by='blocks': cannot split {len(blocks)} blocks into {num_stages} non-empty stages")
        bounds = [0, *(b + 1 for b in _bounds(list(blocks), num_stages, "count", None)[1:-1]), len(units)]
    elif num_stages > len(units):
        raise PipeRuntimeError(f"cannot split an embedding, {len(blocks)} blocks and a head into {num_stages} "
                               f"stages (at most {len(units)})")
    else:
        bounds = _bounds(units, num_stages, by, None)
    return [SequentialStage(*units[a:b], first_unit=a)  # an MoE GPT's blocks pass tuples
            for a, b in zip(bounds, bounds[1:])]


class ModelNamed:
    """A stage module that knows its tensors' names in the whole model it was cut from (a mixin): found by
    identity when the stage is built, before anything (ZeRO, expert parallelism) repacks its tensors."""

    _model_names: dict[str, str]

    def name_after(self, model: nn.Module) -> None:
        """Record each of this stage's state-dict names as `model`'s name of the same tensor (its first one)."""
        whole: dict[int, str] = {}
        for name, t in model.state_dict(keep_vars=True).items():
            whole.setdefault(id(t), name)
        own = self.state_dict(keep_vars=True)  # type: ignore[attr-defined]
        self._model_names = {k: whole[id(t)] for k, t in own.items() if id(t) in whole}

    def model_name(self, local: str) -> str | None:
        """The whole model's name of this stage's tensor `local`, None for one the model does not hold."""
        return self._model_names.get(local)


def matmul_weights(unit: nn.Module) -> float:
    """The weights a token is multiplied by in `unit` — its FLOPs per token, over 2 — what `by="flops"` balances.

    Every weight of two or more dimensions counts (linear layers, GPT-2's Conv1D, a head however it is tied),
    an embedding's none (a lookup), vectors none (norms, biases: no matmul); the experts of an MoE layer count
    top_k / E of theirs (the ones a token reaches; top_k from the block or its router).  Attention's
    sequence-length term is left out: at the lengths pipelines train it is a small share of a layer."""
    from pipedsl.parallel.expert import token_shares

    active = token_shares(unit)  # experts module -> the share of it a token uses
    total = 0.0
    for m in unit.modules():
        if isinstance(m, nn.Embedding):
            continue
        share = active.get(id(m), 1.0)
        total += sum(p.numel() for p in m.parameters(recurse=False) if p.dim() >= 2) * share
    return total


def _bounds(layers: list[nn.Module], n: int | None, by: str, points: Sequence[int] | None) -> list[int]:
    L = len(layers)
    if points is not None:
        pts = [0, *points, L]
        if n is not None and len(pts) - 1 != n:
            raise PipeRuntimeError(f"{len(points)} split points make {len(pts) - 1} stages, not {n}")
        if any(a >= b for a, b in zip(pts, pts[1:])):
            raise PipeRuntimeError(f"split points {list(points)} must be increasing and inside 1..{L - 1}")
        return pts
    if n is None or not 1 <= n <= L:
        raise PipeRuntimeError(f"cannot split {L} layers into {n} non-empty stages")
    if by == "count":
        sizes = [L // n + (1 if i < L % n else 0) for i in range(n)]
    elif by == "params":
        sizes = balanced_sizes([sum(p.numel() for p in m.parameters()) for m in layers], n)
    elif by == "flops":
        sizes = even_sizes([matmul_weights(m) for m in layers], n)
    else:
        raise PipeRuntimeError(f"by={by!r}: expected 'count', 'params' or 'flops' ('blocks' too for split_gpt)")
    out = [0]
    for size in sizes:
        out.append(out[-1] + size)
    return out
