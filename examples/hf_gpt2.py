"""Pipeline-parallel training of a Hugging Face GPT-2 built from a config (random weights, no download).

`transformers` is not a pipedsl dependency; install it first:

    pip install transformers
    python examples/hf_gpt2.py -P 2 -M 4 --steps 5

The model is cut into embedding, blocks and head (`gpt2_stages`), each block wrapped so that
it takes and returns one tensor [B, T, C].  The word embedding stays tied to the output
projection (GPT-2's default): the pipeline finds the shared weight in the stage list and sums
its gradient between the first and the last stage's ranks each step (pipedsl/runtime/ties.py).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import pipedsl
from pipedsl.runtime import split_gpt


def gpt2_model(seed: int = 0, n_layer: int = 4):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=n_layer, n_head=2, bos_token_id=0,
                     eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


class Embed(nn.Module):
    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # [B, T] → [B, T, C]
        return self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))


class Block(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C] → [B, T, C] (causal by default)
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out  # transformers 4.x returns a tuple


class Head(nn.Module):
    def __init__(self, ln_f: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C] → [B, T, V]
        return self.lm_head(self.ln_f(x))


def gpt2_stages(model: nn.Module, num_stages: int) -> list[nn.Module]:
    t = model.transformer
    return split_gpt(Embed(t), [Block(b) for b in t.h], Head(t.ln_f, model.lm_head), num_stages)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # [B, T, V], [B, T]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train(rank: int, schedule: str, M: int, steps: int) -> list[float]:
    P = torch.distributed.get_world_size()
    program = pipedsl.load(schedule).compile(P=P, M=M)
    model = gpt2_model()
    pipe = pipedsl.Pipeline(gpt2_stages(model, program.num_stages), program=program, loss_fn=lm_loss)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        tokens = torch.randint(model.config.vocab_size, (4 * M, 17), generator=gen)
        loss = pipe.step(tokens[:, :-1], tokens[:, 1:])
        opt.step()
        opt.zero_grad()
        losses.append(loss)
        if rank == 0:
            print(f"step {step + 1}/{steps}  loss {loss:.4f}", flush=True)
    return losses


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("-P", type=int, default=2)
    ap.add_argument("-M", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    pipedsl.launch(train, a.P, a.schedule, a.M, a.steps)
