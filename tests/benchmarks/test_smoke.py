"""Each benchmark's quickest path on tiny sizes with near-zero sleeps: it runs, writes JSON of the
expected shape and appends one row to a results table.  Never asserts a time (benchmarks measure,
tests do not)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
TINY = ["--F", "0.0005", "--B", "0.001", "--reps", "1", "--warmup", "0"]

# One built-in a family for gpu_check's every-schedule checks: every built-in on gloo against one process is
# tests/runtime/test_pipeline.py's grid (docs/testing.md); here the check's code runs, not every schedule again.
GPU_CHECK_SCHEDULES = ["1f1b", "chimera", "dualpipev", "gpipe", "interleaved", "zb-v"]
# The slow tests' commands (script, its arguments), by test.  They are independent, and most of the suite keeps one
# core of two busy: tests/conftest.py starts them (`start_in_background`) as soon as the session has collected, at a
# lower CPU priority, and runs this module last, each test checking its own (suite time).  All but ALONE run in this
# order in one interpreter (smoke_runner.py: this module took 184 CPU-seconds with a process a script, 112 so).  No
# test asserts a time.
RUNS = {
    "test_gpu_check_dry_run_on_gloo": ("gpu_check", ["--device", "cpu", "--tiny", "--schedules", *GPU_CHECK_SCHEDULES]),
    "test_op_cpu_against_another_tree": ("op_cpu", ["--quick", "--M", "4", "--against", "HEAD"]),
    "test_startup": ("startup", ["--quick"]),
    "test_moe_overlap": ("moe_overlap", ["--quick", "--M", "4", "--latency", "0.5", "--attn", "0.2", "--experts-ms",
                                         "0.2"]),
    "test_auto_schedule": ("auto_schedule", ["--quick", "--vocab", "2048", "--us-per-mweight", "5"]),
    "test_bench_quick_gates_on_its_baseline": ("bench_quick", ["--tiny", "--baseline", "{tmp}/baseline.json"]),
    "test_shape_change": ("shape_change", ["--quick"]),
    "test_compiler_scale_appends_to_the_same_table": ("compiler_scale", ["--quick", "--formats", "json", "torch-csv",
                                                                         "--baseline", "HEAD"]),
    "test_vs_torch": ("vs_torch", ["--workload", "both", "--P", "2", "--schedules", "1f1b", "--steps", "1",
                                   "--gpt-steps", "1", *TINY]),
    "test_split_backward": ("split_backward", ["--quick"]),
    "test_zero_speed": ("zero_speed", ["--schedules", "1f1b", "zb-h1", "--variants", "zero1", "bf16-main", "--M", "2",
                                       "--layers", "2", "--embd", "16", "--seq", "16", "--rows", "1", "--steps", "1",
                                       "--reps", "1", "--warmup", "1"]),
    "test_precision": ("precision", ["--steps", "1", "--reps", "1", "--warmup", "0", "--layers", "2", "--seq", "16"]),
    "test_recompute": ("recompute", ["--quick"]),
    "test_schedules": ("schedules", ["--P", "2", "--M-factors", "2", "--png", "{tmp}/cmp.png", *TINY]),
    "test_fidelity": ("fidelity", ["--P", "2", "--M", "2", "--schedules", "1f1b", "chimera", "interleaved",
                                   "--zero-M", "2", "--zero-steps", "1", *TINY]),
    "test_post_validate": ("post_validate", ["-P", "2", "-M", "4", "--F", "0.0005", "--B", "0.001", "--opt-ms",
                                             "0.5", "--steps", "2", "--warmup", "1"]),
    "test_schedules_v": ("schedules_v", ["--P", "2", "--M", "4", "--schedules", "1f1b", "dualpipev", "--width", "32",
                                         *TINY]),
    "test_zb_paper": ("zb_paper", ["--only", "1.5B-p8-m24"]),  # all p = 8 searches: tests/pipedsl/test_zb_paper.py
}
QUICK_NAMES = ["compile_200k", "op_cpu_P2", "shape_change_P2", "vs_torch_gpt_1f1b_P2", "zero1_step_P2"]


ALONE = ("startup",)  # it measures a fresh interpreter's first launch: its own process, not the runner's
RUNNER = Path(__file__).resolve().parent / "smoke_runner.py"
NICE = 10  # the background runs' CPU priority: below the suite's own tests, whose time bounds stay theirs
LIMIT_S = 420  # a background process still running this long after this module's tests began is killed
_BACKGROUND: dict[str, tuple[Path, Future]] = {}  # test name -> (its directory, its run), once started
_PROCS: list[subprocess.Popen] = []
_STATE: dict = {"watchers": [], "since": None, "stopped": False}  # since: when this module's first test began


def _job(tmp: Path, script: str, args: list[str]) -> dict:
    """What smoke_runner.py runs: the script, its arguments, its environment and its files."""
    if script == "bench_quick":  # against a baseline no run can meet
        (tmp / "baseline.json").write_text(json.dumps({"figures": dict.fromkeys(QUICK_NAMES, 1e-9)}))
    env = dict(os.environ) if script == "gpu_check" else {**os.environ, "PIPEDSL_RESULTS_MD": str(tmp / "RESULTS.md")}
    return {"script": str(BENCH / f"{script}.py"),
            "argv": [*(a.format(tmp=tmp) for a in args), "--json", str(tmp / f"{script}.json")],
            "env": env, "out": str(tmp / "stdout"), "err": str(tmp / "stderr"), "status": str(tmp / "status")}


def _popen(argv: list[str], out: str, err: str, env: dict | None = None) -> subprocess.Popen:
    """Started at a lower CPU priority while the rest of the suite runs (before it imports anything, so that its
    ranks inherit it)."""
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(argv, stdout=stdout, stderr=stderr, env=env)
    _PROCS.append(proc)
    if _STATE["since"] is None:
        with contextlib.suppress(OSError):  # (exited already)
            os.setpriority(os.PRIO_PROCESS, proc.pid, NICE)
    return proc


def _completed(job: dict, status: int, note: str = "") -> subprocess.CompletedProcess:
    out, err = (Path(job[k]).read_text(errors="replace") if Path(job[k]).exists() else "" for k in ("out", "err"))
    return subprocess.CompletedProcess([job["script"], *job["argv"]], status, out, err + note)


def _watch(proc: subprocess.Popen, jobs: list[tuple[dict, Future]], alone: bool) -> None:
    """Each job's result once its status file is there (the runner's) or its process ended (`alone`); the jobs a
    runner had not finished when it ended, or was killed at LIMIT_S, fail with a note saying so."""
    pending = list(jobs)
    while pending:
        ended = proc.poll() is not None
        for job, future in list(pending):
            done = Path(job["status"])
            if done.exists() or (ended and alone):
                status = int(done.read_text()) if done.exists() else proc.returncode
                future.set_result(_completed(job, status))
                pending.remove((job, future))
        if ended:
            runner = Path(proc.args[-1]).with_name("runner.err")  # what the runner said outside its jobs
            said = runner.read_text(errors="replace")[-2000:] if runner.exists() else ""
            for job, future in pending:
                future.set_result(_completed(job, proc.returncode or 1, f"\n(the smoke runner ended with status "
                                                                         f"{proc.returncode} before this script did)\n"
                                                                         f"{said}"))
            return
        since = _STATE["since"]
        if _STATE["stopped"] or (since is not None and time.monotonic() - since > LIMIT_S):
            proc.kill()
            proc.wait()
            for job, future in pending:
                future.set_result(_completed(job, proc.returncode, f"\n(killed after {LIMIT_S} s)"))
            return
        time.sleep(0.5)


def start_in_background(selected: set[str], mktemp) -> None:
    """Start the selected slow tests' commands (tests/conftest.py, once the session has collected, and runs this
    module's tests last): most of the suite leaves a core idle, and these use it."""
    if _STATE["watchers"]:
        return
    together: list[tuple[dict, Future]] = []
    for test, (script, args) in RUNS.items():
        if test in selected:
            tmp = mktemp(script)
            job, future = _job(tmp, script, args), Future()
            _BACKGROUND[test] = (tmp, future)
            if script in ALONE:
                proc = _popen([sys.executable, job["script"], *job["argv"]], job["out"], job["err"], job["env"])
                _STATE["watchers"].append((proc, [(job, future)], True))
            else:
                together.append((job, future))
    if together:
        jobs = mktemp("smoke_runner") / "jobs.json"
        jobs.write_text(json.dumps([job for job, _ in together]))
        runner = _popen([sys.executable, str(RUNNER), str(jobs)], str(jobs.with_name("runner.out")),
                        str(jobs.with_name("runner.err")))
        _STATE["watchers"].append((runner, together, False))
    for watched in _STATE["watchers"]:
        threading.Thread(target=_watch, args=watched, daemon=True).start()


