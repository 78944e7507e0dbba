"""Hugging Face encoder-decoders (T5, mT5, UMT5, BART, mBART, Marian, Pegasus) as pipeline stages: the stages
compute the model's own logits and gradients in one process, and pipelined training under every kind of
schedule, dp and ZeRO equals one process; what is not an encoder-decoder is refused by name."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (the optional `hf` extra)")

import seq2seq_cases as cases  # noqa: E402
import torch  # noqa: E402
from compared import every_parameter_compared  # noqa: E402

from pipedsl.errors import PipeRuntimeError  # noqa: E402
from pipedsl.models.hf.seq2seq import check_seq2seq_split, seq2seq_loss, seq2seq_stages  # noqa: E402


@pytest.mark.parametrize("family", cases.FAMILIES)
@pytest.mark.parametrize("num_stages", [2, 5])
def test_stages_reproduce_logits_loss_and_every_gradient(family, num_stages):
    """Cut in two (the boundary inside stage 0 or 1) or five ways (a stage holding the last encoder layer, the
    decoder input and the first decoder layer), with source and label padding: logits, HF's loss and every
    parameter's gradient — the shared embedding, the relative position bias, the encoder's last layer whose
    output every decoder layer attends to — equal the unsplit model's."""
    model = cases.tiny_seq2seq(family)
    ref = copy.deepcopy(model)
    (ids, mask, dec), labels = cases.batch(model, 4)
    want = ref(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, labels=labels, use_cache=False)
    want.loss.backward()
    stages = seq2seq_stages(model, num_stages)
    x = (ids, mask, dec)
    for stage in stages:
        x = stage(*x) if isinstance(x, tuple) else stage(x)
    assert (x - want.logits).abs().max().item() <= 1e-5 * want.logits.abs().max().item()
    loss = seq2seq_loss(x, labels)
    assert abs(loss.item() - want.loss.item()) <= 1e-6 * want.loss.item()
    loss.backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        q = ref_params[name].grad
        if not p.requires_grad:  # Marian's sinusoidal positions
            assert p.grad is None and q is None, name
            continue
        assert p.grad is not None, name
        assert (p.grad - q).abs().max().item() <= 1e-5 * q.abs().max().clamp_min(1e-12).item(), name


def test_what_a_stage_holds():
    """Each stage holds its units' modules and nothing of the others (no stage wraps the whole model); the
    encoder output goes on through the decoder stages; T5's shared relative bias is a tie of the Parameter."""
    from pipedsl.runtime.ties import find_ties

    model = cases.tiny_seq2seq("t5")  # units: enc input, 3 enc layers, dec input, 3 dec layers, head
    stages = seq2seq_stages(model, 4, points=[2, 6, 7])
    sizes = [(len(s.encoder_layers), len(s.decoder_layers)) for s in stages]
    assert sizes == [(1, 0), (2, 1), (0, 1), (0, 1)]
    names = {id(p): n for n, p in model.named_parameters()}
    holders: dict[str, int] = {}
    for s in stages:
        for p in s.parameters():
            holders[names[id(p)]] = holders.get(names[id(p)], 0) + 1
    assert set(holders) == set(names.values())  # every parameter on a stage …
    shared = {n for n, k in holders.items() if k > 1}  # … and on several only the tables the model shares
    assert shared == {"shared.weight", "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                      "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"}, shared
    ties = {tuple(s for s, _ in tie) for tie in find_ties(stages)}
    assert (0, 1, 3) in ties  # the shared token embedding: both stacks' inputs and the head
    bias = {tuple(tie) for tie in find_ties(stages) if "relative_attention_bias" in tie[0][1]}
    assert {tuple(s for s, _ in tie) for tie in bias} == {(0, 1), (1, 2, 3)}, bias  # encoder's; decoder's


def test_a_decoder_attention_mask_travels_with_the_batch():
    model = cases.tiny_seq2seq("bart")
    stages = seq2seq_stages(model, 3, decoder_attention_mask=True)
    assert check_seq2seq_split(model, stages) <= 1e-5
    with pytest.raises(TypeError, match="takes 4 tensors"):
        stages[0](torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long))


