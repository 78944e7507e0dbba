"""3-D tensor parallelism (q = 2, 8 processes) equals the dense layers, and moves the bytes of the formula.

Each rank holds [b/q², …, h/q] blocks; references are the dense modules on the full tensors,
compared on this rank's block (`Cube3D.split_input` of the layout the layer promises).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from checks import Errors, diff, failures, grads_as_module, param_grads
from torch import nn

from pipedsl.models.gpt import model as gpt
from pipedsl.parallel import (
    Block3D,
    Classifier3D,
    Embedding3D,
    LayerNorm3D,
    Linear3D,
    ParallelConfig,
    ParallelMesh,
    count_comm,
    loss_value,
)
from pipedsl.parallel.tp1d import qkv_order

Q = 2
B, S, H, HEADS, V = 8, 4, 16, 4, 32  # B and V divisible by q², H by q², HEADS by q


def _check(errs: Errors, name: str, dense: nn.Module, par: nn.Module, expected, x: torch.Tensor,
           in_cube, out_cube) -> None:
    """`expected()` builds the module of expected local gradients once the dense ones exist."""
    dense.zero_grad(set_to_none=True)
    xd = x.clone().requires_grad_()
    yd = dense(xd)
    w_out = torch.randn(yd.shape, generator=torch.Generator().manual_seed(11))
    (yd * w_out).sum().backward()
    xp = in_cube.split_input(x).requires_grad_()
    yp = par(xp)
    (yp * out_cube.split_input(w_out)).sum().backward()
    errs[f"{name}: output"] = diff(yp, out_cube.split_input(yd))
    errs[f"{name}: input grad"] = diff(xp.grad, in_cube.split_input(xd.grad))
    param_grads(errs, name, par, expected())


def tp3d_job() -> Errors:
    mesh = ParallelMesh(ParallelConfig(tp=Q ** 3, tp_mode="3d"))
    cube = mesh.cube
    sw = cube.swapped()
    g = torch.Generator().manual_seed(0)
    errs: Errors = {}
    x = torch.randn(B, S, H, generator=g)

    lin = gpt.randomize_(nn.Linear(H, 2 * H), g)
    _check(errs, "linear", lin, Linear3D.from_dense(lin, cube), lambda: _expected_linear(lin, cube), x, cube, sw)

    # the next linear takes the previous one's output layout: cube' in, cube out
    x2 = torch.randn(B, S, 2 * H, generator=g)
    lin2 = gpt.randomize_(nn.Linear(2 * H, H), g)
    _check(errs, "linear swapped", lin2, Linear3D.from_dense(lin2, sw), lambda: _expected_linear(lin2, sw), x2, sw, cube)

    mlp = gpt.randomize_(gpt.MLP(gpt.GPTConfig(n_embd=H)), g)
    fc, proj = Linear3D.from_dense(mlp.fc, cube), Linear3D.from_dense(mlp.proj, sw)
    par_mlp = nn.Sequential(fc, nn.GELU(), proj)
    dense_mlp = nn.Sequential(mlp.fc, nn.GELU(), mlp.proj)
    _check(errs, "mlp", dense_mlp, par_mlp,
           lambda: nn.Sequential(_expected_linear(mlp.fc, cube), nn.GELU(), _expected_linear(mlp.proj, sw)),
           x, cube, cube)

    ln = gpt.randomize_(nn.LayerNorm(H), g)
    _check(errs, "layernorm", ln, LayerNorm3D.from_dense(ln, cube),
           lambda: LayerNorm3D.from_dense(grads_as_module(ln), cube), x, cube, cube)

    block = gpt.randomize_(gpt.Block(gpt.GPTConfig(n_embd=H, n_head=HEADS)), g)
    par_block = Block3D.from_dense(block, cube)
    block.zero_grad(set_to_none=True)
    xd = x.clone().requires_grad_()
    yd = block(xd)
    w_out = torch.randn(yd.shape, generator=g)
    (yd * w_out).sum().backward()
    expected = Block3D.from_dense(grads_as_module(block), cube)
    xp = cube.split_input(x).requires_grad_()
    with count_comm() as c_block:
        yp = par_block(xp)
        (yp * cube.split_input(w_out)).sum().backward()
    errs["block: output"] = diff(yp, cube.split_input(yd))
    errs["block: input grad"] = diff(xp.grad, cube.split_input(xd.grad))
    param_grads(errs, "block", par_block, expected)

    # embedding: ids and output in the same orientation
    emb = gpt.randomize_(nn.Embedding(V, H), g)
    ids = torch.randint(0, V, (B, S), generator=g)
    pemb = Embedding3D.from_dense(emb, cube)
    w_out = torch.randn(B, S, H, generator=g)
    (emb(ids) * w_out).sum().backward()
    yp = pemb(ids[cube.row_block(B)])
    (yp * cube.split_input(w_out)).sum().backward()
    errs["embedding: output"] = diff(yp, cube.split_input(emb(ids)))
    rows, cols = pemb.block()
    errs["embedding: grad weight"] = diff(pemb.weight.grad, emb.weight.grad[rows, cols])

    # vocabulary-parallel classifier and loss (logits never gathered)
    head = gpt.randomize_(nn.Linear(H, V), g)
    target = torch.randint(0, V, (B, S), generator=g)
    xd = x.clone().requires_grad_()
    logits_d = head(xd)
    loss_d = F.cross_entropy(logits_d.reshape(-1, V), target.reshape(-1))
    loss_d.backward()
    clf = Classifier3D.from_dense(head, cube)
    xp = cube.split_input(x).requires_grad_()
    logits = clf(xp)
    with count_comm() as c_loss:
        local = clf.loss(logits, target[clf.out_cube.row_block(B)], B * S)
    local.backward()
    errs["classifier: logits"] = diff(logits, clf.out_cube.split_input(logits_d))
    errs["classifier: loss"] = diff(loss_value(local, cube), loss_d)
    errs["classifier: input grad"] = diff(xp.grad, cube.split_input(xd.grad))
    exp_head = Classifier3D.from_dense(grads_as_module(head), cube)
    param_grads(errs, "classifier", clf, exp_head)
    errs["classifier: loss only all-reduces"] = (0.0, 0.0) if set(c_loss.by_op()) == {"all_reduce"} else (1.0, 0.0)

    # communication of one linear without bias, forward + backward, against 2(q-1)/q³ (b·in + b·out + in·out)
    nb = Linear3D.from_dense(nn.Linear(H, 2 * H, bias=False), cube)
    xb = cube.split_input(x).requires_grad_()
    with count_comm() as c:
        nb(xb).sum().backward()
    tokens = B * S
    want = 2 * (Q - 1) / Q ** 3 * (tokens * H + tokens * 2 * H + H * 2 * H) * 4
    errs["linear comm: bytes"] = (abs(c.total - want), want)
    errs["linear comm: by op"] = (0.0, 0.0) if set(c.by_op()) == {"all_gather", "reduce_scatter"} else (1.0, 0.0)
    errs["block comm: counted"] = (0.0, 0.0) if c_block.total > 0 else (1.0, 0.0)
    return errs


def _expected_linear(lin: nn.Linear, cube) -> Linear3D:
    return Linear3D.from_dense(grads_as_module(lin), cube)


CHECKS = ["linear", "linear swapped", "mlp", "layernorm", "block", "embedding", "classifier"]


@pytest.mark.parametrize("check", CHECKS)
def test_layer_equals_dense(run_once, check):
    """Each 3-D layer on a q=2 cube: output, input gradient and every parameter gradient equal the dense module's on
    the full tensors, compared on this rank's block (atol and rtol 3e-6)."""
    assert not failures(run_once(tp3d_job, Q ** 3), check, atol=3e-6, rtol=3e-6)


