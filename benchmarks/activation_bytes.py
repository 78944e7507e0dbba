"""Activation bytes per layer: the planner's formula (pipedsl/plan/activations.py) against what the
runtime counts (`Pipeline(activation_bytes=True)`) for a tiny Hugging Face Llama, per mode.

Modes: tp 1, tp 2, tp 2 + sequence parallelism; recomputation none, selective (the attention
modules), per layer (each decoder layer a region: the planner's "full") and pipedsl's "full" (the
stage one region); eager attention and SDPA (fused on CPU).  One layer's bytes are the difference
of pipelines with 1 and 2 layers, one microbatch's the difference of M = 1 and M = 2
(tests/plan/activation_cases.py).  fp32: 4 bytes a value.  Also prints Korthikanti et al.'s
Table 2 per s·b·h for GPT-3 175B at t = 8, the paper's own numbers.

    python benchmarks/activation_bytes.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "plan"))

import activation_cases as cases  # noqa: E402

from pipedsl.plan.activations import layer_activation_bytes  # noqa: E402

MODES = [(1, False), (2, False), (2, True)]
RECOMPUTE = [(None, "none"), ("selective", "selective"), ("layer", "full"), ("full", None)]


def main() -> None:
    from pipedsl.runtime.launch.pool import LocalPool

    z = cases.SIZES
    began = time.perf_counter()
    print(f"tiny Llama: h={z['hidden']}, ffn={z['ffn']}, heads={z['heads']} (kv {z['kv_heads']}), s={z['seq']}, "
          f"b={z['microbatch']}, fp32\n")
    print("| tp | SP | recompute | attention | measured bytes/layer (per rank) | formula | formula / measured |")
    print("|---:|---|---|---|---:|---:|---:|")
    pool = LocalPool(2, timeout=300)
    try:
        for tp, sp in MODES:
            for runtime_mode, planner_mode in RECOMPUTE:
                for attn in ("eager", "sdpa"):
                    measured = [r["layer"] for r in pool.run(cases.layer_bytes, tp, tp, sp, runtime_mode, attn)]
                    if planner_mode is None:  # pipedsl's whole-stage region: no layer keeps anything
                        want = 0.0
                    else:
                        want = layer_activation_bytes(z["seq"], z["microbatch"], z["hidden"], z["heads"], tp, sp,
                                                      planner_mode, attn == "sdpa", "hf", z["ffn"],
                                                      z["hidden"] * z["kv_heads"] // z["heads"], 4)
                    ratio = f"{want / measured[0]:.3f}" if measured[0] else ("exact" if want == 0 else "-")
                    label = {None: "none", "layer": "full (per layer)", "full": "full (pipedsl: stage)"}.get(
                        runtime_mode, runtime_mode)
                    print(f"| {tp} | {'yes' if sp else 'no'} | {label} | {attn} | "
                          f"{', '.join(f'{m:,}' for m in sorted(set(measured)))} | {want:,.0f} | {ratio} |",
                          flush=True)
    finally:
        pool.close()
    s, h, a = 2048, 12288, 96
    print("\nKorthikanti et al. Table 2, GPT-3 175B (s=2048, h=12288, a=96), t=8, bytes per s·b·h:")
    for label, sp, mode in (("tp", False, "none"), ("tp + SP", True, "none"), ("tp + selective", False, "selective"),
                            ("tp + SP + selective", True, "selective"), ("full", False, "full")):
        print(f"  {label:22s} {layer_activation_bytes(s, 1, h, a, 8, sp, mode) / (s * h):6.2f}")
    print(f"\n{time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
