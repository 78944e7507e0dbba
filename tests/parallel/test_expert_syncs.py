"""Host synchronisations per MoE layer (the ready-for-GPUs issue, item 5): on a GPU each one stalls the host until
the device catches up, once per layer and microbatch.  Counted here on the CPU by what would synchronise on a GPU —
ops whose output size depends on the data (nonzero, unique, boolean indexing, bincount, repeat_interleave without
its size), reading a scalar (item, int, bool), and every `tolist` — under a dispatch mode.  Expert parallelism's
own dispatch and combine make none with fixed-size blocks and one dropless (the sizes after the counts exchange);
the GPT's experts make one a layer (their group sizes); its router, with or without a capacity, and the router
statistics (runtime/expert_load.py) none."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING = {"nonzero", "_local_scalar_dense", "item", "is_nonzero", "_unique2", "unique_dim", "unique_consecutive",
           "masked_select", "bincount"}


class _Syncs(TorchDispatchMode):
    """Counts the ops that synchronise the host on a GPU (by name), and repeat_interleave without output_size."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SYNCING or (name == "repeat_interleave" and kwargs.get("output_size") is None
                               and isinstance(args[0], torch.Tensor) and len(args) < 3):
            self.seen.append(name)
        if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is
                                   not None):
            self.seen.append("index by a mask")
        return func(*args, **kwargs)


def _counted(fn, monkeypatch_tolist: list[str]):
    """Run `fn()` counting syncing ops and every Tensor.tolist."""
    original = torch.Tensor.tolist

    def tolist(self):
        monkeypatch_tolist.append("tolist")
        return original(self)

    torch.Tensor.tolist = tolist
    try:
        with _Syncs() as mode:
            out = fn()
    finally:
        torch.Tensor.tolist = original
    return out, mode.seen


def layer_syncs(rank: int) -> dict[str, list[str]]:
    """One MoE layer's forward on ep=2 (this world), fixed-size and dropless: the syncing ops of expert
    parallelism's own dispatch and combine (the experts replaced by a stand-in that syncs nothing), and of the
    GPT's experts alone."""
    from pipedsl.models.gpt.moe import Experts, Router
    from pipedsl.parallel import expert

    torch.manual_seed(0)
    E, N, k, C = 4, 12, 2, 8
    x = torch.randn(N, C)
    index = torch.stack([torch.randperm(E)[:k] for _ in range(N)])
    index[0, 1] = E  # one slot dropped for capacity
    weights = torch.rand(N, k)
    out: dict[str, list[str]] = {}
    for name, capacity in (("fixed", 4.0), ("dropless", None)):
        experts = Experts(E, C, 16)
        torch.nn.init.normal_(experts.fc)
        torch.nn.init.normal_(experts.proj)
        experts.capacity_factor = capacity
        shard = expert.ExpertParallel(experts, dist.group.WORLD, None, 2)
        object.__setattr__(shard, "_local", lambda tokens, index, dtype: tokens * 2.0)  # syncs nothing
        if capacity is not None:  # the device-side check, as on a GPU (on the CPU it reads the maximum at once)
            expert_at_most, expert._at_most = expert._at_most, lambda counts, c, f: torch._assert_async(
                counts.max() <= c)
        tolists: list[str] = []
        try:
            _, seen = _counted(lambda: shard(x, index, weights), tolists)  # noqa: B023 - called at once
        finally:
            if capacity is not None:
                expert._at_most = expert_at_most
        out[name] = seen + tolists
    tolists = []
    _, seen = _counted(lambda: Experts(E, C, 16)(x, index, weights), tolists)
    out["gpt_experts"] = seen + tolists
    for name, capacity in (("router", None), ("router_capacity", 1.0)):
        tolists = []
        _, seen = _counted(lambda: Router(E, C, k, capacity)(x), tolists)  # noqa: B023 - called at once
        out[name] = seen + tolists
    from pipedsl.runtime.expert_load import ExpertLoad

    load = ExpertLoad([expert.ExpertParallel(Experts(E, C, 16), dist.group.WORLD, None, 2)], E)
    tolists = []
    _, seen = _counted(lambda: load._count(load.layers[0], (x, index, weights), {}), tolists)
    out["expert_load"] = seen + tolists
    return out


@pytest.mark.slow
def test_expert_parallel_syncs_once_dropless_and_never_with_fixed_size_blocks(pool2) -> None:
    for r in pool2.run(layer_syncs):
        assert r["fixed"] == [], r
        assert r["dropless"] == ["tolist"], r  # the send and receive sizes, read once
        assert r["gpt_experts"] == ["tolist"], r  # the group sizes, read once
        assert (r["router"], r["router_capacity"], r["expert_load"]) == ([], [], []), r  # routing, statistics: none
