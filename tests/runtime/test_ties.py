"""Parameters tied between stages (GPT-2's embedding = output projection) train as in one process."""

from __future__ import annotations

import pytest
import tie_cases

from pipedsl.runtime.ties import find_ties


def test_find_ties_names_each_shared_parameter_by_stage():
    stages = tie_cases.tied_model(4)
    assert find_ties(stages) == [((0, "wte.weight"), (3, "wte.weight"))]
    assert find_ties(tie_cases.tied_model(4)[1:3]) == []


@pytest.mark.parametrize("schedule, P, M, params", [
    ("1f1b", 2, 4, None),             # first and last stage on different ranks
    ("zb-v", 2, 4, None),             # V placement: both on rank 0 (one object), split backward
    ("interleaved", 2, 4, {"V": 2}),  # stage 0 on rank 0, stage 3 on rank 1
    ("chimera", 2, 4, None),          # replicas: every rank holds a copy of both stages
])
@pytest.mark.quick
def test_tied_weights_train_like_one_process(pools, schedule, P, M, params):
    """Losses, every gradient (the tied weight's included) and the parameters after 3 Adam steps equal one process
    running the tied model (rtol 1e-5); `pipe.parameters()` yields the tied weight once."""
    out = pools[P].run(tie_cases.tied_equivalence, schedule, P, M, False, 3, params)
    for rank, r in enumerate(out):
        assert r["problems"] == [], f"rank {rank}: {r['problems'][:4]}"
        assert r["ties"] == 1
        assert r["params"] == r["distinct"], "pipe.parameters() yields a tied parameter twice"


def test_explicit_ties_align_copies_built_separately(pool2):
    out = pool2.run(tie_cases.tied_equivalence, "1f1b", 2, 4, True)
    for rank, r in enumerate(out):
        assert r["problems"] == [], f"rank {rank}: {r['problems'][:4]}"


def test_tied_weights_under_data_parallelism(pool4):
    out = pool4.run(tie_cases.tied_equivalence, "1f1b", 2, 2, False, 3, None, {"dp": 2, "pp": 2})
    assert sorted(r["dp_rank"] for r in out) == [0, 0, 1, 1]
    for rank, r in enumerate(out):
        assert r["problems"] == [], f"rank {rank}: {r['problems'][:4]}"


@pytest.mark.parametrize("ties, message", [
    ([[(0, "wte.weight"), (1, "nope.weight")]], "stage 1 has no parameter 'nope.weight'"),
    ([[(0, "wte.weight")]], "must name parameters of at least two stages"),
    ([[(0, "wte.weight"), (5, "wte.weight")]], "names stage 5"),
    ([[(0, "wte.weight"), (1, "ln.weight")]], "differ"),
])
def test_bad_ties_fail_on_every_rank(pool2, ties, message):
    out = pool2.run(tie_cases.tie_error, ties)
    for rank, m in enumerate(out):
        assert message in m, f"rank {rank}: {m}"


def test_stage_modules_that_each_wrap_the_whole_model_are_refused() -> None:
    """A stage wrapper holding the whole model and running its part would tie every weight; it is refused."""
    import torch
    from torch import nn

    from pipedsl.errors import PipeRuntimeError
    from pipedsl.runtime.ties import find_ties

    class Part(nn.Module):
        def __init__(self, model: nn.Module, index: int) -> None:
            super().__init__()
            self.model, self.index = model, index

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model[self.index](x)

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(PipeRuntimeError, match="stages 0 and 1 each hold every parameter of the model"):
        find_ties([Part(model, 0), Part(model, 1)])
    embedding = nn.Embedding(8, 4)
    head = nn.Linear(4, 8, bias=False)
    head.weight = embedding.weight  # a real tie between two small stages still is one
    assert len(find_ties([embedding, head])) == 1
