"""Where local ranks are started from: a fork server that imported torch once.

A spawned rank starts a new interpreter and imports torch, pipedsl and the model's code again:
seconds of CPU per rank (4 ranks took 25 s to start on a loaded 2-core machine).  A fork server
(multiprocessing's "forkserver" start method) is one process, started by the launcher, that
imports those modules once and forks a rank per request: a rank then costs a fork (0.3 s for 4).
A rank still gets what spawn gives it — the launcher's current environment (`launch` hands it
over), working directory and sys.path, and the user's script imported as __mp_main__ — so code
that runs under spawn runs the same.  Where the platform has no fork server (Windows), spawn.

`PIPEDSL_START_METHOD=spawn` starts every rank the old way (an escape hatch for code that must not
be imported before a fork, and the baseline of benchmarks/startup.py).

The server is started with SIGINT and SIGHUP blocked (the ranks it forks inherit that, as
spawned ranks do from `signals_held`), ignores SIGINT itself, and exits when the process that
started it does.  `start` may be called early — `pipedsl train` calls it before its own imports
and checks — so the server's imports overlap the command's; the first caller's `preload` is the
one that counts.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Sequence
from typing import Any

from pipedsl.errors import PipeDSLError
from pipedsl.runtime.launch.lifecycle import signals_held

ALWAYS = ("torch", "torch.distributed", "pipedsl.runtime.launch.launcher",  # what every rank imports, and builds:
          "pipedsl.runtime.preload")  # by name: the server imports it, this module does not
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR")  # torchrun's: then `launch` starts no process
METHOD_ENV = "PIPEDSL_START_METHOD"
METHODS = ("forkserver", "spawn")


def method() -> str:
    """How ranks start here: PIPEDSL_START_METHOD (default forkserver), spawn where there is no fork server."""
    chosen = os.environ.get(METHOD_ENV, "forkserver")
    if chosen not in METHODS:
        raise PipeDSLError(f"{METHOD_ENV}={chosen!r}: expected one of {', '.join(METHODS)}")
    return chosen if chosen in mp.get_all_start_methods() else "spawn"


def rank_context(preload: Sequence[str] = ()) -> Any:
    """The multiprocessing context to start ranks with: the fork server's (started if needed), or spawn's."""
    if method() == "spawn":
        return mp.get_context("spawn")
    start(preload)
    return mp.get_context("forkserver")


def start(preload: Sequence[str] = ()) -> None:
    """Start the fork server now, importing `preload` (module names) besides torch and the launcher, unless it
    runs already or ranks are spawned here.  Returns at once: the server imports in the background, and the
    first rank it forks waits for that."""
    if method() == "spawn":
        return
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(dict.fromkeys([*ALWAYS, *preload])))
    with signals_held():
        forkserver.ensure_running()
