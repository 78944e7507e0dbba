"""How the small GPT (`pipedsl.models.gpt.model.GPT`) is parallelized: its stages for one rank of a mesh.

`parallelize_gpt(model, num_stages, mesh)` is everything layout-specific, in the order it applies: the tensor-parallel
slices below when tp > 1 (else the dense stages), then each MoE layer's experts sharded over the mesh's ep group
(parallel/expert.py) when ep > 1.  A `Pipeline` runs the stages it returns as they are.

`tp_gpt_stages(model, num_stages, mesh, sequence_parallel=False)` slices a dense `GPT` — built on every rank from the
same seed — into the layers of `pipedsl.parallel` and the GPT's own (models/gpt/tp.py), and cuts them into pipeline
stages like `GPT.stages`; `tp_gpt_loss(mesh)` is the matching loss.  Because every weight is a slice of
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

from pipedsl.models.gpt.model import GPTConfig
from pipedsl.models.gpt.moe import MoE
from pipedsl.models.gpt.tp import Embedding1D, Embedding3DStage, Head1D, Head3D, ParallelMoEBlock
from pipedsl.models.split import split_gpt
from pipedsl.parallel.config import ParallelConfig, ParallelConfigError
from pipedsl.parallel.expert import shard_experts_over
from pipedsl.parallel.mesh import Cube3D, ParallelMesh
from pipedsl.parallel.tp1d import (
    ColumnParallelLinear,
    ParallelBlock,
    VocabParallelEmbedding,
    defer_grad_sum,
    layer_norm_for,
    vocab_parallel_cross_entropy,
)
from pipedsl.parallel.tp3d import Block3D, Classifier3D, Embedding3D, LayerNorm3D, loss_value

Units = tuple[nn.Module, list[nn.Module], nn.Module]  # (embedding, blocks, head), as `split_gpt` cuts them


def parallelize_gpt(model: nn.Module, num_stages: int, mesh: ParallelMesh, by: str = "count",
                    sequence_parallel: bool = False, points: Sequence[int] | None = None) -> list[nn.Sequential]:
    """The dense `GPT` as `num_stages` stages for this rank of `mesh`: tensor-parallel slices (`tp_gpt_stages`) when
    tp > 1, each experts module this rank's share over ep when ep > 1.  Every rank builds `model` from one seed."""
    if mesh.config.tp > 1:
        stages = tp_gpt_stages(model, num_stages, mesh, by=by, sequence_parallel=sequence_parallel, points=points)
    else:
        if sequence_parallel:
            raise ParallelConfigError("sequence parallelism needs tensor parallelism (tp > 1)")
        stages = model.stages(num_stages, by=by, points=points)
    shard_experts_over(stages, mesh)
    return stages


def tp_gpt_stages(model: nn.Module, num_stages: int, mesh: ParallelMesh, by: str = "count",
                  sequence_parallel: bool = False, points: Sequence[int] | None = None) -> list[nn.Sequential]:
    """The dense `GPT` as `num_stages` tensor-parallel stages for this rank (cut like `GPT.stages`, `points` too).

    `sequence_parallel=True` (1-D only): stages exchange sequence shards [mb, T/t, C]; the parameters,
    their names and shapes are those without it, so checkpoints are interchangeable.
    """
    _check(model.cfg, mesh.config, sequence_parallel)
    if mesh.config.tp_mode == "1d":
        embed, blocks, head = _units_1d(model, mesh.tp_group, sequence_parallel)
    else:
        assert mesh.cube is not None
        embed, blocks, head = _units_3d(model, mesh.cube)
    for unit in (embed, *blocks, head):
        defer_grad_sum(unit)  # the pipeline sums LayerNorm and row-bias gradients over tp once per step
    return split_gpt(embed, blocks, head, num_stages, by=by, points=points)


def _check(cfg: GPTConfig, pc: ParallelConfig, sequence_parallel: bool) -> None:
    """Refuse what these layers cannot split: dropout, SP or experts under 3-D, sizes tp does not divide."""
    if cfg.dropout:
        raise ParallelConfigError(f"tensor-parallel GPT stages need dropout=0, got {cfg.dropout}")
    if sequence_parallel and pc.tp_mode != "1d":
        raise ParallelConfigError("sequence parallelism needs 1-D tensor parallelism (tp_mode='1d'), "
                                  f"got tp_mode={pc.tp_mode!r}")
    pc.check_model(hidden=cfg.n_embd, heads=cfg.n_head, vocab=cfg.vocab_size, ffn=4 * cfg.n_embd)
    if cfg.moe and pc.tp_mode != "1d":
        raise ParallelConfigError("the GPT's experts take 1-D tensor parallelism only (tp_mode='1d')")


def _units_1d(model: nn.Module, group: ProcessGroup, sp: bool) -> Units:
    """Megatron's split over `group`: the token table by vocabulary, each block by heads and MLP columns (an MoE
    block whole, on this rank's share of the tokens), lm_head by columns."""
    emb, head = model.embed, model.head
    embed = Embedding1D(VocabParallelEmbedding.from_dense(emb.wte, group, sp), copy.deepcopy(emb.wpe))
    blocks = [(ParallelMoEBlock if isinstance(b.mlp, MoE) else ParallelBlock).from_dense(b, group, sp)
              for b in model.blocks]
    out = Head1D(layer_norm_for(head.ln_f, group, sp),
                 ColumnParallelLinear.from_dense(head.lm_head, group, sequence_parallel=sp))
    return embed, blocks, out


def _units_3d(model: nn.Module, cube: Cube3D) -> Units:
    """Bian et al.'s split over the q³ ranks of `cube`: every weight a block of its matrix, positions [T, C/q]."""
    emb, head = model.embed, model.head
    wpe = emb.wpe.weight.detach()[:, cube.col_block(model.cfg.n_embd)]  # [block_size, C/q]
    embed = Embedding3DStage(Embedding3D.from_dense(emb.wte, cube), wpe, cube)
    blocks = [Block3D.from_dense(b, cube) for b in model.blocks]
    out = Head3D(LayerNorm3D.from_dense(head.ln_f, cube), Classifier3D.from_dense(head.lm_head, cube))
    return embed, blocks, out


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
