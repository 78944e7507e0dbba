"""Run on every rank of a pool: a pipedsl program exported as torch CSV, loaded by torch's own
`_PipelineScheduleRuntime._load_csv` and run by torch's runtime, equals one process."""

from __future__ import annotations

import copy
import os
import tempfile

import torch
import torch.nn.functional as F  # noqa: N812
from runtime_cases import _close, batch, make_model, reference_step

import pipedsl


def torch_runs_pipedsl_csv(rank: int, schedule: str, P: int, M: int) -> dict:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    program = pipedsl.load(schedule).compile(P=P, M=M)
    S = program.num_stages
    model = make_model(S)
    ref = copy.deepcopy(model)
    mine = [s for (_, s), r in sorted(program.placement.items()) if r == rank]
    stages = [PipelineStage(model[s], s, S, torch.device("cpu")) for s in mine]
    sched = _PipelineScheduleRuntime(stages, n_microbatches=M, loss_fn=F.mse_loss)
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "schedule.csv")
        with open(path, "w") as f:
            f.write(pipedsl.to_torch_csv(program))
        sched._load_csv(path)  # torch's own loader: infers the placement, adds the communication
        x, y = batch(0, 2 * M)
        sched.step(x, target=y, losses=(losses := []))
        reference_step(ref, F.mse_loss, x, y, M)
        for s in mine:
            for (name, p), q in zip(model[s].named_parameters(), ref[s].parameters()):
                if p.grad is None or not _close(p.grad, q.grad):
                    problems.append(f"stage {s} {name}: gradient differs from one process")
        # torch's own dump (with its communication actions) reads back as the same pipedsl order
        dumped = os.path.join(tmp, "dumped.csv")
        sched._dump_csv(dumped, "compute_comms")
        with open(dumped) as f:
            back = pipedsl.from_torch_csv(f.read())
        if back.compute_orders() != program.compute_orders():
            problems.append("torch's compute_comms dump loads as another order")
    return {"problems": problems, "losses": len(losses)}
