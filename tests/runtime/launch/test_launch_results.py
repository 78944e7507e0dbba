"""`pipedsl.launch` returns what every rank's function returned, tensors included (issue 17)."""

from __future__ import annotations

import launch_cases as cases
import pytest
import torch

import pipedsl
from pipedsl.errors import PipeRuntimeError

BOUNDS = {"timeout": 60.0, "join_timeout": 240.0, "threads": 1}


def assert_same(got, want, where="result") -> None:
    assert type(got) is type(want), f"{where}: {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert got.device.type == "cpu" and got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


@pytest.mark.slow
def test_tensors_nested_containers_and_a_large_state_dict_come_back_intact() -> None:
    results = pipedsl.launch(cases.returns_values, 2, **BOUNDS)
    assert len(results) == 2
    for rank, got in enumerate(results):
        want = cases.values(rank)
        assert_same(got, want)
        size = sum(t.numel() * t.element_size() for t in got["state"].values())
        assert size > (50 if rank == 0 else 1) * 2**20, f"rank {rank}'s state dict is only {size} bytes"
        assert got["view"].untyped_storage().data_ptr() == got["tensor"].untyped_storage().data_ptr(), \
            "a view comes back as a view of the same storage"


@pytest.mark.slow
def test_a_value_that_cannot_be_pickled_is_one_error_naming_rank_place_and_type() -> None:
    with pytest.raises(PipeRuntimeError) as info:
        pipedsl.launch(cases.returns_unpicklable, 2, **BOUNDS)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("runtime error: rank 0 failed: cannot return the result['lock'] (a _thread.lock) "
                               "to the launcher: cannot pickle '_thread.lock' object"), lines
    assert "Traceback" not in str(info.value)
    assert lines[1].startswith("  note: rank 1: cannot return the result[1][1] (a builtins.function)"), lines


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_tensors_come_back_on_the_cpu() -> None:
    results = pipedsl.launch(cases.returns_cuda, 1, backend="gloo", **BOUNDS)
    assert results[0].device.type == "cpu" and torch.equal(results[0], torch.arange(5.0))
