"""1-D tensor parallelism equals the dense layers: outputs, input gradients, weight and bias gradients.

One job per tp size runs every check on tp ranks and returns the differences; the tests read them.
References are the dense modules on the full data, with the weights the parallel ones are sliced from.
torch's DTensor tensor parallel (ColwiseParallel / RowwiseParallel) is a second oracle for the MLP.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from checks import Errors, diff, failures, grads_as_module, param_grads
from torch import nn

from pipedsl.models.gpt import model as gpt
from pipedsl.parallel import (
    ColumnParallelLinear,
    ParallelBlock,
    ParallelConfig,
    ParallelMesh,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    VocabParallelEmbedding,
    count_comm,
    vocab_parallel_cross_entropy,
)

pytestmark = pytest.mark.slow

B, S, H, HEADS, V = 4, 6, 16, 4, 24


def _check_layer(errs: Errors, name: str, dense: nn.Module, par: nn.Module, x: torch.Tensor,
                 x_local: torch.Tensor, out_block, x_block) -> None:
    """Same loss weights on both sides: dense on full x, parallel on this rank's x; compare everything."""
    dense.zero_grad(set_to_none=True)
    w_out = torch.randn(dense(x).shape, generator=torch.Generator().manual_seed(7))
    xd = x.clone().requires_grad_()
    yd = dense(xd)
    (yd * w_out).sum().backward()
    xp = x_local.clone().requires_grad_()
    yp = par(xp)
    (yp * out_block(w_out)).sum().backward()
    errs[f"{name}: output"] = diff(yp, out_block(yd))
    errs[f"{name}: input grad"] = diff(xp.grad, x_block(xd.grad))
    expected = type(par).from_dense(grads_as_module(dense), par_group(par))
    param_grads(errs, name, par, expected)


def par_group(par: nn.Module):
    for m in par.modules():
        if hasattr(m, "group"):
            return m.group
    raise AssertionError("no group")


def tp1d_job(tp: int) -> Errors:
    """Every 1-D tensor-parallel layer against its dense module on the same data (the checks in CHECKS), in one world;
    the sections draw from one generator in a fixed order, so every rank builds the same weights and data."""
    mesh = ParallelMesh(ParallelConfig(tp=tp))
    group = mesh.tp_group
    g = torch.Generator().manual_seed(0)  # the same dense weights and data on every rank
    errs: Errors = {}
    r, t = dist.get_rank(group), tp
    x = torch.randn(B, S, H, generator=g)
    dense = _check_layers(errs, group, g, r, t, x)
    dense["emb"] = _check_vocabulary_parallel(errs, group, g, r, t, x)
    _check_mlp_comm(errs, group, t, x, dense["mlp"])
    _check_sequence_parallel(errs, group, g, r, t, dense)
    _check_against_dtensor(errs, mesh, group, g, x, dense["mlp"])
    return errs


