"""The runtime tests' reusable process group (see conftest.py).

It lives in a module of its own, not in conftest.py: spawned ranks unpickle `_serve` by
module name, and several test folders each have a `conftest` module.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import queue
import threading
import time
from typing import Any

import pipedsl

RESULT_TIMEOUT = 240.0  # seconds for one check on every rank
PG_TIMEOUT = 60.0


def _serve(rank: int, tasks: list, results: Any) -> None:
    import traceback

    import torch

    torch.set_num_threads(1)
    baseline: set | None = None
    while True:
        item = tasks[rank].get()
        if item is None:
            return
        baseline = _release_groups(baseline)
        fn, args = item
        try:
            results.put((rank, True, fn(rank, *args)))
        except Exception as err:  # noqa: BLE001 - handed to the test
            results.put((rank, False, f"{type(err).__name__}: {err}\n{traceback.format_exc()[-1500:]}"))


def _release_groups(baseline: set | None) -> set | None:
    """Destroys the process groups the previous check made (each Pipeline makes its own), so that
    hundreds of checks on one long-lived world do not pile up gloo groups and their busy threads
    (>1000 threads a rank were seen).  Safe here: a check is queued only after every rank answered
    the one before."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return baseline
    now = set(c10d._world.pg_map)
    if baseline is None:
        return now
    for group in now - baseline:
        dist.destroy_process_group(group)
    gc.collect()  # a finished Pipeline's cycles still hold its groups (and their threads)
    return baseline


class Pool:
    def __init__(self, nprocs: int) -> None:
        ctx = mp.get_context("spawn")
        self.nprocs = nprocs
        self.tasks = [ctx.Queue() for _ in range(nprocs)]
        self.results = ctx.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._launch, daemon=True)
        self.thread.start()

    def _launch(self) -> None:
        try:
            pipedsl.launch(_serve, self.nprocs, self.tasks, self.results, timeout=PG_TIMEOUT,
                           join_timeout=3000, threads=1)
        except BaseException as err:  # noqa: BLE001
            self.error = err

    def run(self, fn, *args) -> list[Any]:
        """`fn(rank, *args)` on every rank; raises if any rank raised (with its message)."""
        if self.error is not None:
            raise RuntimeError(f"the process group is gone: {self.error}")
        for q in self.tasks:
            q.put((fn, args))
        out: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + RESULT_TIMEOUT
        while len(out) < self.nprocs:
            try:
                rank, ok, value = self.results.get(timeout=1.0)
            except queue.Empty:
                if self.error is not None or not self.thread.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"no answer from ranks {sorted(set(range(self.nprocs)) - set(out))} "
                                       f"(process group error: {self.error})") from None
                continue
            out[rank] = (ok, value)
        failed = {r: v for r, (ok, v) in out.items() if not ok}
        if failed:
            raise AssertionError("\n".join(f"rank {r}: {v}" for r, v in sorted(failed.items())))
        return [out[r][1] for r in range(self.nprocs)]

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        self.thread.join(60)


