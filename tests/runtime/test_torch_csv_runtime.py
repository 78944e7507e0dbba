"""`pipedsl compile --format torch-csv` runs on torch.distributed.pipelining's runtime (loaded with
torch's own `_load_csv`) with one process's gradients, and torch's dump loads back."""

from __future__ import annotations

import pytest
import torch_csv_cases as cases


@pytest.mark.slow
@pytest.mark.parametrize("schedule,M", [("dualpipev", 4), ("interleaved", 4), ("interleaved", 3)])  # 3: M % P != 0
def test_torch_runs_pipedsls_csv(schedule, M, pool2):
    results = pool2.run(cases.torch_runs_pipedsl_csv, schedule, 2, M)
    problems = [f"rank {r}: {p}" for r, res in enumerate(results) for p in res["problems"]]
    assert not problems, "\n".join(problems)
    last = 0 if schedule == "dualpipev" else 1  # the rank holding the last stage computes the M losses
    assert [res["losses"] for res in results] == [M if r == last else 0 for r in range(2)]
