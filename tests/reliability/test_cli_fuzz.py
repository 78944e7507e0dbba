"""A fuzzer over the command line: any argv gives exit status 0, 1 or 2, no traceback, no hang.

Hypothesis builds argument vectors for every `pipedsl` subcommand from each command's own
flags (and some of the others'), with values that are right, wrong or absurd, plus program
and schedule files that are good, malformed or missing, and calls `pipedsl.cli.main(argv)`
in-process.  `train` and `run` would start processes once their arguments pass: the launch
is replaced by a stub that records the call and fails like a runtime error (status 1), so
every generated case stops at argument checking and the fuzzer stays fast.  Each case runs
under an alarm: a case that takes longer than `CASE_LIMIT` seconds fails as a hang.
The program *files* themselves are fuzzed in tests/pipedsl/test_program_fuzz.py.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipedsl
from pipedsl.cli import main
from pipedsl.errors import PipeRuntimeError
from pipedsl.limits import MAX_COMPUTE_OPS
from pipedsl.runtime.launch import launcher

CASE_LIMIT = 30  # seconds per generated command line
WORK = Path(tempfile.mkdtemp(prefix="pipedsl-cli-fuzz-"))  # cwd of every case: -o files land here
atexit.register(shutil.rmtree, WORK, ignore_errors=True)  # (a session left one behind in /tmp each time)
PROGRAM = pipedsl.load("1f1b").compile(P=2, M=2)
FILES = {
    "good.json": PROGRAM.to_json(), "good.csv": PROGRAM.to_csv(), "good.txt": PROGRAM.to_text(),
    "bad.json": '{"ranks": [[{"op": "F"', "bad.csv": "rank,index\n1,2\n", "bad.txt": "r0: F0.0 SEND_F0.0>7\n",
    "sched.pipe": "schedule s(P, M) {\n  stages P\n  place s\n  order F by m\n  order B by m\n  warmup 0\n}\n",
    "broken.pipe": "schedule s(P, M) {\n  place s +\n}\n",
    "timeline.json": "{}",
}
for _name, _text in FILES.items():
    (WORK / _name).write_text(_text)
(WORK / "binary.json").write_bytes(b"\x80\x81\xfe")
(WORK / "adir").mkdir(exist_ok=True)
# `train --model DIR --data …`: a tiny config-only model, a text file, TOML files good and bad
(WORK / "tiny-model").mkdir(exist_ok=True)
(WORK / "tiny-model" / "config.json").write_text(
    '{"model_type": "llama", "vocab_size": 300, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, '
    '"num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64, "eos_token_id": 256}')
(WORK / "corpus.txt").write_text("pipelines overlap communication with compute. " * 60)
(WORK / "good.toml").write_text("[training]\nsteps = 2\n[data]\nseq = 8\n")
(WORK / "bad.toml").write_text("[training]\nstepz = 2\n")
(WORK / "typo.toml").write_text('[training]\nsteps = "two"\n[nope]\nx = 1\n')

launches: list[tuple] = []


def _fake_launch(fn, nprocs, *args, **kwargs):
    launches.append((nprocs, kwargs))
    raise PipeRuntimeError("launch disabled in the CLI fuzzer")


def _hang(signum, frame):
    raise TimeoutError(f"a command line ran longer than {CASE_LIMIT} s")


# absurd counts are generated past every limit (MAX_COMPUTE_OPS and up to 10^30), never between a small
# size and the limit: a valid 400,000-microbatch program is real work, not bad input
absurd = st.one_of(st.integers(MAX_COMPUTE_OPS + 1, 10 ** 30), st.integers(-(10 ** 30), -3)).map(str)
ints = st.one_of(st.integers(-2, 12).map(str), absurd,
                 st.sampled_from(["9" * 400, "1_000", "٣", "+5", "0007", "2**40", "1e6", "0b11"]))
numbers = st.one_of(ints, st.sampled_from(["0.5", "1e-3", "nan", "inf", "-inf", "1e309", "0x10", "", " ", "three",
                                           "1e-320", "-0.0", "9" * 400 + ".5"]))
paths = st.sampled_from([*FILES, "binary.json", "adir", "missing.json", "missing.pipe", "", "-"])
schedules = st.one_of(st.sampled_from(pipedsl.builtin_names()), paths, st.text(max_size=6))
params = st.one_of(st.sampled_from(["V=2", "V=0", "V=-1", "V=x", "V", "=2", "X=1", "W=2", "V=99"]),
                   st.text(max_size=5))
costs = st.one_of(st.sampled_from(["F=1,B=2", "F=1,B=2,I=1,W=1,comm=0", "F=-1", "F@1=2", "F=nan", "comm=1e9",
                                   "Q=1", "F", ",", ""]), st.text(max_size=8))
outputs = st.sampled_from(["out.svg", "out.png", "out.json", "out.dot", "out.txt", "out.csv", "out.pdf", "out.xyz",
                           "nodir/out.png", "adir", ""])
junk = st.one_of(st.text(max_size=6), st.sampled_from(["--", "-", "-x", "--nope", "-h", "--help"]))

SIZE_FLAGS = {"-P": ints, "-M": ints, "-V": ints, "-p": params}
TRAIN_FLAGS = {
    "--steps": ints, "--batch": ints, "--seq": ints, "--layers": ints, "--embd": ints, "--lr": numbers,
    "--dropout": numbers, "--seed": ints, "--timeout": numbers, "--checkpoint-timeout": numbers,
    "--join-timeout": numbers, "--threads": ints, "--checkpoint-dir": paths, "--checkpoint-every": ints,
    "--resume": st.one_of(paths, st.just("")), "-o": outputs, "-P": ints, "--dp": ints, "--zero": ints,
    "--model": st.sampled_from(["tiny-model", "adir", "missing", "", "good.json", "gpt"]),
    "--data": st.one_of(paths, st.sampled_from(["corpus.txt", "good.toml"])),
    "--config": st.sampled_from(["good.toml", "bad.toml", "typo.toml", "missing.toml", "binary.json", "adir"]),
    "--print-config": None, "--packing": st.sampled_from(["pack", "pad", "bucket", ""]), "--doc-mask": None,
    "--eval-fraction": numbers, "--eval-every": ints, "--eval-batches": ints, "--text-field": st.text(max_size=4),
    "--peak-tflops": numbers, "--weight-decay": numbers, "--attn": st.sampled_from(["sdpa", "eager", "flash"]),
    "--loss-reduction": st.sampled_from(["token", "microbatch", "mean"]),
    # issue 39's options: stopping, retention, logging, LR schedules, weight decay, cut points
    "--max-time": numbers, "--stop-timeout": numbers, "--keep-checkpoints": ints, "--log-every": ints,
    "--auto-memory": numbers,
    "--overwrite": None, "--min-lr": numbers, "--decay-steps": ints, "--warmup-steps": ints,
    "--lr-schedule": st.sampled_from(["constant", "cosine", "linear", "wsd", "step", ""]),
    "--no-decay": st.sampled_from(["none", "biases", "biases,norms,embeddings", "norms,,", "bias", "", "none,biases"]),
    "--split": st.sampled_from(["count", "blocks", "flops", "1", "3,7", "7,3", "0", "1,1", "a,b", ""]),
    "--eval-data": st.one_of(paths, st.sampled_from(["corpus.txt"])),
}
FLAGS = {
    "compile": {**SIZE_FLAGS, "--format": st.sampled_from(["text", "json", "csv", "xml"]), "-o": outputs},
    "simulate": {**SIZE_FLAGS, "--cost": costs, "--format": st.sampled_from(["text", "json", "svg"])},
    "check": {"--ranks": st.sampled_from(["2,4", "1", "0", "-1", "a,b", "", "3,,5"]), "--max-factor": ints,
              "-p": params},
    "list": {},
    "compare": {**SIZE_FLAGS, "--cost": costs, "--format": st.sampled_from(["text", "json", "csv"])},
    "show": {**SIZE_FLAGS, "--cost": costs, "--trace": paths, "-o": outputs, "--graph": None, "--width": ints},
    "train": {**TRAIN_FLAGS, "--schedule": schedules, "-M": ints, "-p": params},
    "train-hf": {**TRAIN_FLAGS, "--schedule": schedules, "-M": ints, "-p": params},
    "run": {**TRAIN_FLAGS, "--program": paths},
    "export": {"--hf": outputs, "--dtype": st.sampled_from(["fp32", "bf16", "int8"])},
    "plan": {"--model": st.sampled_from(["gpt-1.7b", "llama-70b", "nope", ""]), "--layers": ints, "--hidden": ints,
             "--heads": ints, "--seq": ints, "--vocab": ints, "--global-batch": ints, "--ffn": ints,
             "--cluster": st.sampled_from(["a100-80gb", "h100", "h200", "tpu", ""]), "--gpus-per-node": ints,
             "--peak-tflops": numbers, "--memory-gb": numbers, "--intra-gbps": numbers, "--inter-gbps": numbers,
             "--intra-latency-us": numbers, "--inter-latency-us": numbers, "--schedule": schedules,
             "--zero": st.sampled_from(["0,1,2,3", "3", "4", "-1", "a", "", "0,,1"]), "--top": ints,
             "--rejected": ints},
}
SMALL_PLAN = ["--gpus", "4"]  # appended to every plan line (argparse: the last wins): a search of seconds, not hours
POSITIONAL = {"compile": 1, "simulate": 1, "check": 1, "compare": 3, "show": 3, "export": 1}
COMMAND = {"train-hf": "train"}  # a second base line for a command: `train` of a Hugging Face model


BASE = {  # a valid line per command; the fuzzer mutates it, so cases get past argparse into the commands
    "compile": ["compile", "1f1b", "-P", "2", "-M", "4"],
    "simulate": ["simulate", "gpipe", "-P", "2", "-M", "2", "--cost", "F=1,B=2"],
    "check": ["check", "1f1b", "--ranks", "2", "--max-factor", "2"],
    "list": ["list"],
    "compare": ["compare", "1f1b", "gpipe", "-P", "2", "-M", "4"],
    "show": ["show", "1f1b", "-P", "2", "-M", "2", "-o", "out.txt"],
    "train": ["train", "-P", "2", "-M", "2", "--seq", "8", "--embd", "16", "--steps", "2"],
    "train-hf": ["train", "--model", "tiny-model", "--data", "corpus.txt", "-P", "2", "-M", "2", "--seq", "8",
                 "--batch", "4", "--steps", "2", "--cache-dir", "cache"],
    "run": ["run", "--program", "good.json", "--seq", "8", "--embd", "16", "--steps", "2"],
    "export": ["export", "adir", "--hf", "exported"],
    "plan": ["plan", "--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--vocab", "100",
             "--global-batch", "8", "--top", "2"],
}


@st.composite
def mutated_lines(draw, command: str) -> list[str]:
    """A valid line with one to three changes: a value replaced, a flag added, a token dropped, junk inserted."""
    argv = list(BASE[command])
    flags = FLAGS[command]
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.integers(0, 3))
        at = draw(st.integers(1, max(1, len(argv) - 1)))
        if kind == 0 and len(argv) > 1:  # another value for a flag already there (or for the positional)
            flag = argv[at - 1]
            argv[at] = draw(flags[flag]) if flags.get(flag) is not None else draw(schedules)
        elif kind == 1 and flags:
            flag = draw(st.sampled_from(sorted(flags)))
            argv += [flag] if flags[flag] is None else [flag, draw(flags[flag])]
        elif kind == 2 and len(argv) > 1:
            del argv[at]
        else:
            argv.insert(at, draw(junk))
    return argv


@st.composite
def command_lines(draw, command: str) -> list[str]:
    if draw(st.integers(0, 2)):
        return draw(mutated_lines(command))
    argv = [COMMAND.get(command, command)]
    argv += draw(st.lists(schedules, min_size=0, max_size=POSITIONAL.get(command, 0)))
    flags = FLAGS[command]
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.integers(0, 9))
        if kind == 0:  # something no command knows
            argv.append(draw(junk))
            continue
        if kind == 1 and command != "list":  # a flag of another command
            other = draw(st.sampled_from(sorted(set().union(*map(set, FLAGS.values())))))
            argv.append(other)
            continue
        if not flags:
            continue
        flag = draw(st.sampled_from(sorted(flags)))
        argv.append(flag)
        if flags[flag] is not None and draw(st.integers(0, 9)):  # sometimes the value is missing
            argv.append(draw(flags[flag]))
    if command in ("train", "run") and draw(st.booleans()):
        argv += ["--seq", "8", "--embd", "16"]  # often get as far as the launch
    return argv


def run_argv(argv: list[str]) -> tuple[int, str]:
    if argv[:1] == ["plan"]:
        argv = [*argv, *SMALL_PLAN]
    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _hang)
    signal.alarm(CASE_LIMIT)
    cwd = os.getcwd()
    try:
        os.chdir(WORK)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        os.chdir(cwd)
    return code, err.getvalue()


@pytest.fixture(autouse=True)
def no_processes(monkeypatch):
    monkeypatch.setattr(launcher, "launch", _fake_launch)
    monkeypatch.setenv("NO_COLOR", "1")


def check_clean(argv: list[str]) -> None:
    code, err = run_argv(argv)
    assert code in (0, 1, 2), (argv, code, err)
    assert "Traceback" not in err, (argv, err)
    if code == 2:
        assert err.strip(), f"{argv}: status 2 without a message"
        assert any(kind in err for kind in ("error", "invalid program", "deadlock")), (argv, err)


@pytest.mark.parametrize("command", sorted(FLAGS))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_command_line_ends_cleanly(command, data) -> None:
    check_clean(data.draw(command_lines(command)))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(junk, schedules, ints, st.sampled_from(sorted(FLAGS))), max_size=6))
def test_arbitrary_argv_ends_cleanly(argv) -> None:
    check_clean(argv)


def test_the_fuzzer_reaches_the_launch_and_the_launch_stub_is_status_1() -> None:
    """The generated train/run lines are not all rejected early: valid ones get to the (stubbed) launch."""
    launches.clear()
    assert run_argv(["run", "--program", "good.csv", "--seq", "8", "--embd", "16", "--steps", "2"])[0] == 1
    assert run_argv(["train", "-P", "2", "-M", "2", "--seq", "8", "--embd", "16"])[0] == 1
    assert run_argv(BASE["train-hf"])[0] == 1  # a Hugging Face model on a text file: checked, tokenized, launched
    assert [n for n, _ in launches] == [2, 2, 2]
    assert all(kw["timeout"] > 0 and kw["join_timeout"] > 0 for _, kw in launches), "every run is bounded"
