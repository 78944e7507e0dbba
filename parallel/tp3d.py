"""3-D tensor parallelism (Bian et al. 2021, "Maximizing Parallelism in Distributed Training for
Huge Neural Networks", arXiv:2105.14450) over an explicit `Cube3D` of q × q × q ranks.

Every tensor is split over all q³ ranks, the batch too.  In an orientation (input, weight,
output groups; this rank's coordinates a_in, a_w, a_out) a linear Y = X W holds

    X  [b/q², in/q]   rows: block a_w, sub-block a_in;   columns: block a_out
    W  [in/q², out/q] rows: block a_out, sub-block a_w;  columns: block a_in

and computes, as in the paper's Algorithm 1,

    X' = all-gather X over `input`        # [b/q, in/q]     rows block a_w, columns block a_out
    W' = all-gather W over `weight`       # [in/q, out/q]   W's (a_out, a_in) block
    Y' = X' W'                            # [b/q, out/q]    partial sum over the in blocks
    Y  = reduce-scatter Y' over `output`  # [b/q², out/q]   rows block a_w, sub-block a_out; columns a_in

Y's layout is X's layout in the swapped orientation (input ⟷ output), so consecutive linears
alternate orientations and no re-layout is ever needed.  Backward is the transposed pattern:
all-gather dY over `output`, dX = reduce-scatter of dY W'ᵀ over `input`, dW = reduce-scatter
of X'ᵀ dY over `weight`.  Per linear and step each rank sends 2 (q−1)/q³ (b·in + b·out + in·out)
elements (forward and backward), against 1-D's 2 (t−1)/t · b·h per all-reduce.

Vectors over a layer's columns (biases, LayerNorm weights) are held [h/q] on every rank of
a q² plane and their gradients all-reduced over it (the f operator on the parameter).
Activations are [b, s, h] with whole samples per rank, so attention needs no communication.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 - the usual name
from torch import nn

from pipedsl.parallel.comm import (
    all_gather,
    all_reduce,
    all_reduce_autograd,
    copy_to_group,
    reduce_scatter,
)
from pipedsl.parallel.config import ParallelConfigError
from pipedsl.parallel.mesh import Cube3D
from pipedsl.parallel.replicated import mark_replicated
from pipedsl.parallel.tp1d import DenseBlock, causal_attention, qkv_order, vocab_parallel_cross_entropy


def _div(n: int, d: int, what: str) -> int:
    if n % d:
        raise ParallelConfigError(f"{what} {n} is not divisible by {d} (3-D tensor parallelism)")
    return n // d


def weight_blocks(cube: Cube3D, in_features: int, out_features: int) -> tuple[slice, slice]:
    """Rows and columns of the dense Wᵀ [in, out] that this rank holds in `cube`'s orientation."""
    q = cube.q
    r = _div(in_features, q * q, "input features")
    c = _div(out_features, q, "output features")
    row0 = cube.a_out * q * r + cube.a_w * r
    return slice(row0, row0 + r), slice(cube.a_in * c, (cube.a_in + 1) * c)


class _Linear3D(torch.autograd.Function):
    """Y = X W on a cube; saves the gathered X' and W' so backward re-gathers only dY."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, cube: Cube3D) -> torch.Tensor:
        ctx.cube = cube
        x_all = all_gather(x, cube.input, 0)  # [b/q, …, in/q]
        w_all = all_gather(w, cube.weight, 0)  # [in/q, out/q]
        y = torch.matmul(x_all, w_all)  # [b/q, …, out/q] partial over in
        ctx.save_for_backward(x_all, w_all)
        return reduce_scatter(y, cube.output, 0)  # [b/q², …, out/q]

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        cube: Cube3D = ctx.cube
        x_all, w_all = ctx.saved_tensors
        dy_all = all_gather(dy.contiguous(), cube.output, 0)  # [b/q, …, out/q]
        dx = reduce_scatter(torch.matmul(dy_all, w_all.t()), cube.input, 0)  # [b/q², …, in/q]
        dw_all = x_all.reshape(-1, x_all.shape[-1]).t() @ dy_all.reshape(-1, dy_all.shape[-1])  # [in/q, out/q]
        dw = reduce_scatter(dw_all, cube.weight, 0)  # [in/q², out/q]
        return dx, dw, None


class Linear3D(nn.Module):
    """Y = X W + b on a cube, input in orientation `cube`, output in `cube.swapped()` (`self.out_cube`).

    weight [in/q², out/q] (note: Wᵀ of nn.Linear, split as in the module docstring);
    bias [out/q], column block a_in, replicated over the weight × output plane.
    """

    def __init__(self, in_features: int, out_features: int, cube: Cube3D, bias: bool = True) -> None:
        super().__init__()
        q = cube.q
        self.cube, self.out_cube = cube, cube.swapped()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(_div(in_features, q * q, "input features"),
                                               _div(out_features, q, "output features")))  # [in/q², out/q]
        self.bias = nn.Parameter(torch.zeros(out_features // q)) if bias else None  # [out/q]
        mark_replicated(self.bias, cube.weight_x_output)
        nn.init.normal_(self.weight, std=in_features ** -0.5)

    @classmethod
    def from_dense(cls, linear: nn.Linear, cube: Cube3D, out_order: torch.Tensor | None = None) -> Linear3D:
        """This rank's blocks of a dense `nn.Linear`; `out_order` permutes its output features first."""
        layer = cls(linear.in_features, linear.out_features, cube, linear.bias is not None)
        w_t = linear.weight.detach().t()  # [in, out]
        b = None if linear.bias is None else linear.bias.detach()
        if out_order is not None:
            w_t, b = w_t[:, out_order], None if b is None else b[out_order]
        rows, cols = weight_blocks(cube, linear.in_features, linear.out_features)
        with torch.no_grad():
            layer.weight.copy_(w_t[rows, cols])
            if b is not None:
                layer.bias.copy_(b[cols])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b/q², …, in/q] in orientation `cube`
        y = _Linear3D.apply(x, self.weight, self.cube)  # [b/q², …, out/q] in `out_cube`
        if self.bias is not None:
            y = y + copy_to_group(self.bias, self.cube.weight_x_output)  # gradient summed over the plane
        return y


