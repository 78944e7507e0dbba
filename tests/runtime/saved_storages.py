"""Every storage an autograd graph saved, by weak reference: what a stage really holds, independent of the runtime's
own counting (tests/runtime/test_stage.py and benchmarks/split_backward.py read it)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from pipedsl.runtime.split_backward import saved_names


def saved_storages(roots: Iterable[torch.Tensor], weights: set[int],
                   min_numel: int = 0) -> dict[int, tuple[StorageWeakRef, int]]:
    """address -> (weak reference, bytes) of each storage the graph below `roots` saved, but `weights` (the
    parameters' storage addresses) and tensors of fewer than `min_numel` values."""
    found: dict[int, tuple[StorageWeakRef, int]] = {}
    stack, seen = [r.grad_fn for r in roots], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in saved_names(node):
            value = getattr(node, name)
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and t.numel() >= min_numel:
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in weights:
                        found[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        stack.extend(f for f, _ in node.next_functions)
    return found