def _cols(r: int, t: int, n: int):
    return lambda a: a[..., r * n // t:(r + 1) * n // t]


def _full(a):
    return a


def _check_layers(errs: Errors, group, g: torch.Generator, r: int, t: int, x: torch.Tensor) -> dict[str, nn.Module]:
    """Column, row, MLP, attention and block against their dense modules; the dense modules, for the later sections."""
    col = gpt.randomize_(nn.Linear(H, 3 * H), g)
    _check_layer(errs, "column", col, ColumnParallelLinear.from_dense(col, group), x, x, _cols(r, t, 3 * H), _full)
    colg = ColumnParallelLinear.from_dense(col, group, gather_output=True)
    _check_layer(errs, "column gathered", col, colg, x, x, _full, _full)

    x4 = torch.randn(B, S, 4 * H, generator=g)
    row = gpt.randomize_(nn.Linear(4 * H, H), g)
    _check_layer(errs, "row", row, RowParallelLinear.from_dense(row, group), x4, _cols(r, t, 4 * H)(x4), _full,
                 _cols(r, t, 4 * H))

    mlp = gpt.randomize_(gpt.MLP(gpt.GPTConfig(n_embd=H)), g)
    _check_layer(errs, "mlp", mlp, ParallelMLP.from_dense(mlp, group), x, x, _full, _full)

    attn = gpt.randomize_(gpt.CausalSelfAttention(gpt.GPTConfig(n_embd=H, n_head=HEADS)), g)
    _check_layer(errs, "attention", attn, ParallelSelfAttention.from_dense(attn, group), x, x, _full, _full)

    block = gpt.randomize_(gpt.Block(gpt.GPTConfig(n_embd=H, n_head=HEADS)), g)
    _check_layer(errs, "block", block, ParallelBlock.from_dense(block, group), x, x, _full, _full)
    return {"col": col, "row": row, "mlp": mlp, "block": block}


def _check_vocabulary_parallel(errs: Errors, group, g: torch.Generator, r: int, t: int, x: torch.Tensor) -> nn.Module:
    """The vocabulary-parallel embedding, cross-entropy (never gathering the logits) and a language-model head; the
    dense embedding, for the sequence-parallel section."""
    emb = gpt.randomize_(nn.Embedding(V, H), g)
    ids = torch.randint(0, V, (B, S), generator=g)
    pemb = VocabParallelEmbedding.from_dense(emb, group)
    w_out = torch.randn(B, S, H, generator=g)
    yd = emb(ids)
    (yd * w_out).sum().backward()
    yp = pemb(ids)
    (yp * w_out).sum().backward()
    errs["embedding: output"] = diff(yp, yd)
    errs["embedding: grad weight"] = diff(pemb.weight.grad, emb.weight.grad[r * V // t:(r + 1) * V // t])

    logits = (3 * torch.randn(B, S, V, generator=g)).requires_grad_()
    target = torch.randint(0, V, (B, S), generator=g)
    dense_loss = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))
    dense_loss.backward()
    local = logits.detach()[..., r * V // t:(r + 1) * V // t].clone().requires_grad_()
    with count_comm() as c:
        loss = vocab_parallel_cross_entropy(local, target, group).mean()
    loss.backward()
    errs["cross-entropy: loss"] = diff(loss, dense_loss)
    errs["cross-entropy: logits grad"] = diff(local.grad, logits.grad[..., r * V // t:(r + 1) * V // t])
    errs["cross-entropy: no logits gathered"] = (float(c.calls.get(("all_gather", "tp"), 0)), 0.0)
    # a language-model head: column-parallel projection + vocabulary-parallel loss
    head = gpt.randomize_(nn.Linear(H, V), g)
    hd = x.clone().requires_grad_()
    F.cross_entropy(head(hd).reshape(-1, V), target.reshape(-1)).backward()
    phead = ColumnParallelLinear.from_dense(head, group)
    hp = x.clone().requires_grad_()
    lp = vocab_parallel_cross_entropy(phead(hp), target, group).mean()
    lp.backward()
    errs["lm head: input grad"] = diff(hp.grad, hd.grad)
    param_grads(errs, "lm head", phead, ColumnParallelLinear.from_dense(grads_as_module(head), group))
    return emb


def _check_mlp_comm(errs: Errors, group, t: int, x: torch.Tensor, mlp: nn.Module) -> None:
    """The communication of an MLP: one all-reduce of [b, s, h] forward, one backward."""
    with count_comm() as c:
        ParallelMLP.from_dense(mlp, group)(x.clone().requires_grad_()).sum().backward()
    want = 2 * 2 * (t - 1) / t * B * S * H * 4
    errs["mlp comm: bytes"] = (abs(c.total - want), want)
    errs["mlp comm: all-reduce calls"] = (abs(sum(c.calls.values()) - 2), 2.0)
    errs["mlp comm: seconds of each collective timed"] = (float(not all(c.seconds[k] > 0 for k in c.calls)), 0.0)
    errs["mlp comm: seconds per collective only"] = (float(set(c.seconds) != set(c.calls)), 0.0)


def _check_sequence_parallel(errs: Errors, group, g: torch.Generator, r: int, t: int, dense: dict) -> None:
    """Sequence parallelism: sequence shards [b, s/t, h] in and out, the whole sequence inside (s = 8 splits at t 2,
    4)."""
    col, row, block, emb, mlp = (dense[k] for k in ("col", "row", "block", "emb", "mlp"))
    xs, x4s, S8 = torch.randn(B, 8, H, generator=g), torch.randn(B, 8, 4 * H, generator=g), 8

    def seq(a):
        return a[:, r * S8 // t:(r + 1) * S8 // t]

    _check_layer(errs, "sp column", col, ColumnParallelLinear.from_dense(col, group, sequence_parallel=True), xs,
                 seq(xs), _cols(r, t, 3 * H), seq)
    _check_layer(errs, "sp row", row, RowParallelLinear.from_dense(row, group, sequence_parallel=True), x4s,
                 _cols(r, t, 4 * H)(x4s), seq, _cols(r, t, 4 * H))
    _check_layer(errs, "sp block", block, ParallelBlock.from_dense(block, group, sequence_parallel=True), xs, seq(xs),
                 seq, seq)
    ids8 = torch.randint(0, V, (B, S8), generator=g)
    emb.zero_grad()
    w_out = torch.randn(B, S8, H, generator=g)
    (emb(ids8) * w_out).sum().backward()
    semb = VocabParallelEmbedding.from_dense(emb, group, sequence_parallel=True)
    ys = semb(ids8)
    (ys * seq(w_out)).sum().backward()
    errs["sp embedding: output"] = diff(ys, seq(emb(ids8)))
    errs["sp embedding: grad weight"] = diff(semb.weight.grad, emb.weight.grad[r * V // t:(r + 1) * V // t])
    # an MLP with SP: all-gather + reduce-scatter forward, reduce-scatter + all-gather + the input gathered again
    # backward: 5 (t-1)/t of [b, s, h] against tp's 2 all-reduces each way, 4 (t-1)/t; the only all-reduce left
    # is the gradient of the row-parallel bias [h], added on the shard
    with count_comm() as c:
        ParallelMLP.from_dense(mlp, group, sequence_parallel=True)(seq(xs).clone().requires_grad_()).sum().backward()
    want = 5 * (t - 1) / t * B * S8 * H * 4
    got = c.by_op()
    errs["sp mlp comm: bytes"] = (abs(got["all_gather"] + got["reduce_scatter"] - want), want)
    errs["sp mlp comm: bias all-reduce"] = (abs(got["all_reduce"] - 2 * (t - 1) / t * H * 4), 0.0)
    errs["sp mlp comm: calls"] = (abs(sum(c.calls.values()) - 6), 0.0)


def _check_against_dtensor(errs: Errors, mesh, group, g: torch.Generator, x: torch.Tensor, mlp: nn.Module) -> None:
    """torch's DTensor tensor parallelism as a second oracle for the MLP."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    ref = parallelize_module(copy.deepcopy(mlp), mesh.device_mesh["tp"],
                             {"0": ColwiseParallel(), "2": RowwiseParallel()})  # mlp.fc, mlp.proj
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    w = torch.randn(B, S, H, generator=g)
    yr = ref(xr)
    (yr * w).sum().backward()
    ours = ParallelMLP.from_dense(mlp, group)
    yo = ours(xo)
    (yo * w).sum().backward()
    errs["dtensor mlp: output"] = diff(yo, yr)
    errs["dtensor mlp: input grad"] = diff(xo.grad, xr.grad)
    errs["dtensor mlp: grad fc.weight"] = diff(ours.fc.weight.grad, ref.fc.weight.grad.to_local())
    errs["dtensor mlp: grad fc.bias"] = diff(ours.fc.bias.grad, ref.fc.bias.grad.to_local())
    errs["dtensor mlp: grad proj.weight"] = diff(ours.proj.weight.grad, ref.proj.weight.grad.to_local())
    errs["dtensor mlp: grad proj.bias"] = diff(ours.proj.bias.grad, ref.proj.bias.grad.full_tensor())


CHECKS = ["column", "column gathered", "row", "mlp", "attention", "block", "embedding", "cross-entropy", "lm head",
          "dtensor mlp", "sp column", "sp row", "sp block", "sp embedding"]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("check", CHECKS)
def test_layer_equals_dense(run_once, tp, check):
    """Each layer at tp 2 and 4: output, input gradient and every weight and bias gradient equal the dense module's on
    the full data, on this rank's slice (atol and rtol 2e-6); "dtensor mlp" equals torch's Colwise/RowwiseParallel."""
    per_rank = run_once(tp1d_job, tp, tp)
    assert not failures(per_rank, check, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("tp", [2, 4])
def test_mlp_communication_is_two_all_reduces_of_b_s_h(run_once, tp):
    per_rank = run_once(tp1d_job, tp, tp)
    assert not failures(per_rank, "mlp comm", atol=0, rtol=0)


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_mlp_communication_is_reduce_scatters_and_all_gathers(run_once, tp):
    per_rank = run_once(tp1d_job, tp, tp)
    assert not failures(per_rank, "sp mlp comm", atol=0, rtol=0)


@pytest.mark.parametrize("tp", [2, 4])
def test_cross_entropy_gathers_no_logits(run_once, tp):
    assert all(errs["cross-entropy: no logits gathered"][0] == 0 for errs in run_once(tp1d_job, tp, tp))
