"""The runtime's CPU per stage op beyond the stage's own compute: pipedsl against torch.distributed.pipelining.

Stages so small (`Linear(8, 8)`) that a step's CPU is almost all runtime: sends, receives, waits,
bookkeeping.  Both runtimes run 1F1B over copies of the same stages in one group of processes,
alternating repetitions; each rank times its *process* CPU (`time.process_time`, every thread:
gloo's included), not wall time, so waiting for a message or for a core shared with another rank
costs nothing, and subtracts the CPU its stage's forwards and backwards take when run alone.  What
is left, over the rank's 2M compute ops, is the runtime's cost per op; the figure is the median over
short repetitions of pipedsl's cost over torch's in the same repetition.  Used by bench_quick.py
and gpu_check.py (run `measure` on every rank, then `summarize` the ranks' results), and on its own:

    python benchmarks/op_cpu.py                       # P = 2, 4, 8
    python benchmarks/op_cpu.py --against 9a2d8da     # and that commit's runtime, alternating, one run
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench  # noqa: E402

WIDTH = 8  # Linear(WIDTH, WIDTH) stages
ROWS = 2  # rows per microbatch


def measure(rank: int, P: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """On one rank: CPU seconds per step of each runtime (one value per repetition) and of the stage alone."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F  # noqa: N812

    import pipedsl

    M, device = cfg["M"], torch.device(cfg.get("device", "cpu"))
    torch.manual_seed(0)
    modules = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(P)]
    alone = copy.deepcopy(modules[rank]).to(device)
    torch_modules = copy.deepcopy(modules)
    sched = _bench.build_torch_schedule("1f1b", torch_modules, P, rank, M, F.mse_loss, device)
    pipe = pipedsl.Pipeline(modules, "1f1b", microbatches=M, loss_fn=F.mse_loss, device=device)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(M * ROWS, WIDTH, generator=g), torch.randn(M * ROWS, WIDTH, generator=g)
    tx, ty = x.to(device), y.to(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def run_pipedsl() -> None:
        pipe.step(x, y)
        for p in pipe.parameters():
            p.grad = None

    def run_torch() -> None:
        sched.step(tx, target=ty, return_outputs=False)
        torch_modules[rank].zero_grad(set_to_none=True)

    def run_alone() -> None:  # the stage's own compute for one step: M forwards and backwards
        for xm, ym in zip(tx.chunk(M), ty.chunk(M)):
            inp = xm if rank == 0 else xm.detach().requires_grad_()
            out = alone(inp)
            if rank == P - 1:
                (F.mse_loss(out, ym) / M).backward()
            else:
                out.backward(torch.ones_like(out))
        alone.zero_grad(set_to_none=True)

    def cpu(run: Any, steps: int, collective: bool = True) -> float:
        if collective:
            dist.barrier()
        sync()
        t0 = time.process_time()
        for _ in range(steps):
            run()
        sync()
        took = (time.process_time() - t0) / max(steps, 1)
        if collective:
            dist.barrier()
        return took

    runners = {"pipedsl": run_pipedsl, "torch": run_torch}
    for run in runners.values():
        cpu(run, cfg["warmup"])
    cpu(run_alone, cfg["warmup"], collective=False)
    # short repetitions, each timing both runtimes and the stage alone back to back: load on a shared
    # machine moves CPU per op by 2-3x within seconds, and what reaches one side of a pair reaches both
    got: dict[str, list[float]] = {"pipedsl": [], "torch": [], "own": []}
    for rep in range(cfg["reps"]):
        for which in (("pipedsl", "torch") if rep % 2 == 0 else ("torch", "pipedsl")):
            got[which].append(cpu(runners[which], cfg["steps"]))
        got["own"].append(cpu(run_alone, cfg["steps"], collective=False))
    return {"cpu_per_step": got, "ops": 2 * M}


def summarize(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """pipedsl's CPU per op beyond compute over torch's (median of the repetitions' ratios, all ranks summed),
    and each runtime's CPU per op beyond compute in seconds (medians)."""
    ops = sum(o["ops"] for o in outs)

    def beyond(which: str, rep: int) -> float:  # all ranks' CPU beyond compute in repetition `rep`
        return sum(o["cpu_per_step"][which][rep] - o["cpu_per_step"]["own"][rep] for o in outs)

    reps = range(len(outs[0]["cpu_per_step"]["own"]))
    per_op = {k: _bench.median([beyond(k, i) / ops for i in reps]) for k in ("pipedsl", "torch")}
    return {"ratio": _bench.median([beyond("pipedsl", i) / beyond("torch", i) for i in reps]),
            "beyond_compute_s_per_op": per_op,
            "own_compute_s_per_op": _bench.median([sum(o["cpu_per_step"]["own"][i] for o in outs) / ops
                                                   for i in reps]),
            "per_rank": outs}


def run(P: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One measurement at P in this process's tree."""
    import pipedsl

    out = summarize(pipedsl.launch(measure, P, P, cfg, threads=1, timeout=600))
    out.pop("per_rank")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--P", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--M", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20, help="repetitions per measurement (each times both runtimes)")
    ap.add_argument("--rounds", type=int, default=2, help="measurements per tree and P (alternating trees)")
    ap.add_argument("--quick", action="store_true", help="P=2, few repetitions (structure only)")
    _bench.ab_arguments(ap, "op_cpu")
    args = ap.parse_args(argv)
    child = _bench.child_result(args, run)
    if child is not None:
        return child
    if args.quick:
        args.P, args.reps, args.rounds = [2], 2, 1
    cfg = {"M": args.M, "steps": 1, "reps": args.reps, "warmup": 2}
    with _bench.trees(args.against) as trees:
        got = _bench.alternate(__file__, trees, args.P, args.rounds, cfg)
    rows = []
    for (name, P), rs in sorted(got.items(), key=lambda kv: (kv[0][1], kv[0][0] != args.against)):
        rows.append({"tree": name, "P": P, "ratio": _bench.median([r["ratio"] for r in rs]),
                     **{f"{k}_ms_per_op": 1e3 * _bench.median([r["beyond_compute_s_per_op"][k] for r in rs])
                        for k in ("pipedsl", "torch")},
                     "own_ms_per_op": 1e3 * _bench.median([r["own_compute_s_per_op"] for r in rs])})
    print(f"CPU per op beyond the stage's compute, 1F1B M={args.M}, Linear({WIDTH}, {WIDTH}) stages")
    print(f"{'tree':<14} {'P':>2} {'pipedsl ms':>10} {'torch ms':>9} {'ratio':>6} {'own ms':>7}")
    for r in rows:
        print(f"{r['tree'][:14]:<14} {r['P']:>2} {r['pipedsl_ms_per_op']:10.3f} {r['torch_ms_per_op']:9.3f} "
              f"{r['ratio']:6.3f} {r['own_ms_per_op']:7.3f}")
    command = ("python benchmarks/op_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    result = {"benchmark": "op_cpu", "command": command, "machine": _bench.machine(), "date": _bench.today(),
              "config": cfg, "trees": trees, "rows": rows}
    _bench.write_json("op_cpu", result, args.json)
    if not args.no_append:
        cells = "; ".join(f"{r['tree']} P={r['P']}: {r['pipedsl_ms_per_op']:.3f} vs torch {r['torch_ms_per_op']:.3f} "
                          f"ms ({r['ratio']:.2f}x)" for r in rows)
        _bench.append_results(_bench.results_row(command, f"CPU per op beyond compute, pipedsl vs torch: {cells}"))
    return result


if __name__ == "__main__":
    main()
