"""Rendezvous stores for local ranks: one TCPStore master that a launching process keeps, one namespace a world.

A client that connects to a TCPStore master in the first few hundred milliseconds of the master's life sometimes
waits 5 s for its first answer (measured on this project's CI machine: one local launch in fifteen, one pool world
in ten; to a master 0.3 s old, none in 80).  A launcher that made a master per launch paid it on every launch whose
ranks started at once, and the test pool on every new world.  So the master is made once per process (`warm`, the
first launch or world) and kept; each launch or world works under a prefix of its own (`new_world`), which also
keeps one world's keys — the failures its ranks recorded (errors.py) — apart from the next one's.  A rank joins with
`joined`; a pool worker, which joins many worlds, keeps its one client of the master.
"""

from __future__ import annotations

import datetime
import itertools
import os

import torch.distributed as dist

_master: tuple[int, dist.TCPStore] | None = None  # (the process that made it, it): a forked child makes its own
_clients: dict[int, tuple[int, dist.TCPStore]] = {}  # port → (this process, its client of that master)
_worlds = itertools.count()


def _seconds(timeout: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout)


def warm(timeout: float) -> dist.TCPStore:
    """This process's master, made now if it has none: call it before starting ranks, so that it is old enough
    by the time they connect."""
    global _master
    if _master is None or _master[0] != os.getpid():
        _master = (os.getpid(), dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                              timeout=_seconds(timeout)))
    return _master[1]


def new_world(timeout: float) -> tuple[int, str, dist.Store]:
    """A fresh world on this process's master: (the master's port, the world's prefix, the world's store as the
    launcher reads it)."""
    master = warm(timeout)
    prefix = f"world-{next(_worlds)}/"
    store = dist.PrefixStore(prefix, master)
    store.set_timeout(_seconds(timeout))
    return master.port, prefix, store


def joined(port: int, prefix: str, timeout: float) -> dist.Store:
    """A rank's store of the world `prefix` on the master at `port` (its process's one client of that master)."""
    found = _clients.get(port)
    if found is None or found[0] != os.getpid():
        found = _clients[port] = (os.getpid(), dist.TCPStore("127.0.0.1", port, is_master=False,
                                                              timeout=_seconds(timeout)))
    store = dist.PrefixStore(prefix, found[1])
    store.set_timeout(_seconds(timeout))
    return store
