"""`python tests/run_shards.py N [pytest arguments]`: the suite as N pytest processes side by side, each running
the part `--shard K/N` selects (tests/shards.py: whole files, balanced by tests/durations.txt).  Most of the suite
keeps one core of two busy (a single-process test, a rank waiting for its peer), so two parts share the machine
better than one.  Each part writes its own log, printed whole when it ends; the exit status is the worst part's
(a part that selected nothing counts as passed).  Stopped (Ctrl-C, SIGTERM), it stops every part and everything
each one started: each part leads a process group of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NO_TESTS = 5  # pytest's exit status when a part selected nothing
STOP_GRACE = 10.0  # seconds a stopped part has to end before it is killed


def _stop(procs: list[subprocess.Popen]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
        deadline = time.monotonic() + STOP_GRACE
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    if not argv or not argv[0].isdigit() or int(argv[0]) < 1:
        print("usage: python tests/run_shards.py N [pytest arguments]", file=sys.stderr)
        return 2
    n, args = int(argv[0]), argv[1:]
    here = Path(__file__).resolve().parent.parent
    logs = Path(tempfile.mkdtemp(prefix="pipedsl-shards-"))
    procs = []
    for k in range(1, n + 1):
        with open(logs / f"part-{k}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "pytest", f"--shard={k}/{n}", *args], cwd=here,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    signal.signal(signal.SIGTERM, _interrupt)
    start, status, left = time.monotonic(), 0, dict(enumerate(procs, 1))
    try:
        while left:
            for k, proc in list(left.items()):
                code = proc.poll()
                if code is None:
                    continue
                del left[k]
                text = (logs / f"part-{k}.log").read_text()
                print(f"==================== part {k}/{n} (exit {code}, {time.monotonic() - start:.0f} s) "
                      f"====================\n{text}", flush=True)
                status = max(status, 0 if code == NO_TESTS else code)
            time.sleep(0.5)
    except KeyboardInterrupt:
        _stop(procs)
        print(f"stopped; the parts' logs are in {logs}", file=sys.stderr)
        return 130
    print(f"all {n} parts in {time.monotonic() - start:.0f} s, exit {status}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
