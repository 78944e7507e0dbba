"""The planner models the runtime it plans for: ZeRO-3's prefetched gathers, the layouts pipedsl can
run for the model (plan/runnable.py), sequence parallelism and fused attention in the costs."""

from __future__ import annotations

import dataclasses

import pytest

from pipedsl.plan import Layout, cluster_preset, evaluate, model_preset, search
from pipedsl.plan.cost import all_gather, all_reduce, prefetched, stage_costs, zero3_exposed
from pipedsl.plan.runnable import NotRunnableError, check_runnable
from pipedsl.plan.search import LayoutError


def test_prefetched_by_hand() -> None:
    """Gathers 3, 3, 3 s; units computing 1, 5, 1 s: the first gather whole, the second 3 - 1 behind the
    first unit's compute, the third hidden behind the second's 5 s."""
    assert prefetched([3.0, 3.0, 3.0], [1.0, 5.0, 1.0]) == 3.0 + 2.0 + 0.0
    assert prefetched([2.0], [10.0]) == 2.0
    assert prefetched([], []) == 0.0


def test_zero3_exposed_by_hand() -> None:
    """Three units gathering 3 s each, computing forward 1, 5, 1 s, backward 2 s and an input gradient 1 s each:
    "unit" pays F 3 + 2 + 0, B 3 + 1 + 1 (in reverse order), I 3 + 2 + 2 and W all three gathers; "step" pays the
    forward's 5 s once a step and nothing in any op."""
    unit = zero3_exposed([3.0] * 3, [1.0, 5.0, 1.0], [2.0] * 3, [1.0] * 3, "unit")
    assert (unit.F, unit.B, unit.I, unit.W, unit.once) == (5.0, 5.0, 7.0, 9.0, 0.0)
    step = zero3_exposed([3.0] * 3, [1.0, 5.0, 1.0], [2.0] * 3, [1.0] * 3, "step")
    assert (step.F, step.B, step.I, step.W, step.once) == (0.0, 0.0, 0.0, 0.0, 5.0)


@pytest.mark.parametrize("inter_gbps", [45.0, 0.05])  # gathers hidden behind compute / longer than it
def test_zero3_forward_charges_one_gather_plus_the_excess(inter_gbps: float) -> None:
    """A middle stage of GPT-175B at dp8 pp4 tp8 (its units: 24 blocks): ZeRO-3's forward (reshard="unit") costs
    over ZeRO-1's the first block's gather plus 23 × max(0, gather - one block's forward), computed by hand.
    Resharded by step (the pipeline's default) no op pays a gather: the same sum is paid once a step, and the
    step's first microbatch meets every stage's up to a rank's last stage in turn (`once_a_step`)."""
    model = model_preset("gpt-175b")
    cluster = dataclasses.replace(cluster_preset("a100-80gb"), gpus=256, inter_bandwidth=inter_gbps * 1e9)
    base = Layout(8, 4, 8, "1f1b", 4, 48, zero=1, recompute="none")
    z1 = stage_costs(model, cluster, base, 4)
    z3 = stage_costs(model, cluster, dataclasses.replace(base, zero=3, zero_reshard="unit"), 4)
    n = model.layers // 4
    g = all_gather(2 * model.layer_params / 8, 8, *cluster.link(8 * 8))
    block = (z1.F[1] - cluster.op_overhead) / n  # compute + tp collectives of one block
    exposed = g + (n - 1) * max(0.0, g - block)
    assert z3.F[1] - z1.F[1] == pytest.approx(exposed)
    assert (g < block) == (inter_gbps > 1)
    if inter_gbps > 1:
        assert z3.F[1] - z1.F[1] == pytest.approx(g)  # only the first gather is exposed
    assert z3.W[1] - z1.W[1] == pytest.approx(n * g)  # a weight pass gathers every unit first
    held = stage_costs(model, cluster, dataclasses.replace(base, zero=3), 4)
    assert dataclasses.replace(base, zero=3).reshard == "step"
    for op in ("F", "B", "I", "W"):
        assert getattr(held, op)[1] == pytest.approx(getattr(z1, op)[1])
    assert held.step_gather[1] == pytest.approx(exposed) and z3.step_gather == (0.0,) * 4
    assert held.once_a_step([1]) == pytest.approx(held.step[1] + held.step_gather[0] + exposed)
    assert z3.once_a_step([1]) == pytest.approx(z3.step[1])  # ZeRO-3 has no gather after the optimizer step