def test_what_is_not_an_encoder_decoder_is_refused_by_name():
    import hf_cases

    with pytest.raises(PipeRuntimeError, match="LlamaForCausalLM is not an encoder-decoder .* causal_lm_stages"):
        seq2seq_stages(hf_cases.tiny_model("llama"), 2)
    with pytest.raises(PipeRuntimeError, match="not a Hugging Face model"):
        seq2seq_stages(torch.nn.Linear(2, 2), 2)
    with pytest.raises(PipeRuntimeError, match="cannot cut T5ForConditionalGeneration"):
        seq2seq_stages(cases.tiny_seq2seq("t5"), 10)


def test_the_check_has_teeth():
    """A forward rule the stages do not know of: seq2seq_stages refuses the model by name (its own check on a
    shallow copy); check_seq2seq_split finds BART's final_logits_bias missing from a head."""
    import transformers as tf

    class DoubledBart(tf.BartForConditionalGeneration):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2.0
            return out

    model = DoubledBart(cases.tiny_seq2seq("bart").config)
    with pytest.raises(PipeRuntimeError, match="DoubledBart cut into 3 stages gives logits .* away"):
        seq2seq_stages(model, 2)
    bart = cases.tiny_seq2seq("bart")
    stages = seq2seq_stages(bart, 2)
    stages[-1].head.final_logits_bias = None
    with pytest.raises(PipeRuntimeError, match="BartForConditionalGeneration cut into 2 stages"):
        check_seq2seq_split(bart, stages)


SCHEDULES = [("1f1b", None), ("zb-h1", None), ("interleaved", {"V": 2}), ("zb-v", None)]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["t5", "mt5", "bart"])
@pytest.mark.parametrize("schedule, params", SCHEDULES)
def test_pipelined_training_equals_one_process_p2(pool2, family, schedule, params):
    """P=2, two SGD steps, the encoder/decoder boundary inside a stage (units by count): loss, gradient norm (rtol 1e-5)
    and every weight (atol 2e-6) equal the unsplit model in one process."""
    results = pool2.run(cases.train_equal, family, schedule, 4, params)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:8])
    every_parameter_compared([n for r in results for n in r["checked"]], results[0]["all"])
    assert min(r["moved"] for r in results) > 1e-3  # the steps changed the weights


@pytest.mark.slow
@pytest.mark.parametrize("family", ["t5", "mt5", "bart"])
@pytest.mark.parametrize("schedule, params", SCHEDULES)
def test_pipelined_training_equals_one_process_p4(pool4, family, schedule, params):
    """P=4 (and 8 chunks for the interleaved and V schedules, a decoder stage holding T5's bias from a tie): loss,
    gradient norm and every weight after two SGD steps equal the unsplit model in one process."""
    results = pool4.run(cases.train_equal, family, schedule, 4, params)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:8])
    every_parameter_compared([n for r in results for n in r["checked"]], results[0]["all"])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["t5", "mt5", "bart"])
@pytest.mark.parametrize("zero", [1, 3])
def test_dp2_pp2_zero_equals_one_process(pool4, family, zero):
    """dp2 × pp2 under ZeRO-1 and ZeRO-3: the global batch split over the replicas, the shared embedding's and
    the relative bias's copies summed over the stages that hold them; loss, norm and weights equal one process."""
    results = pool4.run(cases.train_equal, family, "1f1b", 2, None, 2, zero)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:8])
    every_parameter_compared([n for r in results for n in r["checked"]], results[0]["all"])


@pytest.mark.slow
@pytest.mark.parametrize("family, schedule, zero, recompute, precision", [
    ("t5", "zb-h1", 2, "full", None), ("bart", "interleaved", 0, "full", None), ("mt5", "1f1b", 0, None, "bf16")])
def test_recomputation_zero2_and_bf16(pools, family, schedule, zero, recompute, precision):
    """Full recomputation (under ZeRO-2 on dp2 × pp2, and interleaved), and bf16 against HF under autocast."""
    dp = 2 if zero else 1
    params = {"V": 2} if schedule == "interleaved" else None
    results = pools[2 * dp].run(cases.train_equal, family, schedule, 4, params, dp, zero, None, 2, recompute, precision)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:8])
