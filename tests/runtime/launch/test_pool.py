"""The one worker pool (runtime/launch/pool.py): what it refuses at once instead of waiting out a timeout."""

from __future__ import annotations

import pytest
from launch_cases import fail_and_read

from pipedsl.runtime.launch.pool import LocalPool, WorkerError


def test_a_function_the_workers_cannot_receive_is_refused_before_any_process_starts() -> None:
    """A queue pickles in a thread of its own: a lambda (or a conftest function, whose module name is
    ambiguous) used to leave the workers waiting until the run's timeout."""
    pool = LocalPool(2, timeout=5)
    with pytest.raises(WorkerError, match="cannot be sent to the workers"):
        pool.run(lambda: 1, 2)
    assert not pool._procs
    pool.close()


def test_a_world_larger_than_the_pool_is_refused() -> None:
    with pytest.raises(WorkerError, match="a world of 3 ranks does not fit a pool of 2 workers"):
        LocalPool(2).run(print, 3)


@pytest.mark.quick
def test_a_reused_world_starts_with_no_failure_recorded(pool2) -> None:
    """A run on the same world as the last (`same_world`) shares its store: a failure an earlier run recorded was
    read as the cause of a later run's (a rank named "gone or stuck" where its own peer had said why)."""
    assert pool2.run(fail_and_read, True) == [(0, "rank 0's own failure")] * 2
    assert pool2.run(fail_and_read, False) == [None, None]
