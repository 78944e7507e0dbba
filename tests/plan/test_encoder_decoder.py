"""The planner on encoder-decoders (plan/model.py EncDecSpec, plan/cost.py, the mT5 presets in plan/encdec.py) against its references: transformers' own mT5 modules for
parameters, FLOPs and saved activation bytes, hand counts of every matmul, the runtime's own unit splits
(`seq2seq_stages`), the ZeRO formulas, and the CLI."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from pipedsl.cli import main
from pipedsl.plan import Layout, cluster_preset, model_states
from pipedsl.plan.cost import encdec_stage_costs, split_bounds
from pipedsl.plan.encdec import ENCDEC_MODELS
from pipedsl.plan.model import EncDecSpec
from pipedsl.plan.partition import balanced_sizes, even_sizes
from pipedsl.plan.pipeline import _run_exact, live_peaks, program_peaks, run_pipeline
from pipedsl.plan.report import stage_labels
from pipedsl.plan.search import EXTEND_FROM
from pipedsl.plan.search import evaluate as encdec_evaluate
from pipedsl.plan.search import search as encdec_search

transformers = pytest.importorskip("transformers")

# The HF configs of google/mt5-*: (d_model, num_heads, d_ff, num_layers = num_decoder_layers); d_kv 64, vocabulary
# 250,112 — and the sizes Google publishes for them.
MT5_CONFIGS = {"mt5-small": (512, 6, 1024, 8), "mt5-base": (768, 12, 2048, 12), "mt5-large": (1024, 16, 2816, 24),
               "mt5-xl": (2048, 32, 5120, 24), "mt5-xxl": (4096, 64, 10240, 24)}
PUBLISHED = {"mt5-small": 300e6, "mt5-base": 580e6, "mt5-large": 1.2e9, "mt5-xl": 3.7e9, "mt5-xxl": 13e9}
V = 250112


def hf_count(d: int, heads: int, ff: int, layers: int, d_kv: int = 64, vocab: int = V, buckets: int = 32) -> int:
    """Parameters of MT5ForConditionalGeneration from its config, module by module (modeling_mt5.py): the shared
    embedding and the untied lm_head; per encoder block a T5LayerSelfAttention (q, k, v: d×inner, o: inner×d, a
    norm) and a T5LayerFF (wi_0, wi_1: d×ff, wo: ff×d, a norm); per decoder block also a T5LayerCrossAttention;
    the first block of each stack a relative_attention_bias Embedding(buckets, heads); a final norm per stack."""
    inner = heads * d_kv
    attention = 3 * d * inner + inner * d
    ffn = 2 * d * ff + ff * d
    encoder = layers * (attention + d + ffn + d) + buckets * heads + d
    decoder = layers * (2 * (attention + d) + ffn + d) + buckets * heads + d
    return vocab * d + encoder + decoder + vocab * d


def meta_mt5(d: int, heads: int, ff: int, layers: int, vocab: int = V) -> nn.Module:
    """transformers' own MT5ForConditionalGeneration on the meta device, its lm_head untied.

    transformers 5.x's MT5Config forces `tie_word_embeddings=True` (official weights serialise False, its comment
    says), so a model built from a config shares lm_head with the embedding; `from_pretrained` leaves a checkpoint's
    separate lm_head untied, and google/mt5-* hold one (the published 580M of mT5-Base count it)."""
    config = transformers.MT5Config(d_model=d, d_kv=64, num_heads=heads, d_ff=ff, num_layers=layers,
                                    num_decoder_layers=layers, vocab_size=vocab, dropout_rate=0.0)
    with torch.device("meta"):
        model = transformers.MT5ForConditionalGeneration(config)
        if model.lm_head.weight is model.shared.weight:
            model.lm_head.weight = nn.Parameter(torch.empty(vocab, d))
    return model


@pytest.mark.parametrize("name", list(MT5_CONFIGS))
def test_parameters_are_transformers_mt5(name):
    spec, (d, heads, ff, layers) = ENCDEC_MODELS[name], MT5_CONFIGS[name]
    model = meta_mt5(d, heads, ff, layers)
    assert sum(p.numel() for p in model.parameters()) == hf_count(d, heads, ff, layers) == spec.params
    assert abs(spec.params / PUBLISHED[name] - 1) < 0.06  # "300M … 13B" as published (rounded)
    # each unit, as transformers builds it: a middle layer, the first one with its relative position bias
    for stack, per_layer in ((model.encoder, spec.encoder_layer_params), (model.decoder, spec.decoder_layer_params)):
        assert sum(p.numel() for p in stack.block[1].parameters()) == per_layer
        assert sum(p.numel() for p in stack.block[0].parameters()) == per_layer + spec.position_bias_params
    assert {u.kind: u.params for u in spec.units()}["head"] == model.lm_head.weight.numel() + d


def test_parameters_match_the_briefs_approximate_sizes_within_half_a_percent():
    expected = {"mt5-small": 300.2e6, "mt5-base": 582.4e6, "mt5-large": 1.2296e9, "mt5-xl": 3.7426e9,
                "mt5-xxl": 12.921e9}
    for name, count in expected.items():
        assert ENCDEC_MODELS[name].params == pytest.approx(count, rel=5e-3)


def test_layer_flops_by_hand_for_mt5_base():
    """Every matmul of an mT5-Base layer listed by hand (2 FLOPs a multiply-accumulate), at S = 512, T = 114."""
    spec = ENCDEC_MODELS["mt5-base"]
    S, T, d, inner, ff = 512, 114, 768, 12 * 64, 2048
    encoder = {"q": S * d * inner, "k": S * d * inner, "v": S * d * inner, "scores QKᵀ": S * S * inner,
               "probs·V": S * S * inner, "o": S * inner * d, "wi_0": S * d * ff, "wi_1": S * d * ff, "wo": S * ff * d}
    decoder = {"self q": T * d * inner, "self k": T * d * inner, "self v": T * d * inner, "self QKᵀ": T * T * inner,
               "self probs·V": T * T * inner, "self o": T * inner * d,
               "cross q": T * d * inner, "cross k (encoder output)": S * d * inner,
               "cross v (encoder output)": S * d * inner, "cross QKᵀ": T * S * inner, "cross probs·V": T * S * inner,
               "cross o": T * inner * d, "wi_0": T * d * ff, "wi_1": T * d * ff, "wo": T * ff * d}
    assert spec.encoder_layer_flops() == 2 * sum(encoder.values()) == 8_053_063_680
    assert spec.decoder_layer_flops() == 2 * sum(decoder.values()) == 3_309_907_968
    assert spec.head_flops() == 2 * T * d * V
    assert spec.encoder_core_flops() == 2 * (encoder["scores QKᵀ"] + encoder["probs·V"])
    # training: forward + 2× backward, and one more forward of each layer with full recomputation
    B, layers = spec.global_batch, 12 * (spec.encoder_layer_flops() + spec.decoder_layer_flops())
    assert spec.iteration_flops() == 3 * B * (layers + spec.head_flops())
    assert spec.iteration_flops("full") == spec.iteration_flops() + B * layers


def _tiny_block(decoder: bool, dtype=torch.float32):
    from transformers.models.mt5.modeling_mt5 import MT5Block

    config = transformers.MT5Config(d_model=48, d_kv=8, num_heads=4, d_ff=80, num_layers=2, vocab_size=100,
                                    dropout_rate=0.0, is_decoder=decoder)
    config._attn_implementation = "eager"
    spec = EncDecSpec("tiny", 2, 2, 48, 4, 8, 80, 100, source=24, target=10, global_batch=1,
                      value_bytes=torch.finfo(dtype).bits // 8)
    torch.manual_seed(0)
    return MT5Block(config, has_relative_attention_bias=False, layer_idx=0).to(dtype).train(), spec


def _run_block(block, spec: EncDecSpec, decoder: bool, b: int, dtype=torch.float32):
    """The block as a stage runs it: the stack's position bias handed in, the encoder output for cross-attention."""
    L = spec.target if decoder else spec.source
    x = torch.randn(b, L, spec.d_model, dtype=dtype, requires_grad=True)
    bias = torch.randn(1, spec.heads, L, L, dtype=dtype, requires_grad=True)
    if not decoder:
        return block(x, attention_mask=None, position_bias=bias)
    enc = torch.randn(b, spec.source, spec.d_model, dtype=dtype, requires_grad=True)
    return block(x, attention_mask=None, position_bias=bias, encoder_hidden_states=enc, encoder_attention_mask=None,
                 encoder_decoder_position_bias=torch.zeros(1, spec.heads, L, spec.source, dtype=dtype))


