"""hf_io.LocalStages: a rank builds only its stages — from the directory's weights or a per-module seeded init —
and gets exactly what the whole model would hold; what it cannot fill it refuses, so the caller builds it all."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (the optional `hf` extra)")

import torch  # noqa: E402
from hf_cases import EAGER_ONLY, FAMILIES, VOCAB, tiny_model  # noqa: E402

from pipedsl.models.hf import StageCut  # noqa: E402
from pipedsl.models.hf.io import LocalStages  # noqa: E402

SPLIT = StageCut()
# families whose transformers 5 weight files rename a tensor (its checkpoint conversion mapping), which
# LocalStages does not follow: it says so and the trainer builds the whole model on each rank
RENAMED_IN_FILES = {"gpt_neox": "lm_head.weight is not in the weights file under its own name"}


def _attn(family: str) -> str:
    return "eager" if family in EAGER_ONLY else "sdpa"


@pytest.mark.parametrize("family", FAMILIES)
def test_held_stages_hold_the_saved_weights_and_buffers(family, tmp_path):
    import transformers as tf

    tiny_model(family, _attn(family)).save_pretrained(tmp_path)
    ref = tf.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=_attn(family))
    want = dict(ref.state_dict())
    want.update(dict(ref.named_buffers()))  # the rotary and embedding-scale buffers are not saved: computed
    if family in RENAMED_IN_FILES:  # its files name a tensor otherwise than its module: each rank builds it whole
        with pytest.raises(LocalStages.NotLocal, match=RENAMED_IN_FILES[family]):
            LocalStages(tmp_path, 3, SPLIT, {2}, attn=_attn(family))
        return
    for held in ({0}, {1, 2}):
        local = LocalStages(tmp_path, 3, SPLIT, held, attn=_attn(family))
        names = {id(t): n for n, t in local.model.state_dict(keep_vars=True).items()}
        names.update({id(t): n for n, t in local.model.named_buffers()})
        seen = 0
        for s in held:
            for t in [*local(s).parameters(), *local(s).buffers()]:
                assert torch.equal(t, want[names[id(t)]]), names[id(t)]
                seen += 1
        assert seen
        for s in set(range(3)) - held:  # the others stay shapes only
            assert all(p.is_meta for p in local.stages[s].parameters())


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
def test_random_init_is_the_same_whichever_rank_holds_a_stage(family, tmp_path):
    """Each stage's seeded init on a rank holding only that stage equals, tensor for tensor (torch.equal), the same
    stage built with all three held (a tied copy aside: it starts from the embedding); another seed differs."""
    tiny_model(family, _attn(family)).config.save_pretrained(tmp_path)
    whole = LocalStages(tmp_path, 3, SPLIT, {0, 1, 2}, seed=5, attn=_attn(family))
    copies = {member for tie in whole.ties for member in tie[1:]}  # a tied head starts from the embedding (Pipeline)
    for s in range(3):
        alone = LocalStages(tmp_path, 3, SPLIT, {s}, seed=5, attn=_attn(family))
        for (name, t), u in zip(alone(s).state_dict().items(), whole(s).state_dict().values()):
            assert (s, name) in copies or torch.equal(t, u), (s, name)
    other = LocalStages(tmp_path, 3, SPLIT, {1}, seed=6, attn=_attn(family))
    assert not all(map(torch.equal, other(1).parameters(), whole(1).parameters()))  # the seed matters
    x = torch.randint(VOCAB, (2, 8))
    h = x
    for s in range(3):
        h = whole(s)(h)
    assert torch.isfinite(h).all() and h.std() > 0


def test_a_tie_inside_one_stage_stays_one_parameter(tmp_path):
    tiny_model("llama", tie=True).config.save_pretrained(tmp_path)
    local = LocalStages(tmp_path, 1, SPLIT, {0})
    stage = local(0)
    assert stage.embed.embed_tokens.weight is stage.head.lm_head.weight
    assert local.ties == []  # within a stage: not a cross-stage tie
    cut = LocalStages(tmp_path, 2, SPLIT, {0, 1})
    assert [tuple(s for s, _ in tie) for tie in cut.ties] == [(0, 1)]


def test_a_weights_file_without_a_tensor_is_not_local(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_model("qwen3").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LocalStages.NotLocal, match="up_proj.weight is not in the weights file"):
        LocalStages(tmp_path, 2, SPLIT, {0})
    with pytest.raises(Exception, match="not one of the stages"):
        LocalStages(tmp_path, 2, SPLIT, {1})(0)


def test_random_init_follows_the_models_own_scheme(tmp_path):
    """transformers' per-module init in its order: GPT-2's residual projections scaled by 1/sqrt(2·layers),
    the others at initializer_range, norms at one."""
    model = tiny_model("gpt2", layers=3)
    model.config.save_pretrained(tmp_path)
    (stage,) = [LocalStages(tmp_path, 1, SPLIT, {0})(0)]
    block = stage.layers["1"]
    std = model.config.initializer_range
    assert block.attn.c_attn.weight.std().item() == pytest.approx(std, rel=0.1)
    assert block.attn.c_proj.weight.std().item() == pytest.approx(std / 6 ** 0.5, rel=0.1)
    assert torch.equal(block.ln_1.weight, torch.ones_like(block.ln_1.weight))


def test_the_launcher_decides_for_every_rank_whether_stages_are_built_alone(tmp_path, capsys):
    """hf_setup checks once, before any rank starts, that the architecture's init fills every tensor and the
    weights files hold every parameter; one missing tensor makes every rank build the whole model."""
    from safetensors.torch import load_file, save_file

    from pipedsl.models.hf.io import inspect_model_dir
    from pipedsl.trainer.hf_setup import _check_architecture

    split = StageCut(attention_mask=False, position_ids=False)
    tiny_model("gemma3").save_pretrained(tmp_path)
    assert _check_architecture(inspect_model_dir(tmp_path), split, "sdpa") is True
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert _check_architecture(inspect_model_dir(tmp_path), split, "sdpa") is False
    assert "model.norm.weight is not in the weights files" in capsys.readouterr().out


@pytest.mark.parametrize("family", ["t5", "mt5", "umt5", "bart"])
def test_encoder_decoder_stages_are_built_alone(family, tmp_path):
    """Encoder-decoders build only the held stages from the weights files (every tensor equals from_pretrained's):
    a stage holding later layers of a T5 stack takes the first layer's shared position-bias weight without that
    layer's other weights being its own; BART's head takes final_logits_bias from the model's root module."""
    import seq2seq_cases
    import transformers as tf

    seq2seq_cases.tiny_seq2seq(family).save_pretrained(tmp_path)
    ref = tf.AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    want = {**dict(ref.state_dict()), **dict(ref.named_buffers())}
    for held in ({0}, {1}, {2, 3}):  # units: enc input + 2 layers | 1 layer + dec input + … (4 stages by count)
        local = LocalStages(tmp_path, 4, SPLIT, held)
        names = {id(t): n for n, t in local.model.state_dict(keep_vars=True).items()}
        for s in held:
            for t in [*local(s).parameters(), *local(s).buffers()]:
                assert not t.is_meta and torch.equal(t, want[names[id(t)]]), names[id(t)]
        for s in set(range(4)) - held:
            assert any(p.is_meta for p in local.stages[s].parameters())
