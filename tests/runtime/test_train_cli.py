"""`pipedsl train`: the demo trains on local processes and writes the measured timeline."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import pipedsl


@pytest.mark.slow
def test_train_command_writes_a_measured_timeline(tmp_path) -> None:
    out = tmp_path / "train"
    proc = subprocess.run([sys.executable, "-m", "pipedsl.cli", "train", "--schedule", "1f1b", "-P", "2", "-M", "2",
                           "--steps", "3", "--seq", "8", "--embd", "16", "-o", str(out)],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    progress = [line for line in lines if line.startswith("step ")]
    assert len(progress) == 3 and all("loss" in p and "samples/s" in p for p in progress), proc.stdout
    timeline = pipedsl.Timeline.from_json((out / "timeline.json").read_text())
    program = pipedsl.load("1f1b").compile(P=2, M=2)
    assert timeline.kind == "measured"
    assert [[e.instr for e in events] for events in timeline.ranks] == [list(s) for s in program.ranks]
    assert timeline.peak_activations == pipedsl.simulate(program).peak_activations
