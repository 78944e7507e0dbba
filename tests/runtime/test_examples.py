"""The examples run, and the Hugging Face one trains exactly like one process."""

from __future__ import annotations

import math

import pytest
import runtime_cases as cases


@pytest.mark.slow
def test_nanogpt_example(pool2) -> None:
    a, b = pool2.run(cases.nanogpt_example)
    assert a == b and len(a) == 3 and all(math.isfinite(v) for v in a)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_hf_gpt2_example_matches_single_process(schedule: str, pool2) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed (it is not a pipedsl dependency; "
                        "`pip install transformers` to run the Hugging Face GPT-2 example)")
    results = pool2.run(cases.hf_gpt2_equivalence, schedule, 4)
    problems = [p for res in results for p in res["problems"]]
    assert not problems, "\n".join(problems)
    assert all(res["checked"] > 0 for res in results)
