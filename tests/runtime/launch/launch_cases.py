"""Rank functions for test_launch_results.py (a module of their own: spawned ranks import them by name)."""

from __future__ import annotations

import os
import threading

import torch

LARGE = 50 * 2**20 // 4  # float32 elements of rank 0's state dict: 50 MiB (rank 1's: 1 MiB)


def values(rank: int) -> dict:
    """What rank `rank` returns; the test rebuilds the same values in the launcher to compare."""
    gen = torch.Generator().manual_seed(100 + rank)
    w = torch.randn(6, 5, generator=gen)
    hidden = (LARGE if rank == 0 else LARGE // 50) // 1024 // 2
    model = torch.nn.Sequential(torch.nn.Linear(1024, hidden), torch.nn.Linear(hidden, 1024))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return {
        "rank": rank,
        "tensor": w,
        "view": w[2:],  # a view of the same storage: stays one storage
        "nested": [(torch.arange(4, dtype=torch.int64) * rank, {"half": torch.ones(3, dtype=torch.float16)}), "text"],
        "state": model.state_dict(),
        "empty": torch.empty(0, 7),
    }


def returns_values(rank: int) -> dict:
    return values(rank)


def returns_cuda(rank: int) -> torch.Tensor:
    return torch.arange(5.0, device="cuda") + rank


def returns_unpicklable(rank: int) -> object:
    if rank == 0:
        return {"ok": torch.zeros(2), "lock": threading.Lock()}
    return [torch.ones(1), (1, lambda: rank)]


def where_am_i(rank: int) -> dict:
    """What a rank sees of how it was started (test_fork_server.py)."""
    import multiprocessing as mp
    import os
    import sys

    return {"rank": rank, "probe": os.environ.get("PIPEDSL_PROBE"), "cwd": os.getcwd(),
            "name": mp.current_process().name, "path_has_tests": any(p.endswith("launch") for p in sys.path)}


def fail_and_read(rank: int, fail: bool) -> tuple[int, str] | None:
    """With `fail`, rank 0 records a failure; then each rank reads the first failure recorded in its world."""
    import torch.distributed as dist

    from pipedsl.runtime.launch.errors import first_failure, record_failure

    if fail and rank == 0:
        record_failure(0, "rank 0's own failure")
    dist.barrier()
    return first_failure(wait=0.0)


def store_port_and_failures(rank: int, fail: bool) -> tuple[str, object]:
    """The launch's store port (MASTER_PORT) and the first failure recorded in this launch's world (errors.py); rank 1
    fails instead when `fail`."""
    from pipedsl.runtime.launch.errors import first_failure

    if fail and rank == 1:
        raise ValueError("rank 1 fails on purpose")
    torch.distributed.barrier()
    return os.environ["MASTER_PORT"], first_failure(wait=0.0)