def _renice_to_normal() -> None:
    """The background runs and their ranks back at the suite's priority, now that nothing of the suite runs beside
    them (best effort: an unprivileged user may not raise a priority, and /proc is Linux's)."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
                    children.setdefault(ppid, []).append(int(entry))
    todo = [proc.pid for proc in _PROCS if proc.poll() is None]
    while todo:
        pid = todo.pop()
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, 0))
        todo += children.get(pid, [])


def stop_background() -> None:
    """At the session's end (or an early stop): what still runs is killed."""
    _STATE["stopped"] = True
    for proc in _PROCS:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """test name -> (its directory, a Future of its completed process), for the selected slow tests."""
    _STATE["since"] = time.monotonic()
    _renice_to_normal()
    start_in_background({item.originalname for item in request.session.items}, tmp_path_factory.mktemp)
    return _BACKGROUND


def run(runs, request, script: str) -> dict:
    tmp, future = runs[request.node.originalname]
    proc = future.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp / "RESULTS.md").read_text().splitlines()
    assert table[5] == "|---|---|---|---|" and table[-1].startswith("| ") and f"benchmarks/{script}.py" in table[-1]
    return json.loads((tmp / f"{script}.json").read_text())


@pytest.mark.slow
def test_vs_torch(runs, request):
    got = run(runs, request, "vs_torch")
    assert got["benchmark"] == "vs_torch" and got["machine"] and got["date"]
    assert [(r["workload"], r["schedule"], r["P"]) for r in got["rows"]] == [("sleep", "1f1b", 2), ("gpt", "1f1b", 2)]
    for r in got["rows"]:
        assert set(r["step_s"]) == {"pipedsl", "torch"} and r["step_s"]["pipedsl"]["n"] == 1
        assert r["ratio"] > 0 and r["samples_per_s"]["pipedsl"] > 0 and r["torch_class"] == "Schedule1F1B"


