"""Mixture-of-Experts decoders in the planner: total and active parameters against the published figures
(and exactly against Hugging Face's modules on the meta device), the FLOPs of one MoE layer by hand, the
expert-parallel all-to-alls, expert memory over ep, and the CLI."""

from __future__ import annotations

import dataclasses

import pytest

from pipedsl.cli import main
from pipedsl.errors import PipeDSLError
from pipedsl.plan import Layout, ModelSpec, cluster_preset, evaluate, layouts, model_preset
from pipedsl.plan.cost import all_reduce, all_to_all, moe_all_to_all_bytes, stage_costs
from pipedsl.plan.memory import model_states, moe_model_states
from pipedsl.plan.model import MLA


@pytest.mark.parametrize(("name", "total", "active", "active_rel"), [
    ("mixtral-8x7b", 46.7e9, 12.9e9, 0.01),  # Jiang et al. 2024, "Mixtral of Experts"
    # Qwen3 report / model card: 30.5B total, 3.3B activated.  The active figure is cut to one decimal: the
    # count (embedding and head included, as in its 30.5B total) is 3.353B, which Hugging Face's modules confirm
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, 0.02),
    # DeepSeek-V3 report: 671B total, 37B activated (the MTP module's 14B apart); ours 37.55B (+1.5 %)
    ("deepseek-v3", 671e9, 37e9, 0.02),
])
def test_total_and_active_parameters_match_the_published_counts(name, total, active, active_rel) -> None:
    m = model_preset(name)
    assert m.params == pytest.approx(total, rel=0.01)
    assert m.active_params == pytest.approx(active, rel=active_rel)
    assert m.active_params < m.params


def test_mixtral_by_hand() -> None:
    """Per layer: attention 4096·(4096 + 2·1024) + 4096², 8 SwiGLU experts of 3·4096·14336, router 8·4096, two
    RMSNorms; plus embedding and untied head 2·32000·4096 and the final norm."""
    m = model_preset("mixtral-8x7b")
    attention = 4096 * (4096 + 2 * 1024) + 4096 * 4096
    expert = 3 * 4096 * 14336
    layer = attention + 8 * expert + 8 * 4096 + 2 * 4096
    assert m.moe_layer_params == layer
    assert m.params == 32 * layer + 2 * 32000 * 4096 + 4096 == 46_702_792_704
    assert m.active_params == m.params - 32 * 6 * expert == 12_879_925_248


