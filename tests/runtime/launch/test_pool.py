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


OWNER = """
import os, signal, sys
from pipedsl.runtime.launch.pool import LocalPool
if __name__ == "__main__":
    pool = LocalPool(2, timeout=60)
    print(*pool.run(os.getpid, 2), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit: the workers are on their own
"""


def test_the_workers_of_a_killed_pool_owner_exit_by_themselves(tmp_path) -> None:
    """A test session killed with its pool open left the eight workers waiting on their job queues, and their fork
    server alive through them, for good; they now follow their owner as a rank follows its launcher."""
    import subprocess
    import sys
    import time

    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    pids = [int(p) for p in proc.stdout.split()]
    assert proc.returncode == -9 and len(pids) == 2, (proc.stdout, proc.stderr[-2000:])

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rpartition(")")[2].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 30
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if alive(pid)], "pool workers outlived their owner"
