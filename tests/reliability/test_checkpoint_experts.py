"""Checkpoints of an MoE GPT with its experts sharded over ep (parallel/expert.py): resume bit-exact under the
same layout, reshard over ep and ZeRO stages, and read offline (export) as the whole model.

One job on 4 ranks (dp2 × pp2): runs save after step K; resumed runs start from other random weights,
so only the checkpoint can make them continue.  Resharding sums gradients in another grouping, so those
runs are compared to rtol 1e-5, with a negative control (the same load without the optimizer state).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import reliability_cases as cases
import torch
import torch.distributed as dist

import pipedsl
from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, randomize_, synthetic_batch
from pipedsl.models.gpt.parallelize import parallelize_gpt
from pipedsl.parallel import ParallelConfig, ParallelMesh
from pipedsl.runtime import checkpoint

pytestmark = pytest.mark.slow

CFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, n_experts=4, top_k=2, expert_ffn=24,
                aux_loss_coef=0.1)
BATCH, M, PP = 16, 2, 2
K, STEPS = 2, 4
RTOL = 1e-5


def _model(seed: int) -> GPT:
    return randomize_(GPT(CFG), torch.Generator().manual_seed(seed))


def _run(mesh: ParallelMesh, zero: int, *, seed: int = 0, directory: str | None = None, resume: str | None = None,
         optimizer_state: bool = True) -> dict:
    """Train to STEPS (saving after step K), or resume and train; {"losses": {step: loss}}."""
    pipe = pipedsl.Pipeline(parallelize_gpt(_model(seed), PP, mesh), "1f1b", microbatches=M, loss_fn=gpt_loss,
                            parallel=mesh.with_zero(zero))
    opt = pipe.optimizer(torch.optim.Adam, lr=1e-2)
    return cases.resumable_run(pipe, opt, lambda gen: synthetic_batch(BATCH, CFG.block_size, CFG.vocab_size, gen),
                               STEPS, save_at=K, directory=directory, resume=resume, optimizer_state=optimizer_state)


def ep_job(root: str) -> dict:
    ep2 = ParallelMesh(ParallelConfig(dp=2, pp=PP, ep=2))
    no_ep = ParallelMesh(ParallelConfig(dp=2, pp=PP))
    out: dict = {}
    for zero in (0, 3):
        d = f"{root}/ep2-z{zero}"
        out[f"z{zero}"] = _run(ep2, zero, directory=d)["losses"]
        out[f"z{zero}_resumed"] = _run(ep2, zero, seed=5, resume=d)["losses"]
    out["z0_to_z1"] = _run(ep2, 1, seed=5, resume=f"{root}/ep2-z0")["losses"]
    out["z3_to_no_ep"] = _run(no_ep, 1, seed=5, resume=f"{root}/ep2-z3")["losses"]
    out["z0_to_no_ep"] = _run(no_ep, 0, seed=5, resume=f"{root}/ep2-z0")["losses"]
    out["z0_to_no_ep_no_state"] = _run(no_ep, 0, seed=5, resume=f"{root}/ep2-z0", optimizer_state=False)["losses"]
    d = f"{root}/no-ep"
    out["no_ep"] = _run(no_ep, 1, directory=d)["losses"]
    out["no_ep_to_ep2"] = _run(ep2, 3, seed=5, resume=d)["losses"]
    out["rank"] = dist.get_rank()
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("eckpt")


@pytest.fixture(scope="module")
def job(pool, root) -> list[dict]:
    return pool.run(ep_job, 4, str(root))


def _close(got: dict, want: dict) -> bool:
    return list(got) == list(want) and all(math.isclose(got[k], want[k], rel_tol=RTOL) for k in want)


def _after(losses: dict) -> dict:
    return {k: v for k, v in losses.items() if k > K}


@pytest.mark.parametrize("zero", [0, 3])
def test_resume_under_the_same_ep_layout_is_bit_exact(job, zero) -> None:
    """dp2 × pp2 × ep2 under ZeRO 0 and 3, resumed after step 2 from other random weights: the losses of steps 3 and 4
    equal the run that never stopped, bit for bit."""
    for r in job:
        assert r[f"z{zero}_resumed"] == _after(r[f"z{zero}"]), r["rank"]


@pytest.mark.parametrize("case,saved", [("z0_to_z1", "z0"), ("z3_to_no_ep", "z3"), ("z0_to_no_ep", "z0"),
                                        ("no_ep_to_ep2", "no_ep")])
def test_resharding_over_ep_and_zero_continues_the_run(job, case, saved) -> None:
    """ep2 → ep2 under another ZeRO stage, ep2 → no expert parallelism, and back: the expert shards joined along
    their experts and cut again, with Adam's moments."""
    for r in job:
        assert _close(r[case], _after(r[saved])), (r["rank"], r[case], r[saved])


def test_without_the_optimizer_state_the_continuation_differs(job) -> None:
    """The negative control: rtol 1e-5 tells a resume without Adam's moments apart."""
    r = job[0]
    assert not _close(r["z0_to_no_ep_no_state"], _after(r["z0"]))


def test_an_ep_checkpoint_reads_offline_as_the_whole_model(job, root) -> None:
    """`read_model` (what export uses) joins the expert shards: whole tensors under the unsharded names, and the
    one-process model built from them computes the saved run's next loss."""
    saved = checkpoint.read_model(f"{root}/ep2-z3")
    model = _model(7)
    stages = model.stages(PP)
    for s, module in enumerate(stages):
        module.load_state_dict(saved.stages[s])
    assert saved.stages[0]["1.mlp.experts.fc"].shape[0] == CFG.n_experts
    gen = torch.Generator()
    gen.set_state(saved.extra["data"])
    x, y = synthetic_batch(BATCH, CFG.block_size, CFG.vocab_size, gen)
    with torch.no_grad():
        loss = sum(gpt_loss(model(xm), ym).item() for xm, ym in zip(x.chunk(2 * M), y.chunk(2 * M))) / (2 * M)
    assert math.isclose(loss, job[0]["z3"][K + 1], rel_tol=RTOL), (loss, job[0]["z3"][K + 1])