@pytest.mark.slow
def test_fidelity(runs, request):
    got = run(runs, request, "fidelity")
    rows = {r["schedule"]: r for r in got["rows"]}
    assert set(rows) == {"1f1b", "chimera", "interleaved"}
    assert "skipped" in rows["interleaved"] or rows["interleaved"]["ratio"] > 0  # interleaved needs M % P == 0: runs
    assert rows["1f1b"]["predicted_makespan_s"] > 0 and rows["1f1b"]["measured_makespan_s"]["n"] == 1
    assert set(got["profile"]["cost"]) >= {"F", "B", "I", "W", "comm", "send"}
    assert got["overhead"]["P1_s_per_compute_op"] > 0 and "zero_compute_P2_s_per_compute_op" in got["overhead"]


@pytest.mark.slow
def test_schedules(runs, request):
    got = run(runs, request, "schedules")
    png = runs[request.node.originalname][0] / "cmp.png"
    rows = {r["schedule"]: r for r in got["rows"]}
    assert set(rows) == {"1f1b", "interleaved", "chimera", "hanayo-W1", "hanayo-W2"}
    assert all(r["M"] == 4 and r["predicted_makespan_s"] > 0 and "measured_makespan_s" in r for r in rows.values())
    assert rows["1f1b"]["speedup_vs_1f1b"] == 1.0
    assert png.stat().st_size > 0 and got["picture"] == str(png)


