"""Every causal decoder in transformers' standard layout splits into stages that compute the model's own
logits and gradients (one process, stages called in sequence); what cannot be split is refused by name."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (the optional `examples` extra)")

import hf_cases  # noqa: E402
import torch  # noqa: E402
from compared import every_parameter_compared  # noqa: E402
from hf_cases import EAGER_ONLY, FAMILIES, VOCAB, T, tiny_model  # noqa: E402

from pipedsl.errors import PipeRuntimeError  # noqa: E402
from pipedsl.models.hf.stages import causal_lm_loss, causal_lm_stages, check_split, shift_labels  # noqa: E402


def _attn(family: str) -> str:
    return "eager" if family in EAGER_ONLY else "sdpa"


@pytest.mark.parametrize("family", FAMILIES)
def test_stages_reproduce_logits_loss_and_gradients(family):
    """4 stages (embedding + layer, layer, layer, head) on packed rows with padding: the logits, HF's loss
    and every parameter's gradient equal the unsplit model's."""
    model = tiny_model(family, _attn(family), layers=3)
    ref = copy.deepcopy(model)
    x = torch.randint(VOCAB, (3, T), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(x)
    mask[0, -3:] = 0  # right padding on one row
    labels = x.masked_fill(mask == 0, -100)
    want = ref(x, attention_mask=mask, labels=labels, use_cache=False)
    want.loss.backward()
    stages = causal_lm_stages(model, 4, attention_mask=True)
    h = (x, mask)
    for st in stages:
        h = st(*h)
    logits = h
    assert (logits - want.logits).abs().max().item() <= 1e-5 * want.logits.abs().max().item()
    loss = causal_lm_loss(logits, shift_labels(labels))
    assert abs(loss.item() - want.loss.item()) <= 1e-6 * abs(want.loss.item())
    loss.backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        q = ref_params[name].grad
        assert p.grad is not None, name
        assert (p.grad - q).abs().max().item() <= 1e-5 * q.abs().max().clamp_min(1e-12).item(), name


@pytest.mark.parametrize("family", ["granite", "gemma2"])
def test_check_split_catches_a_missing_logit_rule(family):
    """check_split has teeth: drop the head's logit rule (Granite's divisor, Gemma's soft-cap) and it refuses."""
    model = tiny_model(family, _attn(family))
    stages = causal_lm_stages(model, 2)
    assert check_split(model, stages) <= 1e-5
    head = stages[-1].head
    head.divisor, head.softcap = 1.0, None
    with pytest.raises(PipeRuntimeError, match="away from the model's own forward"):
        check_split(model, stages)


def test_gemma3_layers_get_their_own_rotary():
    """Gemma 3's sliding and global layers use different RoPE bases: a stage holding both computes both."""
    model = tiny_model("gemma3")
    (stage,) = causal_lm_stages(model, 1)
    assert stage.rotary_per_type and set(stage.mask_kinds) == {"sliding_attention", "full_attention"}


def test_what_cannot_be_split_is_refused_by_name():
    import transformers as tf

    bert = tf.BertForMaskedLM(tf.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                            intermediate_size=16))
    with pytest.raises(PipeRuntimeError, match=r"BertForMaskedLM has no decoder layers \(looked for BertModel.layers"):
        causal_lm_stages(bert, 2)
    t5 = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=32, d_model=16, d_ff=16, num_layers=1, num_heads=2,
                                                   d_kv=8))
    with pytest.raises(PipeRuntimeError, match="encoder-decoder"):
        causal_lm_stages(t5, 2)
    with pytest.raises(PipeRuntimeError, match="not a Hugging Face model"):
        causal_lm_stages(torch.nn.Linear(2, 2), 2)
    gemma = tiny_model("gemma3")
    gemma.config.use_bidirectional_attention = True
    with pytest.raises(PipeRuntimeError, match="use_bidirectional_attention"):
        causal_lm_stages(gemma, 2)


