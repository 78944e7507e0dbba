"""The run's metrics: the JSONL record, TensorBoard scalars read back, W&B calls, the console line, MFU's formula."""

from __future__ import annotations

import json
import sys
import types

import pytest

from pipedsl.trainer.metrics import MetricsLogger, model_flops_per_token, peak_flops


def test_jsonl_tensorboard_and_console(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(tmp_path / "out", total_steps=2, tensorboard=str(tmp_path / "tb"), live=False)
    for step, loss in ((1, 3.0), (2, 2.5)):
        log.log(step, {"loss": loss, "step_ms": 10.0, "tokens_per_s": 1000.0, "mfu": 0.25})
    log.log(2, {"loss": 2.0, "perplexity": 7.389}, kind="eval")
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"], r["loss"]) for r in rows] == [("train", 1, 3.0), ("train", 2, 2.5), ("eval", 2, 2.0)]
    acc = EventAccumulator(str(tmp_path / "tb" / "out"))  # the run's folder: named after its output directory
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/loss")] == [3.0, 2.5]
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [(2, 2.0)]
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step   1/2  loss 3.0000  1,000 tok/s  MFU 25.00%")
    assert "ETA" in out[0] and "ETA" not in out[1]  # none after the last step
    assert out[2].startswith("eval   2/2  loss 2.0000  perplexity 7.389")


def test_each_run_has_its_own_tensorboard_folder_and_a_fresh_run_replaces_its_events(tmp_path):
    """Two runs (a training and its fine-tune) given one --tensorboard root: two TensorBoard runs.  Running the
    first again from scratch shows only the new run's steps; a resume from step 1 replaces step 2 and later."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def run(out: str, losses: list[float], resume_from: int = 0) -> None:
        log = MetricsLogger(tmp_path / out, total_steps=3, tensorboard=str(tmp_path / "tb"), live=False,
                            resume_from=resume_from)
        for step, loss in enumerate(losses, resume_from + 1):
            log.log(step, {"loss": loss, "step_ms": 1.0})
        log.close()

    def curve(out: str) -> list[tuple[int, float]]:
        acc = EventAccumulator(str(tmp_path / "tb" / out))
        acc.Reload()
        return [(e.step, e.value) for e in acc.Scalars("train/loss")]

    run("pretrain", [3.0, 2.0, 1.0])
    run("finetune", [0.5, 0.25])
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["finetune", "pretrain"]
    assert curve("pretrain") == [(1, 3.0), (2, 2.0), (3, 1.0)] and curve("finetune") == [(1, 0.5), (2, 0.25)]
    run("pretrain", [9.0])
    assert curve("pretrain") == [(1, 9.0)]
    run("pretrain", [8.0, 7.0], resume_from=1)
    assert curve("pretrain") == [(1, 9.0), (2, 8.0), (3, 7.0)]


def test_wandb_gets_every_number(tmp_path, monkeypatch):
    calls: list = []

    class Run:
        def log(self, values, step):
            calls.append(("log", step, values))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    log = MetricsLogger(tmp_path, total_steps=2, wandb_project="proj", config={"lr": 0.1}, live=False)
    log.log(1, {"loss": 1.5, "step_ms": 3.0, "note": "text"})
    log.close()
    assert calls[0][0] == "init" and calls[0][1]["project"] == "proj" and calls[0][1]["config"] == {"lr": 0.1}
    assert calls[1] == ("log", 1, {"train/loss": 1.5, "train/step_ms": 3.0})
    assert calls[-1] == ("finish",)
    import os

    assert os.environ["WANDB_MODE"] == "offline"  # no network needed


def test_mfu_formula_and_peaks():
    # PaLM: 6 FLOPs per multiplying parameter per token, plus 12·L·H·T for attention
    assert model_flops_per_token(1000, 200, 2, 16, 32) == 6 * 800 + 12 * 2 * 16 * 32
    peak, why = peak_flops(4, 2, override_tflops=100.0)
    assert peak == 400e12 and "--peak-tflops 100" in why
    peak, why = peak_flops(4, 2)
    assert peak > 0 and "measured fp32 GEMM" in why and "x 2 cores" in why
