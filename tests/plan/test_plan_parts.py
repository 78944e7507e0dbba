"""The planner's parts against their references: the ZeRO paper's memory, Megatron's FLOP and
parameter formulas, torch's own modules and FLOP counter, a step-by-step ring, and the rejections."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from pipedsl.library import builtin_names
from pipedsl.models.gpt.model import GPT, Block, GPTConfig
from pipedsl.plan import Layout, LayoutError, ModelSpec, cluster_preset, evaluate, model_preset, model_states, search
from pipedsl.plan.cost import all_gather, all_reduce, stage_costs
from pipedsl.plan.pipeline import _run_exact, compiled, program_peaks, run_pipeline, simulation_sizes, stage_ranks
from pipedsl.plan.scaling import plot_scaling, scaling
from pipedsl.plan.search import rank_key

# Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC'20,
# Figure 1: Ψ = 7.5B parameters, Nd = 64 data-parallel ranks, K = 12 — GB per GPU as printed.
ZERO_FIGURE1_GB = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}


@pytest.mark.parametrize("stage", sorted(ZERO_FIGURE1_GB))
def test_zero_memory_per_stage_is_the_zero_papers_figure1(stage):
    states = model_states(7.5e9, 64, stage)
    assert round(states.total / 1e9, 1) == ZERO_FIGURE1_GB[stage]
    # and the exact terms: (2 + 2 + K)Ψ with the sharded ones divided by Nd
    exact = {0: 16 * 7.5, 1: 4 * 7.5 + 12 * 7.5 / 64, 2: 2 * 7.5 + 14 * 7.5 / 64, 3: 16 * 7.5 / 64}[stage]
    assert states.total / 1e9 == pytest.approx(exact, rel=1e-12)


def test_megatron_distributed_optimizer_bytes_and_the_planner_use_the_same_function():
    """Megatron-LM's distributed optimizer (bf16 parameters, fp32 gradients, fp32 main parameters and Adam
    sharded over dp): 6 + 12/dp bytes a parameter (its docs' table); the planner's memory for a Llama-70B layout
    moves by exactly the gradients' extra 2 bytes (sharded under ZeRO 2) when it plans fp32 gradients, whose
    reduction then moves twice the bytes."""
    import dataclasses

    from pipedsl.plan.memory import MEGATRON, state_bytes

    assert state_bytes("bf16", "fp32") == MEGATRON
    assert model_states(1.0, 8, 1, MEGATRON).total == pytest.approx(6 + 12 / 8)
    model, cluster = model_preset("llama-70b"), dataclasses.replace(cluster_preset("h100"), gpus=512)
    for zero in (1, 2):
        bf16 = evaluate(model, cluster, Layout(64, 2, 4, "1f1b", 1, 8, zero))
        fp32 = evaluate(model, cluster, Layout(64, 2, 4, "1f1b", 1, 8, zero, grads="fp32"))
        psi = bf16.memory.states.params / 2  # the fullest GPU's parameters (bf16, unsharded below ZeRO 3)
        extra = fp32.memory.states.total - bf16.memory.states.total
        assert extra == pytest.approx(2 * psi / (64 if zero >= 2 else 1), rel=1e-9)
        assert bf16.memory.states == model_states(psi, 64, zero, state_bytes("bf16", "bf16"))
        assert fp32.comm["dp"] > bf16.comm["dp"]  # fp32 gradients are reduced in fp32: twice the bytes


sizes = st.fixed_dictionaries({"layers": st.integers(1, 128), "heads": st.sampled_from([1, 8, 32, 96]),
                               "head_dim": st.sampled_from([64, 128]), "seq": st.sampled_from([512, 2048, 8192]),
                               "vocab": st.integers(1000, 260000), "batch": st.integers(1, 4096)})


def spec(d: dict) -> ModelSpec:
    return ModelSpec("h", d["layers"], d["heads"] * d["head_dim"], d["heads"], d["seq"], d["vocab"], d["batch"])


@given(sizes)
def test_iteration_flops_are_megatron_eq3(d):
    # Narayanan et al., SC'21, eq. 3 (with recomputation) and its 72·… form without it (§5.1).
    m = spec(d)
    B, s, l, h, V = m.global_batch, m.seq, m.layers, m.hidden, m.vocab
    assert m.iteration_flops(True) == pytest.approx(96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)),
                                                    rel=1e-12)
    assert m.iteration_flops(False) == pytest.approx(72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h)),
                                                     rel=1e-12)


@given(sizes)
def test_parameter_count_is_megatron_section_5_1(d):
    # SC'21 §5.1: P = 12·l·h²·(1 + 13/12h + (V + s)/12lh); the planner also counts the final LayerNorm (2h).
    m = spec(d)
    l, h, V, s = m.layers, m.hidden, m.vocab, m.seq
    assert m.params == round(12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))) + 2 * h


def test_parameters_and_flops_match_the_torch_gpt():
    cfg = GPTConfig(vocab_size=320, block_size=96, n_layer=3, n_head=4, n_embd=64)
    m = ModelSpec("small", cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.block_size, cfg.vocab_size, 1)
    assert sum(p.numel() for p in Block(cfg).parameters()) == m.layer_params
    # the torch GPT's head is untied: one more V×h matrix than the planner's tied Megatron count
    assert sum(p.numel() for p in GPT(cfg).parameters()) == m.params + cfg.vocab_size * cfg.n_embd
    x = torch.randn(2, cfg.block_size, cfg.n_embd)
    with FlopCounterMode(display=False) as counter:
        Block(cfg)(x)
    # torch does not count its CPU attention kernel: the matmuls are counted, then QKᵀ and AV explicitly
    attention = 4 * 2 * cfg.block_size ** 2 * cfg.n_embd
    assert counter.get_total_flops() == m.layer_flops(samples=2) - attention
    q = torch.randn(2, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head)
    with FlopCounterMode(display=False) as counter:
        torch.softmax(q @ q.transpose(-1, -2), -1) @ q
    assert counter.get_total_flops() == attention


def ring(size: float, ranks: int, bandwidth: float, latency: float, phases: int) -> float:
    """A ring step by step: `phases` rounds (1 reduce-scatter or all-gather, 2 all-reduce) of N-1
    steps, each sending one size/N chunk to the neighbour."""
    t = 0.0
    for _ in range(phases * (ranks - 1)):
        t += latency + size / ranks / bandwidth
    return t


@given(st.floats(1e3, 1e11), st.integers(1, 4096), st.floats(1e8, 1e12), st.floats(0, 1e-4))
def test_collectives_are_the_ring_step_by_step(size, ranks, bandwidth, latency):
    assert all_reduce(size, ranks, bandwidth, latency) == pytest.approx(ring(size, ranks, bandwidth, latency, 2),
                                                                        rel=1e-9, abs=1e-15)
    assert all_gather(size, ranks, bandwidth, latency) == pytest.approx(ring(size, ranks, bandwidth, latency, 1),
                                                                        rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved", "zb-h1", "zb-v", "chimera"])
def test_large_M_extends_the_simulation_linearly(schedule):
    # pipeline.py simulates two sizes past the warmup and extends; equal to simulating M itself.
    P, M = 4, 24
    assert len(simulation_sizes(M, P)) == 2
    model, cluster = model_preset("gpt-1.7b"), cluster_preset("a100-80gb").with_gpus(32)
    layout = Layout(8, P, 1, schedule, 2, M)
    program = compiled(schedule, P, M)
    costs = stage_costs(model, cluster, layout, program.num_stages, program.num_replicas)
    run = run_pipeline(schedule, P, M, (), costs)
    it, makespan, peaks, _ = _run_exact(schedule, P, M, (), costs, None)
    assert run.iteration == pytest.approx(it, rel=1e-9) and run.pipeline == pytest.approx(makespan, rel=1e-9)
    assert program_peaks(schedule, P, M) == pytest.approx([float(p) for p in peaks])


REJECTIONS = [
    # (model, gpus, layout, the reason's beginning)
    ("gpt-1.7b", 32, Layout(32, 1, 1, "1f1b", 1, 10), "batch: dp 32 × M 10 × microbatch 1 != global batch 512"),
    ("gpt-1.7b", 80, Layout(16, 5, 1, "1f1b", 1, 32), "divisibility: 24 layers do not split evenly over pp 5"),
    ("gpt-1.7b", 160, Layout(32, 1, 5, "1f1b", 1, 16), "divisibility: tp 5 must divide heads 24"),
    ("gpt-175b", 8, Layout(8, 1, 1, "1f1b", 1, 192), "out of memory: the model states alone take"),
    ("gpt-175b", 1024, Layout(16, 8, 8, "gpipe", 1, 96, recompute=False), "out of memory: at least"),
    ("gpt-1.7b", 64, Layout(8, 8, 1, "dualpipe", 8, 8), "schedule: "),
]


@pytest.mark.parametrize(("name", "gpus", "layout", "reason"), REJECTIONS, ids=[r[3].split(":")[0] + str(i)
                                                                                 for i, r in enumerate(REJECTIONS)])
def test_rejected_layouts_say_why(name, gpus, layout, reason):
    with pytest.raises(LayoutError) as err:
        evaluate(model_preset(name), cluster_preset("a100-80gb").with_gpus(gpus), layout)
    assert err.value.message.startswith(reason), err.value.message


def test_search_reports_rejections_with_reasons_and_ranks_the_rest():
    model, cluster = model_preset("gpt-18b"), cluster_preset("a100-80gb").with_gpus(16)
    result = search(model, cluster, top=3, schedules=["1f1b", "interleaved"], microbatch_sizes=(1, 2))
    kinds = {r.reason.split(":")[0] for r in result.rejected}
    assert {"out of memory", "divisibility"} <= kinds
    assert len(result.ranked) == 3 and [e.iteration for e in result.ranked] == sorted(e.iteration for e in result.ranked)
    for e in result.ranked:  # what is ranked fits, and its memory report adds up
        assert e.memory.total <= cluster.memory - cluster.reserved_memory
        st_ = e.memory.states
        assert e.memory.total == pytest.approx(st_.params + st_.grads + st_.optimizer + e.memory.gradient_buffer
                                               + e.memory.gathered + e.memory.activations)
        assert e.layout.dp * e.layout.microbatches * e.layout.microbatch == model.global_batch


def test_scaling_best_is_never_below_pure_data_parallel(tmp_path):
    model, cluster = model_preset("gpt-1.7b"), cluster_preset("a100-80gb")
    points = scaling(model, cluster, (8, 16), schedules=["1f1b"])
    for p in points:  # the best searches a superset of the data-parallel layouts
        assert p.best is not None and p.data_parallel is not None
        assert p.data_parallel.layout.pp == p.data_parallel.layout.tp == 1
        assert p.samples_per_second("best") >= p.samples_per_second("data_parallel") * (1 - 1e-9)
    assert points[1].samples_per_second("best") > points[0].samples_per_second("best")
    plot_scaling(points, model, cluster, tmp_path / "s.svg")
    assert (tmp_path / "s.svg").read_text().startswith("<?xml")


@pytest.mark.parametrize("schedule", builtin_names())
def test_the_searchs_skeleton_is_the_compiled_programs_shape(schedule):
    """The search bounds layouts from the schedule's plan (not lowered or validated): its placement,
    stages, replicas, split backward and peak live activations must be the compiled program's."""
    from pipedsl.errors import PipeDSLError
    from pipedsl.plan.pipeline import peak_live, skeleton

    checked = 0
    for P, M in ((2, 2), (2, 4), (4, 4), (4, 8), (4, 12)):
        try:
            program = compiled(schedule, P, M)
        except PipeDSLError:  # a requirement this size breaks: the skeleton refuses it too
            with pytest.raises(PipeDSLError):
                skeleton(schedule, P, M)
            continue
        bones = skeleton(schedule, P, M)
        assert (bones.num_stages, bones.num_replicas, bones.num_ranks) == \
            (program.num_stages, program.num_replicas, program.num_ranks)
        assert bones.placement == program.placement and bones.split_backward == program.split_backward
        assert list(bones.peaks) == peak_live(program) and stage_ranks(bones) == stage_ranks(program)
        checked += 1
    assert checked >= 2


def test_equal_times_rank_less_memory_first_then_fewer_gpus():
    """A small model's ZeRO-1 and ZeRO-2 layouts predict the same time and the same peak (reduce="step" holds
    ZeRO-2's whole gradient from the first backward to REDUCE_GRAD: its saving is between steps); of equal times
    the one holding less ranks first, then the one on fewer GPUs."""
    model = ModelSpec("tiny", 4, 64, 4, 32, 100, 8)
    cluster = replace(cluster_preset("a100-80gb"), gpus=4)
    zero1 = Layout(2, 2, 1, "zb-h1", 2, 2, 1, False)
    first, second = search(model, cluster, candidates=[zero1, replace(zero1, zero=2)]).ranked
    assert first.iteration == second.iteration and first.memory.total == second.memory.total
    assert second.memory.states.grads < first.memory.states.grads or first.memory.states.grads < \
        second.memory.states.grads
    lighter = replace(second, memory=replace(second.memory, activations=second.memory.activations - 1))
    for candidates in ([first, lighter], [lighter, first]):
        assert sorted(candidates, key=rank_key) == [lighter, first]
    fewer = replace(first, layout=replace(first.layout, dp=1))
    assert sorted([first, fewer], key=rank_key) == [fewer, first]
    assert sorted([replace(first, iteration=first.iteration * 1.001), second], key=rank_key)[0] is second


@pytest.mark.parametrize("schedule", [n for n in builtin_names() if n != "zb-auto"])
def test_the_placement_bound_never_exceeds_the_simulated_pipeline(schedule):
    """The search prunes a layout whose placement bound is above the top-k'th time, so the bound must be below
    what the schedule's program really takes: every built-in at a few sizes, under equal stages and under uneven
    ones (a slow last stage, W's cheaper than I's).  Before, a split backward's W's were charged before the
    backward chain below a rank, though they may run beside it: ZB-H1's bound was above its makespan."""
    from pipedsl.errors import PipeDSLError
    from pipedsl.plan.cost import StageCosts
    from pipedsl.plan.pipeline import placement_bound as _placement_bound
    from pipedsl.simulate import Cost, simulate

    checked = 0
    for P, M in ((2, 4), (4, 8), (4, 12)):
        try:
            program = compiled(schedule, P, M)
        except PipeDSLError:
            continue
        S = program.num_stages
        for f, i, w, last in ((1.0, 1.0, 1.0, 1.0), (1.0, 1.3, 0.6, 2.5)):
            F = [f * (last if s == S - 1 else 1.0) for s in range(S)]
            I = [i * (last if s == S - 1 else 1.0) for s in range(S)]  # noqa: E741
            W = [w * (last if s == S - 1 else 1.0) for s in range(S)]
            zeros = (0.0,) * S
            costs = StageCosts(tuple(F), tuple(a + b for a, b in zip(I, W)), tuple(I), tuple(W), 0.0, zeros, zeros,
                               zeros, zeros, zeros, zeros)
            cost = Cost(per_stage={s: {"F": F[s], "I": I[s], "W": W[s], "B": I[s] + W[s]} for s in range(S)})
            assert _placement_bound(program, costs, M) <= simulate(program, cost).makespan * (1 + 1e-9), (P, M, f)
            checked += 1
    assert checked >= 2
