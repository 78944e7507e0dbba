"""MoE with expert parallelism under injected all-to-all latency: what an overlapped F&B pair hides.

The built-in GPT with 4 experts a block, top-2, capacity factor `--capacity` (fixed-size
exchanges; 0: dropless), dp2 × pp2 with the experts over ep=2 (4 local processes), 8 blocks in
all.  Compute is emulated as in the other runtime benchmarks (a 2-core machine standing for
accelerators): every block sleeps around its real, small ops — attention `--attn` ms forward and
twice that backward, the experts `--experts-ms` ms forward and twice that backward — and every
expert all-to-all (`parallel.comm.all_to_all_rows`: 2 a forward per layer with a capacity, 3
dropless, 2 a backward) takes `--latency` ms from its issue (`comm.exchange_latency`, a fixed
network delay).  Rows, side by side in one run:

    1f1b, interleaved (V=2), zb-v, and dualpipev without and with overlap (`Pipeline(overlap=)`)

with the step time (median of `--steps` timed steps after warm-up), the bubble of a traced
step, the median F&B pair, and the simulator's makespan for the traced step:
- "self": with costs fitted to that trace (`Cost.fit`): what the model explains given its own
  per-op times;
- for dualpipev with overlap, "predicted": the costs fitted to the *sequential* dualpipev trace,
  with the pair's own FB dropped and the exchanges' share of F and B set from the injected
  latency (exchange_f, exchange_b = blocks · exchanges · latency): the simulator's FB model
  predicting a run it was not fitted to.

The checks the closing note reports: the overlapped pair at most 0.7× the sequential one, the
predicted makespan within 10 % of the measured one, gradients bit-identical (tests/models/
test_gpt_moe.py holds that).

    python benchmarks/moe_overlap.py            # 7 timed steps
    python benchmarks/moe_overlap.py --quick    # 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench  # noqa: E402

ROWS = (("1f1b", {}, True), ("interleaved", {"V": 2}, True), ("zb-v", {}, True), ("dualpipev", {}, False),
        ("dualpipev", {}, True))
BLOCKS = 8


def layer_exchanges(capacity: float) -> tuple[int, int]:
    """All-to-alls of one MoE layer in a forward and in a backward: dropless, counts, dispatch and combine; with a
    capacity the blocks are of fixed size, so no counts (parallel/expert.py)."""
    return (2 if capacity else 3), 2


def _rank_main(rank: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    import torch

    import pipedsl
    from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, randomize_, synthetic_batch
    from pipedsl.models.gpt.moe import Experts
    from pipedsl.models.gpt.parallelize import parallelize_gpt
    from pipedsl.parallel import ParallelConfig, ParallelMesh, comm
    from pipedsl.runtime.overlap import PairOverlap

    class _Slow(torch.nn.Module):
        """`inner`, then a sleep of `fwd` (forward) and `bwd` (its backward) seconds: emulated compute."""

        def __init__(self, inner: torch.nn.Module, fwd: float, bwd: float) -> None:
            super().__init__()
            self.inner, self.fwd, self.bwd = inner, fwd, bwd

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _bench._Sleep.apply(self.inner(x), self.fwd, self.bwd)

    class SlowExperts(Experts):
        """The GPT's experts with emulated compute after them (on the rank that holds them)."""

        def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
            out = super().forward(hidden_states, top_k_index, top_k_weights)
            return _bench._Sleep.apply(out, cfg["experts_ms"] / 1e3, 2 * cfg["experts_ms"] / 1e3)

    torch.set_num_threads(1)
    mesh = ParallelMesh(ParallelConfig(dp=2, pp=2, ep=2))
    gcfg = GPTConfig(vocab_size=64, block_size=16, n_layer=BLOCKS, n_head=2, n_embd=32, n_experts=4, top_k=2,
                     expert_ffn=64, capacity_factor=cfg["capacity"] or None)
    rows = []
    with comm.exchange_latency(cfg["latency"] / 1e3):
        for name, params, overlap in ROWS:
            program = pipedsl.load(name).compile(P=2, M=cfg["M"], **params)
            model = randomize_(GPT(gcfg), torch.Generator().manual_seed(0))
            for block in model.blocks:
                block.attn = _Slow(block.attn, cfg["attn_ms"] / 1e3, 2 * cfg["attn_ms"] / 1e3)
                block.mlp.experts.__class__ = SlowExperts
            pipe = pipedsl.Pipeline(parallelize_gpt(model, program.num_stages, mesh, by="blocks"), program=program,
                                    loss_fn=gpt_loss, parallel=mesh, overlap=overlap)
            gen = torch.Generator().manual_seed(1)
            batches = [synthetic_batch(2 * cfg["M"] * 2, 16, 64, gen) for _ in range(4)]
            for k in range(cfg["warmup"]):
                pipe.step(*batches[k % 4])
            handovers = PairOverlap.handovers
            times = []
            for k in range(cfg["steps"]):
                torch.distributed.barrier()
                t0 = time.perf_counter()
                pipe.step(*batches[k % 4])
                times.append(time.perf_counter() - t0)
                for p in pipe.parameters():
                    p.grad = None
            timeline = pipe.timeline()
            rows.append({"schedule": name, "params": params, "overlap": overlap, "S": program.num_stages,
                         "step_s": statistics.median(times), "handovers": PairOverlap.handovers - handovers,
                         "timeline": timeline.to_json() if timeline is not None else None})
            pipe.close()
    return rows


