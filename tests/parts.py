"""`make test`: the whole suite as three parts run side by side, one pytest session each.

Linux shares the CPU by thread: beside the multi-process tests' ranks (a pool of eight), one chain of single-process
tests gets a small share and ends last, while two parts left a core idle at the end (801 s for two parts, 684 s for
three, the same machine within the hour; docs/testing.md).  The split is one rule (tests/conftest.py, `part_of`):
part 3 is the slow tests of the folders whose time is ranks (models, parallel, runtime, the language's, the
benchmarks'), part 2 the trainer's and reliability's tests (whole commands, signals, faults), part 1 the rest — the
everyday tier of the language, models and runtime, the planner's, the plots' and the top-level tests.

    python tests/parts.py [pytest options…]     # every part, each given the options; exit status 0 if all pass

Part 2 is one chain of whole commands, each a process that imports torch and starts its own ranks, while parts 1 and
3 run many processes at once: shared by thread, the chain got a tenth of the machine and ended last, alone, with a
core idle (a run's last 40 s).  So parts 1 and 3 run at a lower priority (`NICE`): the chain takes the CPU it needs,
the others fill the rest, and the three end together.

Each session writes to its own log, printed whole when it ends (the quickest first), so they never interleave.
Ctrl-C or SIGTERM stops every session and everything they started (each runs in its own process group); the exit
status is then 128 + the signal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PARTS = {"part 1 (everyday tier: language, models, runtime; planner, plots)": "1/3",
         "part 2 (commands: trainer, reliability)": "2/3",
         "part 3 (multi-process: models, parallel, runtime, language)": "3/3"}
NICE = {"1/3": 4, "2/3": 0, "3/3": 4}  # each part's niceness (the module docstring)
ROOT = Path(__file__).resolve().parents[1]
NO_TESTS = 5  # pytest's status when a selection leaves a part nothing to run: fine for one part, not for all


def _log(folder: Path, part: str) -> Path:
    return folder / f"part-{part[0]}.log"


def _start(part: str, args: list[str], folder: Path) -> subprocess.Popen:
    """One part's session: its own temporary-files root, no shared cache file (two sessions would overwrite each
    other's record of failures)."""
    out = _log(folder, part).open("w")
    try:
        return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "--part", part, "-p", "no:cacheprovider",
                                 "--basetemp", str(folder / f"part-{part[0]}-tmp"), *args], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: os.nice(NICE[part]))  # no thread here: preexec_fn is safe
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
        print(f"==== stopped by {signal.Signals(signum).name}: every part's processes ended; logs in {logs} ====")
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
    print(f"==== all parts done in {time.monotonic() - started:.0f} s: "
          + ", ".join(f"{name} {code}" for name, code in codes.items()) + " ====")
    failed = [code for code in codes.values() if code not in (0, NO_TESTS)]
    return failed[0] if failed else (NO_TESTS if set(codes.values()) == {NO_TESTS} else 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
