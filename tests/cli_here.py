"""`pipedsl …` run inside the test process: the command's ranks are forked from the session's fork server
(tests/conftest.py), which imported torch, the trainer and transformers once.  A new `pipedsl` process and
its own server import them again, 4-10 s of CPU each (suite time).  Tests of what only a separate process
shows (signals, the ranks' own output, torchrun) keep running one."""

from __future__ import annotations

import contextlib
import io
import subprocess
import warnings

from pipedsl.cli import main


def pipedsl_here(*argv: str) -> subprocess.CompletedProcess:
    """The command's exit status and what it printed, warnings included (its ranks' lines are not captured)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            code = main(list(argv))
        except SystemExit as exit_:
            code = exit_.code
    said = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in seen)
    return subprocess.CompletedProcess(list(argv), code, out.getvalue(), err.getvalue() + said)
