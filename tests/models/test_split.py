"""Model splitting: by count, by parameter balance, at explicit points; GPT-style models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipedsl.errors import PipeRuntimeError
from pipedsl.models.gpt.model import GPT, GPTConfig
from pipedsl.models.split import split_gpt, split_sequential


def _seq(widths: list[int]) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(w, w) for w in widths))


def test_by_count_is_contiguous_and_balanced() -> None:
    seq = _seq([4] * 7)
    stages = split_sequential(seq, 3)
    assert [len(s) for s in stages] == [3, 2, 2]
    assert [m for s in stages for m in s] == list(seq), "same modules, same order, no copies"


def test_by_params_minimises_the_heaviest_stage() -> None:
    seq = _seq([2, 2, 16, 2, 2, 2])  # one heavy layer
    stages = split_sequential(seq, 3, by="params")
    weights = [sum(p.numel() for p in s.parameters()) for s in stages]
    assert max(weights) == 16 * 16 + 16, "the heavy layer stands alone"
    assert sum(len(s) for s in stages) == 6


def test_at_points() -> None:
    stages = split_sequential(_seq([4] * 5), points=[1, 4])
    assert [len(s) for s in stages] == [1, 3, 1]
    with pytest.raises(PipeRuntimeError, match="increasing"):
        split_sequential(_seq([4] * 5), points=[3, 2])
    with pytest.raises(PipeRuntimeError, match="non-empty"):
        split_sequential(_seq([4] * 2), 3)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_gpt_into_any_number_of_stages(n: int) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=6, n_head=2, n_embd=8))
    stages = model.stages(n)
    assert len(stages) == n and stages[0][0] is model.embed and stages[-1][-1] is model.head
    x = torch.randint(16, (2, 8))
    h = x
    for s in stages:
        h = s(h)
    torch.testing.assert_close(h, model(x))


def test_gpt_with_too_many_stages() -> None:
    with pytest.raises(PipeRuntimeError, match="at most 4"):
        split_gpt(nn.Identity(), [nn.Identity(), nn.Identity()], nn.Identity(), 5)


@pytest.mark.parametrize("n, blocks", [(1, [6]), (2, [3, 3]), (4, [2, 2, 1, 1]), (6, [1] * 6)])
def test_gpt_split_by_blocks_gives_every_stage_its_share_of_blocks(n: int, blocks: list[int]) -> None:
    """Megatron's split (what `pipedsl plan` models): the embedding and head ride on the end stages."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=6, n_head=2, n_embd=8))
    stages = model.stages(n, by="blocks")
    assert [sum(m in set(model.blocks) for m in s) for s in stages] == blocks
    assert stages[0][0] is model.embed and stages[-1][-1] is model.head
    x = torch.randint(16, (2, 8))
    h = x
    for s in stages:
        h = s(h)
    torch.testing.assert_close(h, model(x))
    with pytest.raises(PipeRuntimeError, match="cannot split 6 blocks into 7"):
        model.stages(7, by="blocks")
