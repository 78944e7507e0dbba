"""Stopping a run from outside (issue 13 §1): no worker outlives its launcher, whatever the signal.

`pipedsl train` and a user's script calling `pipedsl.launch` run as subprocesses; once they are
training (or saving a checkpoint), the test signals the launcher and then checks the exit status
(128 + signal), the one line on stderr, no traceback, and that every worker process found under
the launcher in /proc is gone.  A SIGKILLed launcher cannot clean up: its workers must exit by
themselves (one through the kernel's parent-death signal, one through its watchdog thread).
Bounds are generous (a shared 2-core machine): they show "bounded", not "fast".
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import pipedsl
from pipedsl.runtime import checkpoint

HERE = Path(__file__).parent
SIZES = ["--seq", "8", "--embd", "16", "--timeout", "60", "--threads", "1"]
START_LIMIT = 300  # seconds until the run trains (torch imports on a loaded machine)
GONE_LIMIT = 60  # seconds for the workers to be gone after the signal


SPAWNED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_leftovers():
    """A failing test must not leave its run training: kill each spawned session's process group."""
    yield
    while SPAWNED:
        proc = SPAWNED.pop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _as_from_a_terminal() -> None:
    """The run starts with default dispositions, as from an interactive shell: a CI job started in the
    background (or under nohup) inherits SIGINT/SIGHUP ignored, which the launcher rightly keeps."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def spawn(tmp_path: Path, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    out = open(tmp_path / "stdout.txt", "w")  # noqa: SIM115 - the child writes it; closed with the run
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_as_from_a_terminal, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    SPAWNED.append(proc)
    return proc


def train(tmp_path: Path, *extra: str, env: dict[str, str] | None = None, command: str = "train") -> subprocess.Popen:
    sizes = ["-P", "2", "-M", "2", *SIZES] if command == "train" else SIZES
    return spawn(tmp_path, [sys.executable, "-m", "pipedsl.cli", command, *sizes, "-o", str(tmp_path / "out"),
                            *extra], env)


def wait_until(proc: subprocess.Popen, ready, what: str) -> None:
    deadline = time.monotonic() + START_LIMIT
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before {what}: {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"not {what} within {START_LIMIT} s")
        time.sleep(0.1)


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # exited meanwhile
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def workers(launcher: int) -> dict[int, str]:
    """pid -> start time of every process the launcher started: its fork server and the ranks forked from it
    (or spawned ranks), not multiprocessing's resource tracker."""
    found = {}
    for pid in _children(launcher):
        if b"forkserver" in _cmdline(pid):
            found[pid] = _start_time(pid)
            found.update((rank, _start_time(rank)) for rank in _children(pid))
        elif b"spawn_main" in _cmdline(pid):
            found[pid] = _start_time(pid)
    return {pid: started for pid, started in found.items() if started is not None}


def ranks(launcher: int) -> dict[int, str]:
    """The rank processes among `workers`: not the fork server itself."""
    servers = {pid for pid in _children(launcher) if b"forkserver" in _cmdline(pid)}
    return {pid: started for pid, started in workers(launcher).items() if pid not in servers}


def _start_time(pid: int) -> str | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]  # a zombie has exited


