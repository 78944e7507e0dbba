"""Predicted MFU of Llama 3 on the H100 preset (the planner's best runnable layout) next to Meta's
published numbers ("The Llama 3 Herd of Models", 2024, Table 4: Llama 3 405B, sequence 8192,
16M tokens a batch, BF16 MFU 38-43 %).

    python benchmarks/planner_llama3.py            # 8B and 70B on 512 GPUs, 405B on 8,192 and 16,384
    python benchmarks/planner_llama3.py --quick    # fewer schedules

Meta's 405B layouts (tp8 pp16) need 126 layers split over 16 stages, which the planner's even
split cannot do (Meta gives the first and last stage one layer fewer); they are evaluated on a
128-layer proxy (+1.6 % parameters), labelled so.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from pipedsl.plan import Layout, cluster_preset, evaluate, model_preset, search
from pipedsl.plan.search import LayoutError

# (model, GPUs, global batch in sequences of 8192, Meta's published TFLOP/s per GPU and MFU, Meta's layout)
META = {8192: (430, 0.43, (64, 16, 8)), 16384: (400, 0.41, (128, 16, 8))}
SCHEDULES = ["1f1b", "interleaved", "zb-h1", "zb-v", "gpipe", "dualpipev"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1F1B, interleaved and ZB-V only")
    args = parser.parse_args()
    schedules = SCHEDULES[:2] + ["zb-v"] if args.quick else SCHEDULES
    h100 = cluster_preset("h100")
    rows = []
    began = time.perf_counter()
    for name, gpus in (("llama-8b", 512), ("llama-70b", 512), ("llama-405b", 8192), ("llama-405b", 16384)):
        model = model_preset(name)
        cluster = h100.with_gpus(gpus)
        t0 = time.perf_counter()
        result = search(model, cluster, top=1, schedules=schedules, tp=[1, 2, 4, 8])
        best = result.ranked[0] if result.ranked else None
        rows.append((name, gpus, best, time.perf_counter() - t0))
        if gpus in META:
            proxy = dataclasses.replace(model, layers=128, name=f"{name} (128-layer proxy)")
            found = search(proxy, cluster, top=1, schedules=schedules, tp=[8], pp=[4, 8, 16, 32]).ranked
            rows.append((proxy.name + ", best", gpus, found[0] if found else None, 0.0))
            dp, pp, tp = META[gpus][2]
            M = model.global_batch // dp
            # Meta's layout as pipedsl would run it, and with Megatron's SP memory (the GPT layout keeps only
            # sequence shards: Korthikanti's 34/t), which lets it run without recomputation
            megatron = dataclasses.replace(proxy, layout="gpt", name=f"{proxy.name} with Megatron's SP memory")
            for m in (proxy, megatron):
                for schedule, params in (("1f1b", ()), ("interleaved", (("V", 2),))):
                    layout = Layout(dp, pp, tp, schedule, 1, M, zero=1, recompute="none", params=params,
                                    sequence_parallel=True, attention="fused")
                    try:
                        rows.append((m.name, gpus, evaluate(m, cluster, layout), 0.0))
                    except LayoutError as err:
                        print(f"  {m.name}: {layout}: {err.message}")
            # the same compute and links with 141 GB (H200): what Meta's layout would reach if its memory fitted
            roomy = cluster_preset("h200").with_gpus(gpus)
            layout = Layout(dp, pp, tp, "interleaved", 1, M, zero=1, recompute="none", params=(("V", 2),),
                            sequence_parallel=True, attention="fused")
            rows.append((f"{megatron.name}, on 141 GB (H200)", gpus, evaluate(megatron, roomy, layout), 0.0))
    print("\n| model | GPUs | layout | iteration s | TFLOP/s/GPU | predicted MFU | Meta (Table 4) |")
    print("|---|---:|---|---:|---:|---:|---|")
    for name, gpus, e, _ in rows:
        meta = META.get(gpus) if "405b" in name else None
        published = f"{meta[0]} TFLOP/s, {meta[1]:.0%} (tp8 pp16 dp{meta[2][0]})" if meta else "—"
        if e is None:
            print(f"| {name} | {gpus} | nothing fits | | | | {published} |")
            continue
        print(f"| {name} | {gpus} | {e.layout} | {e.iteration:.2f} | {e.tflops:.0f} | {e.mfu:.1%} | {published} |")
    print(f"\n{time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
