"""JetMoE's MLP experts behind the experts interface `parallel/expert.py` shards, under the model's own names.

transformers' `JetMoeMoE` routes with its `JetMoeTopKGating`, runs the sorted tokens through two
`JetMoeParallelExperts` (weights [E, out, in], `forward(inputs, expert_size)`) and adds a `bias` [h]
after the combine: no module takes `(hidden_states, top_k_index, top_k_weights)`.  `adapt_experts`
gives each `JetMoeMoE` the forward below — its own router, then `JetMoeExperts`, a view over its two
`JetMoeParallelExperts` with the standard interface, then the bias — so `--ep` shards the view (the
two weights cut along their experts in place: state dicts, checkpoints and HF export keep
`mlp.input_linear.weight`, `mlp.output_linear.weight`) and the router statistics count its routings.
The mixture of attention heads (`JetMoeMoA`) is not sharded by `--ep`; under tensor parallelism it splits
itself by key/value heads (`TensorParallelJetMoeAttention.tensor_parallel`, which models/hf/parallelize.py calls).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from transformers.models.jetmoe.modeling_jetmoe import JetMoeAttention, JetMoeMoA, JetMoeMoE, JetMoeParallelExperts

from pipedsl.parallel.comm import copy_to_group, group_rank, group_size, reduce_from_group
from pipedsl.parallel.config import ParallelConfigError
from pipedsl.parallel.expert import routings
from pipedsl.parallel.moe_tp import mark_every_token
from pipedsl.parallel.replicated import mark_replicated, param_sum_grad_later


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
        sizes = routings(flat, E + 1)[:E].tolist()  # JetMoE's own host synchronisation (JetMoeTopKGating makes it too)
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
        top_k_weights = torch.empty_like(batch_gates).index_copy(0, index_sorted, batch_gates).view(-1, k)
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


# ---------------------------------------------------------------- tensor parallelism of the mixture of attention


class _LocalShardExperts(JetMoeParallelExperts):
    """A `JetMoeParallelExperts` whose weight is a tp-sharded DTensor: each expert's matrix applied as this rank's
    local block (`to_local()`, whose gradient is the shard's: no collective)."""

    def forward(self, inputs: torch.Tensor, expert_size: list[int]) -> torch.Tensor:
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        parts = inputs.split(expert_size, dim=0)
        return torch.cat([F.linear(parts[i], weight[i]) for i in range(self.num_experts)], dim=0)


class _TensorParallelMoA(JetMoeMoA):
    """`JetMoeMoA` over this rank's key/value heads: its query experts hold their rows for those heads and its
    output experts the matching columns, so each slot's output projection is a partial sum over the heads, summed
    over tp (`reduce_from_group`) before the gates weight it and the bias is added — the router and the bias then
    see whole values and get the whole gradient on every rank (copies, not summed later)."""

    tp_group: ProcessGroup

    def reduce(self, layer_input: torch.Tensor, topo_info: tuple) -> torch.Tensor:
        bsz, length, _, hidden = layer_input.size()
        index_sorted_experts, batch_index, batch_gates, expert_size = topo_info
        rows = layer_input.reshape(-1, hidden)[index_sorted_experts]
        outputs = reduce_from_group(self.output_linear(rows, expert_size), self.tp_group)
        outputs = outputs * batch_gates[:, None]
        zeros = torch.zeros((bsz * length, self.input_size), dtype=outputs.dtype, device=outputs.device)
        return zeros.index_add(0, batch_index, outputs).view(bsz, length, self.input_size) + self.bias


class TensorParallelJetMoeAttention(JetMoeAttention):
    """JetMoE's attention, able to split itself over a tensor-parallel group (`tensor_parallel`, which
    models/hf/parallelize.py calls for an attention module that has it)."""

    def tensor_parallel(self, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
        """Megatron's split by key/value heads, in place: rank r of t keeps heads [r·H/t, (r+1)·H/t).

        - the query experts `experts.input_linear` [E, H·d, C] by rows (Shard(1)), the output experts
          `experts.output_linear` [E, C, H·d] by columns (Shard(2)): DTensors, so checkpoints and export join them;
        - `kv_proj` [2·H·d, C] (keys, then values) stays whole on every rank and its output is cut to this rank's
          heads (the two halves' rows are not one block); its gradient covers those heads only, summed over tp at
          the step end (`param_sum_grad_later`);
        - the router and the bias stay copies (`_TensorParallelMoA`); the inputs of the head-split projections go
          through `copy_to_group` (their gradients summed over tp), the router's does not (it is whole already);
        - with sequence parallelism the attention takes the gathered sequence and gives back this rank's shard, a
          redistribution whose backward gathers the shards' gradients: every rank runs the same whole backward.
        """
        group = tp_mesh.get_group()
        t, r = group_size(group), group_rank(group)
        H, d = self.num_key_value_heads, self.head_dim
        if H % t:
            raise ParallelConfigError(f"JetMoE: num_key_value_heads={H} is not divisible by tp={t}")
        moa = self.experts
        for linear, dim in ((moa.input_linear, 1), (moa.output_linear, 2)):
            linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), tp_mesh, [Shard(dim)]),
                                         requires_grad=linear.weight.requires_grad)
            linear.__class__ = _LocalShardExperts
        moa.input_linear.register_forward_pre_hook(lambda _m, args: (copy_to_group(args[0], group), *args[1:]))
        moa.__class__ = _TensorParallelMoA
        moa.tp_group = group
        moa.hidden_size = H * d // t
        mark_replicated([*moa.router.parameters(), moa.bias], group)
        mark_every_token(moa.router)
        for p in self.kv_proj.parameters():
            param_sum_grad_later(p)
        mark_replicated(self.kv_proj, group)
        mine = slice(r * H * d // t, (r + 1) * H * d // t)
        self.kv_proj.register_forward_pre_hook(lambda _m, args: (copy_to_group(args[0], group), *args[1:]))
        self.kv_proj.register_forward_hook(
            lambda _m, _args, out: torch.cat([k[..., mine] for k in out.chunk(2, dim=-1)], dim=-1))
        if sequence_parallel:
            self.register_forward_pre_hook(_gathered_input, with_kwargs=True)
            self.register_forward_hook(_sharded_output(tp_mesh))


def _gathered_input(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """With SP: the attention runs on the whole sequence, as a plain tensor (idempotent: a module called again by
    recomputation with the tensor it already converted keeps it)."""
    h = kwargs.get("hidden_states", args[0] if args else None)
    if not isinstance(h, DTensor):
        return None
    whole = h.redistribute(placements=[Replicate()]).to_local()
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": whole}
    return (whole, *args[1:]), kwargs


def _sharded_output(tp_mesh: DeviceMesh):
    def hook(module: nn.Module, args: tuple, out: tuple) -> tuple:
        """With SP: this rank's sequence shard of the whole output, whose backward gathers every shard's gradient
        (each rank then runs the same whole backward, as its router and bias copies need)."""
        whole = DTensor.from_local(out[0], tp_mesh, [Replicate()], run_check=False)
        return (whole.redistribute(placements=[Shard(1)]), *out[1:])
    return hook


def adapt_attention(model: nn.Module) -> None:
    """Give every `JetMoeAttention` in `model` its `tensor_parallel` (in place; parameters and names unchanged)."""
    for m in model.modules():
        if isinstance(m, JetMoeAttention) and not isinstance(m, TensorParallelJetMoeAttention):
            m.__class__ = TensorParallelJetMoeAttention
