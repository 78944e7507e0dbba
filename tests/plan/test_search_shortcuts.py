"""The search's shortcuts give the very numbers of the long way: a stage's parameters as the memory test reads
them before any time is priced (`cost.stage_holdings`) are `stage_costs`' own columns, bit for bit."""

from __future__ import annotations

import pytest

from pipedsl.plan.cluster import cluster_preset
from pipedsl.plan.config import Layout
from pipedsl.plan.cost import stage_costs, stage_holdings, stage_layers
from pipedsl.plan.model import model_preset


@pytest.mark.parametrize("name", ["gpt-1.7b", "llama-8b", "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"])
def test_stage_holdings_are_the_stage_costs_parameter_columns(name: str) -> None:
    model = model_preset(name)
    cluster = cluster_preset("a100-80gb").with_gpus(64)
    eps = [e for e in (1, 2, 4, 8) if not model.moe or model.experts % e == 0] if model.moe else [1]
    for tp in (1, 2, 8):
        for ep in eps:
            for pp, stages in ((1, 1), (2, 2), (4, 4), (4, 8), (8, 16)):
                for split in ("even", "balanced"):
                    if (64 // (tp * pp)) % ep:
                        continue
                    layout = Layout(64 // (tp * pp), pp, tp, "1f1b", 1, 8, 1, ep=ep, split=split)
                    layers = stage_layers(model, layout, stages)
                    if layers is None:
                        continue
                    costs = stage_costs(model, cluster, layout, stages, 1, layers)
                    held = stage_holdings(model, layout, stages, layers)
                    assert held.stage_params == costs.stage_params
                    assert held.expert_params == costs.expert_params
                    assert held.unit_pairs == costs.unit_pairs
