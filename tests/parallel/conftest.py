"""One pool of 8 local processes for the whole session; each job runs once and many tests read its results."""

from __future__ import annotations

import pytest

from pipedsl.parallel.pool import LocalPool


@pytest.fixture(scope="session")
def pool():
    p = LocalPool(8, timeout=240)
    yield p
    p.close()


@pytest.fixture(scope="session")
def run_once(pool):
    """`run_once(fn, world, *args)`: the per-rank results of `fn` on a gloo world, computed once per session."""
    cache: dict = {}

    def run(fn, world: int, *args):
        key = (fn.__module__, fn.__qualname__, world, args)
        if key not in cache:
            try:
                cache[key] = ("ok", pool.run(fn, world, *args))
            except Exception as err:  # noqa: BLE001 - every test reading this job fails with it
                cache[key] = ("err", err)
        kind, value = cache[key]
        if kind == "err":
            raise value
        return value

    return run
