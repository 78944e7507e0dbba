"""JetMoE's MLP experts behind the experts interface `parallel/expert.py` shards, under the model's own names.

transformers' `JetMoeMoE` routes with its `JetMoeTopKGating`, runs the sorted tokens through two
`JetMoeParallelExperts` (weights [E, out, in], `forward(inputs, expert_size)`) and adds a `bias` [h]
after the combine: no module takes `(hidden_states, top_k_index, top_k_weights)`.  `adapt_experts`
gives each `JetMoeMoE` the forward below — its own router, then `JetMoeExperts`, a view over its two
`JetMoeParallelExperts` with the standard interface, then the bias — so `--ep` shards the view (the
two weights cut along their experts in place: state dicts, checkpoints and HF export keep
`mlp.input_linear.weight`, `mlp.output_linear.weight`) and the router statistics count its routings.
The mixture of attention heads (`JetMoeMoA`) is left as it is: replicated, not sharded by `--ep`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.jetmoe.modeling_jetmoe import JetMoeMoE


class JetMoeExperts(nn.Module):
    """A `JetMoeMoE`'s two `JetMoeParallelExperts` as one experts module (parallel/expert.py's interface).  It
    registers neither: they stay the block's children under its names (`parameter_holders`)."""

    def __init__(self, block: JetMoeMoE) -> None:
        super().__init__()
        self.num_experts: int = block.input_linear.num_experts
        object.__setattr__(self, "input_linear", block.input_linear)  # unregistered: named by the block
        object.__setattr__(self, "output_linear", block.output_linear)
        object.__setattr__(self, "activation", block.activation)

    def parameter_holders(self) -> list[nn.Module]:
        return [self.input_linear, self.output_linear]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """`JetMoeMoE.forward`'s experts and combine: the slots sorted by expert, the gated MLP of each, weighted
        and summed per token (an index ≥ num_experts, a slot another rank serves, is left out)."""
        E, k = self.num_experts, top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        _, order = flat.sort(0)  # JetMoeTopKGating's own sort: the same order, so the same sums, bit for bit
        counts = torch.zeros(E + 1, dtype=torch.long, device=flat.device).scatter_add_(
            0, flat.clamp(max=E), torch.ones_like(flat))
        sizes = counts[:E].tolist()  # JetMoE's own host synchronisation (JetMoeTopKGating makes it too)
        slots = order[:sum(sizes)]
        h = self.input_linear(hidden_states[slots // k], sizes)
        gate, up = h.chunk(2, dim=-1)
        out = self.output_linear(self.activation(gate) * up, sizes)
        out = out * top_k_weights.reshape(-1)[slots, None].to(out.dtype)
        return torch.zeros_like(hidden_states, dtype=out.dtype).index_add(0, slots // k, out)


class RoutedJetMoeMoE(JetMoeMoE):
    """`JetMoeMoE` with its experts called through `experts` (a `JetMoeExperts`, or its `ExpertParallel` share):
    the same router call (its logits recorded for the router loss as before), the same output."""

    experts: nn.Module

    def forward(self, layer_input: torch.Tensor) -> torch.Tensor:
        bsz, length, emb_size = layer_input.size()
        flat = layer_input.reshape(-1, emb_size)
        index_sorted, _, batch_gates, expert_size, _ = self.router(flat)
        k = self.router.top_k
        # the router's decision back in token order: the sorted slots' experts are 0…0 1…1 … by expert_size
        experts = torch.repeat_interleave(torch.arange(len(expert_size), device=flat.device),
                                          torch.tensor(expert_size, device=flat.device))
        top_k_index = torch.empty_like(index_sorted).index_copy(0, index_sorted, experts).view(-1, k)
        top_k_weights = batch_gates[torch.argsort(index_sorted)].view(-1, k)
        out = self.experts(flat, top_k_index, top_k_weights)
        return out.view(bsz, length, self.input_size) + self.bias


def adapt_experts(model: nn.Module) -> int:
    """Give every `JetMoeMoE` in `model` its experts as a `JetMoeExperts` (in place, idempotent, parameters and
    names unchanged); how many blocks hold one now."""
    found = 0
    for m in model.modules():
        if isinstance(m, JetMoeMoE):
            if not isinstance(m, RoutedJetMoeMoE):
                m.__class__ = RoutedJetMoeMoE
                m.experts = JetMoeExperts(m)
            found += 1
    return found
