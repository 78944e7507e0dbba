"""Checkpoints written by earlier code keep loading: the layout change of issue 35 moved every module a
checkpoint could name (trainer, checkpoint, models), so a checkpoint written before it is resumed here.

tests/data/pre-layout-checkpoint holds step 3 of a small GPT run saved by commit 5096708, and the losses
that same code printed for steps 4 and 5 of an uninterrupted run: resuming must give them bit for bit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from cli_here import pipedsl_here

DATA = Path(__file__).resolve().parents[1] / "data" / "pre-layout-checkpoint"


def test_a_checkpoint_from_before_the_layout_change_resumes_bit_exactly(tmp_path: Path) -> None:
    """`pipedsl train --resume` from a step-3 checkpoint written by commit 5096708: the losses of steps 4 and 5 equal,
    bit for bit, those that code printed for a run that never stopped."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DATA / "step-00000003", ckpt / "step-00000003")
    out = tmp_path / "out"
    proc = pipedsl_here("train", "--schedule", "1f1b", "-P", "2", "-M", "2", "--steps", "5", "--batch", "4",
                        "--seq", "8", "--layers", "2", "--embd", "8", "-o", str(out), "--checkpoint-dir", str(ckpt),
                        "--resume", "--no-decay", "none")  # that code decayed every parameter (no --no-decay yet)
    assert proc.returncode == 0, proc.stderr
    expected = json.loads((DATA / "expected.json").read_text())["losses"]
    got = json.loads((out / "losses.json").read_text())["losses"]
    assert got == {step: expected[step] for step in ("4", "5")}
