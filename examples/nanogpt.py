"""Train the small nanoGPT-style model (pipedsl/models/gpt/model.py) with a pipeline schedule.

    python examples/nanogpt.py                      # 1F1B on 4 local processes
    python examples/nanogpt.py --schedule gpipe -P 2 -M 4 --steps 10
    torchrun --nproc-per-node 4 examples/nanogpt.py # the same script under torchrun

Every rank builds the same model from the same seed and keeps only its stages; the batch is
the same on every rank (the pipeline splits it into M microbatches); `pipe.step` returns the
mean loss on every rank and leaves the gradients in `.grad` for the user's optimizer.
"""

from __future__ import annotations

import argparse

import torch

import pipedsl
from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch


def train(rank: int, schedule: str, M: int, steps: int, cfg: GPTConfig, batch: int) -> list[float]:
    P = torch.distributed.get_world_size()
    program = pipedsl.load(schedule).compile(P=P, M=M)
    torch.manual_seed(0)
    model = GPT(cfg)  # [B, T] token ids → [B, T, V] logits
    pipe = pipedsl.Pipeline(model.stages(program.num_stages), program=program, loss_fn=gpt_loss)
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)  # the same data on every rank
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(batch, cfg.block_size, cfg.vocab_size, gen)  # [B, T], [B, T]
        loss = pipe.step(x, y)
        opt.step()
        opt.zero_grad()
        losses.append(loss)
        if rank == 0:
            print(f"step {step + 1}/{steps}  loss {loss:.4f}", flush=True)
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("-P", type=int, default=4, help="ranks (ignored under torchrun)")
    ap.add_argument("-M", type=int, default=8, help="microbatches")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=6, n_head=4, n_embd=64)
    pipedsl.launch(train, args.P, args.schedule, args.M, args.steps, cfg, 4 * args.M)


if __name__ == "__main__":
    main()
