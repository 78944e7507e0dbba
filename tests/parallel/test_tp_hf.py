"""Tensor (+ sequence) parallel Hugging Face stages (parallel/tp_hf.py) train exactly like one dense process.

Tiny Llama and Qwen3 (grouped-query attention: 4 query heads, 2 key/value heads; Qwen3's
per-head q/k norms) at tp2, pp1 and pp2, with and without sequence parallelism, and at
dp2 × pp2 × tp2, through `Pipeline(..., parallel=mesh)`: two SGD steps, every step's loss,
every parameter's gradient (DTensor shards gathered) and the global gradient norm against the
dense model's, then the parameters (tp_hf_cases.py).  fp32; measured differences ≤ 1.5e-6
relative (summation order only).  Under ZeRO 1-3 and with bf16 parameters over fp32 main
parameters, whose gradients live in flat buffers, the parameters are compared after every step
instead (AdamW for ZeRO; bf16 within test_bf16_autocast's tolerance).
"""

from __future__ import annotations

import pytest
from tp_hf_cases import checkpoint_resume, norm_grad_all_reduces, refusals, retp_load, retp_save, tp_equivalence

pytestmark = pytest.mark.slow

ADAM_TOL = 2e-5  # of the parameters after AdamW steps (see test_zero_dp2_pp2_tp2_sp)
TOL = 1e-5  # relative: of the loss; of each gradient / parameter tensor's largest entry; of the norm
C, T, MB = 32, 8, 2  # tiny_model's hidden size, the batch's sequence length, rows per microbatch (M=2)


