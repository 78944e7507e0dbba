"""ZeRO's side of checkpoints: what `ZeroOptimizer.shard_state()` slices mean, and resharding them.

A saved slice is only meaningful with its unit layout (entry names, shapes, offsets, padded size, dp
size).  Reading that layout belongs next to ZeRO, so that runtime/checkpoint/state.py handles ZeRO state as
opaque per-dp-rank values: under the same layout they are restored as they are (bit-exact); otherwise
`assemble` rebuilds full tensors from every dp rank's slices and `load_full` cuts them again for this
optimizer.  Only the optimizer's public methods are used.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from pipedsl.parallel.zero import ZeroOptimizer


def local_shard(t: Any) -> Any:
    """A DTensor's local shard (a checkpoint holds each tp rank's), else `t` unchanged."""
    return t.to_local() if isinstance(t, DTensor) else t


class ReshardError(ValueError):
    """Saved ZeRO state that cannot be restored into this optimizer; the message says why."""


@dataclass(frozen=True)
class FullState:
    """One stage's full-size state by parameter name: what resharding goes through.  `state`, `type` and
    `hyper` (its optimizer state, class name and hyperparameters) are None when none is loaded; `buffers`
    is the rest of a dense module state (None when assembled from slices, which hold parameters only)."""

    params: dict[str, torch.Tensor] = field(repr=False)
    state: dict[str, dict[str, Any]] | None = field(default=None, repr=False)
    type: str | None = None
    hyper: dict[str, Any] | None = None
    buffers: dict[str, torch.Tensor] | None = field(default=None, repr=False)


def _entries(unit: dict[str, Any]) -> Iterator[tuple[str, list, int, int, list[str]]]:
    """(name, shape, offset, numel, other names) of each parameter in one unit of a layout."""
    for name, shape, offset, numel, *also in unit["entries"]:
        yield name, shape, offset, numel, also[0] if also else []


def describe(zero: ZeroOptimizer) -> dict[str, list]:
    """{parameter name: [shape, dtype]} by the original names (aliases too), though ZeRO holds flat buffers.  With
    bf16 parameters over fp32 main parameters the dtype is the module's own (fp32): a stage partition does not
    change with the precision mode, and checkpoints move between modes."""
    def dtype(unit: dict[str, Any]) -> str:
        return str(zero.dtype).removeprefix("torch.") if zero.main else unit["dtype"]

    def shape(unit: dict[str, Any], name: str, local: list) -> list:  # a DTensor's whole shape, as a module has it
        return unit.get("dtensors", {}).get(name, {}).get("shape", local)
    return {n: [shape(unit, name, local), dtype(unit)] for unit in zero.layout()
            for name, local, *_, also in _entries(unit) for n in [name, *also]}


def trained_names(zero: ZeroOptimizer) -> list[str]:
    """The parameters that have optimizer state (frozen units have none)."""
    return [e[0] for unit in zero.layout() if not unit.get("frozen") for e in _entries(unit)]


def restorable(zero: ZeroOptimizer, saved: dict[str, Any]) -> bool:
    """Whether `saved` slices can be put back as they are: the same layout, and a stage that shards."""
    return saved["layout"] == zero.layout() and zero.stage != 0


def restore(zero: ZeroOptimizer, saved: dict[str, Any], optimizer: bool) -> None:
    """This rank's own saved slices, as they are (then `zero.sync_parameters()` on every rank)."""
    try:
        zero.load_shard_state(saved if optimizer else {**saved, "optimizer": None})
    except ValueError as err:
        raise ReshardError(str(err)) from None


