"""Faults: a rank killed mid-step or mid-save (SIGKILL, no goodbye), through `pipedsl train`.

The surviving ranks fail with a message naming the dead rank within the configured timeout,
the command exits 1, a checkpoint interrupted by the fault never counts, and resuming from the
previous one gives exactly the losses of a run that never stopped.  The kills come from the
test-only hook PIPEDSL_FAULT=POINT:RANK:STEP (runtime/checkpoint/state.py).  Time bounds are
generous (the machine is shared): they show "bounded", not "fast".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cli_here import pipedsl_here

from pipedsl.runtime import checkpoint

TIMEOUT = 30  # --timeout: the process group's (a dead neighbour is noticed at once: its sockets close)
SAVE_TIMEOUT = 4  # --checkpoint-timeout: how long the others wait for a checkpoint part or the manifest
SIZES = ["-P", "2", "-M", "2", "--seq", "8", "--embd", "16", "--steps", "6", "--timeout", str(TIMEOUT),
         "--checkpoint-timeout", str(SAVE_TIMEOUT)]
HARD_LIMIT = 240  # no test command may run longer than this (its --join-timeout; the stuck run's subprocess timeout)


def train(tmp_path, name: str, *extra: str, fault: str | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """`pipedsl train` run in this process (tests/cli_here.py: its ranks forked from the session's fork server,
    which hands them this environment); the fault hook is read by the ranks."""
    saved = os.environ.pop("PIPEDSL_FAULT", None)
    if fault:
        os.environ["PIPEDSL_FAULT"] = fault
    t0 = time.monotonic()
    try:
        proc = pipedsl_here("train", *SIZES, "--join-timeout", str(HARD_LIMIT), "-o", str(tmp_path / name), *extra)
    finally:
        os.environ.pop("PIPEDSL_FAULT", None)
        if saved is not None:
            os.environ["PIPEDSL_FAULT"] = saved
    return proc, time.monotonic() - t0


def train_rows(out: Path) -> list[dict]:
    """The training rows of a run's metrics.jsonl (flushed line by line: a killed run keeps each one); `time` is
    `time.time()` when the step ended."""
    rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [r for r in rows if r["kind"] == "train"]


def steps_logged(tmp_path, name: str) -> list[int]:
    return [r["step"] for r in train_rows(tmp_path / name)]


def after_last_step(tmp_path, name: str) -> float:
    """Seconds from the run's last logged training step to now (just after it ended): a fault's time bound, which
    a loaded machine's slow start and steps do not eat into."""
    return time.time() - train_rows(tmp_path / name)[-1]["time"]


