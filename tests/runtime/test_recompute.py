"""Activation recomputation (full and selective) gives the gradients of no recomputation — with dropout,
under every built-in schedule (split backward I/W and replicas included) — and its saved-activation
bytes are what the simulator's peak activation count predicts."""

from __future__ import annotations

import llm_cases as cases
import pytest
import torch
from test_pipeline import compile_for

import pipedsl


@pytest.mark.slow
@pytest.mark.parametrize("schedule", pipedsl.builtin_names())
def test_same_gradients_with_dropout(schedule: str, pool2) -> None:
    """Full and selective recomputation with dropout, each built-in schedule: losses equal no recomputation's bit for
    bit, gradients to rtol 2e-5 (the same seeds); full keeps no more saved-activation bytes than selective."""
    program = compile_for(schedule, 2)
    results = pool2.run(cases.recompute_check, program.to_json(), ("full", "selective"))
    problems = [f"rank {r}: {p}" for r, res in enumerate(results) for p in res["problems"]]
    assert not problems, "\n".join(problems[:20])
    # full keeps no more than selective; both keep no more than no recomputation without a split backward, and full
    # keeps less on the first rank, where most activations wait for their backward.  A split backward's I-W window
    # keeps a recomputed region whole until W, where without recomputation I drops what W does not read (counted
    # from I on as what W holds): there the last rank may hold more with recomputation
    for r, res in enumerate(results):
        b = res["bytes"]
        assert b["full"] <= b["selective"], (r, b)
        if not program.split_backward:
            assert b["selective"] <= b["None"], (r, b)
    assert results[0]["bytes"]["full"] < results[0]["bytes"]["None"], results[0]["bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_tied_weights(schedule: str, pool2) -> None:
    """The embedding tied to the output projection: across ranks (1F1B) and on one rank (ZB-V, split backward)."""
    program = compile_for(schedule, 2)
    results = pool2.run(cases.recompute_check, program.to_json(), ("full", "selective"), None, "tied")
    problems = [f"rank {r}: {p}" for r, res in enumerate(results) for p in res["problems"]]
    assert not problems, "\n".join(problems[:20])


@pytest.mark.slow
@pytest.mark.parametrize("mode", [None, "full", "selective"])
def test_saved_bytes_match_the_simulator(mode: str | None, pool4) -> None:
    program = pipedsl.load("1f1b").compile(P=4, M=6)
    results = pool4.run(cases.bytes_prediction, program.to_json(), mode)
    for r, res in enumerate(results):
        assert res["measured"] == res["predicted"], (r, res)
    if mode == "full":  # rank 0 keeps 4 microbatches' stage inputs (token ids) instead of 4 whole activations
        assert results[0]["kept"] * 10 < results[0]["full"]


def _cli_losses(pool, *flags: str) -> dict[int, float]:
    """`pipedsl train FLAGS` parsed and checked by the CLI, its per-rank training run on the pool's ranks."""
    import argparse
    import dataclasses

    from pipedsl.trainer import cli as train_cli
    from pipedsl.trainer import train as trainer
    from pipedsl.trainer.config import from_args

    parser = argparse.ArgumentParser()
    train_cli.add_parser(parser.add_subparsers())
    cfg = from_args(parser.parse_args(["train", "-P", "2", "-M", "2", "--seq", "8", "--embd", "16", *flags]))
    program = pipedsl.load(cfg.schedule.schedule).compile(P=2, M=2)
    cfg = dataclasses.replace(train_cli._config(program, cfg), peak_flops=1.0)
    return pool.run(trainer.train, program.to_json(), cfg)[0]["losses"]


@pytest.mark.slow
def test_train_cli_recompute_and_token_loss(pool2) -> None:
    """`pipedsl train --recompute full|selective --loss-reduction token --pad-fraction F` with dropout and the split
    backward: the losses of no recomputation, bit for bit (the dropout masks are replayed); the padding matters."""
    common = ["--schedule", "zb-h1", "--steps", "2", "--dropout", "0.1", "--pad-fraction", "0.4"]
    plain = _cli_losses(pool2, *common, "--loss-reduction", "token")
    assert _cli_losses(pool2, *common, "--loss-reduction", "token", "--recompute", "selective") == plain
    assert _cli_losses(pool2, *common, "--loss-reduction", "token", "--recompute", "full") == plain
    assert _cli_losses(pool2, *common) != plain  # the per-microbatch mean weighs the padded microbatches otherwise


class _Flaky(torch.nn.Module):
    """A forward that takes another path the second time (e.g. data-dependent control flow on a counter)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.fc(x)
        return y.tanh() if self.calls == 1 else y * 2


def test_a_region_that_runs_differently_again_is_named() -> None:
    from pipedsl.runtime.recompute import Recompute, RecomputeError
    from pipedsl.runtime.stage import ActivationCounter, Stage

    module = _Flaky()
    stage = Stage(module, 0, 1, lambda out, t: out.pow(2).mean(), 1, ActivationCounter(), Recompute(module, "full"))
    act, _ = stage.forward([torch.randn(3, 4)])
    with pytest.raises(RecomputeError, match=r"recomputing the stage saved 2 tensors for backward, its forward saved 3: the region must run"):
        stage.backward(act, None)