def assemble(stage: int, saved: dict[int, dict[str, Any]], optimizer: bool,
             experts: tuple[int, int] = (1, 0)) -> FullState:
    """Full-size parameters (and, with `optimizer`, elementwise optimizer state) of `stage` from the slices of
    every saved dp rank ({dp rank: shard_state}).  A slice's fp32 "main" values win over its "params".

    `experts` = (ep, j): the expert shards' units (layout "edp", parallel/expert.py) are sliced over the dp
    ranks holding the same experts, j, j + ep, j + 2ep, …: their full size is the j-th of ep shards."""
    ep, j = experts
    first = saved[min(saved)]
    n = next((unit["n"] for unit in first["layout"] if not unit.get("edp")),
             first["layout"][0]["n"] * ep if first["layout"] else 1)
    if sorted(saved) != list(range(n)):
        raise ReshardError(f"stage {stage} has ZeRO slices of dp ranks {sorted(saved)}, "
                           f"the layout needs all of 0..{n - 1}")
    if optimizer and first.get("optimizer") is None:
        raise ReshardError(f"stage {stage} was saved without optimizer state")

    def whole(u: int, key: str | None = None) -> torch.Tensor:
        """Unit `u`'s parameters (or optimizer state `key`) at full size: every dp rank's slice in order."""
        layout = first["layout"][u]
        ranks = range(j, n, ep) if layout.get("edp") else range(n)
        units = [saved[d]["units"][u] for d in ranks]
        if key is not None:
            return torch.cat([unit["sharded"][key] for unit in units])
        return torch.cat([unit["params"] if unit.get("main") is None else unit["main"] for unit in units])

    params: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for u, unit in enumerate(first["layout"]):
        flat = whole(u)
        # a unit of frozen parameters has no optimizer state
        sharded = {k: whole(u, k) for k in first["units"][u].get("sharded", {})} if optimizer else {}
        for name, shape, offset, numel, also in _entries(unit):
            params[name] = flat[offset:offset + numel].view(shape).clone()
            for other in also:  # the same parameter under its other names (state_dict's)
                params[other] = params[name]
            if optimizer:
                st = {k: v[offset:offset + numel].view(shape).clone() for k, v in sharded.items()}
                # a tensor per parameter: torch's Adam increments its `step` tensor in place, per parameter
                st.update({k: v.clone() if isinstance(v, torch.Tensor) else v
                           for k, v in first["units"][u].get("scalar", {}).items()})
                state[name] = st
    if not optimizer:
        return FullState(params)
    return FullState(params, state, first.get("optimizer"), first["groups"][0] if first.get("groups") else None)


def from_dense(stage: int, zero: ZeroOptimizer, module_state: dict[str, torch.Tensor],
               optimizer: dict[str, tuple[dict[str, Any], dict[str, Any]]] | None = None,
               optimizer_type: str | None = None) -> FullState:
    """The same full-size form from a stage saved without ZeRO: its state_dict, and (to load optimizer state)
    {trained parameter name: (its state, its group's hyperparameters)} of an `optimizer_type` optimizer."""
    entries = [e for unit in zero.layout() for e in _entries(unit)]
    aliases = {a for *_, also in entries for a in also}
    # a tensor-parallel stage's DTensors (parallel/tp_hf.py): ZeRO packs this tp rank's shards
    module_state = {k: local_shard(v) for k, v in module_state.items()}
    if optimizer is not None:
        optimizer = {n: ({k: local_shard(v) for k, v in st.items()}, hyper) for n, (st, hyper) in optimizer.items()}
    params = {name: module_state[name] for name, *_ in entries if name in module_state}
    buffers = {k: v for k, v in module_state.items() if k not in params and k not in aliases}
    if optimizer is None:
        return FullState(params, buffers=buffers)
    if len({json.dumps(hyper, sort_keys=True, default=str) for _, hyper in optimizer.values()}) > 1:
        raise ReshardError(f"stage {stage}: the saved optimizer has parameter groups with different "
                           f"hyperparameters; ZeRO runs one group per stage, so it cannot take them")
    first = next(iter(optimizer.values()), None)  # None: every parameter of the stage is frozen
    return FullState(params, {n: st for n, (st, _) in optimizer.items()}, optimizer_type,
                     first[1] if first is not None else None, buffers)


def load_full(stage: int, zero: ZeroOptimizer, full: FullState) -> None:
    """Keep this rank's slices of `full` (no communication: every dp rank passes the same values)."""
    if full.type is not None and full.type != type(zero.optimizer).__name__:
        raise ReshardError(f"stage {stage}: the checkpoint holds {full.type} state, the optimizer is "
                           f"{type(zero.optimizer).__name__}")
    try:
        zero.load_full_state(full.params, full.state, full.hyper)
    except ValueError as err:
        raise ReshardError(f"stage {stage}: cannot reshard the saved state into this ZeRO layout: {err}") from None
