"""Shared test helpers: the hypothesis profiles, and one pool of 8 local processes for the session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from pipedsl.runtime.launch.pool import LocalPool, with_rank

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


# The extras `make test` installs (pyproject's `hf`): there a broken or missing one fails the tests that need it
# instead of skipping them while the run stays green (PIPEDSL_REQUIRE_EXTRAS=1, set by the Makefile).
EXTRAS = ("transformers", "tokenizers", "safetensors", "datasets", "tensorboard")
if os.environ.get("PIPEDSL_REQUIRE_EXTRAS") == "1":
    _importorskip = pytest.importorskip

    def _import_extra_or_fail(modname: str, *args, **kwargs):
        if modname.split(".")[0] not in EXTRAS:
            return _importorskip(modname, *args, **kwargs)
        import importlib

        return importlib.import_module(modname)  # ImportError: the test fails, naming the module

    pytest.importorskip = _import_extra_or_fail


# What the suite's ranks import, imported once by the fork server every rank and pool worker is forked from
# (`runtime/launch/fork_server.py`): otherwise each of 8 workers imports transformers itself, again after each restart.
RANK_IMPORTS = ("pipedsl.trainer.train", "pipedsl.models.hf.parallelize", "transformers.modeling_utils",
                *(f"transformers.models.{m}.modeling_{m}" for m in ("llama", "qwen3", "gemma3")),
                "pipedsl.trainer.rank_modules")  # last: the trainer's first-use imports, as `pipedsl train` does


def _start_the_fork_server() -> None:
    """Before the first test: the server imports while the collection goes on, for the pool's workers and for
    every rank a test launches from this process."""
    from importlib.util import find_spec

    from pipedsl.runtime.launch.fork_server import start

    start(RANK_IMPORTS if find_spec("transformers") else (*RANK_IMPORTS[:2], RANK_IMPORTS[-1]))


_start_the_fork_server()

# One intra-op thread in the test process, as in every rank (`launch(threads=1)`): the pool's workers, the launched
# ranks and the smoke scripts keep the other core busy, and torch's second OpenMP thread then spins waiting for it —
# the seq2seq stage checks took 75 s with two threads beside one busy process, 12 s with one.  (After the fork
# server's start: its imports overlap this one.)
import torch  # noqa: E402

torch.set_num_threads(1)


POOL_FIXTURES = {"pool", "pool2", "pool4", "pools", "run_once"}  # the multi-process tests' way to their ranks


# `make test` runs the suite as three sessions side by side (tests/parts.py), split by one rule.  The linux scheduler
# shares the CPU by thread: beside the multi-process part's ranks, one single-process chain of tests gets a small share
# and ends last, so the rest of the suite is two chains, not one.
TESTS = Path(__file__).resolve().parent
RANKS_PART = ("models", "parallel", "runtime", "pipedsl", "benchmarks")  # their slow tests: part 3, mostly ranks
COMMANDS_PART = ("trainer", "reliability")  # part 2: whole `pipedsl train` commands, signals, faults, checkpoints
PARTS = ("1/3", "2/3", "3/3")


def pytest_addoption(parser) -> None:
    parser.addoption("--part", choices=PARTS, default=None,
                     help="run one of the three parts `make test` runs side by side (tests/parts.py)")


def _parts_of_folder(folder: str) -> tuple[str, ...]:
    """The parts a folder's tests can be in ("": a file directly in tests/): COMMANDS_PART's all in 2/3; RANKS_PART's
    slow ones in 3/3, the rest in 1/3; any other folder's in 1/3."""
    return ("2/3",) if folder in COMMANDS_PART else ("1/3", "3/3") if folder in RANKS_PART else ("1/3",)


def part_of(item) -> str:
    """3/3: the slow tests of RANKS_PART's folders (multi-process equalities); 2/3: COMMANDS_PART's folders; 1/3: the
    rest (the everyday tier of the language, models and runtime, the planner's, the plots' and tests/*.py)."""
    parts = _parts_of_folder(item.nodeid.split("/")[1] if item.nodeid.count("/") > 1 else "")
    return parts[-1] if item.get_closest_marker("slow") is not None else parts[0]


def pytest_ignore_collect(collection_path, config) -> bool | None:
    """With --part, a folder none of whose tests `part_of` gives that part is not collected (its modules are not
    imported: seconds of CPU a session)."""
    part = config.getoption("--part")
    if part is None or collection_path == TESTS or not collection_path.is_relative_to(TESTS):
        return None
    relative = collection_path.relative_to(TESTS).parts
    folder = relative[0] if len(relative) > 1 or collection_path.is_dir() else ""  # "": a file directly in tests/
    return None if part in _parts_of_folder(folder) else True


def pytest_collection_modifyitems(config, items) -> None:
    """`slow` by construction: a test that runs on the process pools is slow unless marked `quick` (a deliberate
    smoke check of its area kept in `make test-quick`), so the everyday tier cannot grow by forgetting a marker."""
    for item in items:
        if POOL_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("quick") is None:
            item.add_marker(pytest.mark.slow)
    if part := config.getoption("--part"):
        mine = {id(i) for i in items if part_of(i) == part}
        config.hook.pytest_deselected(items=[i for i in items if id(i) not in mine])
        items[:] = [i for i in items if id(i) in mine]
    # the benchmarks' smoke tests last: their commands start as the session starts and run beside the rest
    items[:] = [i for i in items if not _smoke(i)] + [i for i in items if _smoke(i)]


SMOKE = "tests/benchmarks/test_smoke.py::"


def _smoke(item) -> bool:
    return item.nodeid.startswith(SMOKE)


def pytest_collection_finish(session) -> None:
    """The selected benchmark smoke tests' commands start now at a lower CPU priority, on the core that most of the
    suite's tests leave idle (tests/benchmarks/test_smoke.py); their tests, last, check them."""
    smoke = [item for item in session.items if _smoke(item)]
    if smoke and not session.config.option.collectonly:
        smoke[0].module.start_in_background({item.originalname for item in session.items},
                                            session.config._tmp_path_factory.mktemp)


def pytest_sessionfinish(session) -> None:
    for item in session.items if hasattr(session, "items") else ():
        if _smoke(item):
            item.module.stop_background()
            break


@pytest.fixture(scope="session")
def pool():
    """8 worker processes started once; each `pool.run(fn, world, ...)` is a fresh gloo world on them
    (every multi-rank check of the suite shares them, pool2 and pool4 included: spawning is slow on 2 cores)."""
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


class RankPool:
    """`run(fn, *args)`: `fn(rank, *args)` on every rank of a `size`-rank gloo world of the session's pool, the
    results in rank order.  A check must fail *uniformly* (every rank, before any message) or return its
    findings: a rank left waiting on one that raised would wait out the process-group timeout.  Checks that
    make one rank fail use `pipedsl.launch` directly, with fresh processes."""

    def __init__(self, pool: LocalPool, size: int) -> None:
        self.pool, self.size = pool, size

    def run(self, fn, *args):
        return self.pool.run(with_rank, self.size, fn, *args, same_world=True)  # (no DeviceMesh in these checks)


@pytest.fixture(scope="session")
def pool2(pool):
    return RankPool(pool, 2)


@pytest.fixture(scope="session")
def pool4(pool):
    return RankPool(pool, 4)


@pytest.fixture
def pools(request):
    """pools[P] for the sizes a parametrized test asks for."""
    class _Lazy(dict):
        def __missing__(self, P: int) -> RankPool:
            self[P] = request.getfixturevalue(f"pool{P}")
            return self[P]
    return _Lazy()