def test_linear_communication_matches_the_formula(run_once):
    """A bias-free Linear3D's forward and backward move exactly the bytes of the reference formula
    2(q-1)/q³ · (b·in + b·out + in·out) · 4 bytes, by all-gathers and reduce-scatters only."""
    assert not failures(run_once(tp3d_job, Q ** 3), "linear comm", atol=0, rtol=0)


def test_the_embeddings_backward_makes_its_gradient_where_its_inputs_are(monkeypatch):
    """The vocabulary gradient is accumulated on the device of the incoming gradient: it was made on the CPU,
    and a GPU's index_add_ into it failed.  The meta device stands for a GPU (a CPU tensor is refused alike);
    the cube's collectives are identities on one rank."""
    from types import SimpleNamespace

    from pipedsl.parallel import tp3d

    monkeypatch.setattr(tp3d, "all_gather", lambda t, group, dim: t)
    monkeypatch.setattr(tp3d, "reduce_scatter", lambda t, group, dim: t)
    cube = SimpleNamespace(input=None, weight=None, a_in=0)
    w = torch.empty(8, 4, device="meta", requires_grad=True)
    ids = torch.zeros(2, 3, dtype=torch.long, device="meta")
    tp3d._Embedding3D.apply(ids, w, cube).sum().backward()
    assert w.grad is not None and w.grad.device.type == "meta"


def test_qkv_order_groups_heads_per_block():
    order = qkv_order(hidden=4, parts=2)
    # block 0 = q[0:2] k[0:2] v[0:2], block 1 = q[2:4] k[2:4] v[2:4] of the fused [q | k | v] columns
    assert order.tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
