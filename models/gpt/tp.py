"""The runtime's small GPT (`pipedsl.models.gpt.model.GPT`) as tensor-parallel pipeline stages.

`tp_gpt_stages(model, num_stages, mesh, sequence_parallel=False)` slices a dense `GPT` — built on every rank from the
same seed — into the layers of `pipedsl.parallel` and cuts them into pipeline stages like
`GPT.stages`; `tp_gpt_loss(mesh)` is the matching loss.  Because every weight is a slice of
the dense model, the one-process reference of a parallel run is that dense model.

1-D (Megatron-LM, `mesh.tp_group` of t ranks): activations between stages are [mb, T, C],
the same on every tp rank.

    embedding  token table vocabulary-parallel [V/t, C] (partial lookups summed), positions replicated
    blocks     `ParallelBlock`: attention by heads, MLP column- then row-parallel
    head       ln_f replicated, lm_head column-parallel → logits [mb, T, V/t], never gathered
    loss       vocabulary-parallel cross-entropy: the same per-token loss on every tp rank

1-D with `sequence_parallel=True` (Korthikanti et al. 2022): activations between blocks and
between stages are this rank's sequence shard [mb, T/t, C] (T % t == 0).

    embedding  partial lookups reduce-scattered along the sequence → the shard of the sum;
               positions: this shard's rows of the replicated table (gradient all-gathered)
    blocks     `ParallelBlock(sequence_parallel=True)`: LayerNorms and residuals on the shard
    head       ln_f on the shard, lm_head's input all-gathered → logits [mb, T, V/t] as above
    gradients  of the LayerNorms and row-parallel biases (whole on every rank, applied to a
               shard) summed over tp once per step by the pipeline (tp1d.SequenceParallelGradSum),
               so these stages need a `Pipeline`

3-D (Bian et al. 2021, `mesh.cube`, q³ ranks): the first stage takes the whole microbatch of
ids [mb, T] and keeps its rows, so activations between stages are [mb/q², T, C/q].

    embedding  `Embedding3D`, positions [T, C/q] replicated over the cube's input × weight plane
    blocks     `Block3D`
    head       `LayerNorm3D`, `Classifier3D` → logits [mb/q², T, V/q] in the swapped orientation
    loss       each rank's share of the mean cross-entropy for backward; its *value* is the
               whole microbatch's loss (an all-reduce over the cube), as the pipeline expects

Dropout must be 0: tensor-parallel dropout needs an RNG state per tp rank, which these
layers do not track (with sequence parallelism every shard needs its own stream, Megatron's
RNG tracker).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup

from pipedsl.models.gpt.moe import MoE
from pipedsl.parallel.comm import copy_to_group, split_along
from pipedsl.parallel.config import ParallelConfigError
from pipedsl.parallel.mesh import Cube3D, ParallelMesh
from pipedsl.parallel.moe_tp import TokenShare, split_tokens
from pipedsl.parallel.replicated import mark_replicated
from pipedsl.parallel.tp1d import (
    SEQ,
    ColumnParallelLinear,
    ParallelBlock,
    ParallelSelfAttention,
    VocabParallelEmbedding,
    defer_grad_sum,
    layer_norm_for,
    vocab_parallel_cross_entropy,
)
from pipedsl.parallel.tp3d import Block3D, Classifier3D, Embedding3D, LayerNorm3D, loss_value

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


# ------------------------------------------------------------------------------------------ building


def tp_gpt_units(model: nn.Module, mesh: ParallelMesh,
                 sequence_parallel: bool = False) -> tuple[nn.Module, list[nn.Module], nn.Module]:
    """(embedding, blocks, head) of the dense runtime `GPT`, sliced for this rank of `mesh`."""
    cfg = model.cfg
    if cfg.dropout:
        raise ParallelConfigError(f"tensor-parallel GPT stages need dropout=0, got {cfg.dropout}")
    pc = mesh.config
    if sequence_parallel and pc.tp_mode != "1d":
        raise ParallelConfigError("sequence parallelism needs 1-D tensor parallelism (tp_mode='1d'), "
                                  f"got tp_mode={pc.tp_mode!r}")
    pc.check_model(hidden=cfg.n_embd, heads=cfg.n_head, vocab=cfg.vocab_size, ffn=4 * cfg.n_embd)
    emb, head = model.embed, model.head
    if cfg.moe and pc.tp_mode != "1d":
        raise ParallelConfigError("the GPT's experts take 1-D tensor parallelism only (tp_mode='1d')")
    if pc.tp_mode == "1d":
        g, sp = mesh.tp_group, sequence_parallel
        embed = Embedding1D(VocabParallelEmbedding.from_dense(emb.wte, g, sp), copy.deepcopy(emb.wpe))
        blocks = [(ParallelMoEBlock if isinstance(b.mlp, MoE) else ParallelBlock).from_dense(b, g, sp)
                  for b in model.blocks]
        out = Head1D(layer_norm_for(head.ln_f, g, sp),
                     ColumnParallelLinear.from_dense(head.lm_head, g, sequence_parallel=sp))
        return embed, blocks, out
    cube = mesh.cube
    assert cube is not None
    wpe = emb.wpe.weight.detach()[:, cube.col_block(cfg.n_embd)]  # [block_size, C/q]
    embed = Embedding3DStage(Embedding3D.from_dense(emb.wte, cube), wpe, cube)
    blocks = [Block3D.from_dense(b, cube) for b in model.blocks]
    out = Head3D(LayerNorm3D.from_dense(head.ln_f, cube), Classifier3D.from_dense(head.lm_head, cube))
    return embed, blocks, out


def tp_gpt_stages(model: nn.Module, num_stages: int, mesh: ParallelMesh, by: str = "count",
                  sequence_parallel: bool = False, points: Sequence[int] | None = None) -> list[nn.Sequential]:
    """The dense `GPT` as `num_stages` tensor-parallel stages for this rank (cut like `GPT.stages`, `points` too).

    `sequence_parallel=True` (1-D only): stages exchange sequence shards [mb, T/t, C]; the parameters,
    their names and shapes are those without it, so checkpoints are interchangeable.
    """
    from pipedsl.models.split import split_gpt

    embed, blocks, head = tp_gpt_units(model, mesh, sequence_parallel)
    for unit in (embed, *blocks, head):
        defer_grad_sum(unit)  # the pipeline sums LayerNorm and row-bias gradients over tp once per step
    return split_gpt(embed, blocks, head, num_stages, by=by, points=points)


def tp_gpt_loss(mesh: ParallelMesh, reduction: str = "mean",
                ignore_index: int | None = None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Next-token cross-entropy of this rank's logits block against the microbatch's targets [mb, T].

    The value is the microbatch's loss on every tp rank; backward gives this rank's gradients.
    `reduction="mean"` averages over the (non-ignored) tokens, `"sum"` sums them — what
    `Pipeline(loss_reduction="token")` expects; targets equal to `ignore_index` count for nothing.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")

    def reduce(per_token: torch.Tensor, targets: torch.Tensor, whole: int) -> torch.Tensor:
        """Σ or mean of the kept tokens of `per_token`; `whole` is the microbatch's token count."""
        if ignore_index is not None:
            keep = targets != ignore_index
            per_token = per_token.masked_fill(~keep, 0.0)
            whole = keep.sum()  # of this microbatch (3-D: the whole one, every rank alike)
        return per_token.sum() if reduction == "sum" else per_token.sum() / whole

    if mesh.config.tp_mode == "1d":
        group = mesh.tp_group

        def loss_1d(logits: torch.Tensor | tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
            if isinstance(logits, tuple):  # an MoE model's (logits, the routers' loss sum): added, as gpt_loss does
                logits, router_loss = logits
                return loss_1d(logits, targets) + router_loss
            per_token = vocab_parallel_cross_entropy(logits, targets, group)  # [mb, T] from [mb, T, V/t]
            if ignore_index is None and reduction == "mean":
                return per_token.mean()
            return reduce(per_token, targets, targets.numel())

        return loss_1d
    cube = mesh.cube
    assert cube is not None
    out = cube.swapped()  # the classifier's output orientation

    def loss_3d(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # [mb/q², T, V/q], [mb, T]
        rows = out.row_block(targets.shape[0])
        mine = targets[rows]  # [mb/q², T]
        per_token = vocab_parallel_cross_entropy(logits, mine, out.output, out.a_out * logits.shape[-1])
        if ignore_index is not None:
            per_token = per_token.masked_fill(mine == ignore_index, 0.0)
        total = per_token.sum()
        if reduction == "mean":
            kept = targets.numel() if ignore_index is None else (targets != ignore_index).sum()
            total = total / kept
        # each token's loss is on q ranks: the shares sum to q·(the microbatch's loss)
        return total + (loss_value(total, cube) - total).detach()  # value: the whole; gradient: the share's

    return loss_3d
