"""1-D tensor parallelism (Megatron-LM, Shoeybi et al. 2019) over an explicit process group.

With t ranks in `group`, a linear Y = X A is split either by A's columns (each rank holds
A[:, block] and produces Y[..., block]) or by A's rows (each rank holds A[block, :], takes
X[..., block] and produces a partial sum of Y).  An MLP is column-then-row, so the only
communication is one all-reduce of [b, s, h] forward (the g operator after the row-parallel
linear) and one backward (the f operator before the column-parallel one).  Attention splits
by heads the same way; the embedding and the loss split the vocabulary, and the loss never
gathers the logits: max, sum of exponentials and the target's logit are all-reduced instead.

Sequence parallelism (`sequence_parallel=True`, Korthikanti et al. 2022) keeps the activations
*between* the tensor-parallel regions as sequence shards [b, s/t, h]: LayerNorms and residual
adds run on the shard, the column-parallel input is all-gathered along the sequence (its
gradient reduce-scattered) and the row-parallel output reduce-scattered (its gradient
all-gathered), so each all-reduce becomes a reduce-scatter plus an all-gather of the same
bytes.  The column-parallel linear saves only the shard for its weight gradient and gathers
it again in backward (Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication): the
saved activations of a block drop from (replicated + split/t) to (all)/t.  Weights kept whole
on every rank but applied to a shard — LayerNorms, the row-parallel bias — get only the
shard's part of their gradient, which must be summed over the group: in each backward
(`copy_to_group` on the weight, the default: the layers are then correct on their own), or —
after `defer_grad_sum(module)`, as `tp_gpt_stages` does — once per step at the pipeline's
REDUCE_GRAD (runtime/finalize.py, which `Pipeline` installs when a stage holds such weights), as
Megatron-LM's finalize_model_grads does.

Every layer is built from its dense counterpart by slicing (`from_dense`), so a model has
the same values at any t.  Activations in comments: `[b, s, h]` replicated on every rank,
`[b, s, h/t]` this rank's block, `[b, s/t, h]` this rank's sequence shard.
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch
import torch.nn.functional as F  # noqa: N812 - the usual name
from torch import nn
from torch.distributed import ProcessGroup, ReduceOp

from pipedsl.parallel.comm import (
    all_gather,
    all_reduce,
    copy_to_group,
    gather_replicated,
    group_rank,
    group_size,
    reduce_from_group,
    reduce_scatter,
    scatter_along,
)
from pipedsl.parallel.config import ParallelConfigError
from pipedsl.parallel.replicated import mark_replicated, param_sum_grad_later


class DenseAttention(Protocol):
    """What a dense attention is read for: qkv [h, 3h] (columns q | k | v), proj [h, h], n_head heads."""

    qkv: nn.Linear
    proj: nn.Linear
    n_head: int


class DenseMLP(Protocol):
    """fc [h, ffn], GELU, proj [ffn, h]."""

    fc: nn.Linear
    proj: nn.Linear


class DenseBlock(Protocol):
    """A pre-LN transformer block, x + attn(ln1(x)) then + mlp(ln2(·)): pipedsl.models.gpt's `Block` is one."""

    ln1: nn.LayerNorm
    attn: DenseAttention
    ln2: nn.LayerNorm
    mlp: DenseMLP


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Causal self-attention of `heads` heads: q, k, v [b, s, heads·d] → [b, s, heads·d]."""
    b, s, hd = q.shape

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(b, s, heads, hd // heads).transpose(1, 2)  # [b, heads, s, d]

    y = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)  # [b, heads, s, d]
    return y.transpose(1, 2).reshape(b, s, hd)


def _split(n: int, t: int, what: str) -> int:
    if n % t:
        raise ParallelConfigError(f"{what} {n} is not divisible by the {t} tensor-parallel ranks")
    return n // t


def _block(n: int, group: ProcessGroup | None) -> slice:
    size = n // group_size(group)
    r = group_rank(group)
    return slice(r * size, (r + 1) * size)


SEQ = 1  # the sequence dimension of [b, s, h] activations


def check_sequence(length: int, group: ProcessGroup | None) -> None:
    """Sequence parallelism cuts the sequence into t equal shards."""
    t = group_size(group)
    if length % t:
        raise ParallelConfigError(f"sequence parallelism needs the sequence length {length} divisible by the "
                                  f"{t} tensor-parallel ranks")


def _will_run(edge: tuple) -> bool:
    """Whether this backward pass needs the gradient flowing into `edge` (a node's next function).

    Split backward asks for input gradients (I) and weight gradients (W) in two passes through the
    same node; torch's own `register_multi_grad_hook` asks the engine the same way."""
    node = edge[0]
    return node is not None and torch._C._will_engine_execute_node(node)


class _GatheredLinear(torch.autograd.Function):
    """y = all-gather(x) Wᵀ + b along the sequence, saving only the shard x (gathered again in backward).

    Backward: the input gradient g W is reduce-scattered back to the shard (every rank used the
    whole sequence with its own columns); the weight gradient gᵀ all-gather(x) is this rank's.
    Each is computed only when the pass needs it, so split backward's I reduce-scatters and its W
    gathers again, and neither does the other's collective.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: ProcessGroup | None) -> torch.Tensor:
        total = all_gather(x, group, SEQ)  # [b, s, in]
        y = F.linear(total, weight, bias)  # [b, s, out/t] (autocast: in the compute dtype)
        ctx.group, ctx.bias_dtype = group, None if bias is None else bias.dtype
        ctx.save_for_backward(x, weight)  # the shard [b, s/t, in], not the gathered input
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        edges = ctx.next_functions  # x, weight and, when there is one, bias
        to_x, to_w, to_b = _will_run(edges[0]), _will_run(edges[1]), len(edges) > 2 and _will_run(edges[2])
        grad_x = grad_w = grad_b = None
        if to_x:
            grad_total = grad.matmul(weight.to(grad.dtype))  # [b, s, in]: this rank's columns' share
            grad_x = reduce_scatter(grad_total, ctx.group, SEQ).to(x.dtype)  # [b, s/t, in], summed over the group
        g2 = grad.reshape(-1, grad.shape[-1])
        if to_w:
            total = all_gather(x, ctx.group, SEQ).to(grad.dtype)  # [b, s, in] again
            grad_w = g2.t().matmul(total.reshape(-1, total.shape[-1])).to(weight.dtype)  # [out/t, in]
        if to_b and ctx.bias_dtype is not None:
            grad_b = g2.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None


class SequenceParallelLayerNorm(nn.LayerNorm):
    """A LayerNorm on the sequence shard [b, s/t, h]; weights replicated, their gradients summed over `group`."""

    def __init__(self, shape: int, group: ProcessGroup | None, eps: float = 1e-5) -> None:
        super().__init__(shape, eps=eps)
        self.group, self.sum_in_backward = group, True

    @classmethod
    def from_dense(cls, ln: nn.LayerNorm, group: ProcessGroup | None) -> SequenceParallelLayerNorm:
        layer = cls(ln.normalized_shape[0], group, ln.eps)
        layer.load_state_dict(ln.state_dict())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s/t, h]
        if not self.sum_in_backward:  # the pipeline sums the gradients once per step
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return F.layer_norm(x, self.normalized_shape, copy_to_group(self.weight, self.group),
                            copy_to_group(self.bias, self.group), self.eps)


def layer_norm_for(ln: nn.LayerNorm, group: ProcessGroup | None, sequence_parallel: bool) -> nn.LayerNorm:
    """A copy of `ln` for this rank: on the sequence shard with `sequence_parallel`, else plain (replicated input)."""
    return SequenceParallelLayerNorm.from_dense(ln, group) if sequence_parallel else copy.deepcopy(ln)


class ColumnParallelLinear(nn.Module):
    """Y = X Aᵀ + b with A [out, in] split by output features: this rank holds A[block, :] [out/t, in].

    Input [..., in] replicated (f: identity forward, all-reduce of the input gradient backward);
    output [..., out/t], or [..., out] replicated with `gather_output`.  With `sequence_parallel`
    the input is the shard [b, s/t, in], all-gathered along the sequence (reduce-scatter backward).
    """

    def __init__(self, in_features: int, out_features: int, group: ProcessGroup | None, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False) -> None:
        super().__init__()
        if gather_output and sequence_parallel:
            raise ParallelConfigError("a column-parallel linear cannot both gather its output and take a sequence "
                                      "shard")
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        local = _split(out_features, group_size(group), "output features")
        self.weight = nn.Parameter(torch.empty(local, in_features))  # [out/t, in]
        self.bias = nn.Parameter(torch.zeros(local)) if bias else None  # [out/t]
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: ProcessGroup | None, gather_output: bool = False,
                   out_order: torch.Tensor | None = None, sequence_parallel: bool = False) -> ColumnParallelLinear:
        """Slice a dense `nn.Linear`; `out_order` permutes its output features first (qkv head grouping)."""
        layer = cls(linear.in_features, linear.out_features, group, linear.bias is not None, gather_output,
                    sequence_parallel)
        w, b = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
        if out_order is not None:
            w, b = w[out_order], None if b is None else b[out_order]
        block = _block(linear.out_features, group)
        with torch.no_grad():
            layer.weight.copy_(w[block])
            if b is not None:
                layer.bias.copy_(b[block])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and group_size(self.group) > 1:
            return _GatheredLinear.apply(x, self.weight, self.bias, self.group)  # [b, s/t, in] → [b, s, out/t]
        x = copy_to_group(x, self.group)  # [..., in], gradient all-reduced
        y = F.linear(x, self.weight, self.bias)  # [..., out/t]
        return gather_replicated(y, self.group, -1) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X Aᵀ + b with A [out, in] split by input features: this rank holds A[:, block] [out, in/t].

    Input [..., in/t] (the output of a column-parallel layer); the partial products are
    summed by g (all-reduce forward, identity backward) and the bias is added once, after
    the sum, so it is not counted t times; output [..., out] replicated.  With `sequence_parallel`
    the partial sums are reduce-scattered along the sequence to [b, s/t, out] (all-gather
    backward) and the bias, added on the shard, has its gradient summed over the group.
    """

    def __init__(self, in_features: int, out_features: int, group: ProcessGroup | None, bias: bool = True,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.sequence_parallel, self.sum_in_backward = group, sequence_parallel, True
        self.in_features, self.out_features = in_features, out_features
        local = _split(in_features, group_size(group), "input features")
        self.weight = nn.Parameter(torch.empty(out_features, local))  # [out, in/t]
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None  # [out], replicated
        mark_replicated(self.bias, group)
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: ProcessGroup | None,
                   sequence_parallel: bool = False) -> RowParallelLinear:
        layer = cls(linear.in_features, linear.out_features, group, linear.bias is not None, sequence_parallel)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.detach()[:, _block(linear.in_features, group)])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.detach())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in/t]
        if self.sequence_parallel:
            y = scatter_along(F.linear(x, self.weight), self.group, SEQ)  # [b, s/t, out], summed over the group
            if self.bias is None:
                return y
            return y + (copy_to_group(self.bias, self.group) if self.sum_in_backward else self.bias)
        y = reduce_from_group(F.linear(x, self.weight), self.group)  # [..., out], summed over the group
        return y if self.bias is None else y + self.bias


