"""Activation bytes per layer (pipedsl/plan/activations.py): Korthikanti et al. 2022's Table 2 and
worked figures, and the HF Llama formula against the bytes the runtime measures at tp1/tp2/tp2+SP.

Paper figures used (arXiv 2205.05198): GPT-3 175B (a = 96, h = 12288, s = 2048) has 5as/h = 80;
at t = 8 selective recomputation with SP saves 70 % of the activations (MT-NLG 530B, a = 128,
h = 20480: 65 %); tp + SP + selective is ~5x less than tp alone; full recomputation costs a third
more FLOPs (33-36 % measured), selective recomputation's attention core is s/6h of the GEMM FLOPs
(2.7 % for GPT-3, 1.6 % for MT-NLG).
"""

from __future__ import annotations

import pytest
from activation_cases import SIZES, layer_bytes_each, w_held_layer

import pipedsl
from pipedsl.plan.activations import layer_activation_bytes, layer_w_held_bytes
from pipedsl.plan.model import ModelSpec, model_preset

GPT3 = dict(seq=2048, hidden=12288, heads=96)
MTNLG = dict(seq=2048, hidden=20480, heads=128)


def gpt(s: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: str = "none", fused: bool = False,
        b: int = 1) -> float:
    """Per s·b·h, as Table 2 writes it."""
    return layer_activation_bytes(s, b, h, a, t, sp, recompute, fused) / (s * b * h)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize(("s", "h", "a"), [(2048, 12288, 96), (2048, 20480, 128), (1024, 4096, 32)])
def test_table2_rows(s: int, h: int, a: int, t: int) -> None:
    x = 5 * a * s / h
    assert gpt(s, h, a) == pytest.approx(34 + x)
    assert gpt(s, h, a, t) == pytest.approx(10 + 24 / t + x / t)
    assert gpt(s, h, a, t, True) == pytest.approx((34 + x) / t if t > 1 else 34 + x)
    assert gpt(s, h, a, t, recompute="selective") == pytest.approx(10 + 24 / t)
    assert gpt(s, h, a, t, True, "selective") == pytest.approx(34 / t if t > 1 else 34)
    assert gpt(s, h, a, t, recompute="full") == pytest.approx(2)
    assert gpt(s, h, a, t, True, "full") == pytest.approx(2 / t)
    # a fused attention kernel keeps what selective recomputation keeps, without recomputing
    assert gpt(s, h, a, t, True, fused=True) == gpt(s, h, a, t, True, "selective")
    assert layer_activation_bytes(s, 4, h, a, t) == pytest.approx(4 * layer_activation_bytes(s, 1, h, a, t))


def test_paper_worked_figures() -> None:
    s, h, a = GPT3.values()
    assert 5 * a * s / h == 80
    saved = 1 - gpt(s, h, a, 8, True, "selective") / gpt(s, h, a, 8, True)
    assert saved == pytest.approx(0.70, abs=0.005)
    s2, h2, a2 = MTNLG.values()
    assert 1 - gpt(s2, h2, a2, 8, True, "selective") / gpt(s2, h2, a2, 8, True) == pytest.approx(0.65, abs=0.005)
    assert gpt(s, h, a, 8) / gpt(s, h, a, 8, True, "selective") == pytest.approx(5.4, abs=0.05)  # "5x"


def test_recompute_flops_against_the_paper() -> None:
    for sizes, core_share in ((GPT3, 0.027), (MTNLG, 0.016)):
        m = ModelSpec("m", 1, sizes["hidden"], sizes["heads"], sizes["seq"], 51200, 1)
        gemm = m.layer_flops() - m.attention_core_flops()
        share = m.attention_core_flops() / gemm
        assert share == pytest.approx(sizes["seq"] / (6 * sizes["hidden"]))
        assert int(share * 1000) / 1000 == core_share  # the paper prints 2.78 % and 1.67 % to one decimal, truncated
        assert m.recomputed_flops("selective") == m.attention_core_flops()  # QKᵀ and attention over V, once more
        assert m.recomputed_flops("selective", fused=True) == 0.0  # nothing s² was stored
    m = model_preset("gpt-175b")
    assert m.iteration_flops("full") / m.iteration_flops("none") - 1 == pytest.approx(0.33, abs=0.01)
    assert m.iteration_flops("selective") / m.iteration_flops("none") - 1 == pytest.approx(0.009, abs=0.001)