@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
def test_layer_flops_are_torchs_count_on_transformers_block(decoder):
    from torch.utils.flop_counter import FlopCounterMode

    block, spec = _tiny_block(decoder)
    with FlopCounterMode(display=False) as counter:
        _run_block(block, spec, decoder, b=3)
    expected = spec.decoder_layer_flops(3) if decoder else spec.encoder_layer_flops(3)
    assert counter.get_total_flops() == expected


@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
def test_activation_bytes_are_what_autograd_saves_in_transformers_block(decoder):
    """Every tensor autograd keeps for the backward of a bf16 MT5Block (eager attention, no dropout), each storage
    once, weights excluded: the layer's formula, plus for the decoder the encoder output its cross-attention keeps."""
    dtype = torch.bfloat16
    block, spec = _tiny_block(decoder, dtype)
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    b = 2
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _run_block(block, spec, decoder, b, dtype)
    expected = b * (spec.decoder_layer_bytes() + spec.encoder_output_bytes if decoder else spec.encoder_layer_bytes())
    assert sum(kept.values()) == expected


def test_a_decoder_stage_costs_more_than_an_encoder_stage_at_equal_lengths():
    """Six decoder layers against six encoder layers at S = T: cross-attention makes the decoder's stage slower and
    heavier; at T5's 512/114 the decoder's is the cheaper one, and the 250k-vocabulary head outweighs a layer —
    so each stage is priced by its own units."""
    cluster = cluster_preset("a100-80gb").with_gpus(7)
    layout = Layout(1, 7, 1, "1f1b", 1, 8, 0, "none")
    bounds = (0, 1, 7, 13, 14, 20, 26, 27)  # emb | E0-E5 | E6-E11 | dec-emb | D0-D5 | D6-D11 | head
    for S, T in ((512, 512), (256, 256)):
        spec = ENCDEC_MODELS["mt5-base"].with_lengths(S, T)
        assert stage_labels(spec, bounds)[1] == "E0-E5" and stage_labels(spec, bounds)[4] == "D0-D5"
        stages = encdec_stage_costs(spec, cluster, layout, bounds)
        enc, dec = 1, 4
        assert stages.costs.F[dec] > stages.costs.F[enc] and stages.costs.B[dec] > stages.costs.B[enc]
        assert stages.activation[dec] > stages.activation[enc]
        assert stages.costs.stage_params[dec] > stages.costs.stage_params[enc]
    spec = ENCDEC_MODELS["mt5-base"]  # S 512, T 114
    stages = encdec_stage_costs(spec, cluster, layout, bounds)
    assert stages.costs.F[4] < stages.costs.F[1] and stages.costs.F[6] > stages.costs.F[1] / 6
    assert spec.head_flops() > spec.encoder_layer_flops() > spec.decoder_layer_flops()


