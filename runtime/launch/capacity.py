"""How many ranks one machine may start locally, checked before any process starts (issue 13).

Every local rank is a full Python process with torch imported (~0.3-0.5 GB resident before
any model) and its own threads, so a dp x pp x tp product in the hundreds on a laptop would not
train slowly: it would exhaust memory or process limits and take the machine with it.  The
default limit is

    max(8, min(4 x usable CPU cores, total RAM / 512 MiB))

— four ranks per core is already heavy time-slicing; 512 MiB per rank is roughly the floor of
an idle torch process plus a tiny model; 8 always works (the test suite runs 8 ranks on 2
cores, slowly but correctly).  Going beyond it is a decision the user states:
`launch(..., max_local=N)` or `pipedsl train/run --allow-oversubscribe`.  Many ranks belong
on many machines: run the same script under `torchrun`.
"""

from __future__ import annotations

import os

from pipedsl.errors import PipeDSLError

FLOOR = 8
RANKS_PER_CORE = 4
BYTES_PER_RANK = 512 * 2**20


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity mask: a container's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def total_memory() -> int | None:
    """Physical memory in bytes, or None where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def available_memory() -> int | None:
    """Memory the machine can still give (Linux's MemAvailable, which counts reclaimable cache), else its physical
    memory, else None."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return total_memory()


def max_local_ranks() -> int:
    """The default limit on local ranks (see the module docstring)."""
    by_cores = RANKS_PER_CORE * usable_cores()
    memory = total_memory()
    by_memory = memory // BYTES_PER_RANK if memory else by_cores
    return max(FLOOR, min(by_cores, by_memory))


def check_local_ranks(n: int, limit: int | None = None, what: str = "", override: str = "max_local=N") -> None:
    """Refuse to start `n` local processes when `n` exceeds `limit` (default `max_local_ranks()`)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PipeDSLError(f"{what or 'nprocs'} must be a positive integer, got {n!r}")
    limit = max_local_ranks() if limit is None else limit
    if n > limit:
        cores = usable_cores()
        raise PipeDSLError(f"{what or 'nprocs'} = {n} local processes is more than this machine runs sensibly "
                           f"(limit {limit}: {RANKS_PER_CORE} per core on {cores} core{'s' if cores != 1 else ''}, "
                           f"{BYTES_PER_RANK >> 20} MiB of RAM each, at least {FLOOR}); "
                           f"use torchrun for several machines, or {override} to run them anyway")
