"""The examples run, and the Hugging Face one trains exactly like one process."""

from __future__ import annotations

import math

import pytest
import runtime_cases as cases


@pytest.mark.slow
def test_nanogpt_example(pool2) -> None:
    a, b = pool2.run(cases.nanogpt_example)
    assert a == b and len(a) == 3 and all(math.isfinite(v) for v in a)
    # --clip --post-validate: the same losses as synchronous steps with the same clipping
    sync = pool2.run(cases.nanogpt_example, "zb-h2", 0.5, False)
    post = pool2.run(cases.nanogpt_example, "zb-h2", 0.5, True)
    assert post == sync and len(post[0]) == 3


@pytest.mark.slow
def test_hf_llama_example_trains_like_one_process(pool2, tmp_path) -> None:
    """Six steps of ZB-H1 (split backward) with padding, per-token loss, clipping and AdamW: every
    step's loss equals the unsplit HF model's trained the same way, and the timeline is written."""
    pytest.importorskip("transformers", reason="transformers is not installed (the optional `examples` extra)")
    from pipedsl.visualize import read_timeline

    a, b = pool2.run(cases.hf_llama_example, "zb-h1", {}, 6, str(tmp_path))
    assert a["losses"] == b["losses"]
    assert a["losses"] == pytest.approx(a["reference"], rel=1e-5)  # measured: 9.4e-8
    assert a["losses"][-1] < a["losses"][0] - 0.1, "the example does not learn"
    timeline = read_timeline(tmp_path / "timeline.json")
    assert len(timeline.ranks) == 2 and all(timeline.ranks) and (tmp_path / "timeline.png").stat().st_size > 0
