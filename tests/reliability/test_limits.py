"""Every input built to exhaust pipedsl is refused with the limit's name, in bounded time and memory.

One child process runs every case (CLI lines through `pipedsl.cli.main`, Python API calls)
under an address-space limit (`RLIMIT_AS`, 1.5 GiB: torch alone maps ~0.6) and a timeout, and
reports each case as it ends; a case that hangs is named by the timeout, one that exhausts
memory dies in a MemoryError reported as a crash.  Each case then asserts exit status 2 (a
`PipeDSLError` for an API call), no traceback, and the limit's name in the message.  The
limits themselves are listed in pipedsl/limits.py and docs/language.md ("Limits").
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from pipedsl.limits import MAX_SOURCE_BYTES

ADDRESS_SPACE = 3 << 29  # 1.5 GiB
TIMEOUT = 300  # seconds for all cases together: a hang, not a speed test (the machine is shared)

HEAD = "schedule s(P, M) {\n  stages P\n  place s\n  order F by m\n  order B by m\n  warmup 0\n"
LOOSE = "schedule s(P, M) {\n  stages P\n  place s\n"  # for a compute block


def source(body: str, head: str = HEAD) -> str:
    return f"{head}{body}\n}}\n"


def _sources() -> dict[str, str]:
    lets = "".join(f"  let a{i + 1} = a{i} + a{i}\n" for i in range(40))
    linear = "".join(f"  let b{i + 1} = b{i} + 1\n" for i in range(150))
    return {
        "parens.pipe": source("  warmup " + "(" * 3000 + "0" + ")" * 3000).replace("  warmup 0\n", "", 1),
        "minus.pipe": source("  let x = " + "- " * 12000 + "1"),
        "not.pipe": source("  require " + "not " * 6000 + "P > 0: \"n\""),
        "ifexpr.pipe": source("  let x = " + "if P == 1 then 1 else " * 1200 + "0"),
        "ifblocks.pipe": source("  compute {" + " if r == 0 {" * 2000 + " F(0, 0)" + " }" * 2000 + " }", LOOSE),
        "forblocks.pipe": source("  compute {" + " for i in 0..1 {" * 1500 + " F(0, 0)" + " }" * 1500 + " }", LOOSE),
        "elseif.pipe": source("  compute { if r == 0 { F(0, 0) }" + " else if r == 1 { F(0, 0) }" * 1000 + " }",
                              LOOSE),
        "calls.pipe": source("  let x = " + "min(1, " * 3000 + "1" + ")" * 3000),
        "sum.pipe": source("  let x = " + " + ".join(["1"] * 8000)),
        "digits.pipe": source("  let x = " + "9" * 5000),
        "doubling.pipe": source("  let a0 = 1\n" + lets + "  require a40 > 0: \"a\""),
        "linear.pipe": source("  let b0 = 1\n" + linear + "  require b150 > 0: \"b\""),
        "overflow.pipe": source("  let x = " + " * ".join(["999999999999999999"] * 9) + "\n  require x != 0: \"x\""),
        "loop.pipe": source("  compute { for i in 0..1000000000000 { F(0, 0) } }", LOOSE),
        "loops.pipe": source("  compute { for i in 0..100000 { for j in 0..100000 { } } }", LOOSE),
        "large.pipe": source("# " + "x" * MAX_SOURCE_BYTES),
    }


def _programs() -> dict[str, str]:
    f = {"op": "F", "mb": 0, "stage": 0}
    return {
        "mb.json": json.dumps({"ranks": [[{**f, "mb": 10**12}]]}),
        "stages.json": json.dumps({"ranks": [[f]], "placement": [{"stage": 0, "rank": 0}], "num_stages": 10**9}),
        "replicas.json": json.dumps({"ranks": [[{**f, "replica": 10**15}]]}),
        "ranks.json": json.dumps({"ranks": [[]] * 5000}),
        "rank.csv": "rank,index,op,mb,stage,replica,peer\n1000000000,0,F,0,0,0,\n",
        "mb.csv": "rank,index,op,mb,stage,replica,peer\n0,0,F,999999999999,0,0,\n",
        "mb.txt": "r0: F999999999999.0\n",
        "ranks.txt": "".join(f"r{i}: F0.0\n" for i in range(2000)),
        "torch_mb.csv": "0F999999999\n",
        "torch_stage.csv": "999999999F0\n",
        "torch_rows.csv": "0F0\n" * 5000,
        "torch_pair.csv": "(" * 2000 + "0F0;1B0" + ")OVERLAP_F_B" * 2000 + "\n",
    }


def _cases(d: Path) -> list[tuple[str, str, object, str]]:
    """(id, kind, payload, the words the error must contain)."""
    p = lambda name: str(d / name)  # noqa: E731
    run = ["--seq", "8", "--embd", "16", "--steps", "1"]
    cases = [
        ("check-ranks-0", "cli", ["check", "1f1b", "--ranks", "0"], "MAX_RANKS"),
        ("check-ranks-negative", "cli", ["check", "1f1b", "--ranks", "2,-3"], "MAX_RANKS"),
        ("check-ranks-huge", "cli", ["check", "1f1b", "--ranks", "100000"], "MAX_RANKS"),
        ("check-grid-huge", "cli", ["check", "1f1b", "--ranks", "1000", "--max-factor", "1000000"],
         "MAX_COMPUTE_OPS"),
        ("compile-P-huge", "cli", ["compile", "1f1b", "-P", "100000", "-M", "2"], "MAX_RANKS"),
        ("simulate-P-huge", "cli", ["simulate", "1f1b", "-P", "9" * 5000, "-M", "2"], "MAX_NUMBER_DIGITS"),
        ("compile-PxM", "cli", ["compile", "1f1b", "-P", "1000", "-M", "1000"], "MAX_COMPUTE_OPS"),
        ("compile-M-huge", "cli", ["compile", "1f1b", "-P", "2", "-M", "10000000000"], "MAX_MICROBATCHES"),
        ("compile-V-huge", "cli", ["compile", "interleaved", "-P", "2", "-M", "2", "-V", "1000000000"],
         "MAX_COMPUTE_OPS"),
        ("compile-param-bits", "cli", ["compile", "interleaved", "-P", "2", "-M", "2", "-p", "V=" + "9" * 60],
         "MAX_VALUE_BITS"),
        ("cost-inf", "cli", ["simulate", "1f1b", "-P", "2", "-M", "2", "--cost", "F=inf"], "MAX_COST"),
        ("cost-huge", "cli", ["simulate", "1f1b", "-P", "2", "-M", "2", "--cost", "B=1e308"], "MAX_COST"),
        ("cost-digits", "cli", ["compare", "1f1b", "gpipe", "-P", "2", "-M", "2", "--cost", "W=" + "9" * 400],
         "MAX_COST"),
        ("cost-nan", "cli", ["simulate", "1f1b", "-P", "2", "-M", "2", "--cost", "F=nan"], "non-negative number"),
        ("cost-bandwidth-0", "cli", ["simulate", "1f1b", "-P", "2", "-M", "2", "--cost",
                                     "bandwidth=0,message_bytes=8"], "bandwidth"),
        ("cost-stage-huge", "cli", ["show", "1f1b", "-P", "2", "-M", "2", "--cost", "F@99999999999999=1"],
         "a stage below"),
        ("show-width", "cli", ["show", "1f1b", "-P", "2", "-M", "2", "--width", "100000000000"],
         "MAX_DRAWING_COLUMNS"),
        ("plan-gpus", "cli", ["plan", "--model", "gpt-175b", "--gpus", "1000000000000"], "MAX_PLAN_GPUS"),
        ("plan-batch", "cli", ["plan", "--model", "gpt-175b", "--global-batch", "1000000000000"], "MAX_PLAN_SIZE"),
        ("plan-tflops", "cli", ["plan", "--model", "gpt-175b", "--peak-tflops", "1e308"], "PLAN_RATE_RANGE"),
        ("plan-top", "cli", ["plan", "--model", "gpt-175b", "--top", "1000000000000"], "MAX_PLAN_TOP"),
        ("plan-schedule-device", "cli", ["plan", "--model", "gpt-175b", "--schedule", "/dev/zero"],
         "not a regular file"),
        ("schedule-dev-zero", "cli", ["compile", "/dev/zero", "-P", "2", "-M", "2"], "not a regular file"),
        ("schedule-dev-urandom", "cli", ["simulate", "/dev/urandom", "-P", "2", "-M", "2"], "not a regular file"),
        ("schedule-fifo", "cli", ["check", p("fifo.pipe"), "--ranks", "2"], "not a regular file"),
        ("schedule-sparse-10GiB", "cli", ["compile", p("sparse.pipe"), "-P", "2", "-M", "2"], "MAX_SOURCE_BYTES"),
        ("program-fifo", "cli", ["run", "--program", p("fifo.json"), *run], "not a regular file"),
        ("program-sparse-10GiB", "cli", ["run", "--program", p("sparse.json"), *run], "MAX_PROGRAM_BYTES"),
        ("api-cost-inf", "api", "pipedsl.Cost(F=float('inf'))", "MAX_COST"),
        ("api-cost-int", "api", "pipedsl.Cost(comm=10**400)", "MAX_COST"),
        ("api-cost-type", "api", "pipedsl.Cost(B='2')", "is a number"),
        ("api-simulate-nan", "api", "pipedsl.simulate(pipedsl.load('1f1b').compile(P=2, M=2), 'I=nan')",
         "non-negative"),
        ("api-compile-P", "api", "pipedsl.load('1f1b').compile(P=10**30, M=2)", "MAX_RANKS"),
        ("api-compile-M", "api", "pipedsl.load('gpipe').compile(P=2, M=2**200)", "MAX_MICROBATCHES"),
        ("api-from-text-size", "api", f"pipedsl.Schedule.from_text('#' * {MAX_SOURCE_BYTES + 1})",
         "MAX_SOURCE_BYTES"),
        ("api-from-text-nesting", "api", "pipedsl.Schedule.from_text('schedule s(P, M) { let x = ' + '-' * 20000 "
         "+ '1 }')", "MAX_NESTING"),
        ("api-program-text", "api", "pipedsl.Program.from_text('r0: F0.123456789012')", "digits"),
        ("api-plan-cluster", "api", "from pipedsl.plan.cluster import cluster_preset\n"
         "cluster_preset('a100-80gb').with_gpus(10**12)", "MAX_PLAN_GPUS"),
        ("api-plan-model", "api", "from dataclasses import replace\nfrom pipedsl.plan.model import model_preset\n"
         "replace(model_preset('gpt-175b'), vocab=10**40)", "MAX_PLAN_SIZE"),
    ]
    limits = {"parens": "MAX_NESTING", "minus": "MAX_NESTING", "not": "MAX_NESTING", "ifexpr": "MAX_NESTING",
              "ifblocks": "MAX_NESTING", "forblocks": "MAX_NESTING", "elseif": "MAX_NESTING", "calls": "MAX_NESTING",
              "sum": "MAX_NESTING", "digits": "MAX_NUMBER_DIGITS", "doubling": "MAX_EXPANSION",
              "linear": "MAX_NESTING", "overflow": "MAX_VALUE_BITS", "loop": "MAX_COMPUTE_STEPS",
              "loops": "MAX_COMPUTE_STEPS", "large": "MAX_SOURCE_BYTES"}
    cases += [(f"source-{name}", "cli", ["compile", p(f"{name}.pipe"), "-P", "2", "-M", "2"], limit)
              for name, limit in limits.items()]
    programs = {"mb.json": "MAX_MICROBATCHES", "stages.json": "MAX_COMPUTE_OPS", "replicas.json": "MAX_STAGES",
                "ranks.json": "MAX_RANKS", "rank.csv": "MAX_RANKS", "mb.csv": "MAX_MICROBATCHES",
                "mb.txt": "more than 9 digits", "ranks.txt": "MAX_RANKS", "torch_mb.csv": "MAX_MICROBATCHES",
                "torch_stage.csv": "MAX_STAGES", "torch_rows.csv": "MAX_RANKS",
                "torch_pair.csv": "an OVERLAP_F_B pair is a forward and a full backward"}
    cases += [(f"program-{name}", "cli", ["run", "--program", p(name), *run], words)
              for name, words in programs.items()]
    return cases


DRIVER = r"""
import contextlib, io, json, sys, time, traceback
import pipedsl
from pipedsl.cli import main
from pipedsl.errors import PipeDSLError
from pipedsl.runtime.launch import launcher

