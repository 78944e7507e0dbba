"""What ends a training run before its last step, decided alike on every rank at a step's end.

Two things do: `--max-time` (another step as long as the last would end past the deadline, on rank 0's
clock) and a stop signal.  SIGTERM — from `pipedsl train`'s launcher on SIGTERM, SIGINT or SIGHUP, from
torchrun, or from a job scheduler before its time limit — used to kill a rank at once, losing the work
since the last checkpoint.  Now the rank only records it (Megatron-LM's `--exit-signal-handler`): the step
in flight finishes, every rank learns at its end whether any rank got one (one all-reduce of two numbers),
and all of them save a checkpoint of that step and exit.  The launcher gives them `--stop-timeout` seconds
for it before SIGKILL; a second signal to the launcher kills at once.  Nothing is lost either way:
checkpoints are written atomically (runtime/checkpoint/).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch


class Stop:
    """The early ends of one run: `deadline` (time.time() seconds, or None) and the first stop signal received."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline
        self.received: int | None = None  # the signal number, set by the handler

    @contextlib.contextmanager
    def catching(self) -> Iterator[Stop]:
        """SIGTERM recorded instead of fatal while the block runs (the main thread only: elsewhere, unchanged)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGTERM, self._record)
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signum

    def reason(self, pipe: Any, last_step: float) -> str | None:
        """Why every rank stops after this step (the same answer on each: collective over the world), or None:
        "SIGTERM" (any rank received it) or "--max-time" (rank 0's clock says another step would pass it)."""
        return self.ask(pipe, last_step).answer()

    def ask(self, pipe: Any, ahead: float) -> Question:
        """`reason`'s collective issued without waiting (post-validated steps: answered after the next step, so
        no step waits for every rank's end); "--max-time" when `ahead` more seconds would pass the deadline."""
        world = torch.distributed.is_initialized()
        first = not world or torch.distributed.get_rank() == 0
        late = self.deadline is not None and first and time.time() + ahead > self.deadline
        flags = torch.tensor([float(self.received or 0), float(late)], device=pipe.device)
        work = torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, async_op=True) if world else None
        return Question(flags, work)


class Question:
    """An asked `Stop.reason`: `answer()` waits for it."""

    def __init__(self, flags: torch.Tensor, work: Any) -> None:
        self.flags, self.work = flags, work

    def answer(self) -> str | None:
        if self.work is not None:
            self.work.wait()
        signum, late = int(self.flags[0].item()), bool(self.flags[1].item())
        if signum:
            return signal.Signals(signum).name
        return "--max-time" if late else None
