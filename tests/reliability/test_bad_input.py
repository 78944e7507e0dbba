"""Bad input gives one clear error line, before anything runs: program files, sizes, checkpoints."""

from __future__ import annotations

import json

import pytest
import reliability_cases as cases

import pipedsl
from pipedsl.runtime import checkpoint
from pipedsl.runtime.launch import launcher

GOOD = pipedsl.load("1f1b").compile(P=2, M=2)


@pytest.fixture
def no_launch(monkeypatch):
    """These errors must come before any process starts."""
    def refuse(*args, **kwargs):
        raise AssertionError("a process was started for an input that should have been refused")
    monkeypatch.setattr(launcher, "launch", refuse)


def program_files(d) -> dict[str, str]:
    broken = GOOD.to_dict()
    del broken["ranks"][1][3]  # an instruction missing: fails validation
    gpipe = pipedsl.load("gpipe").compile(P=2, M=2).to_text()
    deadlock = gpipe.replace("F1.0 SEND_F1.0>1 RECV_B0.0<1", "F1.0 RECV_B0.0<1 SEND_F1.0>1")  # waits in a cycle
    files = {"json": GOOD.to_json(), "csv": GOOD.to_csv(), "txt": GOOD.to_text(),
             "malformed.json": '{"ranks": [[{"op": "F", "mb": 0, "stage": 0}', "broken.json": json.dumps(broken),
             "badop.txt": "r0: F0.0 X1.2\n", "badheader.csv": "rank,op\n0,F\n",
             "deadlock.txt": deadlock, "three.json": pipedsl.load("1f1b").compile(P=3, M=3).to_json(),
             "four.json": pipedsl.load("interleaved").compile(P=2, M=2).to_json(),
             "schedule.pipe": "schedule x(P, M) { stages P }\n"}
    out = {}
    for name, text in files.items():
        path = d / (name if "." in name else f"good.{name}")
        path.write_text(text)
        out[name] = str(path)
    (d / "binary.json").write_bytes(b"\xff\xfe\x00junk")
    out["binary.json"] = str(d / "binary.json")
    return out


def fake_checkpoint(d, num_stages: int) -> str:
    """A complete checkpoint as far as discovery is concerned (manifest + parts of the right size)."""
    step = d / "step-00000005"
    step.mkdir(parents=True)
    (step / "rank-00000.pt").write_bytes(b"x" * 3)
    manifest = {"format": "pipedsl-checkpoint", "version": 1, "step": 5, "world_size": 1,
                "schedule": {"schedule": "GPipe", "params": {"P": 1, "M": 1}},
                "partition": {"num_stages": num_stages, "fingerprint": "f", "stages": {}},
                "parts": [{"rank": 0, "file": "rank-00000.pt", "bytes": 3, "sha256": "", "modules": []}]}
    (step / "manifest.json").write_text(json.dumps(manifest))
    return str(d)


@pytest.mark.parametrize(("name", "extra", "message"), [
    ("missing.json", (), "error: cannot read {path}: No such file or directory"),
    ("schedule.pipe", (), "error: {path} is a schedule source, not a compiled program"),
    ("binary.json", (), "error: {path} is not UTF-8 text"),
    ("malformed.json", (), "invalid program: {path}: not JSON: "),
    ("broken.json", (), "invalid program: {path}: "),
    ("badop.txt", (), "invalid program: {path}: line 1: not an instruction: 'X1.2'"),
    ("badheader.csv", (), "invalid program: {path}: CSV header must be rank,index,op,mb,stage,replica,peer"),
    ("json", ("-P", "3"), "error: {path}: the program has 2 rank(s), but 3 were asked for"),
    ("csv", ("--batch", "7"), "error: --batch 7 does not split into M=2 equal microbatches"),
    ("txt", ("--embd", "30"), "error: --embd 30 must be a multiple of 4"),
    ("four.json", ("--layers", "1"), "error: --layers 1: an embedding, 1 blocks and a head make 3 pieces, "
                                     "fewer than the program's 4 stages"),
    ("json", ("--checkpoint-every", "2"), "error: --checkpoint-every needs --checkpoint-dir"),
    ("json", ("--checkpoint-dir", "/dev/null"), "error: --checkpoint-dir /dev/null: not a directory"),
    ("/dev/zero", (), "error: cannot read /dev/zero: not a regular file"),
    (".", (), "error: cannot read .: not a regular file"),
    ("json", ("--resume",), "error: --resume without a checkpoint needs --checkpoint-dir"),
    ("json", ("--resume", "nowhere"), "checkpoint error: nowhere: no such checkpoint directory"),
])
def test_run_rejects_bad_input_in_one_line(tmp_path, run_cli, no_launch, name, extra, message) -> None:
    files = program_files(tmp_path)
    path = files.get(name, name if name.startswith(("/", ".")) else str(tmp_path / name))
    code, lines = run_cli("run", "--program", path, "-o", str(tmp_path / "out"), *extra)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(message.format(path=path)), lines


