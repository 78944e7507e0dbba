"""The planner's uneven stage partitions (cost.py's `stage_layers`, `Layout(split="balanced")`): the head's stage
takes fewer layers by the head's FLOPs, the search tries it beside Megatron's even split, reports every rank's
memory, and names the `pipedsl train --split` points that cut the runtime's model the same way."""

from __future__ import annotations

import pytest
import torch

from pipedsl.limits import MAX_BALANCED_LAYERS
from pipedsl.models.gpt.model import GPT, GPTConfig
from pipedsl.plan.cli import train_split
from pipedsl.plan.cluster import cluster_preset
from pipedsl.plan.config import Layout
from pipedsl.plan.cost import stage_costs, stage_layers
from pipedsl.plan.model import ModelSpec, model_preset
from pipedsl.plan.search import evaluate, search

BIG_VOCAB = ModelSpec("big-vocab", layers=16, hidden=1024, heads=16, seq=1024, vocab=256_000, global_batch=64)


def _layout(split: str, pp: int = 4, schedule: str = "1f1b") -> Layout:
    return Layout(dp=1, pp=pp, tp=1, schedule=schedule, microbatch=1, microbatches=64 // 1, split=split)


def test_a_large_vocabulary_head_takes_layers_off_the_last_stage() -> None:
    """The head costs 2·s·h·V FLOPs, about 21 layers' worth at V = 256k: the balanced cut gives the last stage no
    layer, the others the 16 between them; the stages' forward times are closer than the even split's."""
    layers = stage_layers(BIG_VOCAB, _layout("balanced"), 4)
    assert layers is not None and sum(layers) == 16 and layers[-1] < 4 and layers == sorted(layers, reverse=True)
    assert stage_layers(BIG_VOCAB, _layout("even"), 4) == [4, 4, 4, 4]
    cluster = cluster_preset("a100-80gb").with_gpus(4)
    even = stage_costs(BIG_VOCAB, cluster, _layout("even"), 4).F
    balanced = stage_costs(BIG_VOCAB, cluster, _layout("balanced"), 4).F
    assert max(balanced) < 0.8 * max(even)
    assert max(balanced) / min(balanced) < max(even) / min(even)


def test_the_balanced_layout_is_faster_and_reports_each_ranks_memory() -> None:
    cluster = cluster_preset("a100-80gb").with_gpus(4)
    even, balanced = evaluate(BIG_VOCAB, cluster, _layout("even")), evaluate(BIG_VOCAB, cluster, _layout("balanced"))
    assert balanced.iteration < 0.9 * even.iteration
    assert len(balanced.rank_memory) == 4 and max(balanced.rank_memory) == pytest.approx(balanced.memory.total)
    assert 0 < balanced.memory_balance <= 1 and balanced.layers == tuple(stage_layers(BIG_VOCAB, _layout("balanced"), 4))


def test_search_tries_both_and_is_never_worse_than_even_only() -> None:
    """gpt-3.6b (V = 51200) on 64 A100s: the search with balanced splits finds a faster layout than Megatron's even
    split alone, and it is a balanced one."""
    model, cluster = model_preset("gpt-3.6b"), cluster_preset("a100-80gb").with_gpus(64)
    both = search(model, cluster, top=1)
    even = search(model, cluster, top=1, splits=("even",))
    assert both.ranked[0].iteration < even.ranked[0].iteration
    assert both.ranked[0].layout.split == "balanced" and even.ranked[0].layout.split == "even"


def test_a_balanced_split_equal_to_the_even_one_is_not_searched_twice() -> None:
    small = ModelSpec("small", layers=4, hidden=64, heads=4, seq=32, vocab=100, global_batch=8)
    result = search(small, cluster_preset("a100-80gb").with_gpus(4), top=1000)
    assert all(e.layout.split == "even" or len(set(e.layers)) > 1 for e in result.ranked)
    assert any(r.reason.startswith("duplicate:") for r in result.rejected)


@pytest.mark.parametrize("layers", [(3, 3, 2, 0), (5, 4, 4, 3), (2, 2, 2, 2)])
def test_the_train_split_cuts_the_runtime_gpt_like_the_plan(layers) -> None:
    """`--split` as the table prints it cuts the built-in GPT into stages of the planned layers each."""
    split = train_split(layers)
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=sum(layers), n_head=2, n_embd=16))
    points = None if split == "blocks" else [int(p) for p in split.split(",")]
    stages = model.stages(len(layers), by="blocks", points=points)
    blocks = [sum(1 for i, _ in stage.units() if 1 <= i <= sum(layers)) for stage in stages]
    assert blocks == list(layers)


def test_a_model_deeper_than_the_balanced_limit_is_searched_even_only_and_says_why() -> None:
    """The balanced split's exact DP is quadratic in layers: past `MAX_BALANCED_LAYERS` a layout is rejected as
    `size:` (the fuzzer's 510,920 layers once ran for minutes), the even split still searched."""
    deep = ModelSpec("deep", layers=MAX_BALANCED_LAYERS * 2, hidden=64, heads=4, seq=32, vocab=100, global_batch=8)
    result = search(deep, cluster_preset("a100-80gb").with_gpus(4), top=5)
    assert result.ranked and all(e.layout.split == "even" for e in result.ranked)
    assert any(r.reason.startswith("size: balanced splits") for r in result.rejected)
