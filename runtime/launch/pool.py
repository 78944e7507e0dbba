"""A pool of local worker processes that run one function as a gloo world, again and again.

Starting a process and importing torch costs seconds per process on a small machine; a
`LocalPool` pays it once.  `pool.run(fn, world, *args)` makes workers 0 … world−1 a gloo
world on 127.0.0.1 (a timeout on the group; with `same_world`, a run of the same size and timeout
as the one before reuses that world, less the groups its job made), call `fn(*args)` on every rank and
return the results in rank order.  A failure on any rank raises `WorkerError` with that rank's
traceback and restarts the pool, so the next run starts clean; nothing waits forever (every
get and join has a timeout).  It is the suite's one pool, and the benchmarks' and calibration's.
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

from pipedsl.errors import PipeRuntimeError
from pipedsl.perf import freeze_imports


class WorkerError(PipeRuntimeError):
    """A function run by the pool failed (or timed out) on some rank."""


def _worker(index: int, jobs: mp.Queue, results: mp.Queue, owner: int) -> None:
    import torch
    import torch.distributed as dist

    from pipedsl.runtime.launch import world_store
    from pipedsl.runtime.launch.errors import forget_failures
    from pipedsl.runtime.launch.lifecycle import follow_launcher

    # a worker exits when the pool's owner is gone, as a rank does when its launcher is: a killed test session left
    # its eight workers (and, through them, its fork server) waiting on the job queue for good
    follow_launcher(owner, index)
    torch.set_num_threads(1)
    freeze_imports()  # torch's objects out of every collection (see `_release_groups`)
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, world, world_at, args, path, timeout_s = pickle.loads(job)
        for p in path:
            if p not in sys.path:
                sys.path.append(p)
        try:
            if world_at is not None:  # a new world (else: the previous run's, the same ranks)
                if dist.is_initialized():
                    dist.destroy_process_group()
                store = world_store.joined(*world_at, timeout_s)  # on the parent's master, this worker's one client
                dist.init_process_group("gloo", store=store, rank=index, world_size=world,
                                        timeout=datetime.timedelta(seconds=timeout_s))
            else:  # the world's store outlives each run: this one starts with no failure recorded by an earlier one
                if index == 0:
                    forget_failures(dist.distributed_c10d._get_default_store())
                dist.barrier()
            kept = _groups()
            try:
                torch.manual_seed(1234 + index)
                out = fn(*args)
            finally:
                _release_groups(kept)
            results.put((index, True, out, _threads()))
        except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
            results.put((index, False, traceback.format_exc(), 0))


def _groups() -> set:
    from torch.distributed import distributed_c10d as c10d

    return set(c10d._world.pg_map)


def _release_groups(kept: set) -> None:
    """Destroys the process groups the job made (each Pipeline makes its own), so that hundreds of jobs on one
    world do not pile up gloo groups and their busy threads.  Safe: a job starts only once every rank answered."""
    import torch.distributed as dist

    for group in _groups() - kept:
        dist.destroy_process_group(group)
    gc.collect()  # the job's pipelines hold their gloo groups (two threads each) in reference cycles
    # what survives is the modules the job imported and their caches: frozen, no collection walks them again.  A
    # full collection over torch's ~170,000 objects took 0.15 s, and every job of every worker paid it
    freeze_imports()


MAX_THREADS = 100  # a worker past this many threads is replaced before the next run


def _threads() -> int:
    """This process's threads (Linux; 0 elsewhere).  Some jobs leave gloo groups behind — their store, run-loop
    and TCP threads — and idle ones still wake: hundreds of them took a third of a core per worker."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


class LocalPool:
    """`size` worker processes, started on first use; `run` any function on the first `world` of them."""

    def __init__(self, size: int, timeout: float = 120.0) -> None:
        self.size, self.timeout = size, timeout
        self._procs: list[mp.Process] = []
        self._jobs: list[mp.Queue] = []
        self._results: mp.Queue | None = None
        self._world: tuple[int, float] | None = None  # (size, timeout) of the workers' world: a run alike reuses it

    def _start(self) -> None:
        from pipedsl.runtime.launch.fork_server import rank_context

        ctx = rank_context()  # forked from a server that imported torch once: restarting the pool is cheap
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(self.size)]
        self._procs = [ctx.Process(target=_worker, args=(i, self._jobs[i], self._results, os.getpid()), daemon=True)
                       for i in range(self.size)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], world: int, *args: Any, timeout: float | None = None,
            same_world: bool = False) -> list[Any]:
        """`fn(*args)` on ranks 0 … world−1 of a new gloo world, or with `same_world` of the previous run's when it
        was alike (size, timeout); the results in rank order.  Reuse suits jobs of plain process groups only:
        torch's DeviceMesh caches groups across jobs, which each job's end destroys."""
        if not 1 <= world <= self.size:
            raise WorkerError(f"a world of {world} ranks does not fit a pool of {self.size} workers")
        timeout = timeout or self.timeout
        world_at = None
        if not (same_world and self._procs and (world, timeout) == self._world):
            # the world's rendezvous store: a namespace on this process's master (world_store.py), which holds its
            # port for the process's life: no port is chosen free and bound later, which another process could take
            from pipedsl.runtime.launch import world_store

            port, prefix, _ = world_store.new_world(timeout)
            world_at = (port, prefix)
        path = [p for p in sys.path if p]
        try:  # once, here: a queue pickles in a thread of its own, and a failure there would only be a timeout
            job = bytes(ForkingPickler.dumps((fn, world, world_at, args, path, timeout)))
        except Exception as err:  # noqa: BLE001 - pickle raises many kinds
            raise WorkerError(f"{getattr(fn, '__name__', fn)} cannot be sent to the workers: {err}") from None
        if not self._procs:
            self._start()
        self._world = (world, timeout)
        for i in range(world):
            self._jobs[i].put(job)
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout + 10
        assert self._results is not None
        threads = 0
        while len(out) < world:
            try:
                index, ok, value, used = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(self._procs[:world]) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close(force=True)
                    why = f"worker(s) {dead} died" if dead else f"no answer within {timeout:.0f} s"
                    raise WorkerError(f"{getattr(fn, '__name__', fn)} on {world} ranks: {why}") from None
                continue
            if not ok:
                self.close(force=True)
                raise WorkerError(f"{getattr(fn, '__name__', fn)} failed on rank {index} of {world}:\n{value}")
            out[index] = value
            threads = max(threads, used)
        if threads > MAX_THREADS:  # what the jobs left behind goes with the processes; the next run starts new ones
            self.close()
        return [out[i] for i in range(world)]

    def close(self, force: bool = False) -> None:
        """Stop the workers (this pool's own processes only); the next `run` starts new ones."""
        if not force:
            for q in self._jobs:
                q.put(None)
        for p in self._procs:
            if force:
                p.terminate()
            p.join(timeout=10)
            if p.is_alive():
                os.kill(p.pid, 9)
                p.join(timeout=5)
        self._procs, self._jobs, self._results, self._world = [], [], None, None

    def __enter__(self) -> LocalPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def with_rank(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(rank, *args)`: for `pool.run(with_rank, world, fn, …)`, checks written per rank."""
    import torch.distributed as dist

    return fn(dist.get_rank(), *args)
