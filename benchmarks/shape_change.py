"""What a change of input shape costs a training step: a never-seen shape and a shape seen before, over a steady step.

The small GPT under 1F1B (M=8 by default) at P=2 and P=4, gloo, one thread per rank.  After a
warmup at the base sequence length T and at a second length T-1, each round times (barrier
before and after each step, rank 0's clock):

- *steady*: a step at T after a step at T;
- *seen*: a step at T-1 (known: its executor is cached) after one at T;
- *new*: a step at a length never seen before (T-2, T-3, ...).

Reported per P: the median steady step and the median per-round extra of a seen and of a new
shape over that round's steady step (paired, so the machine's drifting load reaches all three).

A/B against another commit in one run: `--against REF` checks REF out in a temporary git
worktree and runs the same measurement on both trees, alternating them round by round (each
tree's measurement runs in fresh processes that import pipedsl from that tree; this script
is the same for both).  `--tree PATH` (repeatable) measures other checkouts instead of this one.

    python benchmarks/shape_change.py                      # this checkout, P=2 and P=4
    python benchmarks/shape_change.py --against HEAD~3     # before/after, one run
    python benchmarks/shape_change.py --quick --no-append  # structure only, ~30 s
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _bench  # noqa: E402


def _rank_main(rank: int, P: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    import pipedsl
    from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch

    gcfg = GPTConfig(n_layer=cfg["layers"], n_embd=cfg["embd"], block_size=cfg["seq"])
    torch.manual_seed(0)
    pipe = pipedsl.Pipeline(GPT(gcfg).stages(P), "1f1b", microbatches=cfg["M"], loss_fn=gpt_loss)
    T = gcfg.block_size
    x, y = synthetic_batch(cfg["M"] * cfg["rows"], T, gcfg.vocab_size, torch.Generator().manual_seed(1))

    def step(L: int) -> float:
        xs, ys = x[:, :L].contiguous(), y[:, :L].contiguous()
        dist.barrier(group=pipe.group)
        t0 = time.perf_counter()
        pipe.step(xs, ys)
        dist.barrier(group=pipe.group)
        dt = time.perf_counter() - t0
        for p in pipe.parameters():
            p.grad = None
        return dt

    for L in [T] * cfg["warmup"] + [T - 1, T]:
        step(L)
    out: dict[str, list[float]] = {"steady": [], "seen": [], "new": []}
    for k in range(cfg["rounds"]):
        step(T)  # back from the last round's new shape
        out["steady"].append(step(T))
        out["seen"].append(step(T - 1))
        out["new"].append(step(T - 2 - k))
    out["learned"] = pipe.shape_handshakes
    pipe.close()
    return out


def measure(P: int, cfg: dict) -> dict:
    """One measurement at P in this process's tree: the raw times and the paired medians."""
    import pipedsl

    res = pipedsl.launch(_rank_main, P, P, cfg, threads=1, timeout=300)[0]
    steady = res["steady"]
    return {"P": P, "steady_s": _bench.median(steady),
            "seen_extra_s": _bench.median([a - b for a, b in zip(res["seen"], steady)]),
            "new_extra_s": _bench.median([a - b for a, b in zip(res["new"], steady)]), "raw": res}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--P", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--M", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=32)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--rows", type=int, default=2, help="sequences per microbatch")
    ap.add_argument("--rounds", type=int, default=8, help="never-seen shapes per measurement")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2, help="measurements per tree and P (alternating trees)")
    ap.add_argument("--tree", action="append", help="a checkout to measure (repeatable; default: this one)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, P=2 only, one measurement (structure only)")
    _bench.ab_arguments(ap, "shape_change")
    args = ap.parse_args(argv)
    child = _bench.child_result(args, measure)
    if child is not None:
        return child
    if args.quick:
        args.P, args.layers, args.embd, args.seq, args.rounds, args.reps, args.warmup = [2], 2, 16, 16, 2, 1, 1
    cfg = {k: getattr(args, k) for k in ("M", "layers", "embd", "seq", "rows", "rounds", "warmup")}
    with _bench.trees(args.against, args.tree) as trees:
        runs = _bench.alternate(__file__, trees, args.P, args.reps, cfg)
    rows = []
    for (name, P), rs in runs.items():
        steady = [t for r in rs for t in r["raw"]["steady"]]
        pairs = {k: [a - b for r in rs for a, b in zip(r["raw"][k], r["raw"]["steady"])] for k in ("seen", "new")}
        rows.append({"tree": name, "P": P, "steady_ms": 1e3 * _bench.median(steady),
                     "seen_extra_ms": 1e3 * _bench.median(pairs["seen"]),
                     "new_extra_ms": 1e3 * _bench.median(pairs["new"]), "learned": rs[0]["raw"]["learned"]})
    rows.sort(key=lambda r: (r["P"], r["tree"] != args.against))
    print(f"1F1B M={args.M}, GPT {args.layers} layers C={args.embd} T={args.seq}, {args.rows} rows/microbatch; "
          f"medians over {args.reps} x {args.rounds} rounds")
    print(f"{'tree':<14} {'P':>2} {'steady ms':>10} {'seen +ms':>9} {'new +ms':>9} {'new/steady':>10}")
    for r in rows:
        print(f"{r['tree'][:14]:<14} {r['P']:>2} {r['steady_ms']:10.1f} {r['seen_extra_ms']:9.1f} "
              f"{r['new_extra_ms']:9.1f} {r['new_extra_ms'] / r['steady_ms']:10.2f}")
    command = "python benchmarks/shape_change.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"benchmark": "shape_change", "command": command.strip(), "machine": _bench.machine(),
              "date": _bench.today(), "config": cfg, "trees": trees, "rows": rows}
    _bench.write_json("shape_change", result, args.json)
    if not args.no_append:
        summary = "; ".join(f"{r['tree']} P={r['P']}: steady {r['steady_ms']:.1f} ms, seen {r['seen_extra_ms']:+.1f}, "
                            f"new {r['new_extra_ms']:+.1f}" for r in rows)
        _bench.append_results(_bench.results_row(result["command"], f"1F1B M={args.M}, extra ms of a step at a "
                                                 f"seen-before / never-seen input shape over a steady step: {summary}"))
    return result


if __name__ == "__main__":
    main()
