"""Weight decay that spares biases, norms and embeddings (parallel/weight_decay.py) equals one process whose
optimizer has a decayed and an exempt param group: replicated parameters, ZeRO-1 and ZeRO-3's flat buffers (where
a block's matrices, biases and norms share one tensor), AdamW's decoupled and Adam's coupled decay."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pipedsl
from pipedsl.arguments import no_decay_kinds
from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch
from pipedsl.parallel import ParallelConfig, ParallelConfigError, ParallelMesh
from pipedsl.parallel.weight_decay import NO_DECAY_KINDS, exempt_names

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
LR, EPS, WD, STEPS = 1e-2, 1e-4, 0.5, 3  # decay moves a parameter by lr·wd = 0.5 % a step: far above the tolerance
ATOL = 2e-6
RUNS = (("AdamW", 0), ("AdamW", 1), ("AdamW", 3), ("Adam", 1))
# eps as in test_pipeline_parallel.py: 1e-8 would turn fp32 summation-order differences into 1e-5 steps


def _reference(whole: nn.Module, optimizer: str, batches, kinds) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, two param groups (torch's own weight decay on the first only)."""
    ref = copy.deepcopy(whole)
    spared = exempt_names(ref, kinds)
    named = list(ref.named_parameters())
    opt = getattr(torch.optim, optimizer)(
        [{"params": [p for n, p in named if n not in spared]},
         {"params": [p for n, p in named if n in spared], "weight_decay": 0.0}], lr=LR, eps=EPS, weight_decay=WD)
    losses = []
    for x, y in batches:
        loss = gpt_loss(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in ref.named_parameters()}


def decay_job() -> dict:
    """dp2 × pp2 GPT under each (optimizer, ZeRO level) of RUNS: the worst difference from one process with param
    groups, and from one process decaying every parameter (the negative control), on rank 0."""
    torch.manual_seed(0)
    model = GPT(CFG)
    gen = torch.Generator().manual_seed(1)
    batches = [synthetic_batch(8, CFG.block_size, CFG.vocab_size, gen) for _ in range(STEPS)]
    whole = model.stages(1)[0]  # the units [embedding, blocks…, head] under the stages' own names
    out = {}
    for optimizer, zero in RUNS:
        ref_losses, ref = _reference(whole, optimizer, batches, NO_DECAY_KINDS)
        _, decay_all = _reference(whole, optimizer, batches, ())
        mesh = ParallelMesh(ParallelConfig(dp=2, pp=2, zero=zero))
        stages = copy.deepcopy(model).stages(2)
        pipe = pipedsl.Pipeline(stages, schedule="1f1b", microbatches=2, loss_fn=gpt_loss, parallel=mesh)
        opt = pipe.optimizer(getattr(torch.optim, optimizer), lr=LR, eps=EPS, weight_decay=WD,
                                                                                no_decay=NO_DECAY_KINDS)
        losses = []
        for x, y in batches:
            losses.append(pipe.step(x, y))
            opt.step()
            opt.zero_grad()
        err = control = 0.0
        for s, named in opt.stage_parameters().items():
            for local, value in named.items():
                name = stages[s].model_name(local)
                err = max(err, float((value - ref[name]).abs().max()))
                control = max(control, float((value - decay_all[name]).abs().max()))
        worst = torch.tensor([err, control])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        out[(optimizer, zero)] = {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
                                  "params": float(worst[0]), "control": float(worst[1])}
        pipe.close()
    return out if dist.get_rank() == 0 else {}


@pytest.mark.parametrize("optimizer,zero", RUNS)
def test_spared_parameters_equal_one_process_with_param_groups(run_once, optimizer, zero):
    """dp2 × pp2 with `no_decay`, each (optimizer, ZeRO stage): losses (1e-5) and parameters after 3 steps (atol 2e-6)
    equal one process whose optimizer has a decayed and an exempt param group; decaying every parameter differs."""
    res = run_once(decay_job, 4)[0][(optimizer, zero)]
    assert res["loss"] <= 1e-5 and res["params"] <= ATOL, res
    assert res["control"] > 100 * ATOL, res  # decaying every parameter is measurably another run


def test_what_is_spared() -> None:
    """Biases, every parameter of a *Norm* class (LayerNorm, an HF RMSNorm), embeddings and tied weights; never
    a matrix of a linear layer."""

    class MyRMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

    block = nn.ModuleDict({"emb": nn.Embedding(8, 4), "norm": MyRMSNorm(), "ln": nn.LayerNorm(4),
                           "fc": nn.Linear(4, 4), "head": nn.Linear(4, 8, bias=False)})
    assert exempt_names(block, NO_DECAY_KINDS) == {"emb.weight", "norm.weight", "ln.weight", "ln.bias", "fc.bias"}
    assert exempt_names(block, ("biases",)) == {"ln.bias", "fc.bias"}
    assert exempt_names(block, ("embeddings",), tied=["head.weight"]) == {"emb.weight", "head.weight"}
    assert exempt_names(block, ()) == set()
    block["head"].weight = block["emb"].weight  # tied within the module: both names spared
    assert {"emb.weight", "head.weight"} <= exempt_names(block, ("embeddings",))


def test_no_decay_values_and_unsupported_optimizers() -> None:
    assert no_decay_kinds("biases,norms") == ("biases", "norms") and no_decay_kinds("none") == ()
    with pytest.raises(argparse.ArgumentTypeError, match="is not 'none' or some of biases"):
        no_decay_kinds("bias")
    from pipedsl.parallel.weight_decay import split_decay
    assert split_decay(torch.optim.AdamW, {"lr": 1.0})[1] is None  # no decay: the optimizer is built as given
    with pytest.raises(ParallelConfigError, match="supports AdamW, Adam and SGD, got RMSprop"):
        split_decay(torch.optim.RMSprop, {"weight_decay": 0.1})
