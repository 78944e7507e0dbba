"""One reusable group of local processes per size, started once per test session.

Spawning ranks is slow on a small machine, so each group (`pool2`, `pool4`) runs many checks:
`pool.run(fn, *args)` calls `fn(rank, *args)` on every rank (a module-level function, e.g.
from `runtime_cases`) and returns the results in rank order.  A check must fail *uniformly*
(every rank, before any message) or return its findings: a rank left waiting on one that
raised would wait out the process-group timeout.  Checks that make one rank fail use
`pipedsl.launch` directly, with fresh processes.
"""

from __future__ import annotations

import pytest
from process_pool import Pool


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
