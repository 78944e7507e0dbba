"""The same script runs unchanged under torchrun (python -m torch.distributed.run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.slow
def test_under_torchrun() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(HERE / "torchrun_script.py")], capture_output=True, text=True, timeout=240, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "rank 0 OK under torchrun" in out and "rank 1 OK under torchrun" in out, out[-3000:]


@pytest.mark.slow
def test_pipedsl_train_under_torchrun(tmp_path) -> None:
    """`pipedsl train --model …` started by torchrun: each process checks the input and joins the group; global
    rank 0 reports once and writes the run's files; the others exit 0 quietly."""
    pytest.importorskip("transformers")
    root = HERE.parents[1]
    (tmp_path / "text.txt").write_text("stages pass activations forward and gradients back. " * 200)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "pipedsl.cli", "train", "--model", str(root / "examples" / "llama-tiny"), "--data",
                           str(tmp_path / "text.txt"), "-P", "2", "-M", "2", "--steps", "2", "--seq", "32", "--batch",
                           "4", "-o", str(tmp_path / "out")], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=root)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert proc.stdout.count("training llama") == 1 and proc.stdout.count("step   2/2") == 1, proc.stdout
    assert (tmp_path / "out" / "losses.json").exists() and (tmp_path / "out" / "metrics.jsonl").exists()