def test_the_api_verifies_the_architecture_and_refuses_what_it_cannot_reproduce():
    """causal_lm_stages checks a shallow copy of the model itself (the check the launcher runs), so a script
    cannot train a model whose forward does something the stages do not: it is refused with the model's name."""
    import transformers as tf

    class ScaledLlama(tf.LlamaForCausalLM):  # a forward rule between the head and the loss, read from nowhere
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2.0
            return out

    model = ScaledLlama(tiny_model("llama").config)
    with pytest.raises(PipeRuntimeError, match="ScaledLlama cut into 2 stages gives logits .* away from the model's own"):
        causal_lm_stages(model, 2)
    assert len(causal_lm_stages(model, 2, check=False)) == 2  # told not to: the caller takes the responsibility
    llama = tiny_model("llama")
    state = torch.random.get_rng_state()
    causal_lm_stages(llama, 2)
    assert torch.equal(state, torch.random.get_rng_state()), "the check must leave the caller's RNG alone"


@pytest.mark.parametrize("family", hf_cases.MOE_FAMILIES)
def test_moe_router_loss_is_the_models_own_across_stages(family):
    """Mixtral, Qwen3-MoE, OLMoE and JetMoE with output_router_logits: cut into 4 stages with padding, the logits,
    the loss with the router's auxiliary loss (coefficient 0.5) and every gradient — the routers' included — equal
    the model's own; the aux loss is not a sum over layers, so its sums travel between the stages.  JetMoE names
    its coefficient aux_loss_coef: it once trained without the aux loss, every logit right."""
    model = tiny_model(family, layers=3)
    ref = copy.deepcopy(model)
    x = torch.randint(VOCAB, (3, T), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(x)
    mask[0, -3:] = 0
    labels = x.masked_fill(mask == 0, -100)
    want = ref(x, attention_mask=mask, labels=labels, use_cache=False)
    assert want.aux_loss.item() > 0.5
    want.loss.backward()
    h = (x, mask)
    for st in causal_lm_stages(model, 4, attention_mask=True):
        h = st(*h)
    logits, aux = h
    assert torch.equal(logits, want.logits) and aux.item() == pytest.approx(0.5 * want.aux_loss.item(), rel=1e-6)
    loss = causal_lm_loss(h, shift_labels(labels))
    assert loss.item() == pytest.approx(want.loss.item(), rel=1e-6)
    loss.backward()
    ref_params = dict(ref.named_parameters())
    routers = 0
    for name, p in model.named_parameters():
        q = ref_params[name].grad
        assert (p.grad - q).abs().max().item() <= 1e-5 * q.abs().max().clamp_min(1e-12).item(), name
        routers += name.endswith(hf_cases.ROUTER_SUFFIXES[family])
    assert routers == 3 * len(hf_cases.ROUTER_SUFFIXES[family])  # each layer's routers, with the aux loss's gradient
    with pytest.raises(PipeRuntimeError, match="loss_reduction='microbatch'"):
        causal_lm_loss(h, shift_labels(labels), reduction="sum")


def test_a_loss_term_the_stages_miss_is_refused_though_every_logit_is_right(monkeypatch):
    """The check compares the loss, not only the logits: with JetMoE's coefficient name unknown (as it once was),
    the stages give the model's logits but its cross-entropy alone, and the model is refused by name instead of
    training without its router loss."""
    from pipedsl.models.hf import stages as hf_stages

    model = tiny_model("jetmoe", layers=2)
    monkeypatch.setattr(hf_stages, "ROUTER_LOSS_COEFFICIENTS", ("router_aux_loss_coef",))
    with pytest.raises(PipeRuntimeError, match=r"JetMoeForCausalLM cut into 2 stages gives the model's logits but a "
                                               r"loss of \S+ where its own forward gives"):
        causal_lm_stages(model, 2)
    monkeypatch.undo()
    assert causal_lm_stages(model, 2)[-1].router.coef == 0.5


def _phi(embd_pdrop: float) -> torch.nn.Module:
    """Phi (v1): its embedding dropout is a module named `embed_dropout`, applied to the embedding's output."""
    import transformers as tf

    config = tf.PhiConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                          num_attention_heads=4, max_position_embeddings=64, embd_pdrop=embd_pdrop, resid_pdrop=0.1,
                          bos_token_id=None, eos_token_id=None)
    return tf.PhiForCausalLM(config)


