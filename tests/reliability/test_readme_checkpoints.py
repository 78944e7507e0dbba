"""The checkpoint example (docs/checkpoints.md, linked from the README) runs: 10 steps, then a restart that resumes
at step 11."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipedsl.runtime import checkpoint

README = "\n".join((Path(__file__).resolve().parents[2] / name).read_text() for name in ("README.md", "docs/checkpoints.md"))


@pytest.mark.slow
def test_readme_checkpoint_example_resumes(tmp_path) -> None:
    [script] = [body for lang, body in re.findall(r"```(\w*)\n(.*?)```", README, re.S)
                if lang == "python" and "checkpoint.save" in body]
    assert "launch(train, 2, 40)" in script
    script = script.replace("GPTConfig()", "GPTConfig(n_embd=16, block_size=64)")  # small: a test
    script = script.replace("launch(train, 2, 40)", "launch(train, 2, 10)\n    print(launch(train, 2, 20))")
    script = script.replace("        opt.step(); opt.zero_grad()",
                            "        opt.step(); opt.zero_grad()\n        print('step', step, flush=True) if rank == 0 else None")
    (tmp_path / "example.py").write_text(script)
    proc = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert steps == [*range(1, 11), *range(11, 21)], steps
    assert [c.step for c in checkpoint.checkpoints(tmp_path / "ckpt")] == [10, 20]
