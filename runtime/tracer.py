"""The tracer: when each instruction started and ended on each rank, as a measured `Timeline`.

The executor stamps every instruction with `time.perf_counter()` (CLOCK_MONOTONIC on Linux); on a GPU,
compute ops are timed by device events and put on that clock (runtime/device_clock.py).
Processes on one host share that clock, so their stamps are compared as they are: no
per-rank origin (an origin taken after a barrier differs by each rank's wake-up delay and
only adds skew; it made consumers start before their producers ended).  Ranks on other
hosts get an offset to rank 0's clock, estimated by ping-pong (the exchange with the least
round trip, Cristian's method: the error is at most half that round trip).  `gather` sends
the events to the group's first rank as one `Timeline` (kind "measured") starting at 0.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from pipedsl.ir import Program
from pipedsl.parallel.mesh import backend_device_type
from pipedsl.timeline import Event, Timeline

PING_ROUNDS = 8


def host_id() -> str:
    """Names the clock: processes with equal ids read the same CLOCK_MONOTONIC."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}" if boot and os.name == "posix" else f"{socket.gethostname()}/{os.getpid()}"


def message_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a tensor sent over `group` must live: the current GPU under NCCL (which moves device memory only:
    the clock exchange sent host tensors and failed on ranks of several hosts), the CPU otherwise."""
    if backend_device_type(group) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Tracer:
    """Clock offsets of the group's ranks to its first rank; gathers a step's events."""

    def __init__(self, group: dist.ProcessGroup | None, shared_clock: bool | None = None) -> None:
        self.group = group
        self.offset = 0.0  # this rank's clock minus rank 0's
        self.rtt = 0.0  # round trip of the exchange the offset came from (0 on a shared clock)
        self.sync(shared_clock)

    def sync(self, shared_clock: bool | None = None) -> None:
        """Find this rank's clock offset (collective).  `shared_clock=None`: detect it from the hosts."""
        size = dist.get_world_size(self.group)
        if shared_clock is None:
            ids: list[Any] = [None] * size
            dist.all_gather_object(ids, host_id(), group=self.group)
            shared_clock = len(set(ids)) == 1
        self.shared_clock = shared_clock
        if shared_clock:
            self.offset, self.rtt = 0.0, 0.0
            dist.barrier(group=self.group)
            return
        self.offset, self.rtt = self._ping_pong()

    def _ping_pong(self) -> tuple[float, float]:
        rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        glob = [dist.get_global_rank(self.group, r) if self.group is not None else r for r in range(size)]
        device = message_device(self.group)
        buf = torch.zeros(1, dtype=torch.float64, device=device)
        mine = (0.0, 0.0)
        for peer in range(1, size):
            best = (float("inf"), 0.0)  # (round trip, offset of peer)
            for _ in range(PING_ROUNDS):
                if rank == 0:
                    t0 = time.perf_counter()
                    dist.send(buf, glob[peer], group=self.group)
                    dist.recv(buf, glob[peer], group=self.group)
                    t1 = time.perf_counter()
                    best = min(best, (t1 - t0, buf.item() - (t0 + t1) / 2))
                elif rank == peer:
                    dist.recv(buf, glob[0], group=self.group)
                    buf.fill_(time.perf_counter())
                    dist.send(buf, glob[0], group=self.group)
            if rank == 0:  # tell the peer its offset
                dist.send(torch.tensor([best[1], best[0]], dtype=torch.float64, device=device), glob[peer],
                          group=self.group)
            elif rank == peer:
                got = torch.zeros(2, dtype=torch.float64, device=device)
                dist.recv(got, glob[0], group=self.group)
                mine = (got[0].item(), got[1].item())
        dist.barrier(group=self.group)
        return mine

    def gather(self, program: Program, rank: int, starts: list[float], ends: list[float],
               meta: dict[str, Any] | None = None) -> Timeline | None:
        """Collective over the group: the Timeline on its first rank, None on the others."""
        o = self.offset
        mine = ([s - o for s in starts], [e - o for e in ends], meta or {})
        size = dist.get_world_size(self.group)
        dst = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        out: list | None = [None] * size if rank == 0 else None
        dist.gather_object(mine, out, dst=dst, group=self.group)
        if rank != 0:
            return None
        assert out is not None
        t0 = min((st[0] for st, _, _ in out if st), default=0.0)  # the step starts at time 0
        ranks = tuple(tuple(Event(i, s - t0, e - t0) for i, s, e in zip(stream, st, en))
                      for stream, (st, en, _) in zip(program.ranks, out))
        clock = ("perf_counter, one host (shared CLOCK_MONOTONIC)" if self.shared_clock
                 else "perf_counter, offsets to rank 0 by ping-pong")
        meta = {"per_rank": [m for _, _, m in out], "clock": clock}
        if program.params.get("steps", 1) > 1:  # consecutive steps (pipedsl/steps.py): `steps.period` reads it
            meta["steps"] = program.params["steps"]
        return Timeline(program.name, dict(program.params), ranks, "measured", meta)