def _hf_counts(config) -> tuple[int, int]:
    """(total, active) of a Hugging Face model built on the meta device (no memory): active drops
    (E − k)/E of every routed-expert tensor."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = skipped = 0
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    k = config.num_experts_per_tok
    for name, p in model.named_parameters():
        total += p.numel()
        if ".experts." in name or name.endswith(".experts"):
            skipped += p.numel() * (experts - k) // experts
    return total, total - skipped


def _mixtral_config(spec: ModelSpec):
    transformers = pytest.importorskip("transformers")
    return transformers.MixtralConfig(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.expert_ffn,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        num_local_experts=spec.experts, num_experts_per_tok=spec.top_k, tie_word_embeddings=False)


def _qwen3_config(spec: ModelSpec):
    transformers = pytest.importorskip("transformers")
    return transformers.Qwen3MoeConfig(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn,
        moe_intermediate_size=spec.expert_ffn, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, head_dim=spec.head_size, num_experts=spec.experts,
        num_experts_per_tok=spec.top_k, decoder_sparse_step=1, mlp_only_layers=list(range(spec.dense_layers)),
        tie_word_embeddings=False)


def _deepseek_config(spec: ModelSpec):
    transformers = pytest.importorskip("transformers")
    m = spec.mla
    return transformers.DeepseekV3Config(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn,
        moe_intermediate_size=spec.expert_ffn, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads, n_shared_experts=spec.shared_experts, n_routed_experts=spec.experts,
        num_experts_per_tok=spec.top_k, first_k_dense_replace=spec.dense_layers, q_lora_rank=m.q_lora,
        kv_lora_rank=m.kv_lora, qk_nope_head_dim=m.nope_dim, qk_rope_head_dim=m.rope_dim, v_head_dim=m.v_dim,
        n_group=1, topk_group=1, tie_word_embeddings=False)


TINY_MIXTRAL = ModelSpec("tiny-mixtral", 2, 64, 4, 32, 100, 8, ffn=96, gated=True, kv_heads=2, layout="hf",
                         experts=4, top_k=2, expert_ffn=96)
# head_dim ≠ hidden / heads, q/k norms, and a first dense layer (Qwen3-MoE's mlp_only_layers)
TINY_QWEN3 = ModelSpec("tiny-qwen3", 3, 64, 4, 32, 100, 8, ffn=80, gated=True, kv_heads=2, layout="hf", head_dim=24,
                       qk_norm=True, experts=8, top_k=3, expert_ffn=40, dense_layers=1)
TINY_DEEPSEEK = ModelSpec("tiny-deepseek", 3, 64, 4, 32, 100, 8, ffn=96, gated=True, layout="hf", experts=8, top_k=2,
                          expert_ffn=32, shared_experts=1, dense_layers=1, mla=MLA(16, 8, 8, 4, 8))


@pytest.mark.parametrize(("spec", "config"), [
    (TINY_MIXTRAL, _mixtral_config), (model_preset("mixtral-8x7b"), _mixtral_config),
    (TINY_QWEN3, _qwen3_config), (model_preset("qwen3-30b-a3b"), _qwen3_config),
    (TINY_DEEPSEEK, _deepseek_config), (model_preset("deepseek-v3"), _deepseek_config),
], ids=["tiny-mixtral", "mixtral-8x7b", "tiny-qwen3", "qwen3-30b-a3b", "tiny-deepseek", "deepseek-v3"])
def test_counts_equal_hugging_face_modules(spec, config) -> None:
    total, active = _hf_counts(config(spec))
    assert (spec.params, spec.active_params) == (total, active)


def test_one_moe_layer_flops_by_hand() -> None:
    """Mixtral, one sequence of s tokens, forward: Q and O 2·s·4096² each, K and V 2·s·4096·1024 each, the
    router 2·s·4096·8, two experts of three 4096×14336 GEMMs, the scores and the attention over V 2·s²·4096 each."""
    m = model_preset("mixtral-8x7b")
    s = m.seq
    hand = (2 * 2 * s * 4096 * 4096 + 2 * 2 * s * 4096 * 1024 + 2 * s * 4096 * 8
            + 2 * 3 * 2 * s * 4096 * 14336 + 2 * 2 * s * s * 4096)
    assert m.layer_flops(1, moe=True) == hand
    assert m.layer_flops(3, moe=True) == 3 * hand
    # per token and iteration: 6·N_active + 12·l·s·q, the dense rule with active weights
    per_token = m.iteration_flops() / (m.global_batch * s)
    assert per_token == m.flops_per_token() == 6 * (32 * (hand - 4 * s * s * 4096) / (2 * s) + 32000 * 4096) \
        + 12 * 32 * s * 4096
    # and it is the active parameters that count: within the embedding lookup and norms of 6·N_active
    assert 6 * m.active_matmul_params == pytest.approx(6 * m.active_params, rel=0.03)


def test_qwen3_flops_use_the_attention_width_and_dense_layers_their_mlp() -> None:
    m = TINY_QWEN3
    s, q = m.seq, 4 * 24
    attention = 64 * (q + 2 * 2 * 24) + q * 64
    moe = 2 * s * (attention + 3 * 3 * 64 * 40 + 8 * 64) + 4 * s * s * q
    dense = 2 * s * (attention + 3 * 64 * 80) + 4 * s * s * q
    assert m.layer_flops(1, moe=True) == moe and m.layer_flops(1) == dense
    assert m.iteration_flops() == m.global_batch * (3 * (dense + 2 * moe) + 3 * 2 * s * 64 * 100)


def test_mla_attention_by_hand() -> None:
    """DeepSeek-V3's MLA: Q down 7168→1536 and up to 128 heads × 192, the KV latent 7168→512+64 and up to
    128 × (128 + 128), output 128·128→7168; scores over 192 and values over 128 per head."""
    m = model_preset("deepseek-v3")
    assert m.attention_matmul_params == (7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256
                                         + 128 * 128 * 7168)
    s = m.seq
    assert m.attention_core_flops() == 2 * s * s * 128 * 192 + 2 * s * s * 128 * 128
    assert m.moe_layers == 58 and m.moe_layers_in(0, 4) == 1


def test_all_to_all_bytes_and_time() -> None:
    """Each of the four all-to-alls of an MoE layer (dispatch, combine, and their gradients) sends
    tokens·k·h·2·(ep−1)/ep bytes a rank — its tp rank's share of the microbatch's tokens (parallel/moe_tp.py) —
    over NVLink while tp·ep fits in a node, else InfiniBand."""
    m = model_preset("mixtral-8x7b")
    assert moe_all_to_all_bytes(m, 4096, 4) == 4096 * 2 * 4096 * 2 * 3 / 4
    assert moe_all_to_all_bytes(m, 4096, 1) == 0
    cluster = dataclasses.replace(cluster_preset("h100"), gpus=64)
    for ep, tp in ((1, 1), (4, 2), (8, 1), (16, 1)):
        layout = Layout(16, 4, tp, "1f1b", 1, 32, zero=1, recompute="none", ep=ep)
        costs = stage_costs(m, cluster, layout, 4)
        bw, lat = cluster.link(tp * ep)
        assert bw == (cluster.intra_bandwidth if tp * ep <= cluster.gpus_per_node else cluster.inter_bandwidth)
        one = all_to_all(moe_all_to_all_bytes(m, m.seq / tp, ep), ep, bw, lat)
        assert costs.all_to_all[1] == pytest.approx(8 * 4 * one)  # 8 MoE layers a stage, 4 all-to-alls each
        base = stage_costs(m, cluster, dataclasses.replace(layout, ep=1), 4)
        assert costs.F[1] - base.F[1] == pytest.approx(8 * 2 * one)
        assert (one == 0) == (ep == 1)


def test_ep_divides_expert_memory_and_expert_gradients_reduce_over_dp_over_ep() -> None:
    m = model_preset("mixtral-8x7b")
    cluster = dataclasses.replace(cluster_preset("h100"), gpus=64)
    base = Layout(16, 4, 1, "1f1b", 1, 32, zero=0, recompute="full")
    experts = 8 * m.moe_layer_expert_params  # one stage's routed experts
    for ep in (1, 2, 4, 8):
        costs = stage_costs(m, cluster, dataclasses.replace(base, ep=ep), 4)
        assert costs.expert_params[1] == experts / ep
        assert costs.stage_params[1] == 8 * m.moe_layer_params - experts + experts / ep
        dense = costs.stage_params[1] - experts / ep
        bw, lat = cluster.link(16)
        assert costs.reduce[1] == pytest.approx(all_reduce(2 * dense, 16, bw, lat)
                                                + all_reduce(2 * experts / ep, 16 // ep, bw, lat))
    # states: the experts' 1/ep over dp/ep replicas (ZeRO shards over those), the rest over dp
    states = moe_model_states(10e9, 8e9, 16, 4, 1)
    assert states == model_states(2e9, 16, 1) + model_states(2e9, 4, 1)
    assert moe_model_states(10e9, 0, 16, 1, 2) == model_states(10e9, 16, 2)
    e1 = evaluate(m, cluster, Layout(16, 4, 1, "1f1b", 1, 32, zero=1, recompute="full", ep=1))
    e8 = evaluate(m, cluster, Layout(16, 4, 1, "1f1b", 1, 32, zero=1, recompute="full", ep=8))
    assert e8.memory.states.params < e1.memory.states.params / 4 and e8.comm["ep"] > 0 == e1.comm["ep"]


def test_the_search_tries_ep_for_moe_only_and_checks_it() -> None:
    cluster = dataclasses.replace(cluster_preset("h100"), gpus=16)
    space = {"schedules": ["1f1b"], "zero": (1,), "recompute": ("full",), "microbatch_sizes": (1,),
             "sequence_parallel": (False,), "tp": (1,), "pp": (2,)}
    moe = {lay.ep for lay in layouts(model_preset("mixtral-8x7b"), cluster, **space)}
    assert moe == {1, 2, 4, 8}  # dp 8: its divisors that divide 8 experts
    assert {lay.ep for lay in layouts(model_preset("llama-8b"), cluster, **space)} == {1}
    assert {lay.ep for lay in layouts(model_preset("mixtral-8x7b"), cluster, ep=(2, 3), **space)} == {2}
    with pytest.raises(PipeDSLError, match="ep 2 needs a Mixture-of-Experts"):
        evaluate(model_preset("llama-8b"), cluster, Layout(8, 2, 1, "1f1b", 1, 64, ep=2))
    with pytest.raises(ValueError, match="ep must divide dp"):
        Layout(6, 1, 1, "1f1b", 1, 1, ep=4)


def test_bad_moe_specs() -> None:
    with pytest.raises(PipeDSLError, match="top_k"):
        dataclasses.replace(TINY_MIXTRAL, top_k=5)
    with pytest.raises(PipeDSLError, match="hf layout"):
        dataclasses.replace(TINY_MIXTRAL, layout="gpt")
    with pytest.raises(PipeDSLError, match="need experts"):
        ModelSpec("x", 2, 64, 4, 32, 100, 8, top_k=2)


def test_shared_experts_count_in_total_and_active() -> None:
    """DeepSeek-style: S shared experts of width f_s, always active."""
    m = dataclasses.replace(TINY_MIXTRAL, shared_experts=2, shared_ffn=32)
    assert m.params - TINY_MIXTRAL.params == 2 * 2 * 3 * 64 * 32
    assert m.active_params - TINY_MIXTRAL.active_params == 2 * 2 * 3 * 64 * 32


def test_cli_plans_mixtral_with_an_ep_degree(capsys) -> None:
    code = main(["plan", "--model", "mixtral-8x7b", "--gpus", "64", "--schedule", "1f1b", "--zero", "1",
                 "--recompute", "selective", "--sequence-parallel", "on", "--top", "3"])
    out = capsys.readouterr().out
    assert code == 0
    assert "mixtral-8x7b: 46.7B parameters (12.9B active, 8 experts top-2, hf layout)" in out
    assert "a2a %" in out
    rows = [line for line in out.splitlines() if line.startswith("│ ") and "dp" in line]
    assert len(rows) == 3 and all("%" in row for row in rows)
    assert any(" ep" in line for line in out.splitlines() if line.startswith("│ "))


def test_cli_ep_is_for_moe_models(capsys) -> None:
    assert main(["plan", "--model", "llama-8b", "--ep", "2"]) == 2
    assert "--ep applies to Mixture-of-Experts" in capsys.readouterr().err


def test_an_overlapped_pair_hides_the_stages_all_to_alls() -> None:
    """The planner's simulator cost carries each stage's all-to-alls inside F and B, so DualPipeV's F&B pairs cost
    max(F + B − exchange_f − exchange_b, F, B) (runtime/overlap.py), less than their halves one after the other."""
    import pipedsl
    from pipedsl.ir import Op

    m = model_preset("mixtral-8x7b")
    cluster = dataclasses.replace(cluster_preset("h100"), gpus=64)
    layout = Layout(16, 4, 1, "dualpipev", 1, 32, zero=1, recompute="none", ep=8)
    costs = stage_costs(m, cluster, layout, 8)
    cost = costs.simulator_cost()
    f, b = costs.exchanges[1]
    assert f > 0 and b == pytest.approx(f) and f + b == pytest.approx(costs.all_to_all[1])
    assert cost.per_stage[1]["exchange_f"] == f
    program = pipedsl.load("dualpipev").compile(P=4, M=16)
    pair = next(i for rank in program.ranks for i in rank if i.op is Op.OVERLAP)
    fwd, bwd = pair.sub
    halves = cost.compute_time(fwd) + cost.compute_time(bwd)
    assert cost.compute_time(pair) == pytest.approx(max(halves - cost.per_stage[fwd.stage]["exchange_f"]
                                                        - cost.per_stage[bwd.stage]["exchange_b"],
                                                        cost.compute_time(fwd), cost.compute_time(bwd)))
    assert cost.compute_time(pair) < halves


def test_the_planner_and_pipedsl_train_refuse_moe_layouts_by_one_rule() -> None:
    """One capability rule (plan/runnable.py) for the planner's candidates and `pipedsl train`'s refusals: an MoE
    decoder — Mixtral, DeepSeek-V3, the built-in GPT — runs tp × ep under 1-D tensor parallelism (the trainer's
    only mode), not 3-D; with sequence parallelism too (DeepSeek's latent attention included).  The planner once
    ranked "dp4 pp4 tp4+sp zb-v … ep2" first for Mixtral, a layout the trainer refused."""
    from pipedsl.plan.runnable import NotRunnableError, check_runnable, moe_refusal
    from pipedsl.trainer.config import ModelConfig, ParallelismConfig, TrainConfig

    def planned(model: str, tp: int, ep: int, sp: bool = False, mode: str = "1d") -> bool:
        try:
            check_runnable(model_preset(model), Layout(4, 1, tp, "1f1b", 1, 128, ep=ep, sequence_parallel=sp,
                                                       tp_mode=mode))
        except NotRunnableError:
            return False
        return True

    for tp, ep in ((1, 1), (1, 2), (2, 1), (2, 2)):
        assert planned("mixtral-8x7b", tp, ep) and moe_refusal(True, tp) is None, (tp, ep)
        assert planned("mixtral-8x7b", tp, ep, sp=tp > 1) and planned("deepseek-v3", tp, ep), (tp, ep)
        assert planned("deepseek-v3", tp, ep, sp=tp > 1), (tp, ep)
        # the trainer takes the GPT with 8 experts at every such layout (dropless: no --capacity-factor)
        TrainConfig(model=ModelConfig(experts=8), parallel=ParallelismConfig(dp=4, tp=tp, ep=ep))
    assert not planned("mixtral-8x7b", 8, 1, mode="3d") and moe_refusal(True, 8, "3d") is not None
    # without SP each tp rank takes 1/tp of a microbatch's tokens: they must divide (SP: its sequence shard)
    from pipedsl.plan.runnable import moe_tokens_refusal

    assert moe_tokens_refusal(1, 7, 2, False) is not None and moe_tokens_refusal(2, 7, 2, False) is None
    assert moe_tokens_refusal(1, 8, 2, True) is None and moe_tokens_refusal(1, 7, 1, False) is None


@pytest.mark.slow
@pytest.mark.parametrize("name, gpus", [("mixtral-8x7b", 64), ("qwen3-30b-a3b", 64), ("deepseek-v3", 512)])
def test_the_planners_first_choice_for_an_moe_preset_is_one_pipedsl_train_accepts(name: str, gpus: int) -> None:
    """`pipedsl plan --model NAME --gpus N` as the CLI runs it: every layout it ranks is one the trainer takes —
    tp × ep for the MoE decoders, ep dividing dp and the experts — by the capability rule and by `pipedsl train`'s
    own checks of the parallel options."""
    from pipedsl.plan.runnable import check_runnable
    from pipedsl.plan.search import search
    from pipedsl.trainer.config import ParallelismConfig, ScheduleConfig, TrainConfig

    model = model_preset(name)
    result = search(model, dataclasses.replace(cluster_preset("a100-80gb"), gpus=gpus), top=3)
    assert result.ranked, name
    for estimate in result.ranked:
        lay = estimate.layout
        check_runnable(model, lay)
        assert lay.dp % lay.ep == 0 and model.experts % lay.ep == 0, lay
        TrainConfig(parallel=ParallelismConfig(dp=lay.dp, tp=lay.tp, zero=lay.zero,  # ep: by the rule (the GPT has none)
                                               sequence_parallel=lay.sequence_parallel,
                                               zero_reshard=lay.zero_reshard),
                    schedule=ScheduleConfig(schedule=lay.schedule, microbatches=lay.microbatches))


def test_under_tp_an_moe_block_keeps_its_experts_whole_and_its_tp_rank_runs_a_share_of_the_tokens() -> None:
    """The planner prices tp × ep as parallel/moe_tp.py runs it: on each GPU the attention over tp and the MoE
    block's MLP part whole — E/ep routed experts, the router — whose gradients are summed over tp once a step;
    without SP the block's share is all-gathered forward and backward in place of the MLP's all-reduce, with SP
    the MoE block adds no tp collective."""
    m = model_preset("mixtral-8x7b")
    h, f = m.hidden, m.expert_ffn
    assert m.moe_mlp_params == 8 * 3 * h * f + 8 * h  # no shared expert
    rest = m.moe_layer_params - m.moe_mlp_params  # attention and norms
    for tp, ep in ((1, 1), (2, 1), (2, 4), (4, 8)):
        assert m.moe_block_params_per_gpu(tp, ep) == pytest.approx(rest / tp + 8 * h + 8 * 3 * h * f / ep)
    cluster = dataclasses.replace(cluster_preset("h100"), gpus=64)
    base = Layout(8, 4, 2, "1f1b", 1, 32, zero=1, recompute="none", ep=4)
    costs = stage_costs(m, cluster, base, 4)
    per_stage = 8  # layers a stage
    assert costs.stage_params[1] == pytest.approx(per_stage * m.moe_block_params_per_gpu(2, 4))
    assert costs.expert_params[1] == pytest.approx(per_stage * 8 * 3 * h * f / 4)
    sp = stage_costs(m, cluster, dataclasses.replace(base, sequence_parallel=True), 4)
    assert sp.tp_comm[1] < costs.tp_comm[1]  # SP: the block's share is its sequence shard, no gather
    one = stage_costs(m, cluster, dataclasses.replace(base, tp=1, dp=16), 4)
    assert one.tp_comm[1] == 0 and costs.tp_comm[1] > 0


def test_a_pipeline_extended_past_its_simulated_sizes_is_its_exact_simulation() -> None:
    """Past a few P microbatches the planner extends two simulations linearly, which is exact only where a schedule's
    iteration grows by the same time every P microbatches: a third size checks it, and where it does not (ZB-V with
    Mixtral's MoE stage costs at M = 32: the extension was 1.6 % short, so `--top 1` pruned the layout `--top 5`
    ranked first) the planner simulates M itself."""
    from pipedsl.plan.pipeline import run_pipeline
    from pipedsl.plan.pipeline import sharing as _sharing
    from pipedsl.plan.search import _prepare

    m, c = model_preset("mixtral-8x7b"), dataclasses.replace(cluster_preset("a100-80gb"), gpus=64)
    for lay in (Layout(16, 4, 1, "zb-v", 1, 32, zero=2, recompute="selective", ep=8),
                Layout(16, 4, 1, "1f1b", 1, 32, zero=2, recompute="selective", ep=8)):
        costs = _prepare(m, c, lay).costs
        got = run_pipeline(lay.schedule, lay.pp, lay.microbatches, lay.params, costs, _sharing(c, lay))
        exact = run_pipeline(lay.schedule, lay.pp, lay.microbatches, lay.params, costs, _sharing(c, lay),
                             extend_from=100)
        assert got.iteration == pytest.approx(exact.iteration, rel=1e-6), lay
