"""Stopping a local run from outside, without orphans (issue 13).

Launcher side: while `launch` waits for its ranks, SIGTERM, SIGINT and SIGHUP (what a job
scheduler, `timeout`, Ctrl-C or a closed terminal sends) are *recorded*, not acted on in the
middle of whatever the launcher was doing (`StopSignals`); its wait loop then stops every rank
— SIGTERM (plus SIGCONT, so a stopped rank sees it), SIGKILL after a grace period — reaps them,
prints one line (``interrupted by SIGTERM: stopped 4 ranks``) and raises `Interrupted`, a
`SystemExit` with status 128 + signal: uncaught, the program exits with that status and no
traceback, exactly as `pipedsl train` does.  A signal the process ignores (`nohup`, a
background job's SIGINT) stays ignored.  The same three signals outside `launch` (the CLI
compiling, writing its outputs) end the CLI the same way (`exit_on_signals`).

Rank side: ranks ignore SIGINT and SIGHUP (Ctrl-C and a hang-up reach the whole process group:
the launcher decides) and die on SIGTERM; they start with SIGINT and SIGHUP blocked
(`signals_held`), so a Ctrl-C while a rank still imports torch is no traceback either.  A rank
whose launcher is gone — SIGKILLed, or crashed — exits by itself: on Linux the kernel sends it
SIGKILL (PR_SET_PDEATHSIG; a rank's parent is the launcher's fork server, which exits with the
launcher), and everywhere a watchdog thread wakes when the launcher's end of multiprocessing's
parent pipe closes.
Checkpoints need nothing here: a part or manifest is renamed into place only when complete,
so a rank stopped while writing leaves nothing that counts.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))
STOP_GRACE = 5.0  # seconds a rank has between SIGTERM and SIGKILL


class Interrupted(SystemExit):  # noqa: N818 - the name says what happened; SystemExit gives the status
    """The launcher got a stop signal and stopped its ranks; exits with status 128 + signal unless caught."""

    def __init__(self, signum: int, stopped: int) -> None:
        self.signal = signal.Signals(signum)
        self.stopped = stopped
        super().__init__(128 + int(signum))

    def __str__(self) -> str:
        if not self.stopped:  # before any rank started (compiling, checking, drawing)
            return f"interrupted by {self.signal.name}"
        return f"interrupted by {self.signal.name}: stopped {self.stopped} rank{'' if self.stopped == 1 else 's'}"


class StopSignals:
    """While active, the stop signals are recorded in `received` (the first) instead of raising.

    Only the main thread may install signal handlers: from another thread this does nothing and
    the process keeps its own handling.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.repeated = False  # a second signal: stop without the grace period
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        else:
            self.repeated = True

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                previous = signal.getsignal(s)
                if previous is not signal.SIG_IGN:  # nohup'd: stay deaf to it
                    self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Block SIGINT and SIGHUP while ranks are started: a new process inherits the mask, so a Ctrl-C
    that reaches a rank still importing torch stays pending (and is then discarded by
    `follow_launcher`) instead of printing a `KeyboardInterrupt` traceback; the launcher gets
    its own copy when the block ends.  SIGTERM stays deliverable: it ends a starting rank silently."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    # multiprocessing starts its resource tracker with the first spawned process and *unblocks*
    # SIGINT and SIGTERM afterwards: started now, it leaves the mask below alone
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, [s for s in STOP_SIGNALS if s != signal.SIGTERM])
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def stop_processes(procs: Sequence[Any], grace: float, hurry: Any = None) -> None:
    """SIGTERM (+SIGCONT) every live process, SIGKILL whatever is left after `grace` s, reap all.

    `hurry()` (optional) is polled: when it turns true, the rest get SIGKILL at once.
    """
    alive = [p for p in procs if p.pid is not None and p.exitcode is None]
    for p in alive:
        for s in (signal.SIGTERM, signal.SIGCONT):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, s)
    deadline = time.monotonic() + grace
    while any(p.exitcode is None for p in alive) and time.monotonic() < deadline and not (hurry and hurry()):
        time.sleep(0.02)
    for p in alive:
        if p.exitcode is None:
            p.kill()
    for p in alive:
        p.join(10)


def report_interrupt(signum: int, stopped: int) -> Interrupted:
    """Print the one line for an interrupted run and return the exception that ends it."""
    err = Interrupted(signum, stopped)
    print(err, file=sys.stderr, flush=True)
    return err


@contextlib.contextmanager
def exit_on_signals() -> Iterator[None]:
    """For the CLI around its own work: a stop signal ends it with `Interrupted` (no ranks yet)."""
    def handle(signum: int, frame: FrameType | None) -> None:
        raise report_interrupt(signum, 0)

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for s in STOP_SIGNALS:
            if signal.getsignal(s) is not signal.SIG_IGN:
                previous[s] = signal.signal(s, handle)
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old if old is not None else signal.SIG_DFL)


# ---------------------------------------------------------------- on every rank


def follow_launcher(launcher_pid: int, rank: int) -> None:
    """Make this rank exit when its launcher is gone (and leave stop decisions to the launcher)."""
    for s in STOP_SIGNALS:
        if s != signal.SIGTERM:
            signal.signal(s, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):  # started with SIGINT/SIGHUP blocked (signals_held); now ignored
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    if str(rank) not in os.environ.get("PIPEDSL_NO_PDEATHSIG", "").split(","):  # test-only: the watchdog alone
        _let_the_fork_server_go()
        _set_parent_death_signal(signal.SIGKILL)
    if str(rank) not in os.environ.get("PIPEDSL_NO_WATCHDOG", "").split(","):  # test-only: the kernel's signal alone
        threading.Thread(target=_watch, args=(launcher_pid, rank), name="pipedsl-launcher-watch", daemon=True).start()


def launcher_gone() -> bool:
    """True once the launcher has exited (its end of multiprocessing's parent pipe is closed: exact for a
    spawned rank and for one forked by the fork server, whose parent process is the server)."""
    parent = multiprocessing.parent_process()
    return parent is not None and not parent.is_alive()


def _watch(launcher_pid: int, rank: int) -> None:
    parent = multiprocessing.parent_process()
    if parent is None:  # not started by multiprocessing: nothing to follow
        return
    parent.join()  # blocks until the launcher is gone: no polling
    with contextlib.suppress(Exception):
        print(f"pipedsl rank {rank}: the launcher (pid {launcher_pid}) is gone; exiting", file=sys.stderr, flush=True)
    os._exit(128 + signal.SIGHUP)


def _let_the_fork_server_go() -> None:
    """A forked rank holds a copy of the fork server's keep-alive pipe, which would keep the server — this
    rank's parent — alive after the launcher died, and so the parent-death signal from ever firing.  A rank
    that starts processes through a fork server starts its own (CPython's private name; absent: no-op)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None


def _set_parent_death_signal(signum: int) -> None:
    """Linux: the kernel sends `signum` to this process when its parent exits (best effort elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signum), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
