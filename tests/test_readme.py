"""Every example in the README runs: its `pipedsl` commands, the Python API snippet, and the
training script (shortened to one step)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pipedsl.cli import main

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, re.S)
COMMANDS = [line.split("#")[0].strip() for lang, body in BLOCKS if lang == "bash" for line in body.splitlines()
            if line.startswith("pipedsl ")]
SNIPPETS = [body for lang, body in BLOCKS if lang == "python"]


def test_the_readme_has_examples():
    assert len(COMMANDS) >= 5 and len(SNIPPETS) >= 2


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.split()[1] in ("list", "compile", "simulate", "compare")])
def test_command(command, capsys):
    argv = shlex.split(command)[1:]
    assert main(argv) == 0, capsys.readouterr().err


def test_check_command(tmp_path, capsys):
    [command] = [c for c in COMMANDS if c.split()[1] == "check"]
    (tmp_path / "my.pipe").write_text((Path(__file__).resolve().parents[1] / "schedules" / "1f1b.pipe").read_text())
    argv = [a if a != "my.pipe" else str(tmp_path / "my.pipe") for a in shlex.split(command)[1:]]
    assert main(argv) == 0, capsys.readouterr().out


def test_api_snippet(capsys):
    [api] = [s for s in SNIPPETS if "pipedsl.simulate" in s]
    exec(compile(api, "README.md", "exec"), {})
    assert "r0: F0.0 SEND_F0.0>1" in capsys.readouterr().out


def test_training_script(tmp_path):
    [script] = [s for s in SNIPPETS if "pipedsl.launch" in s]
    launch = re.search(r"pipedsl\.launch\(train, (\d+), (\d+)\)", script)
    assert launch, "the training snippet should end with pipedsl.launch(train, P, steps)"
    path = tmp_path / "train.py"
    path.write_text(script.replace(launch.group(0), f"pipedsl.launch(train, {launch.group(1)}, 1)"))
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
