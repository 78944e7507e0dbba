"""Hugging Face stages on dp2 × pp2 with ZeRO 0-3 train like one process: tied embeddings, frozen parameters,
checkpoints (see hf_zero_cases.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (the optional `examples` extra)")

import hf_zero_cases as cases  # noqa: E402
from compared import every_parameter_compared  # noqa: E402

pytestmark = pytest.mark.slow

INTERLEAVED = {"V": 2}
# (family, schedule, params, zero, zero_reduce, variant, recompute): every feature under a few schedules and
# ZeRO stages, not the whole product.  "lora": a frozen base with trainable LoRA adapters, norms and tied
# embedding; "lora-frozen-tie": the embedding frozen too.
RUNS = {
    "tied-1f1b-zero1": ("llama", "1f1b", None, 1, "step", "tied", None),
    "tied-zbh1-zero2": ("llama", "zb-h1", None, 2, "step", "tied", None),  # split backward (I, W)
    "tied-interleaved-zero3": ("llama", "interleaved", INTERLEAVED, 3, "step", "tied", None),  # 2 stages a rank
    "tied-zbv-zero0": ("llama", "zb-v", None, 0, "step", "tied", None),
    "tied-zbv-zero3": ("llama", "zb-v", None, 3, "step", "tied", None),  # both tied copies on rank 0
    "tied-1f1b-zero3-recompute": ("llama", "1f1b", None, 3, "step", "tied", "full"),
    "tied-chimera-zero2": ("llama", "chimera", None, 2, "step", "tied", None),  # stage replicas on both ranks
    "gpt2-1f1b-zero3": ("gpt2", "1f1b", None, 3, "step", "tied", None),  # Conv1D layers, learned positions
    "lora-1f1b-zero0": ("llama", "1f1b", None, 0, "step", "lora-frozen-tie", None),
    "lora-zbh1-zero3": ("llama", "zb-h1", None, 3, "step", "lora", None),
    "lora-interleaved-zero2-microbatch": ("llama", "interleaved", INTERLEAVED, 2, "microbatch", "lora", None),
    "lora-zbv-zero1": ("llama", "zb-v", None, 1, "step", "lora-frozen-tie", None),
    "lora-1f1b-zero3-recompute": ("llama", "1f1b", None, 3, "step", "lora", "full"),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_three_adamw_steps_with_clipping_equal_one_process(pool, run):
    """Losses, clipped global norms (a tie counted once) and every parameter after three steps equal the unsplit
    model's; frozen parameters are bit for bit what they were; the tied copies — on the first and the last stage
    of both dp replicas — are bitwise equal; ZeRO-3 holds no gathered unit once a backward is over."""
    family, schedule, params, zero, reduce, variant, recompute = RUNS[run]
    results = pool.run(cases.zero_equivalence, 4, family, schedule, params, zero, reduce, variant, recompute)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:8])
    every_parameter_compared([n for r in results for n in r["checked"]], results[0]["all"])
    copies = [v for r in results for v in r["ties"].values()]
    assert len(copies) >= 4 and len(results[0]["tie_names"]) == 1  # dp replicas x (first stage, last stage) x replicas
    assert all(c.equal(copies[0]) for c in copies), "the tied copies differ"
    assert results[0]["moved"] > 1000 * cases.PARAM_ATOL, "training did not move the weights: a vacuous check"
    assert (results[0]["frozen"] > 0) == variant.startswith("lora")
    assert all(r["gathered"] == 0 for r in results)
    print(f"{run}: loss {max(r['loss_err'] for r in results):.2g} norm {max(r['norm_err'] for r in results):.2g} "
          f"parameters {max(r['param_err'] for r in results):.2g}")


def test_checkpoints_resume_and_reshard_with_ties_and_frozen_parameters(pool, tmp_path):
    """The LoRA model (tied embedding, frozen base) under ZeRO-2 saves after step 2 of 4.  Resuming under the same
    layout is bit-exact; under ZeRO-3 and ZB-H1 (other units: resharded) and on dp1 without ZeRO (every slice
    reassembled) the losses and weights match the uninterrupted run to fp32 rounding, which matches one process."""
    dp2 = pool.run(cases.checkpoint_dp2, 4, str(tmp_path))
    dp1 = pool.run(cases.checkpoint_dp1, 2, str(tmp_path))
    ref = cases.one_process_losses()
    full = dp2[0]["full"]["losses"]
    assert all(abs(full[k] - ref[k]) <= cases.LOSS_RTOL * ref[k] for k in ref)
    weights = {k: v for r in dp2 for k, v in r["full"]["params"].items()}
    for run, results in [("same", dp2), ("zero3", dp2), ("dp1", dp1)]:
        losses = results[0][run]["losses"]
        assert sorted(losses) == [3, 4]
        got = {k: v for r in results for k, v in r[run]["params"].items()}
        assert got.keys() == weights.keys()
        if run == "same":
            assert losses == {k: full[k] for k in (3, 4)}
            assert all(got[k].equal(weights[k]) for k in got)
        else:
            assert all(abs(losses[k] - full[k]) <= 1e-5 * full[k] for k in losses), (run, losses, full)
            assert max((got[k] - weights[k]).abs().max().item() for k in got) <= cases.PARAM_ATOL


def test_a_module_shared_by_two_local_stages_is_refused_under_zero(pool):
    for message in pool.run(cases.shared_module_refusal, 4):
        assert "stages 0 and 3 share the module holding the tied 'wte.weight'" in message, message
        assert "tie the Parameter instead" in message
