"""`make test`: the whole suite as two parts run side by side, one pytest session each.

Most single-process tests keep one core busy; the multi-process tests' ranks wait on each other part of the time.
One session left a core idle for much of the run; two, each taking what the other leaves, use both.  The split is
one rule (tests/conftest.py, `part_of`): part 2 is the slow tests of the folders whose time is ranks (models,
parallel, runtime, the language's, the benchmarks'), part 1 everything else — the everyday tier of `make
test-quick` and the trainer's, planner's and reliability tests, mostly one process each (docs/testing.md).

    python tests/parts.py [pytest options…]     # both parts, each given the options; exit status 0 if both pass

Each session writes to its own log, printed whole when it ends (the quicker one first), so the two never
interleave.  Ctrl-C or SIGTERM stops both sessions and everything they started (each runs in its own process
group); the exit status is then 128 + the signal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PARTS = {"part 1 (everyday tier, trainer, planner, reliability)": "1/2",
         "part 2 (multi-process: models, parallel, runtime, language)": "2/2"}
ROOT = Path(__file__).resolve().parents[1]
NO_TESTS = 5  # pytest's status when a selection leaves a part nothing to run: fine for one part, not for both


def _log(folder: Path, part: str) -> Path:
    return folder / f"part-{part[0]}.log"


def _start(part: str, args: list[str], folder: Path) -> subprocess.Popen:
    """One part's session: its own temporary-files root, no shared cache file (two sessions would overwrite each
    other's record of failures)."""
    out = _log(folder, part).open("w")
    try:
        return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "--part", part, "-p", "no:cacheprovider",
                                 "--basetemp", str(folder / f"part-{part[0]}-tmp"), *args], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        out.close()  # the child holds its own copy


def _stop_all(procs: dict[str, subprocess.Popen]) -> None:
    """Every session's whole process group: pytest, its pool's workers, its fork server, the ranks."""
    for proc in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    for proc in procs.values():
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main(args: list[str]) -> int:
    logs = Path(tempfile.mkdtemp(prefix="pipedsl-parts-"))
    started = time.monotonic()
    procs = {name: _start(part, args, logs) for name, part in PARTS.items()}

    def stop(signum: int, _frame: object) -> None:
        _stop_all(procs)
        print(f"==== stopped by {signal.Signals(signum).name}: both parts' processes ended; logs in {logs} ====")
        sys.exit(128 + signum)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    codes: dict[str, int] = {}
    while len(codes) < len(procs):
        for name, proc in procs.items():
            if name not in codes and proc.poll() is not None:
                codes[name] = proc.returncode
                print(f"==== {name}: exit status {proc.returncode} after {time.monotonic() - started:.0f} s ====")
                print(_log(logs, PARTS[name]).read_text(errors="replace"), flush=True)
        time.sleep(0.5)
    print(f"==== both parts done in {time.monotonic() - started:.0f} s: "
          + ", ".join(f"{name} {code}" for name, code in codes.items()) + " ====")
    failed = [code for code in codes.values() if code not in (0, NO_TESTS)]
    return failed[0] if failed else (NO_TESTS if set(codes.values()) == {NO_TESTS} else 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