def test_a_dropout_the_stages_leave_out_is_refused_though_every_logit_is_right(monkeypatch):
    """The check runs in training mode too when the model draws dropout: the stages from the model's seed draw the
    model's masks.  Phi's embedding dropout (a module name the splitter once did not know) and StarCoder2's (a bare
    probability) left out give the model's logits in eval mode, and each model is refused by name instead of
    training without it; known, both are accepted and the stage chain reproduces the model's training forward."""
    from pipedsl.models.hf import stages as hf_stages

    starcoder2 = tiny_model("starcoder2", layers=2, dropout=0.2)
    for model, attribute, unknown in ((_phi(0.3), "DROPOUT_NAMES", ("drop", "emb_dropout")),
                                      (starcoder2, "DROPOUT_PROBABILITIES", ())):
        monkeypatch.setattr(hf_stages, attribute, unknown)
        with pytest.raises(PipeRuntimeError, match=rf"{type(model).__name__} cut into 2 stages gives the model's "
                                                   r"logits without dropout but \S+ \(relative\) away with it"):
            causal_lm_stages(model, 2)
        monkeypatch.undo()
        stages = causal_lm_stages(model, 2)
        model.train()
        ids = torch.randint(VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(3)
        want = model(ids, use_cache=False).logits
        torch.manual_seed(3)
        got = stages[1](stages[0](ids))
        torch.manual_seed(4)
        assert (model(ids, use_cache=False).logits - want).abs().max() > 1e-3  # dropout draws: another seed differs
        assert torch.allclose(got, want, rtol=0, atol=1e-5), type(model).__name__


def test_the_check_runs_an_moe_layer_where_the_first_layers_are_dense(monkeypatch):
    """A Qwen2-MoE whose first two layers are dense (as DeepSeek's first_k_dense_replace makes them): the check's
    shallow copy keeps layers up to the first MoE one, so a router loss the stages miss is refused — a copy of
    the first two layers alone has no router and would pass it."""
    import transformers as tf

    from pipedsl.models.hf import stages as hf_stages

    config = tf.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                               shared_expert_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0, 1],
                               output_router_logits=True, router_aux_loss_coef=0.5)
    torch.manual_seed(0)
    model = tf.Qwen2MoeForCausalLM(config)
    assert hf_stages.first_moe_layer(model) == 2
    assert hf_stages.shallow_config(config, through=2).num_hidden_layers == 3
    causal_lm_stages(model, 2)
    monkeypatch.setattr(hf_stages, "ROUTER_LOSS_COEFFICIENTS", ())
    with pytest.raises(PipeRuntimeError, match="gives the model's logits but a loss"):
        causal_lm_stages(model, 2)


def test_a_small_router_loss_coefficient_is_checked_on_its_own_scale(monkeypatch):
    """With a coefficient of 0.001 the router loss is ~1e-4 of the loss: a 10 % error in it is below the loss's
    1e-4 tolerance, so the check compares what each side adds to its own logits' cross-entropy."""
    from pipedsl.models.hf import stages as hf_stages

    model = tiny_model("mixtral", layers=2)
    model.config.router_aux_loss_coef = model.router_aux_loss_coef = 0.001
    causal_lm_stages(model, 2)
    loss = hf_stages.RouterLoss.loss
    monkeypatch.setattr(hf_stages.RouterLoss, "loss", lambda self, sums: 1.1 * loss(self, sums))
    with pytest.raises(PipeRuntimeError, match=r"beyond the cross-entropy: \S+ against"):
        causal_lm_stages(model, 2)