@pytest.mark.slow
def test_compiler_scale_appends_to_the_same_table(runs, request):
    got = run(runs, request, "compiler_scale")
    tmp_path = runs[request.node.originalname][0]
    assert got["benchmark"] == "compiler_scale" and got["rows"] and got["growth_exponent"] > 0
    files = got["program_files"]  # the largest program, loaded back from files by this tree and by HEAD's code
    assert files["instructions"] == got["rows"][-1]["instructions"] and files["compile_instructions_per_s"] > 0
    assert set(files["formats"]) == set(files["baseline"]["formats"]) == {"json", "torch-csv"}
    assert all(f["instructions_per_s"] > 0 and len(f["runs"]) == 1 for f in files["formats"].values())
    assert files["baseline"]["revision"] == "HEAD"
    assert "-instruction program loaded from files at json" in (tmp_path / "RESULTS.md").read_text().splitlines()[-1]


@pytest.mark.slow
def test_precision(runs, request):
    got = run(runs, request, "precision")
    assert got["benchmark"] == "precision" and [r["variant"] for r in got["rows"]][:3] == ["fp32", "bf16", "fp16"]
    by = {r["variant"]: r for r in got["rows"]}
    assert by["fp32"]["p2p_bytes_per_step"] > 0 and by["bf16"]["p2p_vs_fp32"] == by["fp16"]["p2p_vs_fp32"] == 0.5
    assert all(r["vs_fp32"] > 0 and r["step_s"]["n"] == 1 for r in got["rows"])


@pytest.mark.slow
def test_zero_speed(runs, request):
    got = run(runs, request, "zero_speed")
    rows = {(r["schedule"], r["variant"]): r for r in got["rows"]}
    assert set(rows) == {(s, v) for s in ("1f1b", "zb-h1") for v in ("fp32", "zero1", "bf16", "bf16-main")}
    assert rows[("1f1b", "zero1")]["baseline"] == "fp32" and rows[("zb-h1", "bf16-main")]["baseline"] == "bf16"
    assert all(r["ratio_paired_median"] > 0 for r in got["rows"] if r["baseline"])
    assert all(r["vs_1f1b"] > 0 for r in got["rows"] if r["schedule"] == "zb-h1")


@pytest.mark.slow
def test_recompute(runs, request):
    got = run(runs, request, "recompute")
    assert got["benchmark"] == "recompute" and [r["variant"] for r in got["rows"]] == ["baseline", "full",
                                                                                      "selective", "token"]
    for m in got["memory"]:  # one stage per rank: the measured bytes are the prediction
        assert all(m[v]["measured"] == m[v]["predicted"] > 0 for v in ("baseline", "full", "selective"))
    assert got["memory"][0]["full_vs_baseline"] < 1 and got["shapes"]["learned"] == 1 + 2


@pytest.mark.slow
def test_op_cpu_against_another_tree(runs, request):
    got = run(runs, request, "op_cpu")
    assert [(r["tree"], r["P"]) for r in got["rows"]] == [("HEAD", 2), ("this", 2)]  # HEAD from a worktree
    assert all(r["pipedsl_ms_per_op"] > 0 and r["torch_ms_per_op"] > 0 and r["ratio"] > 0 for r in got["rows"])


@pytest.mark.slow
def test_split_backward(runs, request):
    got = run(runs, request, "split_backward")
    kept = {r["stage"]: r for r in got["held"] if not r["release"]}
    for r in (r for r in got["held"] if r["release"]):  # I keeping only W's part holds less than keeping all
        assert r["after_I_saved"] < kept[r["stage"]]["after_I_saved"], r
    plain = {r["stage"]: r for r in got["held"] if r["release"] and not r["zero"]}
    for r in (r for r in got["held"] if r["zero"]):  # under ZeRO a pending W holds what it holds without
        assert r["after_I_saved"] + r["after_I_grads"] <= 1.1 * (plain[r["stage"]]["after_I_saved"] +
                                                                 plain[r["stage"]]["after_I_grads"]), r
    assert got["step"]["ratio"] > 0