class ParallelMLP(nn.Module):
    """fc column-parallel, GELU on [..., ffn/t] locally, proj row-parallel: one all-reduce each way."""

    def __init__(self, fc: ColumnParallelLinear, proj: RowParallelLinear) -> None:
        super().__init__()
        self.fc, self.proj = fc, proj

    @classmethod
    def from_dense(cls, mlp: DenseMLP, group: ProcessGroup | None, sequence_parallel: bool = False) -> ParallelMLP:
        sp = sequence_parallel
        return cls(ColumnParallelLinear.from_dense(mlp.fc, group, sequence_parallel=sp),
                   RowParallelLinear.from_dense(mlp.proj, group, sequence_parallel=sp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h] (SP: [b, s/t, h])
        return self.proj(F.gelu(self.fc(x)))  # [b, s, ffn/t] inside, [b, s, h] (SP: [b, s/t, h]) out


def qkv_order(hidden: int, parts: int) -> torch.Tensor:
    """Output-feature order of a fused [q | k | v] projection so that block t of `parts` is [q_t | k_t | v_t]."""
    per = hidden // parts
    idx = [torch.arange(which * hidden + t * per, which * hidden + (t + 1) * per)
           for t in range(parts) for which in range(3)]
    return torch.cat(idx)


class ParallelSelfAttention(nn.Module):
    """Attention split by heads: this rank computes heads/t heads end to end (no communication inside)."""

    def __init__(self, qkv: ColumnParallelLinear, proj: RowParallelLinear, heads: int) -> None:
        super().__init__()
        self.qkv, self.proj = qkv, proj
        self.local_heads = _split(heads, group_size(qkv.group), "attention heads")

    @classmethod
    def from_dense(cls, attn: DenseAttention, group: ProcessGroup | None,
                   sequence_parallel: bool = False) -> ParallelSelfAttention:
        hidden, t = attn.proj.in_features, group_size(group)
        _split(attn.n_head, t, "attention heads")
        qkv = ColumnParallelLinear.from_dense(attn.qkv, group, out_order=qkv_order(hidden, t),
                                              sequence_parallel=sequence_parallel)
        return cls(qkv, RowParallelLinear.from_dense(attn.proj, group, sequence_parallel), attn.n_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h] (SP: [b, s/t, h])
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # [b, s, h/t] each: this rank's heads, the whole sequence
        return self.proj(causal_attention(q, k, v, self.local_heads))  # [b, s, h] (SP: [b, s/t, h])


class ParallelBlock(nn.Module):
    """A pre-LN GPT block; LayerNorms are replicated (their inputs and gradients are identical on every rank).

    With `sequence_parallel` the block maps the shard [b, s/t, h] to the shard: LayerNorms and
    residual adds on it, attention and MLP on the gathered sequence.
    """

    def __init__(self, ln1: nn.LayerNorm, attn: ParallelSelfAttention, ln2: nn.LayerNorm, mlp: ParallelMLP) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = ln1, attn, ln2, mlp
        mark_replicated(ln1, attn.qkv.group)
        mark_replicated(ln2, attn.qkv.group)

    @classmethod
    def from_dense(cls, block: DenseBlock, group: ProcessGroup | None,
                   sequence_parallel: bool = False) -> ParallelBlock:
        sp = sequence_parallel
        return cls(layer_norm_for(block.ln1, group, sp), ParallelSelfAttention.from_dense(block.attn, group, sp),
                   layer_norm_for(block.ln2, group, sp), ParallelMLP.from_dense(block.mlp, group, sp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, h] replicated (SP: [b, s/t, h])
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class VocabParallelEmbedding(nn.Module):
    """Embedding table [V, h] split by vocabulary: this rank holds rows [V/t block, h].

    Ids outside the block look up zeros; the g operator sums the t partial results (with
    `sequence_parallel` a reduce-scatter along the sequence gives this rank's shard of the sum).
    """

    def __init__(self, vocab: int, hidden: int, group: ProcessGroup | None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group, self.vocab, self.sequence_parallel = group, vocab, sequence_parallel
        local = _split(vocab, group_size(group), "vocabulary size")
        self.start = group_rank(group) * local
        self.weight = nn.Parameter(torch.randn(local, hidden))  # [V/t, h]

    @classmethod
    def from_dense(cls, emb: nn.Embedding, group: ProcessGroup | None,
                   sequence_parallel: bool = False) -> VocabParallelEmbedding:
        layer = cls(emb.num_embeddings, emb.embedding_dim, group, sequence_parallel)
        with torch.no_grad():
            layer.weight.copy_(emb.weight.detach()[_block(emb.num_embeddings, group)])
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [b, s] int
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        y = F.embedding(local.masked_fill(outside, 0), self.weight)  # [b, s, h]
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            check_sequence(ids.shape[SEQ], self.group)
            return scatter_along(y, self.group, SEQ)  # [b, s/t, h] this rank's shard of the sum
        return reduce_from_group(y, self.group)  # [b, s, h] replicated


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: ProcessGroup | None,
                vocab_start: int) -> torch.Tensor:
        # logits [..., V/t] this rank's vocabulary block; target [...] global ids
        logits = logits.float()
        m = logits.max(dim=-1).values  # [...]
        all_reduce(m, group, ReduceOp.MAX)  # the global max: exp() cannot overflow
        z = logits - m.unsqueeze(-1)  # [..., V/t]
        e = z.exp()
        local_t = target - vocab_start
        inside = (local_t >= 0) & (local_t < logits.shape[-1])
        safe_t = local_t.masked_fill(~inside, 0)
        target_z = z.gather(-1, safe_t.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)  # [...]
        stats = torch.stack([e.sum(dim=-1), target_z])  # [2, ...]: Σ exp and the target logit, one message
        all_reduce(stats, group)
        sum_e, target_z = stats[0], stats[1]
        ctx.save_for_backward(e.div_(sum_e.unsqueeze(-1)), safe_t, inside)  # softmax of this block
        return sum_e.log() - target_z  # [...] per-token loss, identical on every rank

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, safe_t, inside = ctx.saved_tensors
        g = softmax.clone()  # d loss / d logits = softmax - onehot(target), this block only
        g.scatter_add_(-1, safe_t.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: ProcessGroup | None,
                                 vocab_start: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy of vocabulary-split logits [..., V/t] without gathering them: [...].

    `vocab_start` is the first id of this rank's block (default: group rank × V/t).
    """
    if vocab_start is None:
        vocab_start = group_rank(group) * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start)


# ------------------------------------------------------------------------ sequence-parallel weights, once a step


def defer_grad_sum(module: nn.Module) -> int:
    """Leave the tp sum of the gradients of `module`'s weights applied to sequence shards to the pipeline.

    Their layers stop summing in each backward and the weights are marked; `Pipeline` then sums them
    once per step (runtime/finalize.py).  Returns how many parameters were marked.
    """
    marked = 0
    for m in module.modules():
        sp = isinstance(m, SequenceParallelLayerNorm) or (isinstance(m, RowParallelLinear) and m.sequence_parallel)
        if not sp or group_size(m.group) == 1:
            continue
        m.sum_in_backward = False
        for p in (m.weight, m.bias) if isinstance(m, SequenceParallelLayerNorm) else (m.bias,):
            if p is not None:
                param_sum_grad_later(p)
                marked += 1
    return marked