def test_zero3_memory_holds_two_units_or_the_whole_stage() -> None:
    """ZeRO-3's peak beyond the states: reshard="unit" the largest two consecutive units (a block and the next,
    prefetched), a split backward's W and reshard="step" the whole
    stage; under ZeRO 2-3 the whole gradient less the shard too (reduce="step") — 2 bytes a parameter each, the
    shard's 1/dp kept anyway."""
    model = model_preset("gpt-18b")
    cluster = dataclasses.replace(cluster_preset("a100-80gb"), gpus=64)
    base = Layout(8, 8, 1, "1f1b", 1, 128, zero=3, recompute="full", zero_reshard="unit")
    unit = evaluate(model, cluster, base)
    costs = stage_costs(model, cluster, base, 8)
    assert model.embedding_params < model.layer_params  # so the largest pair is two blocks, not embedding + block
    pair = 2 * model.layer_params
    assert unit.memory.gradient_buffer == pytest.approx(2 * max(costs.stage_params) * 7 / 8, rel=1e-9)
    assert max(costs.unit_pairs) == pytest.approx(pair)
    assert unit.memory.gathered == pytest.approx(2 * pair * 7 / 8, rel=1e-9)
    for layout in (dataclasses.replace(base, zero_reshard="step"), dataclasses.replace(base, schedule="zb-h1")):
        whole = evaluate(model, cluster, layout)
        # the fullest rank's whole stage (1F1B's: the first; ZB-H1's may be another)
        assert any(whole.memory.gathered == pytest.approx(2 * p * 7 / 8, rel=1e-9) for p in costs.stage_params)
        assert whole.memory.gathered > unit.memory.gathered
        assert whole.memory.total > unit.memory.total
    zero1 = evaluate(model, cluster, dataclasses.replace(base, zero=1))
    assert zero1.memory.gradient_buffer == zero1.memory.gathered == 0.0


def test_zero3_on_auto_reshards_by_unit_only_where_step_does_not_fit() -> None:
    """A ZeRO-3 pipeline left on "auto" is priced resharded by step (the runtime's default); on a GPU too small for
    that but not for two units at a time, by unit, marked so for `pipedsl train --zero-reshard unit`."""
    model = model_preset("gpt-18b")
    roomy = dataclasses.replace(cluster_preset("a100-80gb"), gpus=64)
    auto = Layout(8, 8, 1, "1f1b", 1, 128, zero=3, recompute="full")
    step = evaluate(model, roomy, auto)
    unit = evaluate(model, roomy, dataclasses.replace(auto, zero_reshard="unit"))
    assert step.layout == auto and str(step.layout).endswith("zero3 recompute")
    assert step.iteration < unit.iteration and unit.memory.total < step.memory.total
    tight = dataclasses.replace(roomy, memory=roomy.reserved_memory + (unit.memory.total + step.memory.total) / 2)
    fitted = evaluate(model, tight, auto)
    assert fitted.layout.zero_reshard == "unit" and "zero3/unit" in str(fitted.layout)
    assert fitted.iteration == pytest.approx(unit.iteration) and fitted.memory.total == unit.memory.total
    ranked = search(model, tight, top=1, candidates=[auto]).ranked
    assert [e.layout for e in ranked] == [fitted.layout]
    with pytest.raises(LayoutError, match="out of memory"):  # an explicit mode is not changed
        evaluate(model, tight, dataclasses.replace(auto, zero_reshard="step"))


