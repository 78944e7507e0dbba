"""Checkpoints of data × pipeline × tensor parallel pipelines, ZeRO 0-3: resume, resharding, refusals.

Three jobs on one pool of 8 workers (each job a fresh gloo world): dp2×pp2 (4 ranks), dp1×pp2
(2 ranks) and 8 ranks (dp2×pp2×tp2 1-D TP, and dp4×pp2).  Each "run" builds the small GPT and a
1F1B pipeline, trains with Adam from pipe.optimizer(), and returns its losses by step and its
final parameters.  A resumed run starts from other random weights (seed 5), so only the
checkpoint can make it continue the saved run.

Why bit-for-bit when resuming under the same layout: the same floating-point operations on
the same values (ZeRO slices, Adam state and the data generator restored exactly, one thread
per rank).  Resharding changes the reduction layout (another dp size sums gradients in
another grouping, ZeRO-3 has other units), so those runs are compared to rtol 1e-5 only, and a
negative control (the same load without the optimizer state) shows 1e-5 does tell them apart.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import pipedsl
from pipedsl.errors import PipeRuntimeError
from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch
from pipedsl.models.gpt.parallelize import tp_gpt_loss
from pipedsl.parallel import ParallelConfig, ParallelMesh
from pipedsl.runtime import checkpoint

pytestmark = pytest.mark.slow

GPT_CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
LR, EPS = 1e-2, 1e-4  # eps as in tests/parallel: the key bias's zero gradient is rounding noise
BATCH, M, PP = 16, 2, 2
K, STEPS = 2, 4  # save after step K of STEPS
RTOL = 1e-5


# ----------------------------------------------------------------------------------- worker side


def _run(mesh: ParallelMesh, zero: int, *, seed: int = 0, directory: str | None = None, save_at: tuple = (),
         resume: str | None = None, optimizer_state: bool = True, steps: int = STEPS) -> dict:
    """Train (or resume and train) to `steps`; {"losses": {step: loss}, "params": {stage: {name: tensor}}}."""
    run_mesh = mesh.with_zero(zero)
    torch.manual_seed(seed)
    model = GPT(GPT_CFG)
    tp = mesh.config.tp > 1
    stages = model.tp_stages(PP, run_mesh) if tp else model.stages(PP)
    pipe = pipedsl.Pipeline(stages, "1f1b", microbatches=M, loss_fn=tp_gpt_loss(run_mesh) if tp else gpt_loss,
                            parallel=run_mesh)
    opt = pipe.optimizer(torch.optim.Adam, lr=LR, eps=EPS)
    gen, start = torch.Generator().manual_seed(1), 0
    if resume is not None:
        restored = checkpoint.load(pipe, resume, opt if optimizer_state else None)
        gen.set_state(restored.extra["data"])
        start = restored.step
    losses = {}
    for step in range(start + 1, steps + 1):
        losses[step] = pipe.step(*synthetic_batch(BATCH, GPT_CFG.block_size, GPT_CFG.vocab_size, gen))
        opt.step()
        opt.zero_grad()
        if step in save_at:
            checkpoint.save(pipe, directory, step, opt, extra={"data": gen.get_state()}, timeout=60.0)
    return {"losses": losses, "params": opt.stage_parameters(), "pipe": pipe, "opt": opt}


def _same_params(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[s].keys() == b[s].keys() and all(torch.equal(a[s][n], b[s][n])
                                                                            for n in a[s]) for s in a)


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[s][n] - b[s][n]).abs().max()) for s in a for n in a[s])


def _error(fn) -> str:
    try:
        fn()
    except PipeRuntimeError as err:
        return str(err)
    return "no error"


def dp2_job(root: str) -> dict:
    """dp2×pp2 on 4 ranks: resume bit-exact at zero 0-3; reshard zero 2 → 3 and zero 0 → 2; a rank that never
    writes its part."""
    mesh = ParallelMesh(ParallelConfig(dp=2, pp=PP))
    out: dict = {"rank": dist.get_rank(), "coords": (mesh.coords.dp, mesh.coords.pp, mesh.coords.tp)}
    ref = {}
    for zero in (0, 1, 2, 3):
        d = f"{root}/z{zero}"
        ref[zero] = _run(mesh, zero, directory=d, save_at=(1, K) if zero == 0 else (K,))
        again = _run(mesh, zero, seed=5, resume=d)
        out[f"zero{zero}"] = {"ref": ref[zero]["losses"], "resumed": again["losses"],
                              "same_params": _same_params(again["params"], ref[zero]["params"])}
    # another ZeRO stage at the same dp size: stage 3 has a unit per child module, stage 2 one per stage
    z3 = _run(mesh, 3, seed=5, resume=f"{root}/z2")
    out["z2_to_z3"] = {"resumed": z3["losses"], "param_diff": _max_diff(z3["params"], ref[2]["params"])}
    # a checkpoint without ZeRO into ZeRO 2 (dense state sliced)
    z2 = _run(mesh, 2, seed=5, resume=f"{root}/z0")
    out["z0_to_z2"] = {"resumed": z2["losses"], "param_diff": _max_diff(z2["params"], ref[0]["params"])}
    # rank 3 (dp 1, pp 1) "dies" before writing its part of step 99: the others name it after the timeout
    last = ref[2]
    if dist.get_rank() == 3:
        out["dead"] = "not saving"
    else:
        out["dead"] = _error(lambda: checkpoint.save(last["pipe"], f"{root}/z2", 99, last["opt"], timeout=3.0))
    return out


def dp1_job(root: str) -> dict:
    """dp1×pp2 on 2 ranks: the dp=2 ZeRO-2 checkpoint reassembled into plain Adam (zero 0); without its optimizer
    state as a negative control."""
    mesh = ParallelMesh(ParallelConfig(dp=1, pp=PP))
    with_state = _run(mesh, 0, seed=5, resume=f"{root}/z2")
    without = _run(mesh, 0, seed=5, resume=f"{root}/z2", optimizer_state=False)
    return {"resumed": with_state["losses"], "no_optimizer_state": without["losses"]}


def world8_job(root: str) -> dict:
    """8 ranks: dp2×pp2×tp2 (1-D TP, zero 1) resume bit-exact; dp4×pp2 (zero 1) from the dp=2 ZeRO-2 checkpoint;
    the tp=2 checkpoint into tp=1 is refused on every rank."""
    out: dict = {}
    tp_mesh = ParallelMesh(ParallelConfig(dp=2, pp=PP, tp=2))
    d = f"{root}/tp2"
    ref = _run(tp_mesh, 1, directory=d, save_at=(K,))
    again = _run(tp_mesh, 1, seed=5, resume=d)
    out["tp2"] = {"ref": ref["losses"], "resumed": again["losses"],
                  "same_params": _same_params(again["params"], ref["params"])}
    mesh = ParallelMesh(ParallelConfig(dp=4, pp=PP))
    dp4 = _run(mesh, 1, seed=5, resume=f"{root}/z2")
    out["dp4"] = {"resumed": dp4["losses"]}
    out["tp_mismatch"] = _error(lambda: _run(mesh, 1, seed=5, resume=d))
    out["no_optimizer"] = _error(lambda: checkpoint.save(dp4["pipe"], f"{root}/none", 9, timeout=10.0))
    return out


# ----------------------------------------------------------------------------------- test side


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pckpt")


@pytest.fixture(scope="module")
def dp2(pool, root) -> list[dict]:
    return pool.run(dp2_job, 4, str(root))


@pytest.fixture(scope="module")
def dp1(pool, root, dp2) -> list[dict]:
    return pool.run(dp1_job, 2, str(root))


@pytest.fixture(scope="module")
def world8(pool, root, dp2) -> list[dict]:
    return pool.run(world8_job, 8, str(root))


def tail(losses: dict, after: int) -> dict:
    return {k: v for k, v in losses.items() if k > after}


def close(got: dict, want: dict) -> bool:
    return list(got) == list(want) and all(math.isclose(got[k], want[k], rel_tol=RTOL) for k in want)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_dp2_pp2_resume_is_bit_exact_for_every_zero_stage(dp2, zero) -> None:
    """dp2 × pp2 under each ZeRO stage, resumed after step 2 from other random weights: the losses of steps 3-4 and
    every parameter after them equal the run that never stopped, bit for bit."""
    for r in dp2:
        run = r[f"zero{zero}"]
        assert list(run["ref"]) == [1, 2, 3, 4]
        assert run["resumed"] == tail(run["ref"], K), (r["rank"], run)
        assert run["same_params"], f"rank {r['rank']}: parameters after the resumed steps differ"


def test_zero0_dp_replicas_other_than_0_store_no_stage_state(dp2, root) -> None:
    info = checkpoint.check(root / "z0" / f"step-{K:08d}", verify=True)
    assert info.manifest["parallel"] == {"dp": 2, "pp": 2, "tp": 1, "tp_mode": "1d", "zero": 0}
    parts = {tuple(p["coords"]): p for p in info.manifest["parts"]}
    assert sorted(parts) == [(d, p, 0) for d in range(2) for p in range(2)], "one manifest covers the world"
    for (d, p, _), part in parts.items():
        assert bool(part["modules"]) == (d == 0) and part["optimizers"] == 1, part
        assert part["file"] == f"rank-{p * 2 + d:05d}.pt"  # global rank: (pp, dp, tp), tp fastest
    for p in range(2):
        first, other = (torch.load(info.path / parts[(d, p, 0)]["file"], weights_only=True) for d in (0, 1))
        assert first["modules"] and first["optimizers"] and first["extra"]["data"] is not None
        assert not other["modules"] and not other["optimizers"] and not other["zero"], "dp rank 1: RNG, extra only"
        assert torch.equal(other["extra"]["data"], first["extra"]["data"])


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_parts_hold_each_dp_ranks_slice_with_its_layout(dp2, root, zero) -> None:
    info = checkpoint.check(root / f"z{zero}" / f"step-{K:08d}", verify=True)
    assert info.manifest["parallel"]["zero"] == zero
    for part in info.manifest["parts"]:
        d, p, _ = part["coords"]
        assert part["zero"] == [str(p)] and bool(part["buffers"]) == (d == 0) and not part["modules"], part
        data = torch.load(info.path / part["file"], weights_only=True)
        state = data["zero"][str(p)]
        assert state["rank"] == d and state["stage"] == zero and state["optimizer"] == "Adam"
        for unit, saved in zip(state["layout"], state["units"]):
            assert unit["n"] == 2 and unit["padded"] % 2 == 0 and unit["padded"] >= unit["numel"]
            assert saved["params"].shape == (unit["padded"] // 2,)
            assert {k: v.shape for k, v in saved["sharded"].items()} == {
                "exp_avg": (unit["padded"] // 2,), "exp_avg_sq": (unit["padded"] // 2,)}
            assert float(saved["scalar"]["step"]) == K
        assert (len(state["layout"]) == 1) == (zero < 3), "ZeRO-3: a unit per child module, else one per stage"


def test_reshard_zero2_into_zero3_at_the_same_dp(dp2) -> None:
    """A dp2 ZeRO-2 checkpoint resumed under ZeRO-3 at the same dp: the losses of steps 3-4 (rtol 1e-5) and the
    parameters after them (1e-5) equal the ZeRO-2 run that never stopped (another reduction layout: not bitwise)."""
    for r in dp2:
        want = tail(r["zero2"]["ref"], K)
        assert close(r["z2_to_z3"]["resumed"], want), (r["z2_to_z3"], want)
        assert r["z2_to_z3"]["param_diff"] < 1e-5


def test_checkpoint_without_zero_loads_into_zero2(dp2) -> None:
    for r in dp2:
        want = tail(r["zero0"]["ref"], K)
        assert close(r["z0_to_z2"]["resumed"], want), (r["z0_to_z2"], want)
        assert r["z0_to_z2"]["param_diff"] < 1e-5


def test_reshard_dp2_zero2_into_dp1_plain_adam(dp2, dp1) -> None:
    want = tail(dp2[0]["zero2"]["ref"], K)
    for r in dp1:
        assert close(r["resumed"], want), (r["resumed"], want)
        assert not close(r["no_optimizer_state"], want), "without Adam's state the losses must differ, or rtol proves nothing"


def test_reshard_dp2_zero2_into_dp4_zero1(dp2, world8) -> None:
    want = tail(dp2[0]["zero2"]["ref"], K)
    for r in world8:
        assert close(r["dp4"]["resumed"], want), (r["dp4"]["resumed"], want)


def test_dp2_pp2_tp2_resume_is_bit_exact(world8, root) -> None:
    """dp2 × pp2 × tp2 (1-D, ZeRO-1), resumed after step 2 from other random weights: the losses of steps 3-4 and every
    parameter equal the run that never stopped, bit for bit; the manifest holds 8 parts and 4 tp stages."""
    for rank, r in enumerate(world8):
        assert list(r["tp2"]["ref"]) == [1, 2, 3, 4]
        assert r["tp2"]["resumed"] == tail(r["tp2"]["ref"], K), (rank, r["tp2"])
        assert r["tp2"]["same_params"], f"rank {rank}: parameters after the resumed steps differ"
    manifest = checkpoint.check(root / "tp2" / f"step-{K:08d}").manifest
    assert sorted(manifest["partition"]["tp_stages"]) == ["0/0", "0/1", "1/0", "1/1"]
    assert len({tuple(p["coords"]) for p in manifest["parts"]}) == 8


def test_a_different_tp_size_is_one_clear_error_on_every_rank(world8) -> None:
    messages = {r["tp_mismatch"] for r in world8}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith("checkpoint error: ") and "\n" not in message, message
    assert "was saved with tp=2 (1d), this pipeline has tp=1 (1d): the tp sizes differ" in message


def test_a_dp_rank_that_never_writes_its_part_is_named_and_the_save_does_not_count(dp2, root) -> None:
    assert dp2[3]["dead"] == "not saving"
    for r in dp2[:3]:
        assert "rank 3 did not finish writing its part within 3 s" in r["dead"], r["dead"]
    step = root / "z2" / "step-00000099"
    # the ranks that wrote their parts removed them when the save was abandoned (issue 39: no bytes left behind)
    assert not step.exists() or not list(step.iterdir()), list(step.iterdir())
    assert checkpoint.latest(root / "z2").step == K, "the incomplete step 99 is skipped"


def test_a_parallel_checkpoint_without_its_manifest_is_skipped(dp2, root, tmp_path) -> None:
    d = tmp_path / "z0"
    shutil.copytree(root / "z0", d)
    assert [c.step for c in checkpoint.checkpoints(d)] == [1, K]
    (d / f"step-{K:08d}" / "manifest.json").unlink()
    assert checkpoint.latest(d).step == 1
    manifest = json.loads((d / "step-00000001" / "manifest.json").read_text())
    assert manifest["version"] == checkpoint.VERSION and len(manifest["parts"]) == 4


def test_zero_without_its_optimizer_is_refused_on_every_rank(world8, root) -> None:
    messages = {r["no_optimizer"] for r in world8}
    assert messages == {"checkpoint error: zero=1: the stages' parameters live in the optimizer's flat buffers; "
                        "pass the optimizer pipe.optimizer(...) returned (got none)"}, messages
    assert checkpoint.latest(root / "none") is None
