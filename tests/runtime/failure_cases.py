"""Programs in which one rank fails, run with `pipedsl.launch` on fresh processes."""

from __future__ import annotations

import datetime
import os
import signal

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn

import pipedsl


def shape_mismatch(rank: int) -> None:
    torch.manual_seed(0)
    stages = [nn.Linear(16, 8), nn.Linear(6, 4)]  # stage 1 expects 6 features, stage 0 makes 8
    pipe = pipedsl.Pipeline(stages, "1f1b", microbatches=2, loss_fn=F.mse_loss)
    pipe.step(torch.randn(4, 16), torch.randn(4, 4))


def nan_loss(rank: int) -> None:
    torch.manual_seed(0)
    stages = [nn.Linear(4, 4), nn.Linear(4, 4)]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target) * float("nan") if bad[0] else F.mse_loss(out, target)

    bad = [False]
    pipe = pipedsl.Pipeline(stages, "gpipe", microbatches=2, loss_fn=loss_fn)
    pipe.step(torch.randn(4, 4), torch.randn(4, 4))
    bad[0] = True
    pipe.step(torch.randn(4, 4), torch.randn(4, 4))


class KillAt(nn.Module):
    """Kills its own process (SIGKILL: no goodbye) in the forward of the given call; `abort`: SIGABRT, as glibc
    does when it finds the heap corrupted."""

    def __init__(self, at: int, abort: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0
        self.at, self.abort = at, abort

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            os.kill(os.getpid(), signal.SIGABRT if self.abort else signal.SIGKILL)
        return self.lin(x)


def killed_mid_step(rank: int, abort: bool = False) -> None:
    torch.manual_seed(0)
    stages = [nn.Linear(4, 4), KillAt(at=8 + 3, abort=abort), nn.Linear(4, 4)]  # step 2, microbatch 2 on rank 1
    pipe = pipedsl.Pipeline(stages, "1f1b", microbatches=8, loss_fn=F.mse_loss)
    for _ in range(3):
        pipe.step(torch.randn(16, 4), torch.randn(16, 4))


class FailsAtMicrobatch(nn.Module):
    """A user's module that raises in the forward (or, with `backward=True`, the backward) of microbatch `at`."""

    def __init__(self, at: int, backward: bool = False, announce: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.at, self.backward, self.announce = at, backward, announce
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # the shape handshake's dry run
            return self.lin(x)
        microbatch, self.calls = self.calls, self.calls + 1
        if microbatch == self.at and not self.backward:
            if self.announce:  # for a peer that must still be working when this rank fails (`Slow`)
                dist.distributed_c10d._get_default_store().set(FAILING, "1")
            raise ValueError(f"user forward rejects microbatch {microbatch}")  # the user's forward raises
        y = self.lin(x)
        return RejectGradient.apply(y) if microbatch == self.at else y


class RejectGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise FloatingPointError("user backward rejects this gradient")  # the user's backward raises


FAILING = "failure_cases/failing"  # the store key a `FailsAtMicrobatch(announce=True)` sets as it raises


class Slow(nn.Module):
    """Its second forward waits until the next rank's module is failing (`FAILING`), so this rank is still sending
    when that rank fails."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.calls += 1
            if self.calls == 2:
                dist.distributed_c10d._get_default_store().wait([FAILING], datetime.timedelta(seconds=60))
        return self.lin(x)


def user_forward_raises(rank: int) -> None:
    torch.manual_seed(0)
    pipe = pipedsl.Pipeline([nn.Linear(4, 4), FailsAtMicrobatch(at=2)], "1f1b", microbatches=4, loss_fn=F.mse_loss)
    pipe.step(torch.randn(8, 4), torch.randn(8, 4))  # the user's loop


def user_backward_raises(rank: int) -> None:
    torch.manual_seed(0)
    pipe = pipedsl.Pipeline([nn.Linear(4, 4), FailsAtMicrobatch(at=2, backward=True)], "1f1b", microbatches=4,
                            loss_fn=F.mse_loss)
    pipe.step(torch.randn(8, 4), torch.randn(8, 4))


def sends_to_a_failed_rank(rank: int) -> None:
    """GPipe: rank 1 fails at its first forward while rank 0 is still sending the other microbatches to it."""
    torch.manual_seed(0)
    pipe = pipedsl.Pipeline([Slow(), FailsAtMicrobatch(at=0, announce=True)], "gpipe", microbatches=8,
                            loss_fn=F.mse_loss)
    pipe.step(torch.randn(16, 4), torch.randn(16, 4))
