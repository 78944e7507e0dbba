"""One reusable group of local processes per size, started once per test session.

Spawning ranks is slow on a small machine, so each group (`pool2`, `pool4`) runs many checks:
`pool.run(fn, *args)` calls `fn(rank, *args)` on every rank (a module-level function, e.g.
from `runtime_cases`) and returns the results in rank order.  A check must fail *uniformly*
(every rank, before any message) or return its findings: a rank left waiting on one that
raised would wait out the process-group timeout.  Checks that make one rank fail use
`pipedsl.launch` directly, with fresh processes.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
from typing import Any

import pytest

import pipedsl

RESULT_TIMEOUT = 240.0  # seconds for one check on every rank
PG_TIMEOUT = 60.0


def _serve(rank: int, tasks: list, results: Any) -> None:
    import traceback

    import torch

    torch.set_num_threads(1)
    while True:
        item = tasks[rank].get()
        if item is None:
            return
        fn, args = item
        try:
            results.put((rank, True, fn(rank, *args)))
        except Exception as err:  # noqa: BLE001 - handed to the test
            results.put((rank, False, f"{type(err).__name__}: {err}\n{traceback.format_exc()[-1500:]}"))


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
        while len(out) < self.nprocs:
            try:
                rank, ok, value = self.results.get(timeout=RESULT_TIMEOUT)
            except queue.Empty:
                raise RuntimeError(f"no answer from ranks {sorted(set(range(self.nprocs)) - set(out))} "
                                   f"within {RESULT_TIMEOUT} s (error: {self.error})") from None
            out[rank] = (ok, value)
        failed = {r: v for r, (ok, v) in out.items() if not ok}
        if failed:
            raise AssertionError("\n".join(f"rank {r}: {v}" for r, v in sorted(failed.items())))
        return [out[r][1] for r in range(self.nprocs)]

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        self.thread.join(60)


@pytest.fixture(scope="session")
def pool2():
    p = Pool(2)
    yield p
    p.close()


@pytest.fixture(scope="session")
def pool4():
    p = Pool(4)
    yield p
    p.close()


@pytest.fixture
def pools(request):
    """pools[P] for the sizes a parametrized test asks for (started on first use)."""
    class _Lazy(dict):
        def __missing__(self, P: int) -> Pool:
            self[P] = request.getfixturevalue(f"pool{P}")
            return self[P]
    return _Lazy()
