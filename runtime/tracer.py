"""The tracer: when each instruction started and ended on each rank, as a measured `Timeline`.

The executor stamps every instruction with `time.perf_counter()` (monotonic).  Clocks are
aligned by an origin each rank takes right after a barrier, so times are seconds since that
common moment; `gather` sends the events to the group's first rank as one `Timeline`
(kind "measured"), the type the simulator produces.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from pipedsl.ir import Program
from pipedsl.timeline import Event, Timeline


class Tracer:
    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.origin = 0.0
        self.sync()

    def sync(self) -> None:
        """Take a common origin: every rank leaves the barrier at (nearly) the same moment."""
        dist.barrier(group=self.group)
        self.origin = time.perf_counter()

    def gather(self, program: Program, rank: int, starts: list[float], ends: list[float],
               meta: dict[str, Any] | None = None) -> Timeline | None:
        """Collective over the group: the Timeline on its first rank, None on the others."""
        o = self.origin
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
        return Timeline(program.name, dict(program.params), ranks, "measured",
                        {"per_rank": [m for _, _, m in out], "clock": "perf_counter, barrier-aligned"})