@pytest.mark.slow
def test_shape_change(runs, request):
    got = run(runs, request, "shape_change")
    (row,) = got["rows"]
    assert row["tree"] == "this" and row["P"] == 2 and row["steady_ms"] > 0 and row["learned"] == 2 + 2  # T and T-1 in the warmup, a new length in each of 2 rounds


@pytest.mark.slow
def test_startup(runs, request):
    got = run(runs, request, "startup")
    assert [r["what"] for r in got["rows"]] == ["launch N=2 first", "launch N=2 again"]  # --quick: no train run
    assert all(r["forkserver_s"] > 0 and r["spawn_s"] > 0 and r["ratio"] > 0 for r in got["rows"])


@pytest.mark.slow
def test_schedules_v(runs, request):
    got = run(runs, request, "schedules_v")
    rows = {r["schedule"]: r for r in got["rows"]}
    assert set(rows) == {"1f1b", "dualpipev"} and rows["1f1b"]["sleep_step_vs_1f1b"] == 1.0
    for r in rows.values():  # the runtime counted what the simulator predicts, and saved bytes for each
        assert r["measured_peak_activations"] == r["sim_peak_activations"] and min(r["measured_peak_bytes"]) > 0
        assert r["gpt_step_s"]["n"] == 1 and r["sleep_step_vs_1f1b"] > 0


@pytest.mark.slow
def test_bench_quick_gates_on_its_baseline(runs, request):
    """Against a baseline no run can meet, every figure is a REGRESSION line and the exit status is 1."""
    tmp_path, future = runs[request.node.originalname]
    names = QUICK_NAMES
    out = tmp_path / "bench_quick.json"
    proc = future.result()
    assert proc.returncode == 1, proc.stderr[-3000:]
    flagged = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("REGRESSION")]
    assert flagged == names
    got = json.loads(out.read_text())
    assert got["benchmark"] == "bench_quick" and list(got["ratios"]) == names and len(got["regressions"]) == 5
    assert all(r > 0 for r in got["ratios"].values()) and all(got["figures"][n]["yardstick"] for n in names)
    assert got["figures"]["compile_200k"]["pinned"] and got["figures"]["shape_change_P2"]["learned"] == 2
    assert "bench_quick.py" in (tmp_path / "RESULTS.md").read_text().splitlines()[-1]


def test_bench_quick_compare():
    sys.path.insert(0, str(BENCH))
    import bench_quick

    lines = bench_quick.compare({"compile_200k": 1.25, "op_cpu_P2": 1.2, "shape_change_P2": 0.5},
                                {"compile_200k": 1.0, "op_cpu_P2": 1.0})
    assert [line.split()[0] for line in lines] == ["REGRESSION", "ok", "new"]
    assert json.loads((BENCH / "baseline.json").read_text())["figures"].keys() == bench_quick.YARDSTICKS.keys()


