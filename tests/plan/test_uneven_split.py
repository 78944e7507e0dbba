"""The planner's uneven stage partitions (cost.py's `stage_layers`, `Layout(split="balanced")`): the head's stage
takes fewer layers by the head's FLOPs, the search tries it beside Megatron's even split, reports every rank's
memory, and names the `pipedsl train --split` points that cut the runtime's model the same way."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipedsl.errors import PipeDSLError
from pipedsl.limits import MAX_BALANCED_LAYERS
from pipedsl.models.gpt.model import GPT, GPTConfig
from pipedsl.plan.cluster import cluster_preset
from pipedsl.plan.config import Layout
from pipedsl.plan.cost import piece_params, stage_costs, stage_layers
from pipedsl.plan.model import ModelSpec, model_preset
from pipedsl.plan.partition import balanced_sizes, bounds_of, even_sizes
from pipedsl.plan.report import train_split
from pipedsl.plan.search import LayoutError, evaluate, search

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


def test_piece_params_add_up_to_each_stages_params() -> None:
    """`piece_params`, summed over the pieces of any split, gives `stage_costs`' parameters and expert parameters per
    stage (what the memory-fitted split prices each candidate stage with): dense and MoE (DeepSeek-V3's dense
    first layers, ep 8, tp 2)."""
    cluster = cluster_preset("h100").with_gpus(64)
    for model, layout in ((model_preset("llama-8b"), Layout(dp=2, pp=4, tp=2, schedule="1f1b", microbatch=1, microbatches=8)),
                          (model_preset("deepseek-v3"), Layout(dp=8, pp=4, tp=2, schedule="1f1b", ep=8, microbatch=1, microbatches=8))):
        params, experts = piece_params(model, layout)
        L = model.layers
        for layers in ([L - 3, 1, 1, 1], [1, L - 3, 1, 1], [0, L // 2, L - L // 2, 0]):
            costs = stage_costs(model, cluster, layout, 4, 1, layers)
            edges = [0, layers[0] + 1, layers[0] + 1 + layers[1], layers[0] + 1 + layers[1] + layers[2], L + 2]
            for s, (a, b) in enumerate(zip(edges, edges[1:])):
                assert sum(params[a:b]) == pytest.approx(costs.stage_params[s], rel=1e-12)
                assert sum(experts[a:b]) == pytest.approx(costs.expert_params[s] if costs.expert_params else 0.0,
                                                          rel=1e-12, abs=1e-9)


def test_a_rank_short_of_memory_gives_up_layers_in_the_balanced_split() -> None:
    """16 layers of hidden 2048 on 4 ranks under 1F1B, 5 GB usable: the FLOP-balanced split [5, 4, 4, 3] needs 5.8 GB
    on rank 0, which holds 4 microbatches' activations.  The balanced layout then takes the FLOP-balanced split among
    those where every rank fits: rank 0 gives up a layer, every rank is within 5 GB, and no split that fits (all
    680, tried) has a lighter heaviest stage.  The step is 0.3 % slower than with memory to spare."""
    import dataclasses

    from pipedsl.plan.cost import piece_flops
    from pipedsl.plan.pipeline import compiled, program_peaks, stage_ranks
    from pipedsl.plan.search import _memory

    model = ModelSpec("deep", layers=16, hidden=2048, heads=16, seq=2048, vocab=32000, global_batch=64)
    layout = _layout("balanced")
    roomy = cluster_preset("h100").with_gpus(4)
    cluster = dataclasses.replace(roomy, memory=roomy.reserved_memory + 5e9)
    usable = 5e9
    on_rank, peaks = stage_ranks(compiled("1f1b", 4, 8)), program_peaks("1f1b", 4, 64)

    def memory(layers: list[int]) -> float:
        return _memory(model, layout, stage_costs(model, cluster, layout, 4, 1, layers), on_rank, peaks, layers,
                       False)[0].total

    flop_balanced = stage_layers(model, layout, 4)
    assert flop_balanced == [5, 4, 4, 3] and memory(flop_balanced) > usable
    fitted = evaluate(model, cluster, layout)
    assert fitted.layers[0] < 5 and sum(fitted.layers) == 16 and max(fitted.rank_memory) <= usable
    weights = piece_flops(model)

    def heaviest(layers: tuple[int, ...]) -> float:
        edges = [0, *itertools.accumulate([layers[0] + 1, *layers[1:-1], layers[-1] + 1])]
        return max(sum(weights[a:b]) for a, b in zip(edges, edges[1:]))

    splits = [(a, b, c, 16 - a - b - c) for a in range(17) for b in range(1, 17) for c in range(1, 17)
              if a + b + c <= 16]
    fitting = [s for s in splits if memory(list(s)) <= usable]
    assert len(splits) == 680 and fitting and heaviest(fitted.layers) == min(map(heaviest, fitting))
    assert fitted.iteration <= 1.01 * evaluate(model, roomy, layout).iteration
    with pytest.raises(LayoutError, match=r"out of memory: .*; no other split of the layers fits either$"):
        evaluate(model, dataclasses.replace(roomy, memory=roomy.reserved_memory + 3e9), layout)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=8), st.data())
def test_splits_held_to_what_each_stage_fits_against_every_split(weights, data) -> None:
    """`balanced_sizes` / `even_sizes` with a per-stage `fits` (each stage its own capacity, as ranks' memories
    differ): a split exactly when one fits, the least heaviest part among those that fit, and among those the least
    Σ part²; else an error.  Checked against every split."""
    L = len(weights)
    n = data.draw(st.integers(1, L))
    caps = data.draw(st.lists(st.integers(1, 14), min_size=n, max_size=n))

    def fits(s: int, a: int, b: int) -> bool:
        return sum(weights[a:b]) <= caps[s]

    def parts(sizes) -> list[int]:
        edges = bounds_of(sizes)
        return [sum(weights[a:b]) for a, b in zip(edges, edges[1:])]

    splits = []
    for cuts in itertools.combinations(range(1, L), n - 1):
        edges = [0, *cuts, L]
        sizes = [b - a for a, b in zip(edges, edges[1:])]
        if all(p <= c for p, c in zip(parts(sizes), caps)):
            splits.append(sizes)
    if not splits:
        with pytest.raises(PipeDSLError):
            balanced_sizes(weights, n, fits)
        return
    least = min(max(parts(s)) for s in splits)
    got = balanced_sizes(weights, n, fits)
    assert got in splits and max(parts(got)) == least
    even = even_sizes(weights, n, fits)
    assert even in splits and max(parts(even)) == least
    assert sum(p * p for p in parts(even)) == min(sum(p * p for p in parts(s)) for s in splits
                                                  if max(parts(s)) == least)
