"""`launch(fn, nprocs, *args)`: run `fn(rank, *args)` on local processes with a process group.

Locally it starts `nprocs` processes on 127.0.0.1 and a free port, initialises gloo (NCCL
when there is a GPU per process), runs `fn`, and returns what each rank's `fn` returned, in
rank order.  Under `torchrun` (RANK, WORLD_SIZE and MASTER_ADDR set) it starts nothing: it
initialises from the environment and runs `fn` for this process only, so one script serves both.

Return values travel as one `torch.save` file per rank, complete before the rank exits
(rank_results.py): tensors (CUDA ones arrive on the CPU), nested lists/tuples/dicts of them,
state dicts of any size, anything picklable.  A value that cannot be pickled is an error naming
the rank, where in the value and its type.

Everything is bounded: the process group has `timeout`; the join has `join_timeout`.  When a
rank fails, the others stop (a receive from an exited rank fails at once, a stuck one at the
process-group timeout); the launcher then raises `PipeRuntimeError` naming the rank that
failed first (not the ranks that stopped because of it: a rank whose own work failed outranks
any whose error says a peer went away), the user's frames of its traceback, and every other
rank's error as a note.
Ranks are forked from a server that imported torch once (fork_server.py), with spawn's semantics.
SIGTERM, SIGINT or SIGHUP to the launcher stop every rank and raise `Interrupted` (exit status
128 + signal); a rank whose launcher died exits by itself (lifecycle.py).  More local ranks than
the machine can sensibly run are refused before anything starts (capacity.py).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import math
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pipedsl.errors import PipeDSLError, PipeRuntimeError
from pipedsl.perf import freeze_imports
from pipedsl.runtime.launch import world_store
from pipedsl.runtime.launch.capacity import check_local_ranks, usable_cores
from pipedsl.runtime.launch.errors import RankFailure, failure_order, is_consequence, record_failure
from pipedsl.runtime.launch.fork_server import TORCHRUN_ENV, rank_context
from pipedsl.runtime.launch.lifecycle import (
    STOP_GRACE,
    StopSignals,
    follow_launcher,
    launcher_gone,
    report_interrupt,
    signals_held,
    stop_processes,
)
from pipedsl.runtime.launch.rank_results import (
    UnreturnableResult,
    has_result,
    read_error,
    read_result,
    write_error,
    write_result,
)
from pipedsl.runtime.launch.tracebacks import exception_line, frames_of, trace_of

_RANK_NAME = "pipedsl-rank"  # a rank process's name: the prefix, then its rank
MAX_SECONDS = 365 * 86400.0  # a year: beyond it a timeout is a typo (and overflows timedelta near 1e14 s)


def under_torchrun() -> bool:
    return all(k in os.environ for k in TORCHRUN_ENV) and not dist.is_initialized()


def default_backend(nprocs: int) -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "gloo"


def init_process_group(rank: int, world_size: int, backend: str | None = None, timeout: float = 300.0,
                       local_rank: int | None = None, world: tuple[int, str] | None = None) -> None:
    """Initialise the default group: from MASTER_ADDR/MASTER_PORT (env://), or in the launcher's `world`
    (its store's port and the world's prefix: world_store.py)."""
    backend = backend or default_backend(world_size)
    kwargs: dict[str, Any] = {"init_method": "env://"}
    if world is not None:
        kwargs = {"store": world_store.joined(*world, timeout)}
    if backend == "nccl":
        if getattr(torch.cuda, "_is_in_bad_fork", lambda: False)():
            raise PipeDSLError("CUDA was initialised in the fork server this rank was forked from (a preloaded "
                               "module touched the GPU): set PIPEDSL_START_METHOD=spawn")
        local = rank if local_rank is None else local_rank
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout), **kwargs)
    if backend == "gloo":
        # gloo connects every pair of ranks as it initialises, and a rank can finish before its peers: one whose
        # function returns (or fails) at once would close its sockets under a peer still connecting, which would
        # then report gloo's "connectFullMesh failed" instead of its own outcome (seen on a loaded machine)
        dist.barrier()


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, backend: str | None = None,
           timeout: float = 300.0, join_timeout: float = 3600.0, threads: int | None = None,
           max_local: int | None = None, stop_grace: float = STOP_GRACE) -> list[Any]:
    """Run `fn(rank, *args)` on `nprocs` ranks; their return values in rank order (see the module docstring).

    `max_local` lifts (or lowers) the limit on local processes (runtime/launch/capacity.py); `stop_grace`
    is how long a rank may take to exit after SIGTERM when the launcher is interrupted.
    """
    if getattr(mp.current_process(), "_inheriting", False):
        _refuse_unguarded_launch()
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init_process_group(rank, world, backend, timeout, int(os.environ.get("LOCAL_RANK", rank)))
        faulthandler.enable(file=sys.stderr, all_threads=True)  # as a forked rank (`_child`)
        freeze_imports()  # as a forked rank
        try:
            return [fn(rank, *args)]
        except BaseException as err:
            if not is_consequence(err):
                record_failure(rank, _message(err))
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            # a finished Pipeline holds its gloo groups in reference cycles: freed now, not during the
            # interpreter's shutdown, where a group's threads still running abort the process (SIGABRT)
            gc.collect()
    check_local_ranks(nprocs, max_local)
    for name, value in (("timeout", timeout), ("join_timeout", join_timeout), ("stop_grace", stop_grace)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 < value <= MAX_SECONDS):
            raise PipeDSLError(f"launch: {name} must be a number of seconds in (0, {MAX_SECONDS:g}], got {value!r}")
    world_store.warm(timeout)  # before the fork server starts (seconds, the first time): the master ages meanwhile
    ctx = rank_context()
    outbox = tempfile.mkdtemp(prefix="pipedsl-launch-")  # one result or error file per rank
    try:
        with StopSignals() as signals:
            # The rendezvous store lives here, in the launcher: it outlives any rank, so the ranks can
            # always read which one failed first (see errors.py).
            port, prefix, store = world_store.new_world(timeout)
            threads = threads or max(1, usable_cores() // nprocs)
            with signals_held():  # signals recorded, not lost
                env = dict(os.environ)
                procs = [ctx.Process(target=_child, args=(fn, rank, nprocs, (port, prefix), backend, timeout, threads,
                                                          outbox, os.getpid(), env, args), name=f"{_RANK_NAME}{rank}")
                         for rank in range(nprocs)]
                for p in procs:
                    p.start()
            outcome = _join(procs, signals, grace=timeout + 15.0, join_timeout=join_timeout, stop_grace=stop_grace)
            outcome["order"] = failure_order(store)
            del store
        if outcome["interrupted"] is not None:
            raise report_interrupt(outcome["interrupted"], outcome["stopped"])
        return _report(outcome, procs, join_timeout, outbox)
    finally:
        shutil.rmtree(outbox, ignore_errors=True)


UNGUARDED = ("pipedsl.launch was called while a rank imports your script: put the call under "
             "`if __name__ == \"__main__\":` (each rank imports the script again)")
UNGUARDED_STATUS = 86  # a rank's exit status for UNGUARDED: it exits while importing, before it can report


def _refuse_unguarded_launch() -> None:
    """A rank re-imports the user's script as __mp_main__: a module-level launch() there would start ranks
    from a rank (multiprocessing's RuntimeError, a long traceback per rank).  A rank exits with
    UNGUARDED_STATUS, which the launcher reports as UNGUARDED (the rank cannot write its outbox yet: its
    environment is handed over after the import); anywhere else, the message and exit status 2."""
    name = mp.current_process().name
    if name.startswith(_RANK_NAME) and name[len(_RANK_NAME):].isdigit():
        os._exit(UNGUARDED_STATUS)  # a forked rank's SystemExit would become status 1
    print(UNGUARDED, file=sys.stderr, flush=True)
    raise SystemExit(2)


def _message(err: BaseException) -> str:
    """A rank's error for the launcher: its message, then the user's frames down to where it was raised."""
    if isinstance(err, RankFailure) and err.trace is not None:
        trace = err.trace.under(frames_of(err.__traceback__, innermost=False))  # the user's loop that called step
        return "\n".join([err.message, *(f"  {line}" for line in trace.lines())])
    if isinstance(err, PipeDSLError):
        return err.message
    return "\n".join([exception_line(err), *(f"  {line}" for line in trace_of(err).lines())])


def _child(fn: Callable[..., Any], rank: int, world: int, store_at: tuple[int, str], backend: str | None,
           timeout: float, threads: int, outbox: str, launcher_pid: int, env: dict[str, str], args: tuple) -> None:
    os.environ.clear()  # a forked rank has the fork server's environment: the launcher's, as spawn gives
    os.environ.update(env)
    follow_launcher(launcher_pid, rank)
    # a rank that dies by a signal (heap corruption's SIGABRT, a SIGSEGV in an extension) prints where each of its
    # threads was: the launcher can only say which signal it was
    faulthandler.enable(file=sys.stderr, all_threads=True)
    freeze_imports()  # what the fork server imported (torch: ~170,000 objects) is never garbage: no collection walks it
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_at[0]), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    code = 0
    try:
        init_process_group(rank, world, backend, timeout, world=store_at)
        value = fn(rank, *args)
    except BaseException as err:  # noqa: BLE001 - reported to the parent, then a hard exit
        if launcher_gone():  # (and its store): nobody to tell
            os._exit(1)
        consequence = is_consequence(err)
        message = _message(err)
        if not consequence:
            record_failure(rank, message)
        write_error(outbox, rank, message, consequence)
        code = 1
    else:
        try:
            write_result(outbox, rank, value)  # complete on disk before this process exits
        except UnreturnableResult as err:
            write_error(outbox, rank, str(err), False)
            code = 1
        except OSError as err:
            write_error(outbox, rank, f"cannot write its result for the launcher: {err}", False)
            code = 1
    if code == 0:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    # a hard exit: never hang in the process group's teardown; peers see the closed sockets at once
    os._exit(code)


def _join(procs: list, signals: StopSignals, grace: float, join_timeout: float, stop_grace: float) -> dict[str, Any]:
    """Wait for every rank; kill the rest `grace` s after one failed, all at the join timeout or on a signal."""
    deadline = time.monotonic() + join_timeout
    failed_at = None
    timed_out = False
    killed: set[int] = set()
    while signals.received is None:
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
        time.sleep(0.05)
    stopped = 0
    if signals.received is not None:
        stopped = sum(1 for p in procs if p.pid is not None and p.exitcode != 0)
        stop_processes(procs, stop_grace, hurry=lambda: signals.repeated)
    return {"timed_out": timed_out, "killed": killed, "grace": grace, "interrupted": signals.received,
            "stopped": stopped}


def _report(outcome: dict[str, Any], procs: list, join_timeout: float, outbox: str) -> list[Any]:
    errors: dict[int, str] = {}
    causes: list[int] = []
    for rank, p in enumerate(procs):
        recorded = read_error(outbox, rank)
        if recorded is None and p.exitcode == 0 and has_result(outbox, rank):
            continue
        if recorded is not None:
            message, consequence = recorded
            errors[rank] = message
            if not consequence:
                causes.append(rank)
        elif rank in outcome["killed"] and not outcome["timed_out"]:
            errors[rank] = f"stuck: still running {outcome['grace']:g} s after another rank stopped; killed"
        elif p.exitcode == UNGUARDED_STATUS:
            errors[rank] = UNGUARDED
            causes.append(rank)
        elif p.exitcode is not None and p.exitcode < 0 and rank not in outcome["killed"]:
            errors[rank] = f"killed by signal {signal.Signals(-p.exitcode).name}"
            causes.append(rank)
        elif p.exitcode is None or outcome["timed_out"]:
            errors[rank] = f"still running after the join timeout ({join_timeout:g} s); killed"
        else:
            errors[rank] = f"exited with status {p.exitcode} without reporting an error"
            causes.append(rank)
    if not errors:
        return [_read(outbox, rank) for rank in range(len(procs))]
    # the first to record a failure of its own (a peer's lost connection is never one), then one that vanished;
    # if no rank failed on its own, the ones that stopped blamed a peer: blame the one left running (stuck)
    order = [r for r in outcome.get("order", ()) if r in causes]
    causes = order + [r for r in causes if r not in order]
    stuck = sorted(outcome["killed"]) if not outcome["timed_out"] else []
    first = causes[0] if causes else (stuck[0] if stuck else min(errors))
    notes = tuple(f"rank {r}: {m.splitlines()[0] if m else m}" for r, m in sorted(errors.items()) if r != first)
    raise PipeRuntimeError(f"rank {first} failed: {errors[first]}", notes=notes)


def _read(outbox: str, rank: int) -> Any:
    try:
        return read_result(outbox, rank)
    except Exception as err:  # noqa: BLE001 - e.g. a class the launcher cannot import
        raise PipeRuntimeError(f"rank {rank} returned a value the launcher cannot load: "
                               f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from None