class LayerNorm3D(nn.Module):
    """LayerNorm over a hidden size split in q column blocks (block a_out of orientation `cube`).

    Mean and variance are sums over the `output` group (all-reduced forward and backward);
    weight and bias [h/q] are replicated over the input × weight plane.  Output layout = input layout.
    """

    def __init__(self, hidden: int, cube: Cube3D, eps: float = 1e-5) -> None:
        super().__init__()
        self.cube, self.out_cube, self.hidden, self.eps = cube, cube, hidden, eps
        local = _div(hidden, cube.q, "hidden size")
        self.weight = nn.Parameter(torch.ones(local))  # [h/q]
        self.bias = nn.Parameter(torch.zeros(local))  # [h/q]
        mark_replicated(self, cube.input_x_weight)

    @classmethod
    def from_dense(cls, ln: nn.LayerNorm, cube: Cube3D) -> LayerNorm3D:
        hidden = ln.normalized_shape[0]
        layer = cls(hidden, cube, ln.eps)
        cols = cube.col_block(hidden)
        with torch.no_grad():
            layer.weight.copy_(ln.weight.detach()[cols])
            layer.bias.copy_(ln.bias.detach()[cols])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b/q², …, h/q]
        group = self.cube.output
        mean = all_reduce_autograd(x.sum(-1, keepdim=True), group) / self.hidden  # [b/q², …, 1]
        xc = x - mean
        var = all_reduce_autograd((xc * xc).sum(-1, keepdim=True), group) / self.hidden  # two-pass, as dense
        y = xc * torch.rsqrt(var + self.eps)
        plane = self.cube.input_x_weight
        return y * copy_to_group(self.weight, plane) + copy_to_group(self.bias, plane)