def test_zero3_reduce_scatter_is_exposed_at_pp1_as_in_the_runtime() -> None:
    """ZeRO's reduce="step" reduce-scatters at REDUCE_GRAD, after the stage's last backward: at pp = 1 nothing
    is left to overlap it, so the iteration is the pipeline plus the reduction plus the step."""
    model = dataclasses.replace(model_preset("gpt-1.7b"), global_batch=64)
    cluster = dataclasses.replace(cluster_preset("a100-80gb"), gpus=64)
    e = evaluate(model, cluster, Layout(64, 1, 1, "1f1b", 1, 1, zero=3, recompute="none"))
    costs = stage_costs(model, cluster, e.layout, 1)
    assert e.iteration == pytest.approx(e.pipeline + costs.reduce[0] + costs.step[0])


def test_runtime_rules_for_hf_decoders() -> None:
    llama = model_preset("llama-70b")
    ok = Layout(8, 8, 8, "1f1b", 1, 64, zero=0, recompute="none", sequence_parallel=True, attention="fused")
    check_runnable(llama, ok)
    check_runnable(llama, dataclasses.replace(ok, zero=3))  # ZeRO takes the DTensor shards (tp_hf.py, zero.py)
    for bad, words in ((dataclasses.replace(ok, tp_mode="3d"), "1-D"),
                       (dataclasses.replace(ok, tp=16), "heads")):
        with pytest.raises(NotRunnableError, match=words):
            check_runnable(llama, bad)
    with pytest.raises(NotRunnableError, match="sequence 8190"):
        check_runnable(dataclasses.replace(llama, seq=8190), ok)
    gpt = dataclasses.replace(llama, layout="gpt")
    check_runnable(gpt, dataclasses.replace(ok, tp_mode="3d", sequence_parallel=False))  # the built-in GPT runs 3-D
    with pytest.raises(LayoutError, match="runtime: Hugging Face stages support 1-D"):
        evaluate(llama, cluster_preset("h100").with_gpus(512), Layout(8, 8, 8, "1f1b", 4, 16, tp_mode="3d"))


def test_sequence_parallelism_and_fused_attention_in_the_costs() -> None:
    """SP: the same activation bytes on the ring plus the two norm gradients' small all-reduces a backward
    (torch's SP), less memory-bound work and memory; fused attention: no s² bytes."""
    model = dataclasses.replace(model_preset("llama-70b"), seq=2048)  # room for the layout without SP
    cluster = cluster_preset("h100").with_gpus(512)
    base = Layout(8, 8, 8, "1f1b", 1, 64, zero=0, recompute="none")
    plain, sp = (evaluate(model, cluster, dataclasses.replace(base, sequence_parallel=x, attention="fused"))
                 for x in (False, True))
    norm_grad = all_reduce(2 * model.hidden, 8, *cluster.link(8))  # one bf16 norm weight's gradient
    assert sp.comm["tp"] - plain.comm["tp"] == pytest.approx(64 * model.layers // 8 * 2 * norm_grad)  # M = 64
    assert sp.memory.activations < plain.memory.activations and sp.iteration < plain.iteration
    eager = evaluate(model, cluster, dataclasses.replace(base, sequence_parallel=True))
    assert eager.memory.activations > sp.memory.activations and eager.iteration > sp.iteration
    with pytest.raises(LayoutError, match="out of memory"):  # eager attention's s² scores at s = 8192
        evaluate(model_preset("llama-70b"), cluster, dataclasses.replace(base, sequence_parallel=True))


def test_llama70b_on_512_h100_first_choice_is_runnable() -> None:
    result = search(model_preset("llama-70b"), cluster_preset("h100").with_gpus(512), top=1)
    assert result.ranked
    for e in result.ranked:
        check_runnable(result.model, e.layout)
        assert e.layout.tp_mode == "1d"
    assert any(r.reason.startswith("runtime:") for r in result.rejected)