def test_bench_quick_no_append_writes_no_results(tmp_path, monkeypatch):
    """--no-append is a look, not a record: neither RESULTS.md nor the default JSON is written (the figures are
    stubbed: what is measured does not matter here, only where it goes)."""
    sys.path.insert(0, str(BENCH))
    import _bench
    import bench_quick

    figs = {name: {"ratio": 1.0, "yardstick": yardstick} for name, yardstick in bench_quick.YARDSTICKS.items()}
    monkeypatch.setattr(bench_quick, "figures", lambda sizes: {k: dict(v) for k, v in figs.items()})
    monkeypatch.setattr(_bench, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setenv("PIPEDSL_RESULTS_MD", str(tmp_path / "RESULTS.md"))
    base = tmp_path / "baseline.json"
    base.write_text(json.dumps({"figures": dict.fromkeys(figs, 1.0)}))
    assert bench_quick.main(["--tiny", "--no-append", "--baseline", str(base)]) == 0
    assert not (tmp_path / "RESULTS.md").exists() and not (tmp_path / "results").exists()
    assert bench_quick.main(["--tiny", "--no-append", "--baseline", str(base), "--json", str(tmp_path / "a.json")]) == 0
    assert (tmp_path / "a.json").exists() and not (tmp_path / "RESULTS.md").exists()
    assert bench_quick.main(["--tiny", "--baseline", str(base)]) == 0  # without it, both: the paths are the real ones
    assert (tmp_path / "results" / "bench_quick.json").exists() and (tmp_path / "RESULTS.md").exists()


def test_gpu_check_without_a_gpu_says_so():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py")], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("gpu_check: no GPU") and "--device cpu" in proc.stdout


@pytest.mark.slow
def test_gpu_check_dry_run_on_gloo(runs, request):
    """`--device cpu`: the GPU checks' code on gloo — a built-in of each family equal to one process, every vs_torch
    schedule, CPU per op and plan --calibrate, into one JSON file and its markdown table."""

    tmp_path, future = runs[request.node.originalname]
    out = tmp_path / "gpu_check.json"
    proc = future.result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["backend"] == "gloo" and got["device"] == "cpu" and got["failed"] == []
    assert [r["schedule"] for r in got["schedules"]] == GPU_CHECK_SCHEDULES and all(r["ok"] for r in got["schedules"])
    assert [r["schedule"] for r in got["vs_torch"]] == ["gpipe", "1f1b", "interleaved", "interleaved-zb", "zb-v"]
    assert got["op_cpu"]["ratio"] > 0 and got["calibrate"]["ok"] and got["calibrate"]["calibration"]
    assert got["large"] == [] and got["large_mib"] > 0  # every schedule again, messages sized by --message-mib
    one = got["one_gpu"]  # the one-GPU row's wiring: a one-rank pipeline against a plain loop, first losses equal
    assert one["ratio"] > 0 and one["params"] > 0 and one["first_loss_rel_diff"] < 1e-5, one
    assert got["zero"]["problems"] == [] and len(got["zero"]["losses"]["zero3"]) >= 3  # ZeRO 1-3 on one rank
    # an HF Llama at two ranks' layouts (tp2 + SP with bf16 parameters and recomputation; dp2 with ZeRO-3), and the
    # trainer's --schedule auto against -P 1: what the GPU rows run, on gloo
    assert got["layouts"] == {"dp1 pp1 tp2+sp zero0 bf16-params recompute=full": [],
                              "dp2 pp1 tp1 zero3 fp32 recompute=None": []}, got["layouts"]
    assert got["trainer_auto"] == {"problems": [], "steps": 4}, got["trainer_auto"]
    assert got["timeline"] == []  # the last step's and the last two's measured timelines, in order
    md = out.with_suffix(".md").read_text()
    assert md.startswith("# gpu_check: cpu (gloo), P=2") and "| zb-v | 4 | equal |" in md
    assert "against a plain PyTorch loop" in md and "Each schedule above with" in md and "ZeRO 1-3 on one rank" in md
    assert "Measured timelines (ZB-H1, post-validated; the last step and the last two): in order" in md
    assert "| dp2 pp1 tp1 zero3 fp32 recompute=None | equal |" in md and "every loss equal to -P 1's" in md


@pytest.mark.slow
def test_zb_paper(runs, request):
    """One p = 8 setup (tests/pipedsl/test_zb_paper.py holds every p = 8 search): each search at or below the
    paper's ZB-1p and ZB-2p, within its cap, its overlapped steps' period the longest rank span."""
    got = run(runs, request, "zb_paper")
    assert got["checks"] == {"within": 2, "searches": 2} and [r["setup"] for r in got["rows"]] == ["1.5B p=8 m=24"]


@pytest.mark.slow
def test_moe_overlap(runs, request):
    """Five rows (1F1B, interleaved, ZB-V, DualPipeV without and with overlap); the overlapped row handed over at
    exchanges and has the simulator's prediction from the sequential row's costs."""
    got = run(runs, request, "moe_overlap")
    assert [r["schedule"] for r in got["rows"]] == ["1f1b", "interleaved", "zb-v", "dualpipev", "dualpipev (overlap)"]
    over = got["rows"][-1]
    assert over["handovers"] > 0 and over["predicted_ms"] > 0 and got["rows"][3]["handovers"] == 0
    assert set(got["checks"]) == {"pair_ratio", "predicted_over_measured"}


@pytest.mark.slow
def test_auto_schedule(runs, request):
    """Four rows (1F1B, ZB-H1 and ZB-V split by count, the searched schedule on the cut its profile chose) with the
    searched one's prediction, made before it ran."""
    got = run(runs, request, "auto_schedule")
    assert [r["schedule"] for r in got["rows"]] == ["1f1b", "zb-h1", "zb-v", "auto"]
    assert [r["split"] for r in got["rows"][:3]] == ["count"] * 3 and got["rows"][-1]["split"] != "flops"
    assert got["rows"][-1]["predicted_ms"] > 0 and max(got["rows"][-1]["peaks"]) <= 4
    assert set(got["checks"]) == {"auto_over_best_even", "predicted_over_measured"}


@pytest.mark.slow
def test_post_validate(runs, request):
    got = run(runs, request, "post_validate")
    assert [r["schedule"] for r in got["rows"]] == ["1f1b", "zb-h1", "zb-h2", "zb-auto mem=2", "zb-auto mem=4"]
    for r in got["rows"]:
        assert r["synchronous_s"] > 0 and r["post-validated_s"] > 0 and r["predicted_post_validated_s"] > 0
        assert r["predicted_post_validated_s"] <= r["predicted_synchronous_s"] + 1e-12  # steps overlap, or not


def test_the_smoke_runner_gives_each_script_its_status_output_and_environment(tmp_path):
    """smoke_runner.py runs each job as `python SCRIPT ARGV…` would: the exit status of sys.exit, of an exception (1,
    its traceback in the job's stderr) and of a clean end (0); output, even a child process's, in the job's files;
    exactly the job's environment, not the one before it."""
    scripts = {"exits": "import os, subprocess, sys\nprint('out', sys.argv[1:], os.environ.get('A'), os.environ.get('B'))"
                        "\nsubprocess.run([sys.executable, '-c', 'import sys; print(\"child\", file=sys.stderr)'])"
                        "\nif __name__ == '__main__':\n    sys.exit(3)\n",
               "raises": "import os\nprint(os.environ.get('A'), os.environ.get('B'))\nraise ValueError('broken')\n",
               "ends": "print('fine')\n"}
    jobs = []
    for (name, text), env in zip(scripts.items(), [{"A": "1"}, {"B": "2"}, {}]):
        (tmp_path / f"{name}.py").write_text(text)
        jobs.append({"script": str(tmp_path / f"{name}.py"), "argv": ["--x", name],
                     "env": {**{k: v for k, v in os.environ.items() if k not in ("A", "B")}, **env},
                     **{k: str(tmp_path / f"{name}.{k}") for k in ("out", "err", "status")}})
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    subprocess.run([sys.executable, str(RUNNER), str(tmp_path / "jobs.json")], check=True, timeout=120)
    read = {(name, k): (tmp_path / f"{name}.{k}").read_text() for name in scripts for k in ("out", "err", "status")}
    assert [read[name, "status"] for name in scripts] == ["3", "1", "0"]
    assert read["exits", "out"] == "out ['--x', 'exits'] 1 None\n" and read["exits", "err"] == "child\n"
    assert read["raises", "out"] == "None 2\n" and read["raises", "err"].rstrip().endswith("ValueError: broken")
    assert read["ends", "out"] == "fine\n" and read["ends", "err"] == ""
