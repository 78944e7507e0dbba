"""Shared test helpers: the hypothesis profiles, and one pool of 8 local processes for the session."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from pipedsl.parallel.pool import LocalPool

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(scope="session")
def pool():
    """8 worker processes started once; each `pool.run(fn, world, ...)` is a fresh gloo world on them
    (tests/parallel and the parallel checkpoint tests share it: spawning is slow on 2 cores)."""
    p = LocalPool(8, timeout=240)
    yield p
    p.close()


@pytest.fixture
def run_cli(capsys):
    """`run_cli(*argv)` runs `pipedsl *argv` in this process: (exit status, stderr lines).  A traceback
    on stderr fails the test: bad input must be answered in words."""
    from pipedsl.cli import main

    def run(*argv: str) -> tuple[int, list[str]]:
        try:
            code = main(list(argv))
        except SystemExit as exit_:
            code = exit_.code
        err = capsys.readouterr().err
        assert "Traceback" not in err
        return code, err.strip().splitlines()
    return run
