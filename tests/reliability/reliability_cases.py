"""Rank functions for the reliability tests, run with `pipedsl.launch` on fresh processes.

A module of its own (not a conftest): spawned ranks unpickle these functions by module name.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import pipedsl
from pipedsl.errors import PipeDSLError
from pipedsl.runtime import checkpoint
from pipedsl.trainer.config import TrainConfig
from pipedsl.trainer.train import train as _train

# the small GPT of `pipedsl train` at test size; steps/checkpoints/resume per run
CFG = {"steps": 6, "batch": 8, "seq": 8, "layers": 2, "embd": 16, "lr": 3e-3, "dropout": 0.0, "seed": 0,
       "timeout": 60.0, "checkpoint_dir": None, "checkpoint_every": 0, "resume": None}


def program(name: str, P: int = 2, M: int = 2, **params: int) -> str:
    return pipedsl.load(name).compile(P=P, M=M, **params).to_json()


def sequence(rank: int, runs: list[tuple[str, str, dict[str, Any]]]) -> list[Any]:
    """Run several trainings one after another in the same processes.

    ("train", program_json, cfg) → rank 0's report (losses by step); ("error", …) → the error
    message each rank got (None if none); ("api", directory, {}) → `api_roundtrip`'s findings.
    """
    out: list[Any] = []
    for kind, what, cfg in runs:
        if kind == "train":
            out.append(_train(rank, what, TrainConfig.from_options(cfg)))
        elif kind == "error":
            try:
                _train(rank, what, TrainConfig.from_options(cfg))
                out.append(None)
            except PipeDSLError as err:
                out.append(str(err))
        else:
            out.append(api_roundtrip(rank, what))
    return out


def api_roundtrip(rank: int, directory: str) -> dict[str, Any]:
    """save → disturb everything → load: parameters, optimizer state (two param groups), every RNG,
    `extra` and `shards` come back exactly."""
    torch.manual_seed(1)
    stages = [nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Linear(8, 4)]
    pipe = pipedsl.Pipeline(stages, "1f1b", microbatches=2, loss_fn=F.mse_loss)
    weights = [p for n, p in pipe.local_stages()[rank].named_parameters() if n.endswith("weight")]
    others = [p for n, p in pipe.local_stages()[rank].named_parameters() if not n.endswith("weight")]
    opt = torch.optim.AdamW([{"params": weights, "lr": 1e-2}, {"params": others, "lr": 3e-3, "weight_decay": 0.0}])
    x, y = torch.randn(4, 4, generator=torch.Generator().manual_seed(2)), torch.zeros(4, 4)
    for _ in range(2):
        pipe.step(x, y)
        opt.step()
        opt.zero_grad()
    random.seed(10 + rank)
    np.random.seed(20 + rank)
    torch.manual_seed(30 + rank)
    info = checkpoint.save(pipe, directory, 2, opt, extra={"rank": rank, "t": torch.arange(3)},
                           shards={"zero": torch.full((2,), float(rank))})
    params = {k: v.clone() for k, v in pipe.local_stages()[rank].state_dict().items()}
    opt_state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    # disturb: another step, other seeds, another lr
    pipe.step(x, y)
    opt.step()
    opt.param_groups[0]["lr"] = 5.0
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    restored = checkpoint.load(pipe, directory, opt)
    same_params = all(torch.equal(v, params[k]) for k, v in pipe.local_stages()[rank].state_dict().items())
    same_opt = len(opt.state) == len(opt_state) and all(
        torch.equal(v, opt_state[id(p)][k]) for p, s in opt.state.items() for k, v in s.items())
    again = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    return {"path": str(info.path), "params": same_params, "optimizer": same_opt,
            "lrs": [g["lr"] for g in opt.param_groups], "rng": again == draws, "step": restored.step,
            "pipe_steps": pipe.steps, "extra_rank": restored.extra["rank"],
            "extra_t": restored.extra["t"].tolist(), "shards": restored.shards["zero"].tolist()}


def bad_pipelines(rank: int, files: dict[str, str]) -> dict[str, str | float]:
    """Every way to hand `Pipeline` a wrong program, model or batch: the message each raised (all ranks alike),
    and the losses of the good program files."""
    torch.manual_seed(0)
    stages = [nn.Linear(4, 4), nn.Linear(4, 4)]
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.zeros(8, 4)
    attempts = {
        "malformed": lambda: pipedsl.Pipeline(stages, program=files["malformed"], loss_fn=F.mse_loss),
        "invalid": lambda: pipedsl.Pipeline(stages, program=files["invalid"], loss_fn=F.mse_loss),
        "three_ranks": lambda: pipedsl.Pipeline(stages, program=files["three_ranks"], loss_fn=F.mse_loss),
        "not_a_program": lambda: pipedsl.Pipeline(stages, program={"ranks": []}, loss_fn=F.mse_loss),
        "microbatches": lambda: pipedsl.Pipeline(stages, program=files["json"], microbatches=3, loss_fn=F.mse_loss),
        "stages": lambda: pipedsl.Pipeline([*stages, nn.Linear(4, 4)], program=files["json"], loss_fn=F.mse_loss),
        "batch": lambda: pipedsl.Pipeline(stages, program=files["json"], loss_fn=F.mse_loss).step(x[:7], y[:7]),
        "json": lambda: pipedsl.Pipeline(stages, program=files["json"], loss_fn=F.mse_loss).step(x, y),
        "csv": lambda: pipedsl.Pipeline(stages, program=files["csv"], loss_fn=F.mse_loss).step(x, y),
    }
    out: dict[str, str | float] = {}
    for name, attempt in attempts.items():
        try:
            out[name] = attempt()
        except PipeDSLError as err:
            out[name] = str(err)
    return out


def data_parallel_save(rank: int, directory: str) -> list[str]:
    """dp=2 × pp=1: a checkpoint saves (dp rank 0 holds the stage state) and loads back."""
    from pipedsl.parallel import ParallelConfig

    torch.manual_seed(0)
    pipe = pipedsl.Pipeline([nn.Linear(4, 4)], "1f1b", microbatches=1, loss_fn=F.mse_loss,
                            parallel=ParallelConfig(dp=2, pp=1))
    out = []
    for attempt in (lambda: checkpoint.save(pipe, directory, 1), lambda: checkpoint.load(pipe, directory)):
        try:
            attempt()
            out.append("ok")
        except PipeDSLError as err:
            out.append(str(err))
    return out


def resumable_run(pipe: Any, opt: Any, batch: Any, steps: int, *, save_at: int, directory: str | None = None,
                  resume: str | None = None, optimizer_state: bool = True) -> dict:
    """Train `pipe` to `steps` on `batch(gen)`'s batches (a generator seeded 1), saving after step `save_at` into
    `directory`, or first resuming from `resume` (the data position with it): {"losses": {step: loss}, "changed":
    whether the load changed the stage partition (None without one)}.  The checkpoint tests' shared loop."""
    gen, start, changed = torch.Generator().manual_seed(1), 0, None
    if resume is not None:
        restored = checkpoint.load(pipe, resume, opt if optimizer_state else None)
        gen.set_state(restored.extra["data"])
        start, changed = restored.step, restored.partition_changed
    losses = {}
    for step in range(start + 1, steps + 1):
        losses[step] = pipe.step(*batch(gen))
        opt.step()
        opt.zero_grad()
        if step == save_at and directory is not None:
            checkpoint.save(pipe, directory, step, opt, extra={"data": gen.get_state()}, timeout=60.0)
    pipe.close()
    return {"losses": losses, "changed": changed}