def test_hf_formula_structure() -> None:
    """What tp divides and what SP takes away, for the Llama-70B layer (bf16)."""
    m = model_preset("llama-70b")
    s, h, a, f, kv = m.seq, m.hidden, m.heads, m.ffn_size, m.kv_size

    def hf(t: int, sp: bool = False, recompute: str = "none", fused: bool = False) -> float:
        return layer_activation_bytes(s, 1, h, a, t, sp, recompute, fused, "hf", f, kv, 2) / (s * h)

    norms = 2 * (10 + 4 / h)
    split = 4 * 2 + a * s * 6 / h + 4 * 2 * f / h  # Q, K, V, output; softmax fp32 + bf16; the MLP's four
    for t in (1, 2, 8):
        assert hf(t) == pytest.approx(norms + split / t)
        assert hf(t, True) == pytest.approx((norms - 2 * 2) / t + 2 * 2 + split / t if t > 1 else hf(1))
        assert hf(t, recompute="selective") == pytest.approx(norms + 4 * 2 * f / h / t)
    assert hf(8, fused=True) < hf(8, recompute="selective") + 4 * 2 / 8 + 1e-9  # no s² term
    assert hf(8, True, "full") == pytest.approx(2 / 8)


MODES = [(1, False), (2, False), (2, True)]
VARIANTS = [(recompute, attn) for recompute in (None, "selective", "layer") for attn in ("eager", "sdpa")]


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "sp"), MODES, ids=["tp1", "tp2", "tp2+sp"])
def test_measured_bytes_equal_the_formula(pool, tp: int, sp: bool) -> None:
    """The runtime's count (fp32: 4 bytes a value) of one tiny Llama layer's saved tensors, per rank, for no,
    selective (attention modules) and layer-wise recomputation, eager and sdpa attention (one job per mode).
    At tp2 + SP, pipedsl's recompute="full" (the whole stage one region) keeps nothing per layer.  The reference:
    `layer_activation_bytes`, the HF Llama formula the planner prices, equal to within 1 %."""
    z = SIZES
    variants = VARIANTS + ([("full", "sdpa")] if sp else [])
    per_rank = pool.run(layer_bytes_each, tp, tp, sp, variants)
    for k, (recompute, attn) in enumerate(variants):
        if recompute == "full":
            assert [r[k]["layer"] for r in per_rank] == [0, 0]
            continue
        mode = {None: "none", "selective": "selective", "layer": "full"}[recompute]
        want = layer_activation_bytes(z["seq"], z["microbatch"], z["hidden"], z["heads"], tp, sp, mode,
                                      attn == "sdpa", "hf", z["ffn"], z["hidden"] * z["kv_heads"] // z["heads"], 4)
        for r in per_rank:
            assert r[k]["layer"] == pytest.approx(want, rel=0.01), (recompute, attn, r[k])


@pytest.mark.parametrize("t", [1, 2, 8])
@pytest.mark.parametrize(("s", "h", "a"), [(1024, 1536, 24), (2048, 12288, 96)])
def test_what_a_pending_w_holds_in_the_gpt_layer_is_the_zero_bubble_papers(s: int, h: int, a: int, t: int) -> None:
    """Qi et al. 2024: W reads each linear's input and its output's gradient, 32h of the 34h + 5as bytes a token;
    over tp the QKV and fc1 inputs and the projection's and fc2's output gradients are whole (8 + 24/t), SP shards
    them (32/t); recomputation holds the layer whole until W."""
    def held(sp: bool = False, recompute: str = "none") -> float:
        return layer_w_held_bytes(s, 1, h, a, t, sp, recompute) / (s * h)

    assert held() == pytest.approx(8 + 24 / t)
    assert held() / gpt(s, h, a) * (t == 1) == pytest.approx(32 * h / (34 * h + 5 * a * s) * (t == 1))
    assert held(True) == pytest.approx(32 / t if t > 1 else 32)
    assert held(True, "selective") == pytest.approx(gpt(s, h, a, t, True, "selective"))
    assert held(recompute="full") == pytest.approx(gpt(s, h, a, t, recompute="full"))


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "sp", "kv_heads"), [(1, False, 2), (1, False, 4), (2, False, 2), (2, True, 4)],
                         ids=["tp1", "tp1-kv4", "tp2", "tp2+sp-kv4"])
