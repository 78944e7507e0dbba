"""Expert parallelism: each MoE layer's experts sharded over ranks of the data-parallel dimension,
tokens sent to their experts' ranks and brought back with all-to-alls.

Placement (Megatron's and torchtitan's): ep divides dp, and the dp ranks of a pipeline stage form
dp/ep groups of ep consecutive ranks (`ParallelMesh.ep_group`).  Rank j of an ep group holds experts
[j·E/ep, (j+1)·E/ep); the ranks holding the same experts (rank j of every ep group) form
`ParallelMesh.edp_group`.

What is wrapped is any *experts module* with the interface of transformers' MoE models (Mixtral,
Qwen2/3-MoE, OLMoE, DeepSeek-V3) and of the GPT's (models/gpt/moe.py): an int `num_experts`, its own
parameters all [E, …], and `forward(hidden_states [N, C], top_k_index [N, k], top_k_weights [N, k])`
returning each token's weighted sum of its experts (an index ≥ E is a dropped slot).  An experts module
may instead be a view over modules of the model that keep its [E, …] parameters under the model's own names
(`parameter_holders()`, JetMoE's two `JetMoeParallelExperts`: models/hf/jetmoe.py): those are sharded in
place, so state dicts keep naming them as the model does.  The router
stays where it is: every rank routes its own tokens.  `ExpertParallel.forward`, on every rank of
an ep group at once:

    1. the kept slots, sorted by expert (so by rank);
    2. the count for each expert to its rank (an all-to-all of E/ep counts a peer);
    3. each slot's token to its expert's rank (all-to-all; backward: the tokens' gradients home);
    4. the model's own experts module, holding this rank's E/ep experts, on the tokens received
       (weight 1, local expert ids); the shard's parameters keep the module's names, cut along dim 0;
    5. the outputs back (all-to-all; backward: the outputs' gradients to the experts), weighted and
       summed per token, in ascending expert order as the unsharded module sums them.

Gradients: an expert's gradient on its rank already sums the losses of every ep peer's tokens;
the data-parallel reduction sums it over `edp_group` and divides by dp (not by edp's size), so
every parameter's gradient is the mean over the global batch, as without ep
(`expert_parameters`, runtime/data_parallel.py, parallel/zero.py's groups).

Every rank of an ep group must run the same layers on the same microbatches in the same order:
the dp replicas of one pipeline stage run the same instruction stream, so they do.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Iterable
from fractions import Fraction

import torch
from torch import nn
from torch.distributed import ProcessGroup

from pipedsl.parallel.comm import all_to_all_rows, exchange_rows, group_rank, group_size
from pipedsl.parallel.config import ParallelConfigError
from pipedsl.parallel.mesh import ParallelMesh

SIGNATURE = ("hidden_states", "top_k_index", "top_k_weights")


def holders(module: nn.Module) -> list[nn.Module]:
    """The modules keeping an experts module's [E, …] parameters: its `parameter_holders()` when it is a view over
    the model's own modules (whose names a state dict must keep), else itself."""
    held = getattr(module, "parameter_holders", None)
    return list(held()) if callable(held) else [module]


def is_experts(module: nn.Module) -> bool:
    """An experts module this file can shard: `num_experts`, parameters [E, …] (its own or its holders'), the
    forward above."""
    E = getattr(module, "num_experts", None)
    if not isinstance(E, int) or isinstance(module, ExpertParallel):
        return False
    tables = [h._parameters for h in holders(module)]
    if not any(tables):
        return False
    try:
        names = [n for n in inspect.signature(type(module).forward).parameters][1:4]
    except (TypeError, ValueError):
        return False
    return tuple(names) == SIGNATURE and all(p is not None and p.dim() >= 1 and p.shape[0] == E
                                             for table in tables for p in table.values())


def token_shares(module: nn.Module, top_k: int | None = None) -> dict[int, Fraction]:
    """The share of each experts module in `module` (by id; a shard's too) a token passes through, top_k / E
    exactly: the parameters it counts for a token's FLOPs (the split by FLOPs, MFU).  `top_k`: the model's, else
    read from the block holding the experts or its router or gate (1 when none says)."""
    shares: dict[int, Fraction] = {}
    for m in module.modules():
        for child in m.children():
            if is_experts(child) or isinstance(child, ExpertParallel):
                holders = (m, getattr(m, "router", None), getattr(m, "gate", None))
                k = top_k or next((v for v in (getattr(h, "top_k", None) for h in holders) if isinstance(v, int)), 1)
                shares[id(child)] = Fraction(k, child.num_experts)
    return shares