def _check(results: list[dict], sp: bool, pp: int, tol: dict[str, float] | None = None) -> None:
    for r in results:
        for key in ("loss_err", "grad_err", "param_err", "norm_err"):
            assert r[key] < (tol or {}).get(key, TOL), (key, r)
        assert r["dtensors"] > 0 and r["checked"]
    first = [r for r in results if r["sent"]]  # ranks holding a stage that is not the last
    assert bool(first) == (pp > 1)
    for r in first:  # the runtime sends plain tensors: the sequence shard with SP, the whole sequence without
        assert r["sent"] == [("Tensor", MB, T // 2 if sp else T, C)], r["sent"]
    assert len({tuple(r["losses"]) for r in results}) == 1  # the same loss on every rank


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tp2_equals_dense(run_once, family: str, pp: int, sp: bool) -> None:
    """tp2 at pp1 and pp2, with and without SP: every step's loss, every gradient (shards gathered), the global norm and
    the parameters after 2 SGD steps equal the dense HF model in one process (1e-5 relative)."""
    _check(run_once(tp_equivalence, 2 * pp, family, 1, pp, 2, sp), sp, pp)


def test_tp2_pp2_llama_equals_dense_under_nccls_semantics(run_once) -> None:
    """The pipeline's messages by rendezvous on one stream per directed edge (runtime/rendezvous.py) beside the
    tensor-parallel collectives: the same results as over gloo, each equal to the dense one-process Llama
    (`tp_equivalence`)."""
    import nccl_cases

    _check(run_once(nccl_cases.under, 4, "rendezvous", None, None, tp_equivalence, "llama", 1, 2, 2, True), True, 2)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_dp2_pp2_tp2_sp_equals_dense(run_once, family: str) -> None:
    """dp2 × pp2 × tp2 with SP: every step's loss, every gradient (shards gathered), the global norm and the parameters
    after 2 SGD steps equal the dense HF model in one process on the global batch (1e-5 relative)."""
    _check(run_once(tp_equivalence, 8, family, 2, 2, 2, True), True, 2)


@pytest.mark.parametrize(("family", "zero"), [("llama", 0), ("qwen3", 1)])
def test_norm_gradients_are_summed_once_a_step(run_once, family: str, zero: int) -> None:
    """Under SP the norms' (and Qwen3's q/k norms') gradients are partial sums; DTensor would all-reduce them in
    every backward (5 and 9 all-reduces a microbatch here).  They are summed once per step, so one step runs no
    DTensor all-reduce at all, at M = 2 and M = 4; the tests above check the gradients against the dense model."""
    for counts in run_once(norm_grad_all_reduces, 2, family, zero):
        assert counts == [0, 0], counts


def test_clip_counts_dtensor_shards_once(run_once) -> None:
    """`pipe.clip_grad_norm_` with a max norm below the gradient norm: the clipped steps equal
    `torch.nn.utils.clip_grad_norm_` on the dense model (a shard counted twice, or a replicated
    norm weight counted on both tp ranks, would change the factor and every parameter)."""
    _check(run_once(tp_equivalence, 4, "qwen3", 1, 2, 2, True, 2, 2, "1f1b", 0.5, 2, 0.3), True, 2)


@pytest.mark.parametrize(("schedule", "layers", "recompute"), [
    ("zb-h1", 2, None),  # split backward: W runs autograd.grad from the boundary nodes, through DTensor ops
    ("interleaved", 4, None),  # two stages a rank
    ("1f1b", 2, "full"),  # the stage's collectives run again at recomputation
    ("1f1b", 2, "selective"),  # attention recomputed: its input hook is called again on converted arguments
])
def test_schedules_and_recompute(run_once, schedule: str, layers: int, recompute: str | None) -> None:
    _check(run_once(tp_equivalence, 4, "qwen3", 1, 2, 2, True, 2, 4, schedule, 0.5, layers, None, 0, recompute),
           True, 2)


@pytest.mark.parametrize(("dp", "pp"), [(1, 1), (1, 2), (2, 2)])
def test_tied_embeddings(run_once, dp: int, pp: int) -> None:
    """tie_word_embeddings (Qwen3's small models): one DTensor parameter in the embedding and the head
    (pp1), or a copy on the first and the last stage's ranks whose row blocks the tie sums (pp2)."""
    _check(run_once(tp_equivalence, 2 * dp * pp, "qwen3", dp, pp, 2, True, 2, 2, "1f1b", 0.5, 2, None, 0, None,
                    None, None, True), True, pp)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_padding_mask(run_once, sp: bool) -> None:
    """Left- and right-padded rows: the [mb, T] padding mask travels whole beside the (sharded) hidden
    states and every stage builds the masks of the whole sequence; `loss_reduction="token"`."""
    _check(run_once(tp_equivalence, 4, "qwen3", 1, 2, 2, sp, 2, 2, "1f1b", 0.5, 2, None, 0, None, None, None, None,
                    True), sp, 2)


def test_bf16_autocast(run_once) -> None:
    """precision="bf16" (fp32 parameters, bf16 compute) against the dense model under autocast: within
    bf16's tolerance (tests/models/hf_cases.py's: 1e-3 of the loss, 6e-2 of each gradient's scale)."""
    results = run_once(tp_equivalence, 4, "llama", 1, 2, 2, True, 2, 2, "1f1b", 0.5, 2, None, 0, None, None, "bf16")
    _check(results, True, 2, {"loss_err": 1e-3, "grad_err": 6e-2, "param_err": 6e-2, "norm_err": 1e-3})


def test_refusals(run_once) -> None:
    out = run_once(refusals, 2)[0]
    assert "num_attention_heads=3 is not divisible by tp=2" in out["heads"]
    assert "num_key_value_heads=1 is not divisible by tp=2" in out["kv_heads"]
    assert "not in the Llama layout" in out["layout"]
    assert "the pipeline has no tp dimension: pass parallel=mesh" in out["no_mesh"], out["no_mesh"]
    assert "input_layernorm.weight" in out["no_mesh"]


@pytest.mark.parametrize(("dp", "zero", "other"), [(1, 0, 1), (2, 3, 0)])
def test_checkpoint_resume_same_layout(run_once, tmp_path, dp: int, zero: int, other: int) -> None:
    """A checkpoint of DTensor shards (zero=0) or of ZeRO-3's dp slices of them resumes bit-exactly on the same
    dp × pp × tp layout (each rank's file holds its own), and under another ZeRO stage to 1e-6: zero=0's shards
    re-sliced into ZeRO-1, ZeRO-3's slices put back together into DTensor parameters and Adam state at zero=0.
    Resharding to another tp size: test_checkpoint_loads_under_another_tp; HF export of tp checkpoints is
    tests/trainer/test_train_hf.py's."""
    for r in run_once(checkpoint_resume, 4 * dp, str(tmp_path), dp, zero, other):
        assert r["saved"] == r["loaded"] and r["same_params"], r
        assert r["resharded"] == pytest.approx(r["saved"], rel=1e-6), r


@pytest.mark.parametrize(("saved", "loaded"), [((2, 2, 3), (1, 1, 0)), ((1, 1, 0), (1, 2, 1))])
def test_checkpoint_loads_under_another_tp(run_once, tmp_path, saved: tuple, loaded: tuple) -> None:
    """(dp, tp, zero) → (dp, tp, zero): a checkpoint of dp2 × pp2 × tp2 + SP ZeRO-3 slices of DTensor shards loads
    into the dense model at tp1 without ZeRO, and one of the dense model at tp1 into tp2 + SP under ZeRO-1: each
    tensor and Adam moment put together from its tp shards and cut again; the next two steps' losses equal those
    of the run that saved it (1e-6)."""
    want = run_once(retp_save, 2 * saved[0] * saved[1], str(tmp_path), *saved)[0]
    got = run_once(retp_load, 2 * loaded[0] * loaded[1], str(tmp_path), *loaded)
    for losses in got:
        assert losses == pytest.approx(want, rel=1e-6), (losses, want)


@pytest.mark.parametrize(("zero", "schedule", "family", "clip", "tie"), [
    (1, "1f1b", "qwen3", 0.3, None),  # clipping over flat slices: a tp shard counted on each tp rank, a norm weight once
    (2, "1f1b", "qwen3", None, True),  # tied embeddings: each end's copy a unit of its own, its row blocks summed
    (3, "zb-h1", "llama", None, None),  # split backward: W runs on DTensor views of gathered, then freed, flat buffers
])
def test_zero_dp2_pp2_tp2_sp(run_once, zero: int, schedule: str, family: str, clip: float | None,
                             tie: bool | None) -> None:
    """ZeRO over each DTensor parameter's local shard: AdamW (eps=1e-4, as test_zero.py: Adam turns the rounding
    noise of near-zero gradients into full-size steps), the parameters after every step equal the dense model's:
    5.4e-6 measured (Llama) at zero 0, 1 and 3 alike, hence ADAM_TOL.  The flat buffers hold tp shards (Llama:
    5,440 of 10,816 parameters on a stage-0 rank), ZeRO-3 a dp slice of them."""
    results = run_once(tp_equivalence, 8, family, 2, 2, 2, True, 2, 2, schedule, 1e-2, 2, clip, zero, None, None,
                       None, tie, False, "adamw")
    _check(results, True, 2, {"param_err": ADAM_TOL})
    for r in results:  # the flat buffers hold tp shards (padded to dp's multiple per unit), ZeRO-3 a dp slice of them
        b = r["bytes"]
        assert b["shards"] < 0.6 * b["whole"] and 0 <= b["padded"] - b["shards"] < 2 * 16, b
        assert b["params"] == (4 * b["padded"] // 2 if zero == 3 else 4 * b["padded"]), b


BF16 = {"loss_err": 1e-3, "grad_err": 6e-2, "param_err": 6e-2, "norm_err": 1e-3}  # test_bf16_autocast's


@pytest.mark.parametrize("zero", [0, 1])
def test_bf16_params_dp2_pp2_tp2_sp(run_once, zero: int) -> None:
    """bf16 parameters with fp32 main parameters (Megatron's): ZeRO 0 (flat buffers, not sharded) and ZeRO 1; the
    fp32 main parameters after every SGD step against the dense model stepping fp32 values it rounds to bf16
    before each forward, under autocast."""
    results = run_once(tp_equivalence, 8, "qwen3", 2, 2, 2, True, 2, 2, "1f1b", 0.5, 2, None, zero, None,
                       None, "bf16-params")
    _check(results, True, 2, BF16)