def test_splits_are_the_runtimes_and_the_balanced_one_is_never_slower():
    """by="count" and by="params" equal what `seq2seq_stages` cuts on transformers' model; the planner's split
    minimises the slowest stage, and its layout is predicted faster than the runtime's default split."""
    from pipedsl.models.hf.seq2seq import seq2seq_stages

    spec = ENCDEC_MODELS["mt5-base"]
    model = meta_mt5(*MT5_CONFIGS["mt5-base"])
    cluster = cluster_preset("a100-80gb").with_gpus(16)
    for n in (2, 3, 4, 5, 8, 16, 27):
        for how in ("count", "params"):
            stages = seq2seq_stages(model, n, by=how, check=False)
            assert tuple(s.first for s in stages) + (stages[-1].last,) == split_bounds(spec, cluster, n, how)
    for n in (2, 4, 8):
        layout = Layout(16 // n, n, 1, "1f1b", 1, 1024 // (16 // n), 1, "none")
        times = {how: encdec_evaluate(spec, cluster, layout, how) for how in ("time", "count", "params")}
        assert max(times["time"].stage_seconds) <= min(max(times[h].stage_seconds) for h in ("count", "params"))
        assert times["time"].iteration < times["count"].iteration


@given(st.lists(st.sampled_from([1, 2, 3, 5, 8, 13]), min_size=1, max_size=9), st.data())
def test_the_balanced_splits_are_exact(weights, data):
    """Against every split: `balanced_sizes` reaches the least heaviest part; `even_sizes` too, and among those
    splits the least sum of squares."""
    n = data.draw(st.integers(1, len(weights)))
    L = len(weights)

    def parts(sizes):
        edges = [0, *itertools.accumulate(sizes)]
        return [sum(weights[a:b]) for a, b in zip(edges, edges[1:])]

    every = [parts([b - a for a, b in zip((0, *cuts), (*cuts, L))]) for cuts in itertools.combinations(range(1, L), n - 1)]
    least = min(max(p) for p in every)
    assert max(parts(balanced_sizes(weights, n))) == least
    even = parts(even_sizes(weights, n))
    assert max(even) == least and sum(x * x for x in even) == min(sum(x * x for x in p) for p in every
                                                                  if max(p) == least)


def test_zero3_memory_shrinks_with_dp_as_the_formula_says():
    """ZeRO-3 over dp: the states are 16Ψ/dp (2 + 2 + 12 bytes, all sharded); the runtime's reduce="step" keeps
    the full bf16 gradient between the first backward and REDUCE_GRAD, 2Ψ(1 - 1/dp) more, and (reshard="unit") a
    unit gathered and the next prefetched, (reshard="step", the pipeline's default) the whole stage; activations do
    not depend on dp."""
    spec = ENCDEC_MODELS["mt5-xl"]
    seen = {}
    for dp in (2, 4, 8):
        cluster = cluster_preset("a100-80gb").with_gpus(4 * dp)
        e = encdec_evaluate(spec, cluster, Layout(dp, 4, 1, "1f1b", 1, 1024 // dp, 3, "none", zero_reshard="unit"))
        for m in e.ranks:
            assert m.states == model_states(m.params_count, dp, 3)
            assert m.states.total == pytest.approx(16 * m.params_count / dp, rel=1e-12)
            assert m.gradient_buffer == pytest.approx(2 * m.params_count * (1 - 1 / dp), rel=1e-12)
        seen[dp] = e
    for small, large in ((2, 4), (4, 8)):
        a, b = seen[small].ranks[0], seen[large].ranks[0]
        assert a.params_count == b.params_count and b.states.total == pytest.approx(a.states.total / 2, rel=1e-12)
        assert a.activations == b.activations
    # 1F1B gathers a unit and prefetches the next: at most two consecutive units of a stage at once, beyond the
    # shard it holds; the stages holding a 250k × 2048 table (an embedding copy, the head) gather the most
    e = seen[8]
    units = spec.units()
    for m in e.ranks:
        (s,) = m.stages
        sizes = [u.params for u in units[e.bounds[s]:e.bounds[s + 1]]]
        pair = max(a + b for a, b in zip(sizes, sizes[1:]))
        assert m.gathered == pytest.approx(2 * pair * (1 - 1 / 8), rel=1e-12)
    tables = [m for m in e.ranks if any(u.embedding or u.kind == "head" for u in units[e.bounds[m.stages[0]]:
                                                                                   e.bounds[m.stages[0] + 1]])]
    assert min(m.gathered for m in tables) > max(m.gathered for m in e.ranks if m not in tables)
    held = encdec_evaluate(spec, cluster_preset("a100-80gb").with_gpus(32), Layout(8, 4, 1, "1f1b", 1, 128, 3, "none"))
    assert held.layout.reshard == "step"
    for m in held.ranks:
        assert m.gathered == pytest.approx(2 * m.params_count * (1 - 1 / 8), rel=1e-12)


def test_live_activations_weigh_each_stage_by_its_own_bytes():
    """A rank's activation peak is walked over the compiled program with each stage's own bytes: 1F1B keeps
    min(P - r, M) of its one stage; looped BFS keeps every microbatch of both its stages; the counts are
    `program_peaks`' (and extended past the simulated sizes alike)."""
    assert live_peaks("1f1b", 2, 4, (), [1.0, 10.0]) == ((2.0, 1.0), (2.0, 10.0))
    assert live_peaks("looped-bfs", 2, 4, (("V", 2),), [1.0, 10.0, 100.0, 1000.0])[1] == (404.0, 4040.0)
    for name, params in (("1f1b", ()), ("interleaved", (("V", 2),)), ("zb-h1", ()), ("hanayo", (("W", 1),))):
        for M in (4, 8, 40):
            counts, _ = live_peaks(name, 4, M, params, [1.0] * 8)
            assert counts == program_peaks(name, 4, M, params), (name, M)


@pytest.mark.parametrize(("name", "gpus", "layout"), [
    ("mt5-base", 64, Layout(16, 4, 1, "looped-bfs", 1, 64, 1, "none", "1d", (("V", 2),))),
    ("mt5-base", 8, Layout(4, 2, 1, "hanayo", 1, 256, 1, "none", "1d", (("W", 1),))),
    ("mt5-xxl", 64, Layout(8, 8, 1, "interleaved", 1, 128, 1, "none", "1d", (("V", 2),))),
])
def test_unequal_stages_are_extended_from_where_the_simulation_is_periodic(name, gpus, layout):
    """Stages of unequal cost reach their steady state later: extended from 2P (`pipeline.run_pipeline`) these
    were 14 %, 2.2 % and 1.6 % fast and under the placement bound; from 8P they are the full simulation."""
    from pipedsl.plan.search import _encdec_prepare as _prepare

    prep = _prepare(ENCDEC_MODELS[name], cluster_preset("a100-80gb").with_gpus(gpus), layout, "time")
    P, M = layout.pp, layout.microbatches
    exact = _run_exact(layout.schedule, P, M, layout.params, prep.stages.costs, None)[0]
    assert run_pipeline(layout.schedule, P, M, layout.params, prep.stages.costs, None, EXTEND_FROM).iteration == \
        pytest.approx(exact, rel=1e-9)
    assert prep.bound <= exact * (1 + 1e-9)


def test_the_encoder_output_crosses_every_decoder_boundary():
    spec = ENCDEC_MODELS["mt5-large"]
    cluster = cluster_preset("h100").with_gpus(2)
    layout = Layout(1, 2, 1, "1f1b", 2, 512, 0, "none")
    in_encoder = encdec_stage_costs(spec, cluster, layout, (0, 10, len(spec.units())))
    in_decoder = encdec_stage_costs(spec, cluster, layout, (0, 40, len(spec.units())))
    S, T, d, b = spec.source, spec.target, spec.d_model, 2
    assert in_encoder.message_bytes == 2 * b * S * d + 8 * b * (S + T)  # hidden; the mask and the decoder ids
    assert in_decoder.message_bytes == 2 * b * (T + S) * d + 8 * b * S  # hidden + the encoder output; the mask
    assert in_decoder.activation[1] > in_decoder.activation[1] - b * spec.encoder_output_bytes > 0


def test_search_finds_a_layout_that_fits_and_reports_the_balance():
    spec = ENCDEC_MODELS["mt5-xxl"]
    cluster = cluster_preset("a100-80gb").with_gpus(8)
    result = encdec_search(spec, cluster, top=2, schedules=["1f1b"], zero=(1, 3))
    best = result.ranked[0]
    assert best.memory.total <= cluster.memory - cluster.reserved_memory
    assert best.layout.tp == 1 and best.layout.pp > 1 and len(best.points) == len(best.stage_seconds) - 1
    assert result.rejected and any("out of memory" in r.reason for r in result.rejected)
    tight = dataclasses.replace(cluster, memory=20e9)
    none = encdec_search(spec, tight, top=1, schedules=["1f1b"], zero=(0,), pp=[1])
    assert not none.ranked and none.least_memory > 18e9


def test_the_docs_table_rows_are_what_the_planner_prints():
    """docs/planner.md's mT5 table (A100) is `pipedsl plan --mt5-table`'s output: one of its rows, recomputed."""
    from pipedsl.plan.report import zero_table_markdown
    from pipedsl.plan.search import zero_table

    doc = (Path(__file__).resolve().parents[2] / "docs" / "planner.md").read_text()
    section = doc[doc.index("A100 80 GB (`a100-80gb`):"):doc.index("H100 80 GB (`--cluster h100`):")]
    cluster = cluster_preset("a100-80gb")
    for name, gpus in (("mt5-large", 16),):
        row = zero_table_markdown(zero_table([ENCDEC_MODELS[name]], cluster, [gpus]), cluster).splitlines()[-1]
        assert row in section.splitlines(), row


def test_plan_cli_mt5_preset_prints_a_layout_and_its_stages(capsys):
    code = main(["plan", "--model", "mt5-small", "--gpus", "8", "--schedule", "1f1b", "--zero", "0,1", "--top", "2",
                 "--source-len", "256", "--target-len", "64", "--global-batch", "256"])
    out = capsys.readouterr().out
    assert code == 0
    assert "mt5-small: 300M parameters (encoder-decoder: 8+8 layers" in out and "S=256, T=64" in out
    rows = [line for line in out.splitlines() if line.startswith("│ ") and " 1f1b " in line]
    assert len(rows) == 2 and "tp1" in rows[0]
    assert "train it so: stages = seq2seq_stages(model, " in out and 'by="count"' in out


def test_plan_cli_mt5_table_is_markdown(capsys):
    code = main(["plan", "--mt5-table", "--model", "mt5-base", "--gpu-counts", "8", "--schedule", "1f1b",
                 "--zero", "1,3"])
    out = capsys.readouterr().out
    assert code == 0 and "S = 512 source and T = 114 target tokens, global batch 1024" in out
    row = next(line for line in out.splitlines() if line.startswith("| mt5-base |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "8" and cells[3].startswith("`dp") and cells[3].endswith("zero1`")
    assert cells[8] == cells[10] == "not searched" and cells[9].endswith(" s") and cells[11].endswith(" s")
    assert cells[12].startswith(cells[5]) and "zero1" in cells[12]  # pp 1 is the best here: pure data parallel


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "mt5-base", "--layers", "4"], "--layers describe decoder models"),
    (["--model", "mt5-base", "--recompute", "selective"], "--recompute none or full"),
    (["--model", "mt5-base", "--attention", "fused"], "eager attention"),
    (["--mt5-table", "--model", "gpt-1.7b"], "plans the encoder-decoder presets"),
    (["--mt5-table", "--gpu-counts", "8,x"], "--gpu-counts"),
    (["--model", "gpt-1.7b", "--source-len", "512"], "--source-len apply to the encoder-decoder presets"),
])
def test_encoder_decoder_bad_input_is_one_line(run_cli, argv, message):
    code, err = run_cli("plan", *argv)
    assert code == 2 and len(err) == 1 and message in err[0], err
