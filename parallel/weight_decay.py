"""Weight decay on some parameters only: biases, norms and embeddings are exempt by choice.

HF Trainer, torchtitan and Megatron-LM decay matrices only: decaying a norm's gain or a bias pulls it
towards 0, which nothing in the model wants, and an embedding row is decayed on every step although
its token appears in few batches.  With one optimizer over whole tensors that is two param groups;
ZeRO's optimizer, however, steps flat buffers in which a block's matrices, biases and norms sit side by
side in one tensor.  So decay is applied here, on element ranges, and the optimizer underneath is built
with `weight_decay=0`: the same arithmetic torch's optimizers do, in the same order —

    decoupled (AdamW, Adam(decoupled_weight_decay=True)):  p ← p·(1 − lr·wd), before the update
    coupled (Adam, SGD):                                   g ← g + wd·p,      before the update

— so a run equals one process whose optimizer has a decayed and an exempt param group, bit for bit
on the same arithmetic (tests/parallel/test_weight_decay.py).  Other optimizers keep their own decay
and accept no exemption.  One mechanism serves replicated parameters (whole tensors) and ZeRO's flat
buffers (ranges); optimizer state and checkpoints keep their one param group.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipedsl.arguments import NO_DECAY_KINDS
from pipedsl.parallel.config import ParallelConfigError

__all__ = ["NO_DECAY_KINDS", "Decay", "exempt_names", "merged", "split_decay"]


def exempt_names(module: nn.Module, kinds: Collection[str], tied: Iterable[str] = ()) -> set[str]:
    """The qualified names (every name of a shared parameter) of `module`'s parameters weight decay skips:
    biases (a name ending in "bias"), the parameters of normalization layers (a class named *Norm*) and those of
    embeddings (an nn.Embedding or a class named *Embedding*).  `tied`: names tied to another stage's copy
    (runtime/ties.py) — pipelines tie an embedding to its head, so they count as embeddings, and every copy of
    a tied weight is decayed alike."""
    out: set[str] = set()
    for path, m in module.named_modules(remove_duplicate=False):
        cls = type(m).__name__.lower()
        for attr, _ in m.named_parameters(recurse=False):
            name = f"{path}.{attr}" if path else attr
            if (("biases" in kinds and attr.lower().endswith("bias"))
                    or ("norms" in kinds and "norm" in cls)
                    or ("embeddings" in kinds and (isinstance(m, nn.Embedding) or "embedding" in cls))):
                out.add(name)
    if "embeddings" in kinds:
        out.update(tied)
    names_of: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    for names in names_of.values():  # a parameter held twice is exempt when either place is
        if any(n in out for n in names):
            out.update(names)
    return out


@dataclass
class Decay:
    """Weight decay `wd` applied on chosen element ranges of the tensors an optimizer steps (the module
    docstring).  `spans`: (stepped tensor, its decayed [start, end) ranges of the flattened tensor, or None for
    the whole tensor); tensors not listed are exempt."""

    wd: float
    decoupled: bool
    spans: list[tuple[torch.Tensor, list[tuple[int, int]] | None]] = field(default_factory=list)

    def hold(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep `optimizer` (built with weight_decay=0) from decaying for good: `load_state_dict` restores the saved
        groups' hyperparameters, and a checkpoint of a run without exemptions saved its decay there."""

        def undecayed(opt: torch.optim.Optimizer) -> None:
            for group in opt.param_groups:
                group["weight_decay"] = 0.0

        optimizer.register_load_state_dict_post_hook(undecayed)

    def apply(self, optimizer: torch.optim.Optimizer) -> None:
        """Decay before `optimizer.step()`, as the optimizer itself would (a tensor without a gradient is skipped,
        as torch's optimizers skip it)."""
        lr = float(optimizer.param_groups[0]["lr"])
        with torch.no_grad():
            for p, ranges in self.spans:
                if p.grad is None:
                    continue
                if ranges is None:
                    if self.decoupled:
                        p.mul_(1 - lr * self.wd)
                    else:
                        p.grad.add_(p, alpha=self.wd)
                    continue
                flat, grad = p.view(-1), p.grad.view(-1)
                for a, b in ranges:
                    if self.decoupled:
                        flat[a:b].mul_(1 - lr * self.wd)
                    else:
                        grad[a:b].add_(flat[a:b], alpha=self.wd)


def split_decay(optimizer_class: Callable[..., torch.optim.Optimizer],
                kwargs: dict[str, Any]) -> tuple[dict[str, Any], Decay | None]:
    """The optimizer's kwargs with weight_decay=0 and the `Decay` (without spans yet) that takes its place; the
    kwargs unchanged and None when they decay nothing.  Optimizers whose decay is not one of the two forms above
    are refused: an exemption would silently change their arithmetic."""
    wd = float(kwargs.get("weight_decay", 0.0) or 0.0)
    if wd == 0.0:
        return kwargs, None
    if isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.AdamW):
        decoupled = True
    elif isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Adam | torch.optim.SGD):
        decoupled = bool(kwargs.get("decoupled_weight_decay", False))
    else:
        name = getattr(optimizer_class, "__name__", type(optimizer_class).__name__)
        raise ParallelConfigError(f"no_decay: exempting parameters from weight decay supports AdamW, Adam and SGD, "
                                  f"got {name} (pass no_decay=() to keep its own decay on every parameter)")
    return {**kwargs, "weight_decay": 0.0}, Decay(wd, decoupled)


def merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Non-empty ranges in order, adjacent ones joined (one `mul_` for a block's consecutive matrices)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out