def test_alibi_is_refused_by_name():
    """What the stages cannot reproduce is refused when they are made, not left to fail at the first step."""
    import transformers as tf

    falcon = tf.FalconForCausalLM(tf.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                  num_attention_heads=4, alibi=True))
    with pytest.raises(PipeRuntimeError, match=r"FalconForCausalLM's decoder layers take 'alibi' \(config.alibi=True\)"):
        causal_lm_stages(falcon, 2)


def test_stages_call_no_deprecated_transformers_argument():
    """transformers removes `past_key_values` in 5.40: the stages must not pass it (no FutureWarning)."""
    import warnings

    model = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        h = torch.randint(VOCAB, (2, T))
        for st in causal_lm_stages(model, 2, attention_mask=True):
            h = st(*h) if isinstance(h, tuple) else st(h, torch.ones_like(h))


@pytest.mark.slow
@pytest.mark.parametrize("family, schedule, params", [("gemma3", "zb-h1", None), ("granite", "interleaved", {"V": 2}),
                                                      ("gemma2", "1f1b", None), ("phi3", "1f1b", None),
                                                      ("olmo2", "zb-h1", None), ("qwen3", "1f1b", None),
                                                      ("cohere", "1f1b", None), ("gpt_neox", "zb-h1", None),
                                                      ("falcon", "1f1b", None), ("starcoder2", "zb-h1", None)])
def test_pipelined_steps_equal_the_unsplit_model(pool2, family, schedule, params):
    """Two SGD steps on 2 ranks with padding and the per-token loss: loss, gradients, norm and weights equal the unsplit
    model in one process (rtol 1e-5 on the loss, 1e-4 of each tensor's largest entry)."""
    results = pool2.run(hf_cases.equivalence, family, schedule, 4, params, _attn(family), None, True, True, None,
                        None, 2)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:8])


def test_a_peft_style_wrapper_splits_its_base_model_with_frozen_weights():
    """A PEFT model (duck-typed: `peft_config`, `get_base_model()`): the stages hold the base model's modules with
    the adapters inside; frozen base weights get no gradient, the adapter does, and the logits are the model's."""
    model = tiny_model("llama")
    for p in model.parameters():
        p.requires_grad_(False)
    layer = model.model.layers[1].self_attn
    adapter = torch.nn.Linear(32, 32, bias=False)
    torch.nn.init.normal_(adapter.weight, std=0.1)
    base_q = layer.q_proj
    layer.q_proj = torch.nn.Sequential()  # q = base(x) + adapter(x), LoRA's shape with rank = width
    layer.q_proj.forward = lambda x: base_q(x) + adapter(x)
    layer.q_proj.add_module("adapter", adapter)
    layer.q_proj.add_module("base", base_q)

    class Wrapper(torch.nn.Module):
        peft_config = {"default": None}

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def get_base_model(self):
            return self.inner

    stages = causal_lm_stages(Wrapper(model), 2)
    assert check_split(model, stages) <= 1e-6
    x = torch.randint(VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    h = x
    for st in stages:
        h = st(h)
    causal_lm_loss(h, shift_labels(x)).backward()
    assert adapter.weight.grad is not None and adapter.weight.grad.abs().sum() > 0
    assert all(p.grad is None for n, p in model.named_parameters() if "adapter" not in n)


@pytest.mark.slow
@pytest.mark.parametrize("family, schedule, params", [("mixtral", "1f1b", None), ("qwen3_moe", "zb-v", None),
                                                      ("olmoe", "interleaved", {"V": 2}),
                                                      ("mixtral", "dualpipev", None)])
def test_moe_router_loss_pipelined_equals_gradient_accumulation(pool2, family, schedule, params):
    """Two SGD steps on 2 ranks: the loss with the router's auxiliary loss per microbatch, every gradient (the
    routers' on every stage) and the weights equal the unsplit model accumulating the same microbatches."""
    results = pool2.run(hf_cases.moe_equivalence, family, schedule, 4, params)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:8])
    assert all(r["gates"] for r in results)  # routers on both ranks


