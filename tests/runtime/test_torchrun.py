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
