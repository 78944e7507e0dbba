"""Memory per rank of ZeRO 0–3 and communication per rank of 1-D vs 3-D tensor parallelism, measured.

    python benchmarks/parallel_memory_comm.py [--json out/parallel_memory_comm.json]

Table 1 trains a small GPT (2 blocks) with fp32 Adam under ZeroOptimizer at dp = 2 and 4, M
microbatches per step, and reads `memory_report` right after REDUCE_GRAD of the second step
(optimizer state exists, gradients reduced): bytes of parameters, gradients and optimizer
state held by one rank, beside the ZeRO paper's formulas with p = g = 4 and K = 8 bytes per
parameter: ZeRO-0 (4+4+8)Ψ, ZeRO-1 (4+4+8/N)Ψ, ZeRO-2 (4+(4+8)/N)Ψ, ZeRO-3 (4+4+8)Ψ/N.
Measured values are on the *padded* flat buffers and include Adam's 4-byte step counter per
unit, so they sit a few bytes above the formula.  "peak grads" is the most gradient memory
held during the step's backward: with reduce="step" the full gradient lives until REDUCE_GRAD.
It also counts the data-parallel bytes each rank sends per step, beside k·(N−1)/N·4Ψ with
k = 2 for stages 0–2 (one all-reduce, or reduce-scatter + all-gather), M+1 for stage 2 with
reduce="microbatch", 2M+1 for stage 3 (every unit gathered for each microbatch's forward and
backward, one reduce-scatter) and 3M for stage 3 with reduce="microbatch".

Table 2 counts the bytes one rank sends in forward + backward at the collectives of one
layer, for 1-D (t = 8) and 3-D (q = 2, 8 ranks), b = tokens (batch × sequence):
    1-D, per all-reduce of [b, h]: 2(t−1)/t · b·h elements; a linear costs one (column-parallel:
        the input gradient backward; row-parallel: the output forward), an MLP or attention two,
        a block four.
    3-D, per linear in→out: 2(q−1)/q³ · (b·in + b·out + in·out) elements (all-gather X and W,
        reduce-scatter Y forward; all-gather dY, reduce-scatter dX and dW backward; the gathered
        X and W are kept from forward).  Blocks add LayerNorm statistics ([b/q², 1] all-reduces)
        and the q²-plane all-reduces of bias and LayerNorm gradients: listed as "other".
4 bytes per element.  The counts are the ring (bandwidth-optimal) volumes of the collectives
actually called, not bytes observed on gloo's sockets.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STEPS, M = 2, 4
HIDDEN, HEADS, LAYERS = 64, 8, 2


def zero_job(n: int) -> list[dict]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from pipedsl.models.gpt import model as gpt
    from pipedsl.parallel import ParallelConfig, ParallelMesh, ZeroOptimizer, count_comm, memory_report

    mesh = ParallelMesh(ParallelConfig(dp=n))
    g = torch.Generator().manual_seed(0)
    blocks = [gpt.Block(gpt.GPTConfig(n_embd=HIDDEN, n_head=HEADS)) for _ in range(LAYERS)]
    base = gpt.randomize_(nn.Sequential(*blocks), g)
    psi = sum(p.numel() for p in base.parameters())
    rows = []
    for stage, reduce in [(0, "step"), (1, "step"), (2, "step"), (2, "microbatch"), (3, "step"), (3, "microbatch")]:
        model = copy.deepcopy(base)
        # stage 3 gathers, and reduce="microbatch" reduces, per block child (ln1, attn, ln2, mlp of each block)
        units = [c for blk in model for c in blk.children()] if stage == 3 or reduce == "microbatch" else None
        zero = ZeroOptimizer(model, torch.optim.Adam, group=mesh.dp_group, stage=stage, reduce=reduce,
                             units=units, lr=1e-3)
        for _ in range(STEPS):
            zero.reset_peak()
            with count_comm() as c:
                for _ in range(M):
                    x = torch.randn(2, 8, HIDDEN, generator=g)
                    (model(x).pow(2).mean() / M).backward()
                zero.reduce_gradients()
                mem = memory_report(zero)
                zero.step()
            zero.zero_grad()
        rows.append({"dp": n, "stage": stage, "reduce": reduce, "psi": psi, "padded": mem.padded_numel,
                     "units": len(zero.units), "params": mem.params, "grads": mem.grads,
                     "optimizer": mem.optimizer, "peak_grads": mem.peak_grads, "comm": c.total,
                     "rank": dist.get_rank()})
    return rows


def comm_job(mode: str, hidden: int, batch: int, seq: int) -> dict:
    import torch
    from torch import nn

    from pipedsl.models.gpt import model as gpt
    from pipedsl.parallel import (
        Block3D,
        ColumnParallelLinear,
        Linear3D,
        ParallelBlock,
        ParallelConfig,
        ParallelMesh,
        ParallelMLP,
        RowParallelLinear,
        count_comm,
    )

    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, seq, hidden, generator=g)
    x4 = torch.randn(batch, seq, 4 * hidden, generator=g)
    up, down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
    mlp, block = gpt.MLP(gpt.GPTConfig(n_embd=hidden)), gpt.Block(gpt.GPTConfig(n_embd=hidden, n_head=HEADS))
    out: dict = {}

    def measure(name: str, layer: nn.Module, inp: torch.Tensor) -> None:
        inp = inp.clone().requires_grad_()
        with count_comm() as c:
            layer(inp).sum().backward()
        out[name] = {"total": c.total, "by_op": c.by_op(), "by_group": c.by_group()}

    if mode == "1d":
        mesh = ParallelMesh(ParallelConfig(tp=8))
        tp, r = mesh.tp_group, mesh.coords.tp
        measure("linear h->4h", ColumnParallelLinear.from_dense(up, tp), x)
        measure("linear 4h->h", RowParallelLinear.from_dense(down, tp), x4[..., r * hidden // 2:(r + 1) * hidden // 2])
        measure("mlp", ParallelMLP.from_dense(mlp, tp), x)
        measure("block", ParallelBlock.from_dense(block, tp), x)
    else:
        mesh = ParallelMesh(ParallelConfig(tp=8, tp_mode="3d"))
        cube = mesh.cube
        measure("linear h->4h", Linear3D.from_dense(up, cube), cube.split_input(x))
        measure("linear 4h->h", Linear3D.from_dense(down, cube.swapped()), cube.swapped().split_input(x4))
        measure("mlp", nn.Sequential(Linear3D.from_dense(mlp.fc, cube), nn.GELU(),
                                     Linear3D.from_dense(mlp.proj, cube.swapped())), cube.split_input(x))
        measure("block", Block3D.from_dense(block, cube), cube.split_input(x))
    return out


def formula_1d(layer: str, t: int, b: int, h: int) -> float:
    per = 2 * (t - 1) / t * b * h * 4
    return {"linear h->4h": per, "linear 4h->h": per, "mlp": 2 * per, "block": 4 * per}[layer]


def formula_3d(layer: str, q: int, b: int, h: int) -> float:
    def lin(i: int, o: int) -> float:
        return 2 * (q - 1) / q ** 3 * (b * i + b * o + i * o) * 4
    return {"linear h->4h": lin(h, 4 * h), "linear 4h->h": lin(4 * h, h), "mlp": lin(h, 4 * h) + lin(4 * h, h),
            "block": lin(h, 3 * h) + lin(h, h) + lin(h, 4 * h) + lin(4 * h, h)}[layer]


# data-parallel bytes per step in units of (N-1)/N·4Ψ: a reduce-scatter or an all-gather of all parameters is 1
DP_COMM = {(0, "step"): 2,  # one all-reduce
           (1, "step"): 2, (2, "step"): 2,  # reduce-scatter gradients + all-gather parameters after the step
           (2, "microbatch"): M + 1,  # a reduce-scatter per microbatch + the all-gather
           (3, "step"): 2 * M + 1,  # gather for forward and backward of each microbatch + one reduce-scatter
           (3, "microbatch"): 3 * M}  # gathers + a reduce-scatter per microbatch


def zero_formula(stage: int, n: int, psi: int) -> dict:
    p, g, k = 4 * psi, 4 * psi, 8 * psi
    return {0: dict(params=p, grads=g, optimizer=k), 1: dict(params=p, grads=g, optimizer=k / n),
            2: dict(params=p, grads=g / n, optimizer=k / n), 3: dict(params=p / n, grads=g / n, optimizer=k / n)}[stage]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=str(ROOT / "out" / "parallel_memory_comm.json"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from pipedsl.runtime.launch.pool import LocalPool

    result: dict = {"zero": [], "tp": []}
    with LocalPool(8, timeout=600) as pool:
        for n in (2, 4):
            per_rank = pool.run(zero_job, n, n)
            assert all(r[i]["params"] == per_rank[0][i]["params"] for r in per_rank for i in range(len(r)))
            result["zero"] += per_rank[0]
        for hidden, batch, seq in ((64, 8, 16), (256, 8, 16), (64, 8, 128), (256, 8, 128)):
            one = pool.run(comm_job, 8, "1d", hidden, batch, seq)[0]
            three = pool.run(comm_job, 8, "3d", hidden, batch, seq)[0]
            b = batch * seq
            for layer in one:
                result["tp"].append({
                    "layer": layer, "hidden": hidden, "tokens": b,
                    "1d_measured": one[layer]["total"], "1d_formula": formula_1d(layer, 8, b, hidden),
                    "3d_measured": three[layer]["total"], "3d_formula": formula_3d(layer, 2, b, hidden),
                    "3d_by_op": three[layer]["by_op"], "3d_by_group": three[layer]["by_group"]})

    print(f"Table 1: bytes per rank held at REDUCE_GRAD (GPT, {LAYERS} blocks, h={HIDDEN}; fp32 Adam; M={M})")
    head = (f"{'dp':>3} {'ZeRO':>4} {'reduce':>10} | {'params':>9} {'formula':>9} | {'grads':>9} {'formula':>9} | "
            f"{'optim':>9} {'formula':>9} | {'peak grads':>10} | {'dp comm/step':>12} {'formula':>12}")
    print(head)
    print("-" * len(head))
    for row in result["zero"]:
        n, st, psi = row["dp"], row["stage"], row["psi"]
        f = zero_formula(st, n, psi)
        comm_f = DP_COMM[(st, row["reduce"])] * (n - 1) / n * 4 * psi
        row["formula"] = f
        row["comm_formula"] = comm_f
        print(f"{n:>3} {st:>4} {row['reduce']:>10} | {row['params']:>9} {f['params']:>9.0f} | {row['grads']:>9} "
              f"{f['grads']:>9.0f} | {row['optimizer']:>9} {f['optimizer']:>9.0f} | {row['peak_grads']:>10} | "
              f"{row['comm']:>12} {comm_f:>12.0f}")
    psi = result["zero"][0]["psi"]
    print(f"Ψ = {psi} parameters; measured values use the flat buffers padded to a multiple of dp "
          f"and include Adam's 4-byte step counter per unit.")
    print()
    print("Table 2: bytes sent per rank per step (forward + backward) at the collectives, 8 ranks")
    head = (f"{'layer':>13} {'h':>4} {'b':>4} | {'1-D t=8':>9} {'formula':>9} | {'3-D q=2':>9} {'formula':>9} "
            f"{'other':>7} | {'3-D/1-D':>7}")
    print(head)
    print("-" * len(head))
    for row in result["tp"]:
        other = row["3d_measured"] - row["3d_formula"]
        row["3d_other"] = other
        print(f"{row['layer']:>13} {row['hidden']:>4} {row['tokens']:>4} | {row['1d_measured']:>9} "
              f"{row['1d_formula']:>9.0f} | {row['3d_measured']:>9} {row['3d_formula']:>9.0f} {other:>7.0f} | "
              f"{row['3d_measured'] / row['1d_measured']:>7.2f}")
    print("1-D formula: 2(t-1)/t·b·h·4 bytes per all-reduce (1 per linear, 2 per MLP, 4 per block); "
          "3-D formula: 2(q-1)/q³·(b·in + b·out + in·out)·4 per linear; 'other' = LayerNorm statistics and "
          "q²-plane gradient all-reduces of biases and LayerNorm weights.")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
