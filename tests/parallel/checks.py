"""Helpers the worker-side checks share: differences against a dense reference, expected gradients."""

from __future__ import annotations

import copy

import torch
from torch import nn

Errors = dict[str, tuple[float, float]]  # name -> (max |parallel - reference|, max |reference|)


def diff(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    if got is None:
        return (float("inf"), 0.0)
    if got.shape != want.shape:
        raise AssertionError(f"shape {tuple(got.shape)} != reference {tuple(want.shape)}")
    return float((got.detach() - want.detach()).abs().max()), float(want.detach().abs().max())


def grads_as_module(dense: nn.Module) -> nn.Module:
    """A copy of `dense` whose parameter values are its gradients: slicing it like the weights gives expected local grads."""
    g = copy.deepcopy(dense)
    with torch.no_grad():
        for p, src in zip(g.parameters(), dense.parameters()):
            p.copy_(src.grad)
    return g


def param_grads(errs: Errors, prefix: str, parallel: nn.Module, expected: nn.Module) -> None:
    got = dict(parallel.named_parameters())
    want = dict(expected.named_parameters())
    assert got.keys() == want.keys(), (got.keys(), want.keys())
    for name in got:
        errs[f"{prefix}: grad {name}"] = diff(got[name].grad, want[name])


def failures(per_rank: list[Errors], prefix: str, atol: float, rtol: float) -> list[str]:
    bad = []
    for rank, errs in enumerate(per_rank):
        names = [n for n in errs if n.startswith(prefix + ":")]
        assert names, f"no checks named {prefix!r} on rank {rank}"
        for n in names:
            err, mag = errs[n]
            if not err <= atol + rtol * mag:
                bad.append(f"rank {rank} {n}: max error {err:.3g} (reference magnitude {mag:.3g})")
    return bad
