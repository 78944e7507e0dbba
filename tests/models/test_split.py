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


def test_by_flops_weighs_what_a_token_multiplies() -> None:
    """`matmul_weights`: a block 12·C² (qkv 3C², proj C², MLP 8C²), a head V·C, an embedding nothing (a lookup), norms
    and biases nothing; an MoE layer's experts top_k / E of theirs."""
    from pipedsl.models.split import matmul_weights

    C, V = 32, 512
    gpt = GPT(GPTConfig(vocab_size=V, block_size=16, n_layer=6, n_head=4, n_embd=C))
    assert matmul_weights(gpt.embed) == 0 and matmul_weights(gpt.head) == V * C
    assert matmul_weights(gpt.blocks[0]) == 12 * C * C
    moe = GPT(GPTConfig(vocab_size=V, block_size=16, n_layer=1, n_head=4, n_embd=C, n_experts=8, top_k=2))
    experts = 2 * 8 * C * 4 * C  # fc and proj of each of 8 experts
    assert matmul_weights(moe.blocks[0]) == 4 * C * C + 8 * C + experts * 2 / 8  # attention, router, 2 of 8


def test_by_flops_gives_a_large_vocabulary_head_a_stage_of_its_own_and_spreads_the_rest() -> None:
    """V·C = 16 blocks' worth: the head alone on the last stage (it bounds every split), the blocks spread evenly
    over the others (the least Σ stage², `even_sizes`); by count the head's stage would also hold blocks."""
    gpt = GPT(GPTConfig(vocab_size=6144, block_size=16, n_layer=9, n_head=4, n_embd=32))
    by_flops = [len(s) for s in gpt.stages(4, by="flops")]
    assert by_flops == [4, 3, 3, 1]  # [embed + 3 blocks, 3, 3, head]
    assert [len(s) for s in gpt.stages(4)] == [3, 3, 3, 2]
    seq = _seq([2, 2, 16, 2, 2, 2])
    assert [len(s) for s in split_sequential(seq, 3, by="flops")] == [2, 1, 3]


def test_the_trainer_cuts_a_hugging_face_model_by_flops_on_the_meta_device() -> None:
    import types

    tf = pytest.importorskip("transformers")
    from pipedsl.trainer.hf_setup import _split

    config = tf.LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    md = types.SimpleNamespace(config=config, path="llama")
    split = _split("flops", 6, 3, md)
    assert split.keywords() == {"points": [4, 7]}  # [embed + 3 layers, 3 layers, head]: the head weighs 4096·32
