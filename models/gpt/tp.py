"""The small GPT's own tensor-parallel modules, which models/gpt/parallelize.py builds from a dense `GPT`.

The blocks are parallel/'s (`ParallelBlock`, `Block3D`); what is the GPT's own is here: its embedding (token
table + learned positions) and head (ln_f + lm_head) in 1-D and 3-D, and its MoE block under 1-D tp, whose
experts stay whole on every tp rank and run on that rank's share of the tokens (parallel/moe_tp.py).

Dropout must be 0 (models/gpt/parallelize.py says why).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed import ProcessGroup

from pipedsl.models.gpt.moe import MoE
from pipedsl.parallel.comm import copy_to_group, split_along
from pipedsl.parallel.config import ParallelConfigError
from pipedsl.parallel.mesh import Cube3D
from pipedsl.parallel.moe_tp import TokenShare, split_tokens
from pipedsl.parallel.replicated import mark_replicated
from pipedsl.parallel.tp1d import (
    SEQ,
    ColumnParallelLinear,
    ParallelSelfAttention,
    VocabParallelEmbedding,
    layer_norm_for,
)
from pipedsl.parallel.tp3d import Classifier3D, Embedding3D, LayerNorm3D

# ------------------------------------------------------------------------------------------ 1-D


class Embedding1D(nn.Module):
    """ids [mb, T] → [mb, T, C] on every tp rank: vocabulary-parallel tokens + replicated positions.

    With sequence parallelism → this rank's shard [mb, T/t, C]: the positions of the shard are
    its rows of the table, whose gradient rows the other ranks complete (all-gather backward).
    """

    def __init__(self, wte: VocabParallelEmbedding, wpe: nn.Embedding) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe
        mark_replicated(wpe, wte.group)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)  # [mb, T, C] (SP: [mb, T/t, C])
        if self.wte.sequence_parallel:
            return x + split_along(self.wpe.weight[:idx.shape[SEQ]], self.wte.group, 0)  # + [T/t, C]
        pos = torch.arange(idx.shape[1], device=idx.device)  # [T]
        return x + self.wpe(pos)  # [mb, T, C]


class ParallelMoEBlock(nn.Module):
    """A GPT block with a mixture of experts under 1-D tp: attention as `ParallelBlock`'s, the `MoE` whole on every
    tp rank and run on that rank's share of the tokens (parallel/moe_tp.py; with SP its sequence shard), its router
    losses from the microbatch's statistics summed over tp, so the loss sum is the same on every rank."""

    def __init__(self, ln1: nn.LayerNorm, attn: ParallelSelfAttention, ln2: nn.LayerNorm, moe: MoE,
                 share: TokenShare) -> None:
        super().__init__()
        if moe.router.capacity_factor is not None:
            raise ParallelConfigError("tensor parallelism of the GPT's experts needs a dropless router "
                                      "(capacity_factor=None): each tp rank would fill the experts' capacity "
                                      "with its own share of the tokens, first come first served")
        self.ln1, self.attn, self.ln2, self.mlp = ln1, attn, ln2, moe
        mark_replicated(ln1, attn.qkv.group)
        mark_replicated(ln2, attn.qkv.group)
        moe.router.share = share
        split_tokens(moe, share)

    @classmethod
    def from_dense(cls, block: nn.Module, group: ProcessGroup, sequence_parallel: bool = False) -> ParallelMoEBlock:
        sp = sequence_parallel
        return cls(layer_norm_for(block.ln1, group, sp), ParallelSelfAttention.from_dense(block.attn, group, sp),
                   layer_norm_for(block.ln2, group, sp), copy.deepcopy(block.mlp), TokenShare(group, sp))

    def forward(self, x: torch.Tensor, loss_sum: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if loss_sum is None:
            loss_sum = torch.zeros((), device=x.device)
        x = x + self.attn(self.ln1(x))
        y, loss_sum = self.mlp(self.ln2(x), loss_sum)
        return x + y, loss_sum


class Head1D(nn.Module):
    """[mb, T, C] (SP: [mb, T/t, C]) → logits [mb, T, V/t] (this rank's vocabulary block, the whole sequence); an
    MoE model's (logits, the routers' loss sum)."""

    def __init__(self, ln_f: nn.LayerNorm, lm_head: ColumnParallelLinear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head
        mark_replicated(ln_f, lm_head.group)

    def forward(self, x: torch.Tensor, loss_sum: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        logits = self.lm_head(self.ln_f(x))
        return logits if loss_sum is None else (logits, loss_sum)


# ------------------------------------------------------------------------------------------ 3-D


class Embedding3DStage(nn.Module):
    """ids [mb, T] (the whole microbatch) → [mb/q², T, C/q] in orientation `cube`: this rank's rows."""

    def __init__(self, wte: Embedding3D, wpe: torch.Tensor, cube: Cube3D) -> None:
        super().__init__()
        self.cube, self.wte = cube, wte
        self.wpe = nn.Parameter(wpe.detach().clone())  # [block_size, C/q], column block a_out
        mark_replicated(self.wpe, cube.input_x_weight)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # [mb, T]
        rows = idx[self.cube.row_block(idx.shape[0])]  # [mb/q², T]
        pos = copy_to_group(self.wpe, self.cube.input_x_weight)  # gradient summed over the ranks of other rows
        return self.wte(rows) + pos[:idx.shape[1]]  # [mb/q², T, C/q]


class Head3D(nn.Module):
    """[mb/q², T, C/q] → logits [mb/q², T, V/q] in `cube.swapped()`."""

    def __init__(self, ln_f: LayerNorm3D, lm_head: Classifier3D) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))
