"""`pipedsl plan --calibrate`'s measurements are sane and the planner predicts with them (no
wall-clock comparison here: benchmarks/planner_calibration.py compares with measured steps)."""

from __future__ import annotations

from pipedsl.plan import Layout, evaluate, search
from pipedsl.plan.calibrate import SmallGPT, calibrate


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