def test_measured_w_held_bytes_equal_the_formula(pool, tp: int, sp: bool, kv_heads: int) -> None:
    """What the runtime's byte counter holds for one tiny Llama layer's pending W after I (fp32, SDPA; the counter
    was checked against weak references in test_stage.py) is `layer_w_held_bytes`, v·(4h + (2h + 2h_kv + 3f)/t),
    on every rank, and what it stored is `layer_activation_bytes`."""
    z = SIZES
    kv = z["hidden"] * kv_heads // z["heads"]
    args = (z["seq"], z["microbatch"], z["hidden"], z["heads"], tp, sp, "none", True, "hf", z["ffn"], kv, 4)
    per_rank = pool.run(w_held_layer, 2 * tp, tp, sp, kv_heads)
    last = [r for r in per_rank if r["rank"] >= tp]  # the second stage's ranks
    assert len(last) == tp
    for r in last:
        assert r["held"] == pytest.approx(layer_w_held_bytes(*args), rel=1e-6), r
        assert r["stored"] == pytest.approx(layer_activation_bytes(*args), rel=0.01), r


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v", "1f1b"])
def test_the_planner_counts_a_pending_w_at_its_share(schedule: str) -> None:
    """Without recomputation a zero-bubble layout's activation memory is its fullest rank's peak with a pending W
    counted at `w_share` (the simulator's rule: 1 from F to I, the share from I to W) times a stage's layers and a
    layer's bytes (the last stage's rank: the logits too); 1F1B (no W) is unchanged, and under recomputation the
    share is 1."""
    from pipedsl.plan import cluster_preset, model_preset
    from pipedsl.plan.config import Layout
    from pipedsl.plan.pipeline import compiled, stage_ranks
    from pipedsl.plan.search import evaluate, w_share

    model, cluster = model_preset("gpt-1.7b"), cluster_preset("a100-80gb").with_gpus(4)
    layout = Layout(1, 4, 1, schedule, 1, model.global_batch, recompute="none", attention="eager")
    share = w_share(model, layout)
    assert share == pytest.approx(32 * model.hidden / (34 * model.hidden + 5 * model.heads * model.seq))
    assert w_share(model, Layout(1, 4, 1, schedule, 1, layout.microbatches)) == 1.0  # recompute="full"
    M = layout.microbatches
    program = compiled(schedule, 4, M)
    peaks = pipedsl.simulate(program, pipedsl.Cost(wmem=share)).peak_activations
    whole = pipedsl.simulate(program).peak_activations
    estimate = evaluate(model, cluster, layout)
    per_layer = model.layer_activation_bytes(1, 1, "none")
    layers = list(estimate.layers)
    on_rank = stage_ranks(program)
    activations = [peaks[r] * max(layers[s] for s in st) * per_layer for r, st in on_rank.items()]
    fullest = max(range(4), key=lambda r: estimate.rank_memory[r])
    last = program.num_stages - 1  # its rank also holds the fp32 logits of the microbatch in flight
    expected = activations[fullest] + (4 * model.seq * model.vocab if last in on_rank[fullest] else 0.0)
    assert estimate.memory.activations == pytest.approx(expected, rel=1e-9)
    if schedule == "1f1b":
        assert peaks == whole
    elif schedule == "zb-h1":  # its later ranks defer W's past their peak; ZB-V's peaks come before any pending W
        assert all(p < w for p, w in zip(peaks[1:], whole[1:])), (peaks, whole)