def _row_summary(row: dict[str, Any], cfg: dict[str, Any], sequential_fit: Any) -> dict[str, Any]:
    import pipedsl
    from pipedsl.ir import Op

    timeline = pipedsl.Timeline.from_json(row["timeline"])
    program = pipedsl.load(row["schedule"]).compile(P=2, M=cfg["M"], **row["params"])
    pairs = [e.end - e.start for rank in timeline.ranks for e in rank if e.instr.op is Op.OVERLAP]
    fit = pipedsl.Cost.fit(timeline)
    out = {"schedule": row["schedule"] + (" (overlap)" if row["overlap"] and pairs else ""),
           "step_ms": row["step_s"] * 1e3, "makespan_ms": timeline.makespan * 1e3, "bubble": timeline.bubble_ratio,
           "pair_ms": statistics.median(pairs) * 1e3 if pairs else None, "handovers": row["handovers"],
           "self_ms": pipedsl.simulate(program, fit).makespan * 1e3, "predicted_ms": None}
    if row["overlap"] and pairs and sequential_fit is not None:
        blocks = BLOCKS // row["S"]
        lat = cfg["latency"] / 1e3
        cost = pipedsl.Cost(**{**{k: getattr(sequential_fit, k) for k in ("F", "B", "I", "W", "comm", "reduce",
                                                                         "step", "send")},
                               "per_stage": sequential_fit.per_stage, "FB": None,
                               "exchange_f": blocks * layer_exchanges(cfg["capacity"])[0] * lat,
                               "exchange_b": blocks * layer_exchanges(cfg["capacity"])[1] * lat})
        out["predicted_ms"] = pipedsl.simulate(program, cost).makespan * 1e3
    return out


def table(result: dict[str, Any]) -> str:
    lines = ["| schedule | step ms | traced makespan ms | bubble | F&B pair ms | simulated (self-fit) ms | "
             "predicted ms |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        pair = f"{r['pair_ms']:.1f}" if r["pair_ms"] is not None else ""
        pred = f"{r['predicted_ms']:.1f}" if r["predicted_ms"] is not None else ""
        lines.append(f"| {r['schedule']} | {r['step_ms']:.1f} | {r['makespan_ms']:.1f} | {r['bubble']:.3f} | {pair} | "
                     f"{r['self_ms']:.1f} | {pred} |")
    c = result["checks"]
    lines += ["", f"overlapped pair / sequential pair: {c['pair_ratio']:.3f}; predicted / measured makespan "
                  f"(dualpipev, overlap): {c['predicted_over_measured']:.3f}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import pipedsl

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 timed steps")
    ap.add_argument("--M", type=int, default=8, help="microbatches (default 8)")
    ap.add_argument("--latency", type=float, default=3.0, help="ms every all-to-all takes (default 3)")
    ap.add_argument("--attn", type=float, default=3.0, help="attention's emulated forward ms a block (default 3)")
    ap.add_argument("--experts-ms", type=float, default=3.0, help="experts' emulated forward ms a block (default 3)")
    ap.add_argument("--capacity", type=float, default=1.5,
                    help="the router's capacity factor (default 1.5: fixed-size exchanges); 0: dropless")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--json", help="output file (default benchmarks/results/moe_overlap.json)")
    ap.add_argument("--no-append", action="store_true", help="do not append a row to RESULTS.md")
    args = ap.parse_args(argv)
    cfg = {"M": args.M, "latency": args.latency, "attn_ms": args.attn, "experts_ms": args.experts_ms,
           "capacity": args.capacity,
           "steps": 2 if args.quick else args.steps, "warmup": 1 if args.quick else 2}
    ranks = pipedsl.launch(_rank_main, 4, cfg, threads=1, timeout=1200)
    rows = ranks[0]
    seq = next(r for r in rows if r["schedule"] == "dualpipev" and not r["overlap"])
    seq_fit = pipedsl.Cost.fit(pipedsl.Timeline.from_json(seq["timeline"]))
    summary = [_row_summary(r, cfg, seq_fit) for r in rows]
    over = next(s for s in summary if s["predicted_ms"] is not None)
    seq_row = next(s for s in summary if s["schedule"] == "dualpipev")
    checks = {"pair_ratio": over["pair_ms"] / seq_row["pair_ms"],
              "predicted_over_measured": over["predicted_ms"] / over["makespan_ms"]}
    _bench.publish("moe_overlap", argv, cfg, summary, checks, table,
                   f"pair ratio {checks['pair_ratio']:.3f}, predicted/measured {checks['predicted_over_measured']:.3f}",
                   args.json, args.no_append)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
