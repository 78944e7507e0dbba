"""Activation recomputation, per-token loss and shape changes on the small GPT: bytes and step time.

One group of P local processes (gloo, one thread per rank) builds the same GPT stages once per
variant — no recomputation (the baseline), `recompute="full"`, `recompute="selective"` (the
attention modules), `loss_reduction="token"` — each a `Pipeline` with `pipe.optimizer(AdamW)`,
all on the same batch whose targets have a padded tail (--pad-fraction, ignore_index -100).
After a warmup, repetitions run every variant in turn (the order rotates each repetition); each
times `--steps` training steps between two barriers.  Reported per variant: median step time
and its ratio to the baseline (ratio of medians and median of per-repetition ratios, same
run), and per rank the peak saved-activation bytes (`pipe.counter.peak_bytes`) next to the
prediction: the simulator's peak count of live activations × the bytes one activation of the
rank's stage keeps, plus what one recomputation brings back during its backward.

Shape changes: a baseline pipeline alternates steps at the known sequence length with steps at
lengths it has never seen (each learned by a discovery step, runtime/discovery.py); reported: the
median extra time of a new-shape step over a known-shape step, and the per-step shape agreement (one all-reduce).

    python benchmarks/recompute.py                 # P=2, 1F1B, M=4
    python benchmarks/recompute.py --schedule zb-h1 --reps 9
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench  # noqa: E402

VARIANTS = {"baseline": {}, "full": {"recompute": "full"}, "selective": {"recompute": "selective"},
            "token": {"loss_reduction": "token"}}


def _rank_main(rank: int, schedule: str, P: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F  # noqa: N812

    import pipedsl
    from pipedsl.models.gpt.model import GPT, CausalSelfAttention, GPTConfig, gpt_loss, synthetic_batch
    from pipedsl.runtime.recompute import Recompute
    from pipedsl.runtime.stage import ActivationCounter, Stage

    def token_sum(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")

    def attention(m) -> bool:
        return isinstance(m, CausalSelfAttention)

    gcfg = GPTConfig(n_layer=cfg["layers"], n_embd=cfg["embd"], block_size=cfg["seq"])
    torch.manual_seed(0)
    model = GPT(gcfg)
    gen = torch.Generator().manual_seed(1)
    n, T = cfg["M"] * cfg["rows"], gcfg.block_size
    x, y = synthetic_batch(n, T, gcfg.vocab_size, gen)
    tail = torch.randint(0, int(2 * cfg["pad"] * T) + 1, (n, 1), generator=gen).clamp(max=T)
    y = y.masked_fill(torch.arange(T) >= T - tail, -100)
    prog = pipedsl.load(schedule).compile(P=P, M=cfg["M"], **cfg["params"])
    S = prog.num_stages
    runs = {}
    for name, opts in VARIANTS.items():
        loss = token_sum if opts.get("loss_reduction") == "token" else gpt_loss
        pipe = pipedsl.Pipeline(copy.deepcopy(model).stages(S), program=prog, loss_fn=loss,
                                recompute_filter=attention, activation_bytes=True, **opts)
        opt = pipe.optimizer(torch.optim.AdamW, lr=1e-4)

        def step(xs=x, ys=y, pipe=pipe, opt=opt) -> None:
            pipe.step(xs, ys)
            opt.step()
            opt.zero_grad()
        runs[name] = (pipe, step)

    def timed(name: str, steps: int) -> float:
        step = runs[name][1]
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        dist.barrier()
        return (time.perf_counter() - t0) / steps

    names = list(VARIANTS)
    for name in names:
        timed(name, max(1, cfg["warmup"]))  # the first step learns shapes: never timed
    times: dict[str, list[float]] = {k: [] for k in names}
    for rep in range(cfg["reps"]):
        for k in range(len(names)):
            name = names[(k + rep) % len(names)]
            times[name].append(timed(name, cfg["steps"]))

    # saved-activation bytes: measured peaks and the simulator-based prediction (one stage per rank here)
    held = sorted({s for (_, s), r in prog.placement.items() if r == rank})
    peak_count = pipedsl.simulate(prog).peak_activations[rank]
    mb_x, mb_y = x[:cfg["rows"]], y[:cfg["rows"]]
    bytes_rows = {}
    for name in ("baseline", "full", "selective"):
        mode = VARIANTS[name].get("recompute")
        per_stage = {}
        for s in held:
            inp = copy.deepcopy(torch.nn.Sequential(*model.stages(S)[:s]))(mb_x).detach() if s else mb_x

            def kept(policy, s=s, inp=inp) -> int:
                module = copy.deepcopy(model.stages(S)[s])
                st = Stage(module, s, S, gpt_loss, cfg["M"], ActivationCounter(),
                           None if policy is None else Recompute(module, policy, attention))
                return st.forward([inp], mb_y)[0].token.nbytes
            per_stage[s] = (kept(None), kept(mode))
        full, mine = (sum(v[i] for v in per_stage.values()) for i in (0, 1))
        predicted = peak_count * mine + (full - mine) if len(held) == 1 else None
        bytes_rows[name] = {"measured": runs[name][0].counter.peak_bytes, "predicted": predicted,
                            "per_activation": mine, "peak_activations": peak_count}

    # shape changes: known length vs never-seen lengths (each new one is a discovery step)
    pipe, step = runs["baseline"]
    known, new = _bench.shape_change_times(step, x, y,
                                           [T - 4 * (k + 1) for k in range(cfg["new_shapes"])])
    key = torch.zeros(2, dtype=torch.int64)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(50):
        dist.all_reduce(key, op=dist.ReduceOp.MAX, group=pipe.group)
    agree = (time.perf_counter() - t0) / 50
    return {"times": times, "bytes": bytes_rows, "known": known, "new": new, "agree_s": agree,
            "learned": pipe.shape_handshakes}


def main(argv: list[str] | None = None) -> dict:
    import pipedsl

    ap = _bench.small_gpt_parser(__doc__.splitlines()[0], "recompute")
    ap.add_argument("--pad-fraction", type=float, default=0.25)
    ap.add_argument("--new-shapes", type=int, default=6, help="never-seen sequence lengths to time (default 6)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repetition")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.embd, args.seq, args.reps, args.steps, args.new_shapes = 2, 32, 32, 1, 1, 2
    cfg = {**_bench.small_gpt_config(args), "pad": args.pad_fraction, "new_shapes": args.new_shapes}
    outs = pipedsl.launch(_rank_main, args.P, args.schedule, args.P, cfg, threads=1, timeout=300)
    t = outs[0]["times"]
    med = {k: _bench.median(v) for k, v in t.items()}
    rows = []
    for name in VARIANTS:
        paired = [a / b for a, b in zip(t[name], t["baseline"])]
        rows.append({"variant": name, "step_s": _bench.spread(t[name]), "vs_baseline": med[name] / med["baseline"],
                     "vs_baseline_paired_median": _bench.median(paired), "raw": t[name]})
    memory = []
    for r, out in enumerate(outs):
        b = out["bytes"]
        memory.append({"rank": r, **{k: v for k, v in b.items()},
                       "full_vs_baseline": b["full"]["measured"] / b["baseline"]["measured"],
                       "selective_vs_baseline": b["selective"]["measured"] / b["baseline"]["measured"]})
    known = _bench.median(outs[0]["known"])
    extra = [a - b for a, b in zip(outs[0]["new"], outs[0]["known"])]
    shapes = {"known_step_s": known, "new_shape_extra_s": _bench.median(extra), "raw_new": outs[0]["new"],
              "raw_known": outs[0]["known"], "agree_s": max(o["agree_s"] for o in outs),
              "learned": outs[0]["learned"]}
    command = "python benchmarks/recompute.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"benchmark": "recompute", "command": command.strip(), "machine": _bench.machine(),
              "date": _bench.today(), "schedule": args.schedule, "P": args.P, "config": cfg, "rows": rows,
              "memory": memory, "shapes": shapes}
    print(f"{'variant':<10} {'step ms':>8} {'vs base':>8} {'paired':>8}")
    for r in rows:
        print(f"{r['variant']:<10} {r['step_s']['median'] * 1e3:8.2f} {r['vs_baseline']:8.3f} "
              f"{r['vs_baseline_paired_median']:8.3f}")
    print(f"{'rank':<5} {'variant':<10} {'peak bytes':>11} {'predicted':>11} {'vs base':>8}")
    for m in memory:
        for name in ("baseline", "full", "selective"):
            print(f"{m['rank']:<5} {name:<10} {m[name]['measured']:11d} {str(m[name]['predicted']):>11} "
                  f"{m[name]['measured'] / m['baseline']['measured']:8.3f}")
    print(f"shape re-learn: {shapes['new_shape_extra_s'] * 1e3:.1f} ms extra per new shape (a known-shape step "
          f"{known * 1e3:.1f} ms); per-step shape agreement {shapes['agree_s'] * 1e6:.0f} us")
    _bench.write_json("recompute", result, args.json)
    summary = ", ".join(f"{r['variant']} {r['vs_baseline_paired_median']:.2f}x" for r in rows[1:])
    ratios = "; ".join(f"rank {m['rank']} full {m['full_vs_baseline']:.3f} selective {m['selective_vs_baseline']:.3f}"
                       for m in memory)
    _bench.append_results(_bench.results_row(
        result["command"], f"{args.schedule} P={args.P} M={args.M}, step time vs no recompute (paired median): "
                           f"{summary}; saved-activation bytes vs none: {ratios}; new shape +"
                           f"{shapes['new_shape_extra_s'] * 1e3:.1f} ms vs a {known * 1e3:.1f} ms step"))
    return result


if __name__ == "__main__":
    main()
