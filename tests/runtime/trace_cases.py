"""Checks for the tracer and the executor's timing, run on every rank (see conftest.Pool)."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from runtime_cases import batch, make_model

import pipedsl
from pipedsl.ir import Op
from pipedsl.models.split import split_sequential
from pipedsl.runtime.tracer import Tracer


def causality_problems(timeline: pipedsl.Timeline) -> list[str]:
    """Every compute op that consumes a message starts after the op that produced it ended."""
    producer: dict[tuple, tuple[int, float]] = {}
    consumer: dict[tuple, tuple[int, float, str]] = {}
    for r, events in enumerate(timeline.ranks):
        pending: dict[tuple, tuple] = {}
        last_compute = None
        for e in events:
            ins = e.instr
            if ins.op in (Op.F, Op.B, Op.I, Op.W):
                last_compute = e
                for key in [k for k, (op, mb, st) in pending.items()
                            if ins.mb == mb and ins.stage == st and (ins.op is Op.F) == (op is Op.RECV_F)]:
                    consumer[key] = (r, e.start, str(ins))
                    del pending[key]
            elif ins.op in (Op.SEND_F, Op.SEND_B):
                producer[(ins.op is Op.SEND_F, ins.mb, ins.stage, ins.replica)] = (r, last_compute.end)
            elif ins.op in (Op.RECV_F, Op.RECV_B):
                fwd = ins.op is Op.RECV_F
                key = (fwd, ins.mb, ins.stage - 1 if fwd else ins.stage + 1, ins.replica)
                pending[key] = (ins.op, ins.mb, ins.stage)
    out = []
    for key, (r, start, name) in consumer.items():
        pr, end = producer[key]
        if start < end:
            out.append(f"rank {r} {name} starts at {start:.6f}, before its input was produced on rank {pr} "
                       f"(ends {end:.6f})")
    return out


def causal_timeline(rank: int, schedule: str, M: int) -> list[str]:
    """Run two steps and return the causality problems of the last step's timeline (rank 0)."""
    P = torch.distributed.get_world_size()
    program = pipedsl.load(schedule).compile(P=P, M=M)
    model = make_model(program.num_stages)
    pipe = pipedsl.Pipeline(split_sequential(model, program.num_stages), program=program, loss_fn=F.mse_loss)
    for step in range(2):
        x, y = batch(step, 2 * M)
        pipe.step(x, y)
    tl = pipe.timeline()
    if rank != 0:
        return []
    problems = causality_problems(tl)
    if "one host" not in tl.meta.get("clock", ""):
        problems.append(f"clock: {tl.meta.get('clock')!r}")
    return problems


def ping_pong_offset(rank: int) -> dict:
    """The multi-host path on one host: the estimated offset is within half the round trip of 0."""
    tracer = Tracer(None, shared_clock=False)
    return {"offset": tracer.offset, "rtt": tracer.rtt, "shared": tracer.shared_clock}