def losses(tmp_path, name: str) -> dict[int, float]:
    return {int(k): v for k, v in json.loads((tmp_path / name / "losses.json").read_text())["losses"].items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    proc, _ = train(d, "out")
    assert proc.returncode == 0, proc.stderr
    return losses(d, "out")


def ckpt_args(d) -> list[str]:
    return ["--checkpoint-dir", str(d / "ck"), "--checkpoint-every", "2"]


def assert_names_the_dead_rank(proc: subprocess.CompletedProcess, dead: int, survivor: int, what: str) -> None:
    err = proc.stderr.splitlines()
    assert proc.returncode == 1, proc.stdout[-1500:] + proc.stderr[-1500:]
    assert "Traceback" not in proc.stderr
    assert err[0] == f"runtime error: rank {dead} failed: killed by signal SIGKILL", proc.stderr
    notes = [line for line in err[1:] if line.startswith(f"  note: rank {survivor}: ")]
    assert notes and f"rank {dead}" in notes[0].split(": ", 2)[2] and what in notes[0], proc.stderr


@pytest.mark.slow
def test_rank_killed_mid_step_stops_the_others(tmp_path) -> None:
    proc, _ = train(tmp_path, "killed", *ckpt_args(tmp_path), fault="step:1:5")
    since = after_last_step(tmp_path, "killed")
    assert_names_the_dead_rank(proc, dead=1, survivor=0, what="")
    assert since < TIMEOUT + 60, since
    assert steps_logged(tmp_path, "killed") == [1, 2, 3, 4], "killed inside step 5"
    assert checkpoint.latest(tmp_path / "ck").step == 4  # resuming from it: the next test and test_resume.py
    assert checkpoint.check(tmp_path / "ck" / "step-00000004", verify=True)


@pytest.mark.slow
def test_rank_killed_while_saving_leaves_no_valid_checkpoint(tmp_path, reference) -> None:
    proc, elapsed = train(tmp_path, "killed", *ckpt_args(tmp_path), fault="save-part:1:4")
    since = after_last_step(tmp_path, "killed")
    assert_names_the_dead_rank(proc, dead=1, survivor=0, what="checkpoint step 4: rank 1 did not finish")
    assert f"within {SAVE_TIMEOUT} s" in proc.stderr
    assert SAVE_TIMEOUT <= elapsed and since < SAVE_TIMEOUT + 60, (elapsed, since)
    step4 = tmp_path / "ck" / "step-00000004"
    names = sorted(p.name for p in step4.iterdir())
    # rank 0 removed its own part when the save was abandoned; rank 1, killed mid-write, left its temporary file
    assert "manifest.json" not in names and "rank-00000.pt" not in names and "rank-00001.pt" not in names, names
    assert any(n.startswith(".rank-00001.pt.tmp") for n in names), "rank 1 died with its part half written"
    with pytest.raises(checkpoint.CheckpointError, match="incomplete"):
        checkpoint.check(step4)
    assert checkpoint.latest(tmp_path / "ck").step == 2
    proc, _ = train(tmp_path, "resumed", *ckpt_args(tmp_path), "--resume")
    assert proc.returncode == 0, proc.stderr
    assert "resuming from" in proc.stdout and steps_logged(tmp_path, "resumed") == [3, 4, 5, 6], "resumed at step 2"
    assert losses(tmp_path, "resumed") == reference  # steps 1-2 from the checkpoint, 3-6 run again
    assert checkpoint.check(step4, verify=True).step == 4, "the step is saved again, completely"
    assert not [p.name for p in step4.iterdir() if ".tmp-" in p.name], "the stale temporary part is gone"


@pytest.mark.slow
def test_rank_0_killed_before_the_manifest_leaves_the_checkpoint_invalid(tmp_path) -> None:
    proc, elapsed = train(tmp_path, "killed", *ckpt_args(tmp_path), fault="save-manifest:0:4")
    since = after_last_step(tmp_path, "killed")
    assert_names_the_dead_rank(proc, dead=0, survivor=1, what="checkpoint step 4: rank 0 did not finish")
    assert SAVE_TIMEOUT <= elapsed and since < SAVE_TIMEOUT + 60, (elapsed, since)
    step4 = tmp_path / "ck" / "step-00000004"
    names = sorted(p.name for p in step4.iterdir())
    # rank 1 removed its part when the save was abandoned; rank 0 was killed with its part written, no manifest
    assert "rank-00000.pt" in names and "rank-00001.pt" not in names and "manifest.json" not in names, names
    assert checkpoint.latest(tmp_path / "ck").step == 2
    assert checkpoint.check(tmp_path / "ck" / "step-00000002", verify=True).step == 2, "the previous one loads"


@pytest.mark.slow
def test_the_join_timeout_bounds_a_whole_run(tmp_path) -> None:
    proc, elapsed = train(tmp_path, "slow", "--steps", "100000", "--join-timeout", "3")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert lines == ["runtime error: rank 0 failed: still running after the join timeout (3 s); killed",
                     "  note: rank 1: still running after the join timeout (3 s); killed"], proc.stderr
    assert elapsed < 3 + 60


STUCK_TIMEOUT = 8  # --timeout of the stuck-rank run


class _Background:
    """One `pipedsl train` run in a thread of its own: (the completed process, seconds from start to exit); `ended`:
    the wall-clock time it exited (`time.time()`, as metrics.jsonl's rows)."""

    def __init__(self, argv: list[str], env: dict[str, str], out: Path) -> None:
        self.argv, self.env, self.out, self.outcome, self.ended = argv, env, out, None, 0.0
        self.proc: subprocess.Popen | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=self.env)
        try:
            out, err = self.proc.communicate(timeout=HARD_LIMIT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        self.ended = time.time()
        self.outcome = (subprocess.CompletedProcess(self.argv, self.proc.returncode, out, err), time.monotonic() - t0)

    def result(self) -> tuple[subprocess.CompletedProcess, float]:
        self.thread.join(HARD_LIMIT + 30)
        assert self.outcome is not None, "the background run did not finish"
        return self.outcome


@pytest.fixture(scope="module", autouse=True)
def stuck_run(request, tmp_path_factory):
    """The stuck-rank run, started with the module's first test: most of its time is waiting (the peer's
    --timeout, then the launcher's grace period) with the CPU idle, so it overlaps the other tests' runs
    (suite time); its test, the last one here, collects it.  Not started when that test is deselected."""
    if not any(item.name == "test_a_stuck_rank_is_named_and_killed_in_bounded_time" for item in request.session.items):
        yield None
        return
    sizes = [a if a != str(TIMEOUT) else str(STUCK_TIMEOUT) for a in SIZES]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PIPEDSL_FAULT": "hang:1:3"}
    out = tmp_path_factory.mktemp("stuck") / "out"
    run = _Background([sys.executable, "-m", "pipedsl.cli", "train", *sizes, "-o", str(out)], env, out)
    yield run
    if run.proc is not None and run.proc.poll() is None:  # a deselected or failed stuck test: no run outlives this
        run.proc.kill()
    run.thread.join(60)


@pytest.mark.slow
def test_a_stuck_rank_is_named_and_killed_in_bounded_time(stuck_run) -> None:
    """A rank that stops (SIGSTOP) but never exits: its peer gives up after --timeout, the launcher kills it
    after its grace period (timeout + 15 s) and names it as the rank that failed.  The bound counts from step 2's
    metrics row (the rank stops as step 3 starts), not from the command's start: a loaded CI machine took 110 s to
    start the run and train two steps."""
    timeout = STUCK_TIMEOUT
    proc, elapsed = stuck_run.result()
    err = proc.stderr.splitlines()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert err[0] == f"runtime error: rank 1 failed: stuck: still running {timeout + 15} s after another rank " \
                     f"stopped; killed", proc.stderr
    assert err[1].startswith("  note: rank 0: ") and "rank 1" in err[1][len("  note: rank 0: "):], proc.stderr
    *_, step_2 = train_rows(stuck_run.out)  # the rank stops as step 3 starts
    assert step_2["step"] == 2, step_2
    since = stuck_run.ended - step_2["time"]
    assert timeout + 15 <= elapsed and timeout + 15 - 5 <= since < timeout + 15 + 60, (elapsed, since)