def test_a_deadlocking_program_file_names_the_cycle(tmp_path, run_cli, no_launch) -> None:
    path = program_files(tmp_path)["deadlock.txt"]
    code, lines = run_cli("run", "--program", path)
    assert code == 2
    assert lines == [f"deadlock: {path}: the ranks wait on each other in a cycle: rank 0 waits at instruction 3 "
                     f"(RECV_B0.0<1) for rank 1; rank 1 waits at instruction 2 (RECV_F1.1<0) for rank 0"]


def test_resume_from_another_partition_fails_before_starting(tmp_path, run_cli, no_launch) -> None:
    ckpt = fake_checkpoint(tmp_path / "ck", num_stages=3)
    code, lines = run_cli("train", "-P", "2", "-M", "2", "--checkpoint-dir", ckpt, "--resume",
                          "-o", str(tmp_path / "out"))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("checkpoint error: the checkpoint (step 5, GPipe P=1 M=1) has 3 stages, the 2-block "
                               "GPT cut into 2 stages has 2: a checkpoint loads only into the same stage partition")


def test_resume_finds_no_complete_checkpoint(tmp_path, run_cli, no_launch) -> None:
    step = tmp_path / "ck" / "step-00000003"
    step.mkdir(parents=True)
    (step / "rank-00000.pt").write_bytes(b"half")  # no manifest: an interrupted save
    code, lines = run_cli("run", "--program", program_files(tmp_path)["json"], "--resume", str(tmp_path / "ck"))
    assert code == 2 and lines == [f"checkpoint error: {tmp_path / 'ck'}: no complete checkpoint "
                                   f"(1 incomplete: step-00000003)"]


@pytest.mark.parametrize("argv", [("-M", "0"), ("--steps", "-1"), ("--timeout", "0"), ("--timeout", "inf"),
                                  ("--lr", "nan"), ("--dropout", "1"), ("-p", "V")])
def test_train_rejects_bad_sizes(run_cli, no_launch, argv) -> None:
    code, lines = run_cli("train", "-P", "2", *argv)
    assert code == 2 and lines[-1].startswith("error: "), lines


@pytest.mark.slow
def test_pipeline_program_files_are_validated_on_every_rank(tmp_path) -> None:
    files = program_files(tmp_path)
    given = {"malformed": files["malformed.json"], "invalid": files["broken.json"],
             "three_ranks": files["three.json"], "json": files["json"], "csv": files["csv"]}
    results = pipedsl.launch(cases.bad_pipelines, 2, given, timeout=60.0, join_timeout=240.0, threads=1)
    same = [{k: str(v).replace("rank 1", "rank 0") for k, v in r.items()} for r in results]
    assert same[0] == same[1], "the same outcome on every rank"
    got = results[0]
    expect = {
        "malformed": f"invalid program: {files['malformed.json']}: not JSON",
        "invalid": f"invalid program: {files['broken.json']}: ",
        "three_ranks": "runtime error: the program '1F1B' has 3 ranks, but the process group has 2",
        "not_a_program": "runtime error: program= takes a Program or the path of a program file",
        "microbatches": "runtime error: microbatches=3, but the program was compiled for M=2",
        "stages": "runtime error: rank 0: the model has 3 stage(s), but schedule '1F1B' with P=2, M=2 has 2 stages",
        "batch": "runtime error: rank 0: inputs with batch size 7 (dim 0) do not split into M=2 equal microbatches",
    }
    for key, start in expect.items():
        text = got[key]
        assert text.startswith(start) and "\n" not in text, (key, got[key])
    assert isinstance(got["json"], float) and got["json"] == got["csv"], "good program files run"


@pytest.mark.slow
def test_data_parallel_checkpoint_saves_and_loads(tmp_path) -> None:
    results = pipedsl.launch(cases.data_parallel_save, 2, str(tmp_path), timeout=60.0, join_timeout=240.0, threads=1)
    assert results[0] == results[1] == ["ok", "ok"]
    info = checkpoint.latest(tmp_path)
    assert info is not None and info.step == 1


def test_a_script_calling_launch_without_the_main_guard_is_told_so(tmp_path) -> None:
    """Ranks are spawned and import the user's script again: an unguarded module-level launch() there
    used to give multiprocessing's 'bootstrapping phase' traceback from every rank."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text("import pipedsl\n\ndef f(rank):\n    return rank\n\npipedsl.launch(f, 2, timeout=60)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert "bootstrapping phase" not in proc.stderr and "spawn_main" not in proc.stderr, proc.stderr[-3000:]
    assert "without reporting an error" not in proc.stderr, proc.stderr[-3000:]
    told = [line for line in proc.stderr.splitlines() if "pipedsl.launch was called while a rank" in line]
    assert told and 'if __name__ == "__main__":' in told[0], proc.stderr[-3000:]
    assert "rank 0 failed: pipedsl.launch was called" in proc.stderr, proc.stderr[-3000:]
