"""`pipedsl plan --calibrate`'s measurements are sane and the planner predicts with them (no
wall-clock comparison here: benchmarks/planner_calibration.py compares with measured steps)."""

from __future__ import annotations

import math

import pytest

from pipedsl.plan import Layout, evaluate, search
from pipedsl.trainer.calibrate import SmallGPT, calibrate


def test_calibration_gives_positive_costs_and_a_usable_cluster(pool):
    small = SmallGPT(layers=4, embd=64, seq=32, batch=8)
    cal = calibrate(2, small, reps=2, pool=pool)
    assert 1e6 < cal.flops < 1e14  # a CPU core to a GPU
    assert 0 < cal.latency < 0.1 and 1e6 < cal.bandwidth < 1e12 and cal.memory_bandwidth > 1e6
    cluster, model = cal.cluster(), small.spec()
    one = evaluate(model, cluster, Layout(1, 2, 1, "1f1b", 2, 4, recompute=False))
    # the compute alone: every microbatch's forward and backward of half the blocks, on the measured rate
    compute = 4 * 3 * (small.layers // 2) * model.layer_flops(2) / cal.flops
    assert compute < one.iteration < 10 * compute
    assert search(model, cluster, top=3).ranked


def test_calibration_runs_on_gloo_on_a_machine_with_a_gpu_a_rank(monkeypatch):
    """`pipedsl plan --calibrate` measures the CPU with host tensors: on a machine with as many GPUs as ranks the
    launcher's default backend is NCCL, which refuses them (it did on every 4-GPU machine), so it asks for gloo."""
    import pipedsl.runtime.launch.launcher as launcher
    from pipedsl.trainer import calibrate as cal

    monkeypatch.setattr(launcher.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launcher.torch.cuda, "device_count", lambda: 8)
    assert launcher.default_backend(4) == "nccl"  # what a launch without a backend would get
    asked = {}

    def fake_launch(fn, nprocs, *args, backend=None, **kwargs):
        asked["backend"] = backend
        raise RuntimeError("stop")

    monkeypatch.setattr(launcher, "launch", fake_launch)
    with pytest.raises(RuntimeError, match="stop"):
        cal.calibrate(4, SmallGPT(layers=2, embd=16, seq=8, batch=2))
    assert asked == {"backend": "gloo"}


def _machine_measurements(small: SmallGPT, fixed: float, per_sample: float, op: float, step: float,
                          latency: float, bandwidth: float, all_reduce: tuple[float, float],
                          gather: tuple[float, float], tp_own: tuple[float, float],
                          sp_own: tuple[float, float]) -> list[dict[str, float]]:
    """What `measure_rank` reports on a machine with these costs (2 ranks, a core each).  `all_reduce` and
    `gather`: (seconds per ring step, bytes/s per fp16 byte) of the collectives inside a tensor-parallel step;
    `tp_own`, `sp_own`: the tp and SP blocks' own work, fixed and per sample."""
    from pipedsl.trainer.calibrate import LARGE, PIPELINE_MICROBATCHES, SIZES

    rank: dict[str, float] = {"adam": 0.01, "adam_params": 1e6}
    for suffix, b in (("", small.microbatch), ("_large", LARGE * small.microbatch)):
        act = 2 * b * small.seq * small.embd  # fp16 bytes of [b, T, C]
        ar = 2 * all_reduce[0] + act / all_reduce[1]
        g = gather[0] + act / 2 / gather[1]
        half = fixed + b * per_sample / 2
        small_sums = 6e-4  # SP's gradient all-reduces of its norms and biases: not a sequence collective
        rank.update({f"block{suffix}": fixed + b * per_sample, f"tp_block_collective{suffix}": ar,
                     f"tp_block_comm{suffix}": 4 * ar, f"tp_block{suffix}": half + tp_own[0] + b * tp_own[1] + 4 * ar,
                     f"sp_block_collective{suffix}": g, f"sp_block_comm{suffix}": 10 * g + small_sums,
                     f"sp_block{suffix}": half + sp_own[0] + b * sp_own[1] + 10 * g + small_sums})
    block = rank["block"]
    rank.update({"split_block": 1.1 * block, "block_cpu": block, "tp_block_cpu": rank["tp_block"] - 0.75 * 4 * (
        2 * all_reduce[0] + 2 * small.microbatch * small.seq * small.embd / all_reduce[1])})
    rank.update({f"pipeline{m}_cpu": step + m * (block + 2 * op) for m in PIPELINE_MICROBATCHES})
    rank.update({f"msg{size}": latency + size / bandwidth for size in SIZES})
    return [rank, dict(rank)]


def test_summarize_recovers_the_machine_it_was_given():
    """The fits of calibration (fixed + FLOP-proportional block, CPU per stage op, link, the collectives timed
    inside tensor-parallel steps at two sizes, tp's own work) return the costs the measurements were made from."""
    from pipedsl.trainer.calibrate import summarize

    small = SmallGPT()
    per_sample = 3 * small.spec().layer_flops(1) / 30e9  # a 30 GFLOP/s core
    machine = _machine_measurements(small, 3e-3, per_sample, 1.2e-3, 5e-3, 150e-6, 2e9, (1e-3, 4e8), (6e-4, 3e8),
                                    (2e-3, 1e-4), (3e-3, 2e-4))
    cal = summarize([machine], small, 2)
    assert math.isclose(cal.layer_overhead, 3e-3, rel_tol=1e-9)
    assert math.isclose(cal.peak_flops, 30e9, rel_tol=1e-9)
    assert math.isclose(cal.op_overhead, 1.2e-3, rel_tol=1e-9)
    assert math.isclose(cal.latency, 150e-6, rel_tol=1e-6) and math.isclose(cal.bandwidth, 2e9, rel_tol=1e-6)
    for got, want in ((cal.tp_all_reduce, (1e-3, 4e8)), (cal.tp_gather, (6e-4, 3e8))):
        assert all(math.isclose(g, w, rel_tol=1e-6) for g, w in zip(got, want)), (got, want)
    assert math.isclose(cal.sync_latency, 1e-3 - 150e-6, rel_tol=1e-6)  # the ring step's wait beyond the link
    assert math.isclose(cal.collective_busy, 0.25, rel_tol=1e-6)  # a quarter of the collectives' time on the CPU
    for got, want in ((cal.tp_own, (2e-3, 1e-4)), (cal.sp_own, (3e-3, 2e-4))):
        assert all(math.isclose(g, w, rel_tol=1e-6) for g, w in zip(got, want)), (got, want)
    assert math.isclose(cal.split_backward, 1.1, rel_tol=1e-9)
    cluster = cal.cluster()
    assert (cluster.layer_overhead, cluster.op_overhead, cluster.peak_flops, cluster.collective_busy,
            cluster.tp_own, cluster.sp_own, cluster.tp_all_reduce, cluster.tp_gather) == \
        (cal.layer_overhead, cal.op_overhead, cal.peak_flops, cal.collective_busy, cal.tp_own, cal.sp_own,
         cal.tp_all_reduce, cal.tp_gather)


def test_a_split_backward_measured_on_a_loaded_machine_gives_a_cluster_the_planner_takes():
    """A split backward timed at 10.5× the full one (a CI run, the suite beside it) failed `plan --calibrate` with
    exit 2 (the cluster refuses more than `MAX_SPLIT_BACKWARD`); the calibration holds it to that bound."""
    from pipedsl.plan.cluster import MAX_SPLIT_BACKWARD
    from pipedsl.trainer.calibrate import summarize

    small = SmallGPT()
    machine = _machine_measurements(small, 3e-3, 3 * small.spec().layer_flops(1) / 30e9, 1.2e-3, 5e-3, 150e-6, 2e9,
                                    (1e-3, 4e8), (6e-4, 3e8), (2e-3, 1e-4), (3e-3, 2e-4))
    for rank in machine:
        rank["split_block"] = 10.5 * rank["block"]
    cal = summarize([machine], small, 2)
    assert cal.split_backward == MAX_SPLIT_BACKWARD and cal.cluster().split_backward == MAX_SPLIT_BACKWARD


def test_a_link_whose_larger_message_is_no_slower_is_credited_with_what_that_message_shows():
    """On a loaded machine the 4 KiB ping-pong waited as long as the 4 MiB one (4.4 ms each, 1 µs apart) and the fit
    said 4·10^15 bytes/s, every message free to the planner: the link gets the larger message's bytes over its time."""
    from pipedsl.trainer.calibrate import SIZES, summarize

    small = SmallGPT()
    machine = _machine_measurements(small, 3e-3, 3 * small.spec().layer_flops(1) / 30e9, 1.2e-3, 5e-3, 150e-6, 2e9,
                                    (1e-3, 4e8), (6e-4, 3e8), (2e-3, 1e-4), (3e-3, 2e-4))
    for rank in machine:
        rank[f"msg{SIZES[0]}"], rank[f"msg{SIZES[1]}"] = 4.4446e-3, 4.4456e-3
    cal = summarize([machine], small, 2)
    assert math.isclose(cal.bandwidth, SIZES[1] / 4.4456e-3) and 1e8 < cal.bandwidth < 1e10
    assert math.isclose(cal.latency, 4.4446e-3 - SIZES[0] / cal.bandwidth)


def test_flat_collective_times_fit_as_ring_steps_only():
    """Noise that makes the larger collective no slower gives no bandwidth term: all of it is per step."""
    from pipedsl.trainer.calibrate import MAX_BANDWIDTH, _fit_collective

    step, bandwidth = _fit_collective(2e-3, 1.9e-3, 1e5, 2, 1.0)
    assert bandwidth == MAX_BANDWIDTH and math.isclose(step, 1.95e-3 / 2)


def test_fixed_costs_are_charged_per_block_pass_and_per_stage_op():
    """F, B, I, W of every stage grow by the per-op overhead plus a third of the per-block one per
    block pass (F one, B two, I and W one each) — nothing else changes."""
    from dataclasses import replace

    from pipedsl.plan.cluster import cluster_preset
    from pipedsl.plan.cost import stage_costs

    model, base = SmallGPT().spec(), cluster_preset("a100-80gb")
    layout = Layout(1, 2, 1, "zb-h1", 2, 4, recompute=False)
    plain = stage_costs(model, base, layout, 2)
    fixed = stage_costs(model, replace(base, layer_overhead=3e-3, op_overhead=1e-3), layout, 2)
    per_pass = model.layers // 2 * 3e-3 / 3
    for s in range(2):
        for op, passes in (("F", 1), ("B", 2), ("I", 1), ("W", 1)):
            grown = getattr(fixed, op)[s] - getattr(plain, op)[s]
            assert math.isclose(grown, 1e-3 + passes * per_pass, rel_tol=1e-9), (op, s, grown)
    assert fixed.message == plain.message and fixed.reduce == plain.reduce


def test_tensor_parallel_overhead_is_charged_per_block_pass_of_a_1d_tp_layout_only():
    """The tp block's own work (the SP block's with SP), fixed plus per sample, joins the per-block overhead
    where blocks are 1-D tensor-parallel; without tp (or with 3-D tp, whose layers are not the ones
    calibrated) nothing changes."""
    from dataclasses import replace

    from pipedsl.plan.cluster import cluster_preset
    from pipedsl.plan.cost import stage_costs

    model, base = SmallGPT().spec(), cluster_preset("a100-80gb")
    costly = replace(base, tp_own=(3e-3, 1e-4), sp_own=(5e-3, 2e-4))
    for tp, sp, own in ((1, False, 0.0), (2, False, 3e-3 + 2 * 1e-4), (2, True, 5e-3 + 2 * 2e-4), (8, False, 0.0)):
        layout = Layout(1, 2, tp, "1f1b", 2, 4, recompute=False, tp_mode="3d" if tp == 8 else "1d",
                        sequence_parallel=sp)
        plain, grown = stage_costs(model, base, layout, 2), stage_costs(model, costly, layout, 2)
        per_pass = model.layers // 2 * own / 3
        for op, passes in (("F", 1), ("B", 2)):
            extra = getattr(grown, op)[0] - getattr(plain, op)[0]
            assert math.isclose(extra, passes * per_pass, abs_tol=1e-12), (tp, sp, op, extra)


def test_cluster_refuses_overheads_that_are_not_seconds():
    from dataclasses import replace

    from pipedsl.errors import PipeDSLError
    from pipedsl.plan.cluster import cluster_preset

    for bad in (-1.0, float("nan"), float("inf"), 1e9):
        with pytest.raises(PipeDSLError, match="op_overhead must be a number of seconds"):
            replace(cluster_preset("h100"), op_overhead=bad)


def test_sequence_parallel_collectives_are_priced_as_calibrated_inside_a_step():
    """With in-step prices, a 1-D tp block's forward is two all-reduces at `tp_all_reduce`, and with SP two
    all-gathers and two reduce-scatters at `tp_gather` (ring formulas over t = 2); the GPT's SP backward gathers
    its two column-parallel inputs again."""
    from dataclasses import replace

    from pipedsl.plan.cluster import cluster_preset
    from pipedsl.plan.cost import all_gather, all_reduce, stage_costs

    model = SmallGPT().spec()
    cluster = replace(cluster_preset("a100-80gb"), tp_all_reduce=(1e-3, 4e8), tp_gather=(6e-4, 3e8))
    act = 2 * 2 * model.seq * model.hidden  # fp16 [b, s, h] at microbatch 2
    blocks = model.layers // 2
    for sp, fwd, bwd in ((False, 2 * all_reduce(act, 2, 4e8, 1e-3), 2 * all_reduce(act, 2, 4e8, 1e-3)),
                         (True, 4 * all_gather(act, 2, 3e8, 6e-4), 6 * all_gather(act, 2, 3e8, 6e-4))):
        layout = Layout(1, 2, 2, "1f1b", 2, 4, recompute=False, sequence_parallel=sp)
        middle = stage_costs(model, cluster, layout, 2).tp_comm[1]  # the last stage: no embedding all-reduce
        loss = 3 * all_reduce(4 * 2 * model.seq, 2, 4e8, 1e-3)  # the vocabulary-parallel cross-entropy's three
        assert math.isclose(middle, blocks * (fwd + bwd) + loss, rel_tol=1e-9), (sp, middle)