class _Embedding3D(torch.autograd.Function):
    """Y = onehot(ids) E on a cube: E [V/q², h/q] (vocab block a_in, sub-block a_w; hidden block a_out)."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, w: torch.Tensor, cube: Cube3D) -> torch.Tensor:
        ctx.cube = cube
        ids_all = all_gather(ids, cube.input, 0)  # [b/q, s]: every sample of row block a_w
        w_all = all_gather(w, cube.weight, 0)  # [V/q, h/q]: vocab block a_in
        local = ids_all - cube.a_in * w_all.shape[0]
        outside = (local < 0) | (local >= w_all.shape[0])
        local = local.masked_fill(outside, 0)
        y = F.embedding(local, w_all).masked_fill(outside.unsqueeze(-1), 0.0)  # [b/q, s, h/q] partial over vocab
        ctx.save_for_backward(local, outside)
        ctx.vocab_rows = w_all.shape[0]
        return reduce_scatter(y, cube.input, 0)  # [b/q², s, h/q]: sub-block a_in, summed over vocab blocks

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        cube: Cube3D = ctx.cube
        local, outside = ctx.saved_tensors
        dy_all = all_gather(dy.contiguous(), cube.input, 0).masked_fill(outside.unsqueeze(-1), 0.0)  # [b/q, s, h/q]
        dw_all = torch.zeros(ctx.vocab_rows, dy.shape[-1], dtype=dy.dtype, device=dy.device)
        dw_all.index_add_(0, local.reshape(-1), dy_all.reshape(-1, dy.shape[-1]))  # [V/q, h/q]
        return None, reduce_scatter(dw_all, cube.weight, 0), None  # [V/q², h/q]


class Embedding3D(nn.Module):
    """Vocabulary-parallel embedding whose ids [b/q², s] and output [b/q², s, h/q] are both in orientation `cube`.

    Table E [V, h] split q³ ways: vocabulary block a_in (sub-block a_w) × hidden block a_out.
    Ids are all-gathered over `input` (small, integers), E's blocks over `weight`, and the
    partial lookups reduce-scattered over `input`, which sums the vocabulary blocks.
    """

    def __init__(self, vocab: int, hidden: int, cube: Cube3D) -> None:
        super().__init__()
        q = cube.q
        self.cube, self.out_cube, self.vocab, self.hidden = cube, cube, vocab, hidden
        self.weight = nn.Parameter(torch.randn(_div(vocab, q * q, "vocabulary size"),
                                               _div(hidden, q, "hidden size")))  # [V/q², h/q]

    def block(self) -> tuple[slice, slice]:
        """Rows and columns of the dense table this rank holds."""
        q, cube = self.cube.q, self.cube
        r, c = self.vocab // (q * q), self.hidden // q
        row0 = cube.a_in * q * r + cube.a_w * r
        return slice(row0, row0 + r), slice(cube.a_out * c, (cube.a_out + 1) * c)

    @classmethod
    def from_dense(cls, emb: nn.Embedding, cube: Cube3D) -> Embedding3D:
        layer = cls(emb.num_embeddings, emb.embedding_dim, cube)
        rows, cols = layer.block()
        with torch.no_grad():
            layer.weight.copy_(emb.weight.detach()[rows, cols])
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [b/q², s] rows block a_w, sub-block a_in
        return _Embedding3D.apply(ids, self.weight, self.cube)


class Classifier3D(nn.Module):
    """Vocabulary-parallel output layer: logits [b/q², s, V/q] in `out_cube` (vocab block = its a_out)."""

    def __init__(self, linear: Linear3D) -> None:
        super().__init__()
        self.linear = linear
        self.cube, self.out_cube = linear.cube, linear.out_cube

    @classmethod
    def from_dense(cls, linear: nn.Linear, cube: Cube3D) -> Classifier3D:
        return cls(Linear3D.from_dense(linear, cube))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def loss(self, logits: torch.Tensor, target: torch.Tensor, total_tokens: int) -> torch.Tensor:
        """This rank's share of the mean cross-entropy over `total_tokens`, never gathering logits.

        `target` [b/q², s] in `out_cube`'s row layout (`out_cube.row_block`).  Each token's loss
        is computed on the q ranks holding its logits; backward on this value gives every rank
        its own gradient.  The mean loss itself is `loss_value(...)`.
        """
        oc = self.out_cube
        per_token = vocab_parallel_cross_entropy(logits, target, oc.output, oc.a_out * logits.shape[-1])
        return per_token.sum() / total_tokens


def loss_value(local: torch.Tensor, cube: Cube3D) -> torch.Tensor:
    """The whole mean loss from every rank's `Classifier3D.loss` (each token's loss sits on q ranks)."""
    out = local.detach().clone()
    all_reduce(out, cube.whole)
    return out / cube.q


class Block3D(nn.Module):
    """Pre-LN GPT block on a cube: [b/q², s, h/q] in orientation `cube` → the same layout.

    ln1 (cube) → qkv Linear3D (cube → cube', heads block a_in) → attention on h/(q·d) local heads
    → proj Linear3D (cube' → cube) → residual → ln2 → fc (cube → cube') → GELU → proj (cube' → cube).
    """

    def __init__(self, ln1: LayerNorm3D, qkv: Linear3D, proj: Linear3D, ln2: LayerNorm3D, fc: Linear3D,
                 fc_proj: Linear3D, heads: int) -> None:
        super().__init__()
        self.ln1, self.qkv, self.proj, self.ln2, self.fc, self.fc_proj = ln1, qkv, proj, ln2, fc, fc_proj
        self.cube = self.out_cube = ln1.cube
        self.local_heads = _div(heads, ln1.cube.q, "attention heads")

    @classmethod
    def from_dense(cls, block: DenseBlock, cube: Cube3D) -> Block3D:
        hidden, q = block.attn.proj.in_features, cube.q
        _div(block.attn.n_head, q, "attention heads")
        swapped = cube.swapped()
        return cls(LayerNorm3D.from_dense(block.ln1, cube),
                   Linear3D.from_dense(block.attn.qkv, cube, out_order=qkv_order(hidden, q)),
                   Linear3D.from_dense(block.attn.proj, swapped),
                   LayerNorm3D.from_dense(block.ln2, cube),
                   Linear3D.from_dense(block.mlp.fc, cube),
                   Linear3D.from_dense(block.mlp.proj, swapped),
                   block.attn.n_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b/q², s, h/q] orientation cube
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)  # [b/q², s, h/q] each, cube': this rank's heads
        x = x + self.proj(causal_attention(q, k, v, self.local_heads))  # back to cube
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))  # [b/q², s, ffn/q] in cube' inside