@pytest.mark.slow
@pytest.mark.parametrize("family, schedule, zero", [
    # every schedule family under ZeRO-1 and ZeRO-3, every family under both and under 2-3 schedules (pairwise)
    ("mixtral", "1f1b", 1), ("mixtral", "dualpipev", 3), ("qwen3_moe", "zb-v", 1), ("qwen3_moe", "interleaved", 3),
    ("qwen3_moe", "dualpipev", 1), ("olmoe", "interleaved", 1), ("olmoe", "1f1b", 3), ("olmoe", "zb-v", 3),
    ("deepseek_v3", "1f1b", 1), ("deepseek_v3", "dualpipev", 3)])
def test_moe_expert_parallel_equals_one_process(pool4, family, schedule, zero):
    """dp2 × pp2 with each layer's experts sharded over ep=2 (parallel/expert.py, the model's own experts module on
    each rank's half) under ZeRO-1 and ZeRO-3 and every schedule family: loss, gradient norm and every weight (each
    shard against its experts' rows) after two SGD steps equal the whole model accumulating the same microbatches,
    the router's auxiliary loss included.  DeepSeek-V3 (MLA, a dense first layer, shared experts, group-limited
    routing, no auxiliary loss) shards its routed experts the same way."""
    import moe_cases

    results = pool4.run(moe_cases.hf_train_equal, family, schedule, 4, 2, 2, zero)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:8])
    shards = {c for r in results for c in r["checked"] if "experts" in c}
    assert any(c.endswith("[0:2]") for c in shards) and any(c.endswith("[2:4]") for c in shards)
    every_parameter_compared([n for r in results for n in r["checked"]], results[0]["all"], results[0]["rows"])


@pytest.mark.slow
@pytest.mark.parametrize("family, dp", [("mixtral", 2), ("jetmoe", 2), ("mixtral", 4)])
def test_tied_embeddings_under_expert_parallelism_equal_one_process(pool, family, dp):
    """dp2 × pp2 × ep2 and dp4 × pp2 × ep2 (8 ranks: two ep groups), without ZeRO, the word embedding tied to the
    head on the other pipeline rank: the tie's sum
    spans every dp replica — without ZeRO one all-reduce over the holders of all of them, which under ep had
    spanned only the replicas at this ep rank (the expert mesh is (pp, edp, ep, tp): runtime/groups.py took edp for
    dp) and left the embedding's gradient wrong by 0.05-0.07.  Loss, gradient norm and every weight after two SGD
    steps equal the whole model accumulating the same microbatches (tests/models/moe_cases.py's
    `hf_train_equal`)."""
    import moe_cases

    results = pool.run(moe_cases.hf_train_equal_here, dp * 2, family, "1f1b", 4, dp, 2, 0, 2, 1, False, False, True)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:8])
    assert any("embed_tokens" in c for r in results for c in r["checked"])
    every_parameter_compared([n for r in results for n in r["checked"]], results[0]["all"], results[0]["rows"])


@pytest.mark.slow
@pytest.mark.parametrize("dp, pp, schedule, zero, adamw", [
    (2, 1, "1f1b", 1, False),  # dp2 × ep2: one ep group, SGD (each weight's change is lr × its gradient)
    (2, 1, "1f1b", 3, True),  # ... ZeRO-3, AdamW
    (2, 1, "1f1b", 0, False),  # ... without ZeRO
    (2, 2, "1f1b", 3, False),  # dp2 × pp2 × ep2
    (4, 2, "1f1b", 1, True),  # dp4 × pp2 × ep2, 8 ranks: two ep groups, the experts' gradients summed over edp
    (4, 2, "zb-v", 3, False)])
