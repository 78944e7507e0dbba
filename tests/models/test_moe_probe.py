"""Every MoE causal LM the installed transformers ships trains exactly or is refused by name: the probe
(benchmarks/moe_probe.py) over all of them, and its self-test — pipedsl's router loss broken on purpose must never
come out exact.  A model accepted and trained wrong is the one bug never to ship (JetMoE once was)."""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import moe_probe  # noqa: E402

pytestmark = pytest.mark.slow


def test_no_moe_model_is_accepted_and_wrong() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = moe_probe.main(["--no-write"])
    text = out.getvalue()
    assert status == 0 and "ACCEPTED AND WRONG" not in text, text[-3000:]
    exact = [line.split("|")[1].strip() for line in text.splitlines()
             if line.startswith("|") and "| exact |" in line]
    assert {"mixtral", "jetmoe", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "olmoe"} <= set(exact), exact


def test_a_broken_router_loss_is_never_exact() -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        assert moe_probe.self_test() == 0
