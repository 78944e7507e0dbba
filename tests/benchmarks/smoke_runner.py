"""Run benchmark scripts one after another in this one interpreter, each as its own `__main__`.

Each script alone pays ~5 CPU-seconds before its first step: this interpreter's torch import and its own fork
server's (torch, torch._dynamo, the language's parser; runtime/launch/fork_server.py).  The smoke tests' scripts do
seconds of work or less, so those imports were most of their CPU: tests/benchmarks/test_smoke.py took 184 CPU-seconds
with a process a script and 112 with this runner, on a 2-core machine where the suite's time is its CPU work
(docs/testing.md).  Here torch is imported once and one
fork server forks every script's ranks.  A script still runs as its command does: `runpy` runs it as `__main__`
with its own argv and environment, its ranks import it as `__mp_main__`, and what it prints — it and the processes
it starts — goes to its own files.

    python smoke_runner.py JOBS.json

JOBS.json: a list of {"script": path, "argv": [...], "env": {...}, "out": path, "err": path, "status": path}; each
job's exit status is written to its "status" file when it ends (the tests wait for that file).
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def _output_to(out: str, err: str) -> Iterator[None]:
    """File descriptors 1 and 2 (so that the processes the script starts write there too) to the job's files."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(out, "w") as o, open(err, "w") as e:
        os.dup2(o.fileno(), 1)
        os.dup2(e.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _exit_status(code: object) -> int:
    """SystemExit's code as the command's exit status."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1  # sys.exit("message") prints it and exits 1


def run_job(job: dict) -> int:
    """One script as `python SCRIPT ARGV…` would run it, in the environment `job["env"]` (exactly that one)."""
    environ = dict(os.environ)
    os.environ.clear()
    os.environ.update(job["env"])
    argv = sys.argv
    sys.argv = [job["script"], *job["argv"]]
    try:
        with _output_to(job["out"], job["err"]):
            try:
                runpy.run_path(job["script"], run_name="__main__")
                return 0
            except SystemExit as stop:
                if stop.code is not None and not isinstance(stop.code, int):
                    print(stop.code, file=sys.stderr)
                return _exit_status(stop.code)
            except BaseException:  # noqa: BLE001 - the traceback Python would print, and its exit status
                traceback.print_exc()
                return 1
    finally:
        sys.argv = argv
        os.environ.clear()
        os.environ.update(environ)


def main(jobs_file: str) -> int:
    from pipedsl.runtime.launch.fork_server import start

    start()  # now, with this process's own output: the server outlives every job's redirection
    for job in json.loads(Path(jobs_file).read_text()):
        status = run_job(job)
        done = Path(job["status"])
        done.with_suffix(".tmp").write_text(str(status))
        done.with_suffix(".tmp").replace(done)  # whole, or not there
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
