"""Mixture-of-Experts layers for the built-in GPT: a top-k router with its auxiliary losses, and
experts laid out as transformers' MoE models lay theirs out, so that one expert-parallel wrapper
(parallel/expert.py) serves both.

Per layer and microbatch (N tokens, E experts, top k):

    router      logits = x Wr^T [N, E]; probs = softmax(logits) in fp32; the k largest, renormalised
                to sum to 1 (Mixtral's routing)
    capacity    with `capacity_factor` c, an expert takes at most ceil(c·N·k/E) slots, first come
                (token order) first served; a dropped slot has index E and weight 0, and its token
                goes on through the residual alone (Switch Transformer).  None: dropless
    aux loss    E/N · Σ_e count_e · mean_n probs[n, e], counts before dropping (the load-balancing
                loss of transformers' `load_balancing_loss_func`, taken per layer)
    z-loss      mean_n logsumexp(logits_n)² (ST-MoE)

A layer adds aux_coef·aux + z_coef·z to a scalar that travels beside the activations, block to
block and stage to stage (a block takes and returns (hidden, that sum)); the head returns
(logits, the sum) and `gpt_loss` adds it to the cross-entropy.  So a pipeline computes one
process's loss and every gradient exactly, whatever stage each layer is on, and nothing needs the
loss scale (Megatron injects the auxiliary gradient with the scale instead).

Router statistics (tokens each expert receives, slots dropped) are counted at the experts module,
as for any MoE model of this layout (runtime/expert_load.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the usual name
from torch import nn

from pipedsl.parallel.expert import host_ints, routings


class Experts(nn.Module):
    """E two-layer GELU MLPs as 3-D weights, fc [E, F, C] and proj [E, C, F], called as transformers'
    expert modules are: `forward(x [N, C], index [N, k], weight [N, k]) -> [N, C]`, the weighted sum of
    each token's experts (index E: no expert, the slot was dropped).  `capacity_factor` is the router's: with it,
    expert parallelism exchanges fixed-size blocks (parallel/expert.py)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.capacity_factor: float | None = None
        self.fc = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.proj = nn.Parameter(torch.empty(num_experts, hidden, ffn))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        x, out = hidden_states, torch.zeros_like(hidden_states)
        E, k = self.num_experts, top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert, ascending; within one, by token (as torch.where lists)
        start = 0
        for e, n in enumerate(host_ints(routings(flat, E + 1)[:E])):  # the layer's one host sync: the group sizes
            if n:
                slots = order[start:start + n]
                token = slots // k
                h = F.gelu(F.linear(x[token], self.fc[e]))
                weight = top_k_weights.reshape(-1)[slots, None].to(x.dtype)
                out.index_add_(0, token, F.linear(h, self.proj[e]) * weight)
            start += n
        return out


class Router(nn.Module):
    """Top-k routing with an optional capacity; see the module docstring for the formulas."""

    def __init__(self, num_experts: int, hidden: int, top_k: int, capacity_factor: float | None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and the {num_experts} experts, got {top_k}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive (or None: dropless), got {capacity_factor}")
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.share: Any = None  # under tp: this rank routes its share of the tokens (parallel/moe_tp.py)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x [N, C] → index [N, k] (E where dropped), weight [N, k], aux and z (scalars), counts [E], dropped."""
        E, k = self.num_experts, self.top_k
        logits = F.linear(x, self.weight).float()  # [N, E]
        probs = logits.softmax(dim=-1)
        top, index = probs.topk(k, dim=-1)  # [N, k]
        weight = top / top.sum(dim=-1, keepdim=True)
        flat = index.reshape(-1)  # slots in token order
        counts = routings(flat, E)  # [E], before dropping
        squares = torch.logsumexp(logits, dim=-1).square().sum()
        whole, mass = counts, probs.sum(dim=0)
        N = x.shape[0]
        if self.share is not None:  # the microbatch's sums from every tp rank's share: the losses are its
            whole = self.share.summed(counts)
            sums = self.share.summed(torch.cat([mass, squares.reshape(1)]))  # one all-reduce for both
            mass, squares, N = sums[:-1], sums[-1], N * self.share.size
        aux = E / N * (whole.to(probs.dtype) * mass / N).sum()
        z = squares / N
        dropped = torch.zeros((), dtype=torch.int64, device=x.device)
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * flat.numel() / E)
            # each slot's place in its expert's queue, in token order (one_hot checks its input on the host)
            order = torch.argsort(flat, stable=True)
            queued = torch.arange(flat.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
            position = torch.empty_like(flat).scatter_(0, order, queued)
            kept = (position < capacity).view_as(index)
            index = torch.where(kept, index, E)
            weight = weight * kept
            dropped = (~kept).sum()
        return {"index": index, "weight": weight, "aux": aux, "z": z, "counts": counts, "dropped": dropped}


class MoE(nn.Module):
    """A router and its experts in place of a block's MLP: (x [B, T, C], loss sum) → (y, loss sum + this layer's
    coef·aux + z_coef·z)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, ffn: int, capacity_factor: float | None = None,
                 aux_coef: float = 0.01, z_coef: float = 0.0) -> None:
        super().__init__()
        self.router = Router(num_experts, hidden, top_k, capacity_factor)
        self.experts = Experts(num_experts, hidden, ffn)  # parallel/expert.py may swap in this rank's share
        self.experts.capacity_factor = capacity_factor  # the router's cap: expert parallelism sends fixed-size blocks
        self.aux_coef, self.z_coef = aux_coef, z_coef

    def forward(self, x: torch.Tensor, loss_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        flat = x.reshape(B * T, C)
        r = self.router(flat)
        y = self.experts(flat, r["index"], r["weight"]).view(B, T, C)
        loss_sum = loss_sum + self.aux_coef * r["aux"]
        if self.z_coef:
            loss_sum = loss_sum + self.z_coef * r["z"]
        return y, loss_sum