def importing_torch(pid: int) -> bool:
    """Whether the process has loaded torch's C++ library: its `import torch` is under way (it takes seconds more)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def alive(pids: dict[int, str]) -> list[int]:
    return [pid for pid, started in pids.items() if _start_time(pid) == started]


def wait_gone(pids: dict[int, str]) -> dict[int, float]:
    """Seconds until each worker was gone (polled every 10 ms, at most GONE_LIMIT)."""
    t0 = time.monotonic()
    gone: dict[int, float] = {}
    while len(gone) < len(pids) and time.monotonic() < t0 + GONE_LIMIT:
        for pid in set(pids) - set(gone) - set(alive(pids)):
            gone[pid] = time.monotonic() - t0
        time.sleep(0.01)
    assert not alive(pids), f"workers {alive(pids)} still running {GONE_LIMIT} s after the launcher was signalled"
    return gone


def training(tmp_path: Path):
    return lambda: "step   1/" in (tmp_path / "stdout.txt").read_text()


def stop(proc: subprocess.Popen, sig: signal.Signals, pids: dict[int, str], group: bool = False) -> dict[int, float]:
    """Sends `sig` to the launcher (or its whole process group, as Ctrl-C does), then checks that every
    worker is gone and how the launcher exited; returns the seconds until each worker was gone."""
    (os.killpg if group else os.kill)(proc.pid, sig)
    took = wait_gone(pids)
    finish(proc, sig)
    return took


def finish(proc: subprocess.Popen, sig: signal.Signals, ranks: int = 2) -> str:
    _, err = proc.communicate(timeout=GONE_LIMIT + 60)
    assert proc.returncode == 128 + sig, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    assert err.splitlines()[-1] == f"interrupted by {sig.name}: stopped {ranks} ranks", err[-2000:]
    return err


@pytest.mark.slow
def test_sigint_to_the_process_group_stops_every_rank(tmp_path) -> None:
    """Ctrl-C reaches the launcher and its ranks at once: the ranks leave it to the launcher."""
    proc = train(tmp_path, "--steps", "100000")
    wait_until(proc, training(tmp_path), "training")
    pids = workers(proc.pid)
    assert len(ranks(proc.pid)) == 2
    took = stop(proc, signal.SIGINT, pids, group=True)
    print(f"SIGINT to pipedsl train's group -> every worker gone: {max(took.values()):.2f} s")


@pytest.mark.slow
def test_sighup_to_pipedsl_run_stops_every_rank(tmp_path) -> None:
    """A closed terminal (SIGHUP) to `pipedsl run` with a program file, the launcher alone."""
    program = tmp_path / "prog.json"
    program.write_text(pipedsl.load("1f1b").compile(P=2, M=2).to_json())
    proc = train(tmp_path, "--program", str(program), "--steps", "100000", command="run")
    wait_until(proc, training(tmp_path), "training")
    pids = workers(proc.pid)
    assert len(ranks(proc.pid)) == 2
    took = stop(proc, signal.SIGHUP, pids)
    print(f"SIGHUP to pipedsl run -> every worker gone: {max(took.values()):.2f} s")


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.slow
def test_sigterm_while_a_checkpoint_is_written_finishes_it_saves_the_next_step_and_resumes_bit_exactly(tmp_path) -> None:
    """Rank 1 freezes (SIGSTOP) with its step-4 part half written; SIGTERM to the launcher then.  The ranks only
    record it (trainer/stop.py): rank 1, continued, completes step 4's checkpoint, every rank runs step 5, saves it
    and exits; the launcher exits 128 + SIGTERM with its one line.  Resuming from step 4 rewrites rank 0's step-5
    part bit for bit (parameters, optimizer state, RNG, data generator): the stop lost nothing."""
    ck = tmp_path / "ck"
    step4 = ck / "step-00000004"
    proc = train(tmp_path, "--steps", "6", "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
                 "--checkpoint-timeout", "200", env={"PIPEDSL_FAULT": "stop-save-part:1:4"})

    def saving() -> bool:
        names = [p.name for p in step4.iterdir()] if step4.is_dir() else []
        return "rank-00000.pt" in names and any(n.startswith(".rank-00001.pt.tmp") for n in names)

    wait_until(proc, saving, "saving step 4")
    pids = workers(proc.pid)
    t0 = time.monotonic()
    took = stop(proc, signal.SIGTERM, pids)
    print(f"SIGTERM while saving -> step 4 completed, step 5 run and saved, every worker gone: "
          f"{max(took.values()):.2f} s; launcher exited after {time.monotonic() - t0:.2f} s")
    assert "stopped after step 5 of 6: SIGTERM received (checkpoint saved; --resume continues it)" in \
        (tmp_path / "stdout.txt").read_text()
    assert [c.step for c in checkpoint.checkpoints(ck)] == [2, 4, 5]
    assert not [p for p in ck.rglob("*") if ".tmp" in p.name]
    again = tmp_path / "again"
    again.mkdir()
    proc = train(again, "--steps", "5", "--resume", str(step4), "--checkpoint-dir", str(again / "ck"))
    _, err = proc.communicate(timeout=START_LIMIT)
    assert proc.returncode == 0, err[-2000:]
    stopped = torch.load(ck / "step-00000005" / "rank-00000.pt", weights_only=False)
    resumed = torch.load(again / "ck" / "step-00000005" / "rank-00000.pt", weights_only=False)
    assert stopped["step"] == resumed["step"] == 5
    for key in ("modules", "optimizers", "rng", "extra"):
        assert same(stopped[key], resumed[key]), key


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM])  # SIGHUP: the same launcher code, tested with `pipedsl run`
def test_a_stop_signal_to_a_users_launch_stops_every_rank_even_one_ignoring_sigterm(tmp_path, sig) -> None:
    """`pipedsl.launch` in a user's script; rank 1 ignores SIGTERM: the launcher SIGKILLs it after
    its stop_grace (1 s) and still exits 128 + signal with the one line."""
    proc = spawn(tmp_path, [sys.executable, str(HERE / "signal_script.py"), str(tmp_path)])
    # a pid file appears whole (renamed into place) after its rank installed its SIGTERM handler
    wait_until(proc, lambda: all((tmp_path / f"pid-{r}").exists() for r in (0, 1)), "running")
    pids = workers(proc.pid)
    assert sorted(ranks(proc.pid)) == sorted(int((tmp_path / f"pid-{r}").read_text()) for r in (0, 1))
    took = stop(proc, sig, pids)
    assert "not reached" not in (tmp_path / "stdout.txt").read_text()
    rank0, rank1 = (took[int((tmp_path / f"pid-{r}").read_text())] for r in (0, 1))
    print(f"{sig.name} to a user's launch -> rank 0 gone {rank0:.2f} s, rank 1 (ignores SIGTERM) {rank1:.2f} s")


@pytest.mark.slow
def test_ctrl_c_while_the_ranks_start_is_no_traceback(tmp_path) -> None:
    """SIGINT to the whole process group while the launcher's fork server is still importing torch, before
    any rank exists: the server starts with the stop signals blocked, so nothing prints a KeyboardInterrupt
    traceback, and the launcher stops whatever it started."""
    proc = spawn(tmp_path, [sys.executable, str(HERE / "signal_script.py"), str(tmp_path)])
    wait_until(proc, lambda: any(importing_torch(pid) for pid in workers(proc.pid)), "importing torch in its server")
    pids = workers(proc.pid)
    assert not ranks(proc.pid) and not any((tmp_path / f"pid-{r}").exists() for r in (0, 1)), \
        "the ranks started too fast to test this"
    os.killpg(proc.pid, signal.SIGINT)
    took = wait_gone(pids)
    finish(proc, signal.SIGINT)
    print(f"SIGINT while the fork server starts -> every worker gone: {max(took.values(), default=0):.2f} s")


@pytest.mark.slow
def test_workers_of_a_sigkilled_launcher_exit_by_themselves(tmp_path) -> None:
    """Rank 0 through the kernel's parent-death signal alone (its parent, the fork server, exits with the
    launcher), rank 1 through its watchdog thread alone (the test switches the other way off for each).  The ranks of the script never talk to
    each other, so neither can exit because the other did."""
    proc = spawn(tmp_path, [sys.executable, str(HERE / "signal_script.py"), str(tmp_path)],
                 env={"PIPEDSL_NO_PDEATHSIG": "1", "PIPEDSL_NO_WATCHDOG": "0"})
    wait_until(proc, lambda: all((tmp_path / f"pid-{r}").exists() for r in (0, 1)), "running")
    pids = workers(proc.pid)
    assert len(ranks(proc.pid)) == 2
    proc.kill()
    took = wait_gone(pids)
    rank0, rank1 = (took[int((tmp_path / f"pid-{r}").read_text())] for r in (0, 1))
    print(f"SIGKILL of the launcher -> rank 0 (parent-death signal) gone {rank0:.2f} s, rank 1 (watchdog) {rank1:.2f} s")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert err.strip() == f"pipedsl rank 1: the launcher (pid {proc.pid}) is gone; exiting", err[-2000:]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_while_the_cli_compiles_is_one_line_and_keeps_the_previous_output(tmp_path, sig) -> None:
    """No rank yet: `pipedsl compile` of a large program (tens of CPU seconds) is signalled once it has
    used 1.5 CPU seconds (its imports take well under one): one line, 128 + signal, and the output
    file it would have replaced is still the previous one (outputs are renamed into place whole)."""
    out = tmp_path / "program.json"
    out.write_text("previous")
    proc = spawn(tmp_path, [sys.executable, "-m", "pipedsl.cli", "compile", "1f1b", "-P", "8", "-M", "40000",
                            "-o", str(out)])
    wait_until(proc, lambda: cpu_seconds(proc.pid) > 1.5, "compiling")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=GONE_LIMIT)
    assert proc.returncode == 128 + sig, err[-2000:]
    assert err.strip() == f"interrupted by {sig.name}", err[-2000:]
    assert out.read_text() == "previous"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left
