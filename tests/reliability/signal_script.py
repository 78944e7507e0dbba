"""A user's script for test_signals.py: `pipedsl.launch` of ranks that write their pids and wait.

Rank 1 ignores SIGTERM, so stopping it needs the launcher's SIGKILL after the grace period.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pipedsl


def wait_forever(rank: int, directory: str) -> None:
    if rank == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    path = os.path.join(directory, f"pid-{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)  # whole when it appears, and the handler above is in place by then
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    pipedsl.launch(wait_forever, 2, sys.argv[1], timeout=60.0, stop_grace=1.0)
    print("not reached")
