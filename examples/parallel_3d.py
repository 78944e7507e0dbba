"""Train the small GPT with data × pipeline × tensor parallelism: dp=2 × pp=2 × tp=2 on 8 processes.

    python examples/parallel_3d.py                                   # 1F1B, 1-D tensor parallelism, ZeRO-1
    python examples/parallel_3d.py --schedule hanayo -p W=1 --zero 2
    python examples/parallel_3d.py --dp 1 --pp 1 --tp 8 --tp-mode 3d # 3-D tensor parallelism on a 2x2x2 cube
    python examples/parallel_3d.py --check                           # rank 0 also trains one dense process
    torchrun --nproc-per-node 8 examples/parallel_3d.py              # the same script under torchrun

Every rank builds the same dense GPT from the same seed and keeps its tensor-parallel slices of
its pipeline stages (`GPT.tp_stages`); every rank passes the same global batch and its data-parallel
replica trains on 1/dp of it; `pipe.step` returns the mean loss of the global batch on every rank.
With `--check`, rank 0 trains the dense model on the whole batch in one process beside it: the
losses agree to float precision.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import pipedsl
from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch
from pipedsl.models.gpt.parallelize import tp_gpt_loss
from pipedsl.parallel import ParallelConfig, ParallelMesh


def train(rank: int, cfg: ParallelConfig, schedule: str, params: dict[str, int], M: int, steps: int,
          gpt: GPTConfig, batch: int, check: bool = False, lr: float = 3e-3) -> dict:
    mesh = ParallelMesh(cfg)  # dp, pp and tp process groups (collective: every rank)
    cfg.check_model(hidden=gpt.n_embd, heads=gpt.n_head, vocab=gpt.vocab_size, batch=batch, microbatches=M)
    torch.manual_seed(0)
    model = GPT(gpt)  # the dense model, identical on every rank
    reference = copy.deepcopy(model) if check and rank == 0 else None
    program = pipedsl.load(schedule).compile(P=cfg.pp, M=M, **params)
    stages = model.tp_stages(program.num_stages, mesh)  # this rank's slices: [mb, T] ids → … → logits
    pipe = pipedsl.Pipeline(stages, program=program, loss_fn=tp_gpt_loss(mesh), parallel=mesh)
    opt = pipe.optimizer(torch.optim.Adam, lr=lr)  # ZeRO-sharded over dp when cfg.zero >= 1
    ref_opt = torch.optim.Adam(reference.parameters(), lr=lr) if reference is not None else None
    gen = torch.Generator().manual_seed(1)  # the same global batch on every rank
    out: dict = {"losses": [], "reference": [], "seconds": []}
    for step in range(steps):
        x, y = synthetic_batch(batch, gpt.block_size, gpt.vocab_size, gen)  # [B, T], [B, T]
        t0 = time.perf_counter()
        loss = pipe.step(x, y)
        opt.step()
        opt.zero_grad()
        out["seconds"].append(time.perf_counter() - t0)
        out["losses"].append(loss)
        line = f"step {step + 1}/{steps}  loss {loss:.6f}  {out['seconds'][-1] * 1e3:.0f} ms"
        if reference is not None:
            ref_loss = gpt_loss(reference(x), y)  # one process, the whole batch
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            out["reference"].append(ref_loss.item())
            line += f"  (one process: {ref_loss.item():.6f})"
        if rank == 0:
            print(line, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--tp-mode", default="1d", choices=["1d", "3d"])
    ap.add_argument("--zero", type=int, default=1)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("-p", dest="params", action="append", default=[], metavar="NAME=VALUE",
                    help="schedule parameter, e.g. -p W=1 for hanayo")
    ap.add_argument("-M", type=int, default=4, help="microbatches")
    ap.add_argument("--batch", type=int, default=32, help="global batch (sequences per step)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--check", action="store_true", help="rank 0 also trains the dense model in one process")
    args = ap.parse_args()
    params = {k: int(v) for k, v in (p.split("=", 1) for p in args.params)}
    cfg = ParallelConfig(dp=args.dp, pp=args.pp, tp=args.tp, tp_mode=args.tp_mode, zero=args.zero)
    gpt = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=64)
    pipedsl.launch(train, cfg.world_size, cfg, args.schedule, params, args.M, args.steps, gpt, args.batch,
                   args.check, threads=1)


if __name__ == "__main__":
    main()
