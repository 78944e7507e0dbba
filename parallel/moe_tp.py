"""Tensor parallelism for a mixture-of-experts block: each tp rank runs the whole block on its own
share of the tokens.

Under tensor parallelism the hidden states entering a block are the same on every tp rank (or,
with sequence parallelism, each rank holds a sequence shard).  Sharding an MoE block's experts
over tp as well would cut each expert's matrices into slivers; Megatron and torchtitan instead
keep the routed experts whole and let the tp ranks divide the *tokens*: with sequence parallelism
a rank's tokens are its shard already, without it each rank takes 1/t of the microbatch's rows
(`split_along`: backward, the rows' gradients all-gathered back) and the block's outputs are
all-gathered (`gather_replicated`: backward, each rank keeps its rows' gradient, which the layers
above give alike on every tp rank).  Inside, the router, any shared expert and the routed experts
run on those tokens only, so no FLOP is repeated over tp, and expert parallelism exchanges them
over its ep group — the ranks of the same tp index (`ParallelMesh`'s (pp, edp, ep, tp) order), as
Megatron's token dispatcher does with tp × ep.

Each tp rank's block parameters (router, shared and routed experts) thus get the gradient of its
tokens only: they are marked `param_sum_grad_later`, summed over tp once per step
(runtime/finalize.py, as the sequence-parallel norms are), and `mark_replicated`, counted once by a
global norm.  The router's auxiliary loss adds per-expert sums over tokens (models/hf/stages.py
`RouterLoss`): a rank adds its tokens' and `TokenShare.summed` adds them over tp, so the loss is
the whole microbatch's on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Shard

from pipedsl.parallel.comm import gather_replicated, group_rank, group_size, reduce_from_group, split_along
from pipedsl.parallel.config import ParallelConfigError
from pipedsl.parallel.replicated import mark_replicated, param_sum_grad_later

_WHOLE = "_pipedsl_whole_shape"  # on the token share a block received: the hidden states' shape it came from
_EVERY_TOKEN = "_pipedsl_routes_every_token"  # on a router that every tp rank runs on every token
_WAS_DTENSOR = "_pipedsl_was_dtensor"  # on a sequence shard a block received as a DTensor's local part


@dataclass(frozen=True)
class TokenShare:
    """Which tokens of a microbatch this tp rank's MoE blocks run: a sequence shard (`sequence_parallel`) or 1/t
    of the flattened rows."""

    group: ProcessGroup
    sequence_parallel: bool

    @property
    def size(self) -> int:
        return group_size(self.group)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a per-token tensor [mb, T, …] (an attention mask), flattened to [n, …] in the order
        its blocks see them."""
        r, n = group_rank(self.group), self.size
        if self.sequence_parallel:
            T = t.shape[1]
            return t[:, r * T // n:(r + 1) * T // n].reshape(-1, *t.shape[2:])
        flat = t.reshape(-1, *t.shape[2:])
        return flat[r * flat.shape[0] // n:(r + 1) * flat.shape[0] // n]

    def summed(self, t: torch.Tensor) -> torch.Tensor:
        """A sum over this rank's tokens made a sum over the microbatch's: all-reduced over tp; its gradient
        reaches every rank's part unchanged."""
        return reduce_from_group(t, self.group)


def mark_every_token(router: nn.Module) -> None:
    """Record that every tp rank runs `router` on every token of the microbatch (a router outside an MoE block:
    JetMoE's attention router), so the router loss adds its statistics as they are, not summed over tp."""
    setattr(router, _EVERY_TOKEN, True)


def routes_every_token(router: nn.Module) -> bool:
    """Whether `mark_every_token` marked `router`."""
    return getattr(router, _EVERY_TOKEN, False)


def split_tokens(block: nn.Module, share: TokenShare, tp_mesh: Any = None) -> None:
    """Run `block` (an MoE block: hidden states [mb, T, C] in, the same shape out, or a tuple led by it) on this
    rank's share of the tokens, in place (forward hooks: the parameters keep their names), and mark its
    parameters as above."""
    if share.size == 1:
        return
    block.register_forward_pre_hook(_take_share(share))
    block.register_forward_hook(_give_back(share, tp_mesh))
    params = [p for p in block.parameters() if p.requires_grad]
    for p in params:
        param_sum_grad_later(p)
    mark_replicated(params, share.group)


def _take_share(share: TokenShare):
    def hook(block: nn.Module, args: tuple) -> tuple | None:
        h = args[0]
        if share.sequence_parallel:  # a sequence shard already: a DTensor's (torch's SP) or a plain one (tp1d's)
            if not isinstance(h, DTensor):
                return None
            local = h.to_local()
            setattr(local, _WAS_DTENSOR, True)
            return (local, *args[1:])
        mb, T, C = h.shape
        if (mb * T) % share.size:
            raise ParallelConfigError(f"tensor parallelism of an MoE block ({type(block).__name__}): the microbatch's "
                                      f"{mb}·{T} tokens do not divide among tp={share.size} ranks")
        mine = split_along(h.reshape(mb * T, C), share.group)
        part = mine.view(1, mine.shape[0], C)
        setattr(part, _WHOLE, (mb, T, C))
        return (part, *args[1:])
    return hook


def _give_back(share: TokenShare, tp_mesh: Any):
    def hook(block: nn.Module, args: tuple, out: Any) -> Any:
        h = out[0] if isinstance(out, tuple) else out
        if share.sequence_parallel:  # the shard back as it came: the DTensor the layer's residual adds, or plain
            if not getattr(args[0], _WAS_DTENSOR, False):
                return None
            back = DTensor.from_local(h, tp_mesh, [Shard(1)], run_check=False)
        else:
            whole = getattr(args[0], _WHOLE)
            back = gather_replicated(h.reshape(-1, whole[2]), share.group, dim=0).view(whole)
        return (back, *out[1:]) if isinstance(out, tuple) else back
    return hook