def why_no_experts(module: nn.Module) -> str:
    """One line on why `module` holds no experts module `is_experts` accepts: a module that looks like one (an int
    `num_experts` and parameters of its own) named with the forward it takes instead, or none at all."""
    for path, m in module.named_modules():
        if isinstance(getattr(m, "num_experts", None), int) and m._parameters:
            try:
                takes = ", ".join(list(inspect.signature(type(m).forward).parameters)[1:])
            except (TypeError, ValueError):
                takes = "?"
            return (f"its experts module {type(m).__name__} ({path}) takes forward({takes}), not "
                    f"({', '.join(SIGNATURE)}) with parameters [E, …] of its own")
    return f"no module has num_experts and parameters [E, …] of its own taking forward({', '.join(SIGNATURE)})"


class ExpertParallel(nn.Module):
    """This rank's share of an experts module, serving the tokens of every rank of `group` routed to its experts.

    Its parameters are the module's, under the same names, cut to rows [first, first + E/ep) along dim 0, so a
    state dict names them as the unsharded model does (checkpoints join and re-cut them, runtime/checkpoint).
    The model's own experts module computes, holding E/ep experts (`_impl`, unregistered: it reads the
    parameters this module holds now, ZeRO's views included).  A view's share (`parameter_holders()`) is cut in
    place instead: its holders keep their names and places in the model, this module holds no parameter."""

    def __init__(self, experts: nn.Module, group: ProcessGroup, edp_group: ProcessGroup | None, dp: int) -> None:
        super().__init__()
        E, ep = experts.num_experts, group_size(group)
        if E % ep:
            raise ParallelConfigError(f"{type(experts).__name__} has {E} experts, which ep={ep} ranks cannot share "
                                      f"evenly")
        held = holders(experts)
        if any(True for h in held for m in h.children() for _ in m.parameters()):
            raise ParallelConfigError(f"{type(experts).__name__} keeps parameters in submodules: expert "
                                      f"parallelism shards only [E, …] parameters of the experts module itself "
                                      f"(or of the modules its parameter_holders() names)")
        self.num_experts, self.ep, self.rank = E, ep, group_rank(group)
        # a router that caps each expert at ceil(c·N·k/E) slots (the GPT's capacity_factor c): fixed-size blocks
        self.capacity_factor: float | None = getattr(experts, "capacity_factor", None)
        self.per_rank = E // ep
        self.first = self.rank * self.per_rank
        self.group, self.edp_group, self.dp = group, edp_group, dp
        impl = copy.copy(experts)  # its attributes and activation modules shared; its parameters set per call
        impl.num_experts = self.per_rank
        object.__setattr__(self, "_impl", impl)
        if held != [experts]:  # a view: the holders keep their names and places, their parameters cut in place
            self._names: list[str] = []
            for h in held:
                for name, p in h._parameters.items():
                    h.register_parameter(name, self._shard(p))
                if isinstance(getattr(h, "num_experts", None), int):  # a holder counting its experts counts its share
                    h.num_experts = self.per_rank
        else:
            for name, p in experts._parameters.items():
                self.register_parameter(name, self._shard(p))
            self._names = list(experts._parameters)
            impl._parameters = dict(self._parameters)
            impl._modules = dict(experts._modules)
            impl._buffers = dict(experts._buffers)
            held = [self]
        # (holder, its sharded parameters' names): kept, since ZeRO's flat buffer may stand for them later
        object.__setattr__(self, "_held", [(h, self._names if h is self else list(h._parameters)) for h in held])

    def _shard(self, p: nn.Parameter) -> nn.Parameter:
        """This rank's rows of `p`, a parameter with its marks (a tp copy whose gradient is summed later: moe_tp.py)."""
        rows = p.detach()[self.first:self.first + self.per_rank].clone()
        shard = nn.Parameter(rows, requires_grad=p.requires_grad)
        shard.__dict__.update(p.__dict__)
        return shard

    def parameter_holders(self) -> list[nn.Module]:
        """The modules holding this share's parameters: itself, or the view's holders (sharded in place)."""
        return [h for h, _ in self._held]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """Dispatch, this rank's experts, combine: no host synchronisation with fixed-size blocks, one (the sizes
        after the counts exchange) dropless — every other size is known on the host or stays on the device."""
        k, E = top_k_index.shape[1], self.num_experts
        flat = top_k_index.reshape(-1)  # [N·k]: each slot's expert, ≥ E for a slot dropped for capacity
        order = torch.argsort(flat, stable=True)  # kept slots by expert (token order within one), dropped ones last
        counts = routings(flat, E + 1)  # per expert, the last entry the dropped slots
        exchange = self._fixed_size if self.capacity_factor is not None else self._dropless
        slots, back = exchange(hidden_states, order, flat, counts, k, top_k_weights.dtype)  # back: [S, C] by slot
        weighted = back * top_k_weights.reshape(-1)[slots, None].to(back.dtype)
        return torch.zeros_like(hidden_states).index_add(0, slots // k, weighted.to(hidden_states.dtype))

    def _dropless(self, hidden: torch.Tensor, order: torch.Tensor, flat: torch.Tensor, counts: torch.Tensor, k: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Each kept slot's row to its expert's rank after the counts (steps 2–3), this rank's experts on the rows
        received, the outputs home: (the kept slots, their outputs).  The one host synchronisation: the sizes."""
        ep, El = self.ep, self.per_rank
        per_rank = counts[:-1].view(ep, El)
        received = all_to_all_rows(per_rank, [1] * ep, [1] * ep, self.group)  # [ep, El]: peer r's tokens for each
        sizes = host_ints(torch.cat([per_rank.sum(dim=1), received.sum(dim=1)]))
        send, recv = sizes[:ep], sizes[ep:]
        slots = order[:sum(send)]  # the kept slots, by expert: by rank
        tokens = exchange_rows(hidden[slots // k], send, recv, self.group)  # [R, C]
        index = torch.repeat_interleave(torch.arange(El, device=hidden.device).repeat(ep), received.reshape(-1),
                                        output_size=sum(recv))
        return slots, exchange_rows(self._local(tokens, index, dtype), recv, send, self.group)

    def _fixed_size(self, hidden: torch.Tensor, order: torch.Tensor, flat: torch.Tensor, counts: torch.Tensor,
                    k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`_dropless` as fixed-size blocks (GShard's): each expert gets C = ceil(c·slots/E) rows, its slots first
        and zeros after, so no counts are exchanged first — one exchange less a layer's forward, and no host
        synchronisation.  The zero rows are computed and thrown away; a dropped slot's row goes to a row of its
        own past the blocks and comes back as zeros.  Returns (every slot, its output)."""
        E, ep, El = self.num_experts, self.ep, self.per_rank
        C = math.ceil(self.capacity_factor * flat.numel() / E)
        _at_most(counts[:-1], C, self.capacity_factor)
        experts = flat[order]  # [N·k] ascending, dropped slots (≥ E) last
        kept = experts < E
        starts = torch.cumsum(counts, 0) - counts  # each expert's first position in `order`
        position = torch.arange(experts.numel(), device=hidden.device) - starts[experts.clamp(max=E)]
        where = torch.where(kept, experts * C + position, E * C)  # each slot's row in the [E·C] blocks, or the spare
        rows = hidden[order // k] * kept[:, None].to(hidden.dtype)
        block = hidden.new_zeros((E * C + 1, hidden.shape[1])).index_add(0, where, rows)[:E * C]
        size = [El * C] * ep
        tokens = exchange_rows(block, size, size, self.group)  # [ep·El·C]: each peer's blocks for these experts
        index = torch.arange(El, device=hidden.device).repeat_interleave(C).repeat(ep)
        out = exchange_rows(self._local(tokens, index, dtype), size, size, self.group)  # [E·C, H]
        return order, torch.cat([out, out.new_zeros((1, out.shape[1]))])[where]

    def _local(self, tokens: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This rank's experts on the rows received (step 4), weight 1, the model's own code."""
        for name in self._names:  # what this module holds now: its parameters, or ZeRO's views standing for them
            self._impl._parameters[name] = getattr(self, name)
        ones = torch.ones((tokens.shape[0], 1), dtype=dtype, device=tokens.device)
        return self._connected(self._impl(tokens, index.unsqueeze(1), ones), tokens)

    def _connected(self, out: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """`out` tied into the graph like a peer's: a rank that received no tokens gets an output its experts
        never touched, whose gradient the combine's backward would skip — and its peers would wait for it."""
        if out.requires_grad or not torch.is_grad_enabled():
            return out
        if tokens.requires_grad:
            return out + 0 * tokens
        trainable = [p for h in self.parameter_holders() for p in h.parameters(recurse=False) if p.requires_grad]
        return out + 0 * trainable[0].sum() if trainable else out

    def extra_repr(self) -> str:
        return f"experts {self.first}..{self.first + self.per_rank - 1} of {self.num_experts}, ep={self.ep}"


def routings(slots: torch.Tensor, bins: int) -> torch.Tensor:
    """How many of `slots` (expert ids) go to each of `bins` experts [bins], ids ≥ bins counted in the last bin
    (dropped slots): by scatter_add, since `bincount` reads its input's maximum on the host."""
    slots = slots.reshape(-1).clamp(max=bins - 1)
    return torch.zeros(bins, dtype=torch.long, device=slots.device).scatter_add_(0, slots, torch.ones_like(slots))


def host_ints(t: torch.Tensor) -> list[int]:
    """`t`'s integers on the host: a host synchronisation on a GPU, which every caller names (the one a dropless
    layer makes: tests/parallel/test_expert_syncs.py counts them)."""
    return t.tolist()


def _at_most(counts: torch.Tensor, capacity: int, factor: float | None) -> None:
    """Refuse a router that gave an expert more slots than the capacity `factor` allows: on the CPU at once, on
    a GPU as a device-side assertion (no host synchronisation: reading the maximum would be one a layer)."""
    if counts.device.type == "cpu":
        if counts.numel() and int(counts.max()) > capacity:
            raise ParallelConfigError(f"expert parallelism: an expert got {int(counts.max())} slots, more than the "
                                      f"capacity {capacity} its router's capacity_factor={factor} allows")
    else:
        torch._assert_async(counts.max() <= capacity, f"expert parallelism: an expert got more slots than the "
                                                      f"capacity {capacity} (capacity_factor={factor})")


def shard_experts(module: nn.Module, group: ProcessGroup, edp_group: ProcessGroup | None, dp: int) -> int:
    """Replace every experts module inside `module` by this rank's `ExpertParallel` share, in place; how many."""
    found = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if is_experts(child):
                setattr(parent, name, ExpertParallel(child, group, edp_group, dp))
                found += 1
    return found


def shard_experts_over(modules: Iterable[nn.Module], mesh: ParallelMesh) -> int:
    """Every experts module inside `modules` replaced by this rank's share over `mesh`'s ep group, in place; how
    many (none when ep = 1).  What a model source's parallelize.py applies, and what any module with experts
    needs before a `Pipeline` on a mesh with ep > 1 — the pipeline runs the stages as they come."""
    c = mesh.config
    return sum(shard_experts(m, mesh.ep_group, mesh.edp_group, c.dp) for m in modules) if c.ep > 1 else 0


def fixed_size(module: nn.Module) -> bool:
    """Whether every expert exchange inside `module` is fixed-size (no counts exchanged first): what decides which
    half of an overlapped pair starts (runtime/overlap.py)."""
    shards = [m for m in module.modules() if isinstance(m, ExpertParallel)]
    return bool(shards) and all(m.capacity_factor is not None for m in shards)


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of `module`'s expert shards (reduced over `edp_group`, divided by dp)."""
    return [p for m in module.modules() if isinstance(m, ExpertParallel) for h in m.parameter_holders()
            for p in h.parameters(recurse=False)]


def expert_units(module: nn.Module) -> list[tuple[nn.Module, ProcessGroup | None, int]]:
    """(holder, edp group, dp) for each module holding expert shards inside `module`: ZeRO's units of their own,
    reduced over the edp group and divided by dp."""
    return [(h, m.edp_group, m.dp) for m in module.modules() if isinstance(m, ExpertParallel)
            for h in m.parameter_holders()]


def expert_shards(module: nn.Module) -> dict[str, tuple[int, int]]:
    """{state-dict name: (ep, this rank's index among them)} of `module`'s expert-sharded parameters, each cut
    along dim 0 into ep equal parts (what checkpoints join and cut again)."""
    path_of: dict[int, str] = {}
    for path, m in module.named_modules():
        path_of.setdefault(id(m), path)
    out = {}
    for m in module.modules():
        if not isinstance(m, ExpertParallel):
            continue
        for h, names in m._held:  # ZeRO's flat buffer may stand for the parameters now: their names kept
            path = path_of[id(h)]
            out.update({f"{path}.{name}" if path else name: (m.ep, m.rank) for name in names})
    return out


def reduction_of(module: nn.Module) -> tuple[ProcessGroup | None, int] | None:
    """(edp group, dp) the expert shards inside `module` reduce over, or None without any."""
    shards = [m for m in module.modules() if isinstance(m, ExpertParallel)]
    return (shards[0].edp_group, shards[0].dp) if shards else None