def refuse(*args, **kwargs):
    raise AssertionError("a process was started for an input that should have been refused")

launcher.launch = refuse
for case_id, kind, payload in json.load(sys.stdin):
    err = io.StringIO()
    began = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(payload) if kind == "cli" else exec(payload, {"pipedsl": pipedsl}) or 0
        except SystemExit as exit_:
            code = exit_.code
        except PipeDSLError as error:
            code = 2
            print(error, file=sys.stderr)
        except BaseException:
            code = "crash"
            traceback.print_exc()
    print(json.dumps([case_id, code, err.getvalue(), time.perf_counter() - began]), flush=True)
"""


def _bounded() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, tuple[object, str]]:
    d = tmp_path_factory.mktemp("limits")
    for name, text in {**_sources(), **_programs()}.items():
        (d / name).write_text(text)
    for name in ("fifo.pipe", "fifo.json"):
        os.mkfifo(d / name)  # opening one would block until a writer comes: never opened
    for name in ("sparse.pipe", "sparse.json"):
        with open(d / name, "wb") as f:
            f.truncate(10 << 30)  # 10 GiB that take no disk: refused from its size alone
    cases = [(case_id, kind, payload) for case_id, kind, payload, _ in _cases(d)]
    try:
        done = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(cases), capture_output=True,
                              text=True, timeout=TIMEOUT, preexec_fn=_bounded, env={**os.environ, "NO_COLOR": "1"})
        lines = done.stdout
    except subprocess.TimeoutExpired as hang:
        lines = hang.stdout.decode() if isinstance(hang.stdout, bytes) else (hang.stdout or "")
    rows = [json.loads(line) for line in lines.splitlines()]
    slowest = sorted(rows, key=lambda r: -r[3])[:5]  # for the record (-s): the limits are checked before the work
    print("slowest refusals: " + ", ".join(f"{case_id} {seconds:.2f} s" for case_id, _, _, seconds in slowest))
    return {case_id: (code, err) for case_id, code, err, _ in rows}


@pytest.mark.parametrize(("case_id", "words"), [(c[0], c[3]) for c in _cases(Path("/d"))],
                         ids=[c[0] for c in _cases(Path("/d"))])
def test_refused_with_the_limit_named(outcomes, case_id, words) -> None:
    assert case_id in outcomes, f"{case_id} did not finish within {TIMEOUT} s (all cases) or the run died"
    code, err = outcomes[case_id]
    assert code == 2, (code, err)
    assert "Traceback" not in err, err
    assert words in err, err
    message = [line for line in err.splitlines() if "error" in line or "invalid program" in line]
    assert message and len(message[-1]) < 400, err  # one line that a person reads, not a dump of the input