def test_jetmoe_expert_parallel_equals_one_process(pool, dp, pp, schedule, zero, adamw):
    """JetMoE's MLP experts (two JetMoeParallelExperts behind the view models/hf/jetmoe.py gives them) sharded over
    ep=2 under ZeRO-1 and ZeRO-3, its mixture of attention heads replicated: the loss (its router loss over both
    routers included), the gradient norm and every weight — each expert shard against its rows, under the HF
    names mlp.input_linear.weight / mlp.output_linear.weight — equal one process, JetMoeForCausalLM's own forward
    accumulating the same microbatches (tests/models/moe_cases.py's `hf_train_equal`)."""
    import moe_cases

    results = pool.run(moe_cases.hf_train_equal_here, dp * pp, "jetmoe", schedule, 4, dp, 2, zero, 2, 1, False,
                       adamw)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:8])
    shards = {c for r in results for c in r["checked"] if "[" in c}
    assert {c.partition("[")[0].rsplit(".", 2)[-2] for c in shards} == {"input_linear", "output_linear"}, shards
    assert any(c.endswith("[0:2]") for c in shards) and any(c.endswith("[2:4]") for c in shards)
    every_parameter_compared([n for r in results for n in r["checked"]], results[0]["all"], results[0]["rows"])


@pytest.mark.slow
@pytest.mark.parametrize("family, schedule, dp, ep, sp, zero", [
    ("mixtral", "1f1b", 1, 1, False, 0),  # tp2 × pp2: 4 ranks
    ("mixtral", "dualpipev", 2, 2, True, 1),  # dp2 × pp2 × tp2, experts over ep2, overlapped F&B pairs: 8 ranks
    ("qwen3_moe", "zb-v", 2, 2, False, 3),  # per-head q/k norms
    ("qwen2_moe", "1f1b", 2, 2, True, 3),  # a shared expert and its gate
    ("granitemoe", "zb-v", 2, 2, True, 1),  # its block named block_sparse_moe
    ("deepseek_v3", "dualpipev", 2, 2, False, 3),  # latent attention, shared experts, a dense first layer
    ("deepseek_v2", "1f1b", 2, 2, False, 1),  # latent attention without a q down-projection
    ("deepseek_v3", "1f1b", 1, 1, True, 0),  # latent attention under SP: tp2 × pp2
    ("deepseek_v2", "zb-v", 2, 2, True, 1),  # ... without a q down-projection, under SP, experts over ep2
    ("jetmoe", "1f1b", 1, 1, False, 0),  # its mixture of attention heads split by heads (models/hf/jetmoe.py)
    ("jetmoe", "1f1b", 1, 1, True, 0),  # ... under SP
    ("jetmoe", "dualpipev", 2, 2, True, 1),  # ... its MLP experts over ep2, overlapped F&B pairs: 8 ranks
    ("jetmoe", "1f1b", 2, 2, False, 3)])  # ... ZeRO-3
def test_moe_tensor_times_expert_parallel_equals_one_process(pool, family, schedule, dp, ep, sp, zero):
    """Tensor parallelism of an MoE decoder (parallel/moe_tp.py): the attention over tp (with sequence parallelism
    or not), each MoE block whole on its tp rank's share of the tokens, the routed experts over ep, ZeRO-1 and
    ZeRO-3: after two SGD steps the loss (the router's auxiliary loss included), the gradient norm and every weight
    (tp shards joined, each expert shard against its rows) equal the whole model accumulating the same
    microbatches, and every parameter was compared."""
    import moe_cases

    results = pool.run(moe_cases.hf_train_equal_here, 2 * dp * 2, family, schedule, 4, dp, ep, zero, 2, 2, sp)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:8])
    checked = {c.partition("[")[0] for r in results for c in r["checked"]}
    assert checked == set(results[0]["all"]), set(results[0]["all"]) - checked
    if ep > 1:  # JetMoE's MLP experts are mlp.input_linear / mlp.output_linear
        shards = {c for r in results for c in r["checked"]
                  if ("mlp.input_linear" in c if family == "jetmoe" else "experts" in c) and "[" in c}
        assert any(c.endswith("[0:2]") for c in shards) and any(c.endswith("[2:4]") for c in shards)


