"""`launch(fn, nprocs, *args)`: run `fn(rank, *args)` on local processes with a process group.

Locally it spawns `nprocs` processes on 127.0.0.1 and a free port, initialises gloo (NCCL
when there is a GPU per process), runs `fn`, and returns the results in rank order.  Under
`torchrun` (RANK, WORLD_SIZE and MASTER_ADDR set) it spawns nothing: it initialises from the
environment and runs `fn` for this process only, so one script serves both.

Everything is bounded: the process group has `timeout`; the join has `join_timeout`.  When a
rank fails, the others stop (a receive from an exited rank fails at once, a stuck one at the
process-group timeout); the launcher then raises `PipeRuntimeError` naming the rank that
failed first (not the ranks that stopped because of it), with every rank's error as notes.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pipedsl.errors import PipeDSLError, PipeRuntimeError

from .errors import RankFailure, record_failure

ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


def under_torchrun() -> bool:
    return all(k in os.environ for k in ENV) and not dist.is_initialized()


def default_backend(nprocs: int) -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "gloo"


def init_process_group(rank: int, world_size: int, backend: str | None = None, timeout: float = 300.0,
                       local_rank: int | None = None, store_port: int | None = None) -> None:
    """Initialise the default group: from MASTER_ADDR/MASTER_PORT (env://), or on the launcher's store."""
    backend = backend or default_backend(world_size)
    kwargs: dict[str, Any] = {"init_method": "env://"}
    if store_port is not None:
        kwargs = {"store": dist.TCPStore("127.0.0.1", store_port, is_master=False,
                                         timeout=datetime.timedelta(seconds=timeout))}
    if backend == "nccl":
        local = rank if local_rank is None else local_rank
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout), **kwargs)


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, backend: str | None = None,
           timeout: float = 300.0, join_timeout: float = 3600.0, threads: int | None = None) -> list[Any]:
    """Run `fn(rank, *args)` on `nprocs` ranks; the results in rank order (see the module docstring)."""
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init_process_group(rank, world, backend, timeout, int(os.environ.get("LOCAL_RANK", rank)))
        try:
            return [fn(rank, *args)]
        except BaseException as err:
            if not (isinstance(err, RankFailure) and err.peer_failure):
                record_failure(rank, _message(err))
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    if nprocs < 1:
        raise PipeRuntimeError(f"nprocs must be at least 1, got {nprocs}")
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    # The rendezvous store lives here, in the launcher: it outlives any rank, so the ranks can
    # always read which one failed first (see errors.py).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    port = store.port
    threads = threads or max(1, (os.cpu_count() or 1) // nprocs)
    procs = [ctx.Process(target=_child, args=(fn, rank, nprocs, port, backend, timeout, threads, results, args),
                         name=f"pipedsl-rank{rank}") for rank in range(nprocs)]
    for p in procs:
        p.start()
    outcome = _join(procs, results, grace=timeout + 15.0, join_timeout=join_timeout)
    del store
    return _report(outcome, procs, join_timeout)


def _message(err: BaseException) -> str:
    if isinstance(err, PipeDSLError):
        return err.message
    return f"{type(err).__name__}: {err}\n" + "".join(traceback.format_exception(err)[-6:]).rstrip()


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, backend: str | None, timeout: float,
           threads: int, results: mp.Queue, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    code = 0
    try:
        init_process_group(rank, world, backend, timeout, store_port=port)
        results.put(("ok", rank, fn(rank, *args), False))
    except BaseException as err:  # noqa: BLE001 - reported to the parent, then a hard exit
        consequence = isinstance(err, RankFailure) and err.peer_failure
        message = _message(err)
        if not consequence:
            record_failure(rank, message)
        results.put(("error", rank, message, consequence))
        code = 1
    results.close()
    results.join_thread()
    if code == 0:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    # a hard exit: never hang in the process group's teardown; peers see the closed sockets at once
    os._exit(code)


def _join(procs: list, results: mp.Queue, grace: float, join_timeout: float) -> dict[str, Any]:
    got: dict[int, tuple[str, Any, bool]] = {}
    deadline = time.monotonic() + join_timeout
    failed_at = None
    timed_out = False
    killed: set[int] = set()
    while True:
        try:
            kind, rank, value, consequence = results.get(timeout=0.05)
            got[rank] = (kind, value, consequence)
            continue
        except queue.Empty:
            pass
        alive = [p for p in procs if p.exitcode is None]
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if not alive:
            break
        now = time.monotonic()
        if (failed_at is not None and now > failed_at + grace) or now > deadline:
            timed_out = now > deadline
            killed = {procs.index(p) for p in alive}  # our SIGKILL: not a failure of their own
            for p in alive:
                p.kill()
            for p in alive:
                p.join(5)
            break
    while True:  # anything still in the pipe
        try:
            kind, rank, value, consequence = results.get(timeout=0.2)
            got[rank] = (kind, value, consequence)
        except queue.Empty:
            break
    return {"got": got, "timed_out": timed_out, "killed": killed, "grace": grace}


def _report(outcome: dict[str, Any], procs: list, join_timeout: float) -> list[Any]:
    got = outcome["got"]
    errors: dict[int, str] = {}
    causes: list[int] = []
    for rank, p in enumerate(procs):
        kind, value, consequence = got.get(rank, (None, None, False))
        if kind == "ok" and p.exitcode == 0:
            continue
        if kind == "error":
            errors[rank] = value
            if not consequence:
                causes.append(rank)
        elif rank in outcome["killed"] and not outcome["timed_out"]:
            errors[rank] = f"stuck: still running {outcome['grace']:g} s after another rank stopped; killed"
        elif p.exitcode is not None and p.exitcode < 0 and rank not in outcome["killed"]:
            errors[rank] = f"killed by signal {signal.Signals(-p.exitcode).name}"
            causes.append(rank)
        elif p.exitcode is None or outcome["timed_out"]:
            errors[rank] = f"still running after the join timeout ({join_timeout:g} s); killed"
        else:
            errors[rank] = f"exited with status {p.exitcode} without reporting an error"
            causes.append(rank)
    if not errors:
        return [got[r][1] for r in range(len(procs))]
    # no rank failed on its own: the ones that stopped blamed a peer; blame the one left running (stuck)
    stuck = sorted(outcome["killed"]) if not outcome["timed_out"] else []
    first = causes[0] if causes else (stuck[0] if stuck else min(errors))
    notes = tuple(f"rank {r}: {m.splitlines()[0] if m else m}" for r, m in sorted(errors.items()) if r != first)
    raise PipeRuntimeError(f"rank {first} failed: {errors[first]}", notes=notes)
