"""A disk that fills during a checkpoint: the save fails in one line naming the file and the cause, on every rank,
and leaves no bytes behind (no temporary file, no part of the abandoned step); the previous checkpoint stays the
latest and loads."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import pipedsl
from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch
from pipedsl.runtime import checkpoint
from pipedsl.runtime.checkpoint.files import write_atomic
from pipedsl.runtime.launch.errors import RankFailure

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _no_space(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_failed_atomic_write_removes_its_temporary_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(os, "fsync", _no_space)
    with pytest.raises(OSError, match="No space left on device"):
        write_atomic(tmp_path / "part.pt", b"x" * 1000)
    assert list(tmp_path.iterdir()) == []


def full_disk_job(root: str) -> dict:
    torch.manual_seed(0)
    pipe = pipedsl.Pipeline(GPT(CFG).stages(2), "1f1b", microbatches=2, loss_fn=gpt_loss)
    opt = torch.optim.Adam([p for m in pipe.local_stages().values() for p in m.parameters()], lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    out: dict = {"rank": dist.get_rank()}
    fsync = os.fsync  # the pool's workers outlive this job: restored whatever happens
    try:
        for step in (1, 2):
            pipe.step(*synthetic_batch(8, CFG.block_size, CFG.vocab_size, gen))
            opt.step()
            opt.zero_grad()
            if step == 2 and dist.get_rank() == 1:  # rank 1's disk is full for step 2
                os.fsync = _no_space
            try:
                checkpoint.save(pipe, root, step, opt, timeout=30.0)
            except (checkpoint.CheckpointError, RankFailure) as err:  # rank 1 fails; rank 0 abandons the step
                out["error"] = err.message
    finally:
        os.fsync = fsync
    restored = checkpoint.load(pipe, root, opt)
    out["restored"] = restored.step
    pipe.close()
    return out


def test_a_full_disk_fails_the_save_in_one_line_and_leaves_nothing(pool, tmp_path) -> None:
    results = pool.run(full_disk_job, 2, str(tmp_path))
    for r in results:
        assert "No space left on device" in r["error"] and "\n" not in r["error"], r
        assert r["restored"] == 1
    assert "rank-00001.pt" in next(r["error"] for r in results if r["rank"] == 1)
    step2 = checkpoint.step_dir(tmp_path, 2)
    assert not step2.exists() or list(step2.iterdir()) == [], list(step2.iterdir())
    assert [p.name for p in Path(tmp_path).rglob(".*tmp-*")] == []
    assert checkpoint.latest(tmp_path).step == 1
