"""Hugging Face causal LMs cut by `causal_lm_stages` train exactly like the unsplit model."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (the optional `examples` extra)")

import hf_cases  # noqa: E402
from compared import every_parameter_compared  # noqa: E402

pytestmark = pytest.mark.slow


def _check(results: list[dict]) -> None:
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:8])
    every_parameter_compared([n for r in results for n in r["checked"]], results[0]["all"])


SCHEDULES = [
    ("1f1b", None),
    ("zb-h1", None),            # split backward: I then W
    ("interleaved", {"V": 2}),  # 4 stages on 2 ranks: embedding and head on different ranks
]
FAMILIES = [
    ("llama", "eager", True),  # a tied Llama, eager 4-D masks
    ("qwen2", "sdpa", None),   # full + sliding-window layer types
    ("gpt2", "sdpa", None),    # learned positions, tied by default
]


@pytest.mark.parametrize("schedule, params", SCHEDULES, ids=[s for s, _ in SCHEDULES])
@pytest.mark.parametrize("family, attn, tie", FAMILIES, ids=[f for f, _, _ in FAMILIES])
def test_two_steps_equal_the_unsplit_model(pool2, family, attn, tie, schedule, params):
    """Loss, every gradient and the global norm at each of two SGD steps, and the weights after them:
    a tied embedding counted once in the norm and still one weight (every copy equal to it)."""
    results = pool2.run(hf_cases.equivalence, family, schedule, 4, params, attn, tie, False, False, None, None, 2)
    _check(results)
    assert all(r["ties"] == (1 if tie or family == "gpt2" else 0) for r in results)


@pytest.mark.parametrize("schedule", ["zb-v", "chimera"])
def test_llama_with_both_ends_on_one_rank_and_with_replicas(pool2, schedule):
    """ZB-V puts the embedding and the head on rank 0 (the tie within one rank); Chimera holds two
    replicas of every stage on different ranks."""
    _check(pool2.run(hf_cases.equivalence, "llama", schedule, 4, None, "sdpa", True, False, False, None, None, 2))


def test_mistral_sliding_window_on_every_layer(pool2):
    _check(pool2.run(hf_cases.equivalence, "mistral", "1f1b", 2, None, "eager"))


@pytest.mark.parametrize("family, attn, schedule", [("llama", "sdpa", "1f1b"), ("qwen2", "eager", "zb-h1"),
                                                    ("gpt2", "eager", "1f1b")])
def test_padding_mask_with_per_token_loss(pool2, family, attn, schedule):
    """Left and right padding spread unevenly over microbatches, labels -100 there: the mask travels
    with the hidden states, and loss_reduction="token" gives HF's mean over every label of the batch."""
    _check(pool2.run(hf_cases.equivalence, family, schedule, 2, None, attn, None, True, True))


def test_bf16_equals_hf_under_autocast(pool2):
    """precision="bf16" against the unsplit model under torch.autocast(bf16), to bf16's tolerance."""
    _check(pool2.run(hf_cases.equivalence, "llama", "1f1b", 4, None, "sdpa", True, True, True, "bf16"))


@pytest.mark.parametrize("family, schedule, params", [("qwen2", "zb-h1", None), ("gpt2", "interleaved", {"V": 2})])
def test_full_recomputation_gives_the_same_gradients(pool2, family, schedule, params):
    """recompute="full" with padding and the per-token loss: loss, every gradient and the global norm of one SGD step
    equal the unsplit model's in one process (rtol 1e-5 on the loss, 1e-4 of each tensor's largest entry)."""
    _check(pool2.run(hf_cases.equivalence, family, schedule, 4, params, "sdpa", None, True, True, None, "full"))


@pytest.mark.parametrize("family, attn, padded, positions", [
    ("llama", "eager", True, False),
    ("qwen2", "eager", False, True),   # packed documents (position ids restart): HF's packed masks
    ("qwen3", "sdpa", True, False),
    ("gpt2", "sdpa", False, True),
    ("starcoder2", "sdpa", True, False),  # its embedding dropout: a probability, applied by the stage's embedding
])
def test_stages_in_sequence_reproduce_the_logits_with_dropout(pool2, family, attn, padded, positions):
    r = pool2.run(hf_cases.stage_chain, family, attn, 3, 0.2, padded, positions)[0]
    assert r["dropout_changes"] > 1e-3, "dropout did nothing: the check would not see a different draw order"
    assert r["err"] < 1e-5


def test_units_are_spread_like_split_gpt(pool2):
    r = pool2.run(hf_cases.stage_chain, "qwen2", "sdpa", 4, 0.0, False, False)[0]
    assert r["sizes"] == [1, 1, 1, 0]  # [embed, layer 0] [layer 1] [layer 2] [head]
    assert r["kinds"] == ["full_attention", "sliding_attention", "sliding_attention"]


def test_bad_requests_say_what_is_wrong(pool2):
    out = pool2.run(hf_cases.bad_requests)[0]
    assert "Linear is not a Hugging Face model" in out["unsupported"]
    assert "cannot cut an embedding, 3 layers and a head into 6 stages" in out["too_many"]
