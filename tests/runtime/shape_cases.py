"""Worker-side checks of the step that learns a new input shape (runtime/discovery.py), module-level so they pickle."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from llm_cases import _step_like_one_process, padded_batch, tiny_lm, token_mean, token_sum
from torch import nn

import pipedsl


def discovery_check(rank: int, program_json: str, shapes: list[tuple[int, int]], options: dict[str, Any]
                    ) -> dict[str, Any]:
    """Steps at changing (batch, length) shapes equal one process's; `options` for the Pipeline (strict pair order,
    look-ahead).  Also which executor ran each step, and an evaluation at a never-seen shape."""
    program = pipedsl.Program.from_json(program_json)
    stages = tiny_lm(program.num_stages)
    ref = nn.Sequential(*copy.deepcopy(stages))
    pipe = pipedsl.Pipeline(stages, program=program, loss_fn=token_sum, loss_reduction="token", **options)
    problems, ran = [], []
    for step, (n, T) in enumerate(shapes):
        problems += _step_like_one_process(pipe, ref, *padded_batch(step, n, T), f"step {step} ({n}x{T})")
        ran.append(type(pipe._executor).__name__)
    x, y = padded_batch(99, 2 * program.num_microbatches, 7)  # never seen: evaluation learns it
    with torch.no_grad():
        want = token_mean(ref.eval()(x), y).item()
    got = pipe.evaluate(x, y)
    if abs(got - want) > 2e-5 * abs(want):
        problems.append(f"evaluate() at a new shape = {got}, one process {want}")
    problems += _step_like_one_process(pipe, ref.train(), x, y, "a step at the shape evaluation learned")
    ran.append(type(pipe._executor).__name__)
    return {"problems": problems, "ran": ran, "learned": pipe.shape_handshakes}


class ShrinksLater(nn.Module):
    """Its output's width follows how often it ran, not its input's shape: 8 features, then 6."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.lin(x)
        return y if self.calls == 1 else y[:, :6]


class Pad(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, 8 - x.shape[1]))


def output_shape_changes(rank: int) -> None:
    torch.manual_seed(0)
    pipe = pipedsl.Pipeline([ShrinksLater(), Pad()], "1f1b", microbatches=2, loss_fn=F.mse_loss)
    pipe.step(torch.randn(4, 16), torch.randn(4, 8))


def pool_after_many_shapes(rank: int, shapes: int) -> dict[str, Any]:
    """`shapes` steps of 1F1B, each at a new microbatch size: the receive buffers' shapes the pool still holds, and
    those the cached executors receive."""
    import torch.nn.functional as F  # noqa: N812
    from runtime_cases import WIDTH, batch, make_model

    import pipedsl
    from pipedsl.models.split import split_sequential

    pipe = pipedsl.Pipeline(split_sequential(make_model(2), 2), "1f1b", microbatches=2, loss_fn=F.mse_loss)
    for rows in range(1, shapes + 1):
        x, y = batch(rows, 2 * rows)
        pipe.step(x, y)
    held = sorted({tuple(m.shape) for m in pipe.channels.pool._free if m.shape != (WIDTH,)})
    cached = sorted({tuple(m.shape) for ex in pipe._executors.values()
                     for metas in (*ex.in_meta.values(), *ex.grad_meta.values()) for m in metas})
    pipe.close()
    return {"held": held, "cached": cached}