def _dense_layer_numel_under_tp(family: str, sp: bool) -> int:
    """The parameters this tp rank holds of layer 0 (dense) of the tiny `family` under tp_hf_stages."""
    from torch.distributed.tensor import DTensor

    from pipedsl.models.hf.parallelize import tp_hf_stages
    from pipedsl.parallel import ParallelConfig, ParallelMesh

    stages = causal_lm_stages(hf_cases.tiny_model(family), 1)
    tp_hf_stages(stages, ParallelMesh(ParallelConfig(tp=2)), sequence_parallel=sp)
    layer = stages[0].layers["0"]
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in layer.parameters())


@pytest.mark.parametrize("sp", [False, True])
def test_the_planner_prices_latent_attention_under_tp_as_the_ranks_hold_it(pool, sp):
    """DeepSeek-V3's latent attention keeps its down-projections and their norms whole on every tp rank: the planner's
    per-GPU parameters of a block (plan/model.py `layer_params_per_gpu`) are what each rank of the tiny model holds
    under the tp plan, less the two layer norms, which stay whole too and which the planner prices over tp (2h of
    a block's ~12h²).  It priced the down-projections over tp before."""
    from pipedsl.plan.model import MLA, ModelSpec

    spec = ModelSpec("tiny-deepseek-v3", 3, 32, 4, T, VOCAB, 8, ffn=48, gated=True, layout="hf", experts=4, top_k=2,
                     expert_ffn=16, shared_experts=1, dense_layers=1, mla=MLA(16, 16, 4, 4, 8))
    held = pool.run(_dense_layer_numel_under_tp, 2, "deepseek_v3", sp)
    norms = 2 * 32
    assert held == [spec.layer_params_per_gpu(2) + norms / 2] * 2, (held, spec.layer_params_per_gpu(2))
    assert spec.layer_params_per_gpu(1) == spec.layer_params == sum(
        p.numel() for p in hf_cases.tiny_model("deepseek_v3").model.layers[0].parameters())


def _tp_refusal(family: str, sp: bool) -> str:
    import hf_cases

    from pipedsl.models.hf.parallelize import tp_hf_stages
    from pipedsl.models.hf.stages import causal_lm_stages
    from pipedsl.parallel import ParallelConfig, ParallelConfigError, ParallelMesh

    stages = causal_lm_stages(hf_cases.tiny_model(family), 1)
    try:
        tp_hf_stages(stages, ParallelMesh(ParallelConfig(tp=2)), sequence_parallel=sp)
    except ParallelConfigError as err:
        return str(err)
    return "accepted"


@pytest.mark.parametrize("family, sp, said", [
    ("olmoe", False, "layer 0's q_norm is not per head"),
    ("starcoder2", False, "layer 0 (Starcoder2DecoderLayer) is not in the Llama layout"),
    ("jetmoe", True, "accepted")])
def test_what_tensor_parallelism_cannot_split_is_refused_by_name(pool, family, sp, said):
    """A decoder whose layers the tp plan cannot split is refused naming the layer or module: OLMoE's q/k
    norms over every head, StarCoder2's GELU MLP (c_fc, c_proj: not gate/up/down_proj).  JetMoE's mixture of attention heads, once refused, splits itself (models/hf/jetmoe.py)
    and is accepted, with sequence parallelism too."""
    said_on = pool.run(_tp_refusal, 2, family, sp)
    assert all(said in s for s in said_on), said_on
