"""Train the small nanoGPT-style model (pipedsl/models/gpt/model.py) with a pipeline schedule.

    python examples/nanogpt.py                      # 1F1B on 4 local processes
    python examples/nanogpt.py --schedule gpipe -P 2 -M 4 --steps 10
    python examples/nanogpt.py --schedule zb-h2 --clip 1.0 --post-validate  # steps that overlap
    torchrun --nproc-per-node 4 examples/nanogpt.py # the same script under torchrun

Every rank builds the same model from the same seed and keeps only its stages; the batch is
the same on every rank (the pipeline splits it into M microbatches).  `TrainingSteps` runs each
step — forward, backward, clipping by the whole model's gradient norm, the optimizer — and
returns its report (mean loss, norm) on every rank; post-validated, each rank steps when its part
ends and the checks are read in the next step, so each report comes one step late and `settle()`
gives the last (docs/runtime.md, "Post-validated steps").
"""

from __future__ import annotations

import argparse

import torch

import pipedsl
from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch
from pipedsl.runtime.post_validate import StepReport, TrainingSteps


def train(rank: int, schedule: str, M: int, steps: int, cfg: GPTConfig, batch: int, clip: float | None = None,
          post_validate: bool = False) -> list[float]:
    P = torch.distributed.get_world_size()
    program = pipedsl.load(schedule).compile(P=P, M=M)
    torch.manual_seed(0)
    model = GPT(cfg)  # [B, T] token ids → [B, T, V] logits
    pipe = pipedsl.Pipeline(model.stages(program.num_stages), program=program, loss_fn=gpt_loss)
    opt = pipe.optimizer(torch.optim.AdamW, lr=3e-3)
    training = TrainingSteps(pipe, opt, max_norm=clip, post_validate=post_validate)
    gen = torch.Generator().manual_seed(1)  # the same data on every rank
    losses = []

    def log(report: StepReport | None) -> None:
        if report is None:  # post-validated: the first step's report comes with the second
            return
        losses.append(report.loss)
        if rank == 0:
            norm = f"  grad norm {report.grad_norm:.3f}" if report.grad_norm is not None else ""
            redone = f"  (redone: {'skipped' if report.skipped else 'clipped'})" if report.redone else ""
            print(f"step {report.step}/{steps}  loss {report.loss:.4f}{norm}{redone}", flush=True)

    for _ in range(steps):
        x, y = synthetic_batch(batch, cfg.block_size, cfg.vocab_size, gen)  # [B, T], [B, T]
        log(training.step(x, y))
    log(training.settle())
    pipe.close()
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("-P", type=int, default=4, help="ranks (ignored under torchrun)")
    ap.add_argument("-M", type=int, default=8, help="microbatches")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--clip", type=float, help="clip the whole model's gradient norm to this (default: no clipping)")
    ap.add_argument("--post-validate", action="store_true", help="steps overlap; the checks are read a step later")
    args = ap.parse_args()
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=6, n_head=4, n_embd=64)
    pipedsl.launch(train, args.P, args.schedule, args.M, args.steps, cfg, 4 * args.M, args.clip, args.post_validate)


if __name__ == "__main__":
    main()
