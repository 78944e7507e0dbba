"""Checkpoints load into another stage partition (runtime/checkpoint/state.py, by the whole model's tensor names):
other cut points, another number of stages, from and to ZeRO and expert parallelism; a different model is
refused naming the tensor.

One job on 4 ranks: runs save after step K; resumed runs start from other random weights under another
partition, so only the checkpoint can make them continue the saved run's losses (rtol 1e-5: another grouping of
the gradient sums), with a negative control (the same load without the optimizer state)."""

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

DENSE = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16)
MOE = GPTConfig(vocab_size=32, block_size=8, n_layer=4, n_head=2, n_embd=16, n_experts=4, top_k=2, expert_ffn=24,
                aux_loss_coef=0.1)
BATCH, M = 16, 4
K, STEPS = 2, 4
RTOL = 1e-5
VOCAB = 96  # the Hugging Face model's


def _run(cfg: GPTConfig, pp: int, points: list[int] | None, *, mesh: ParallelMesh | None = None, zero: int = 0,
         seed: int = 0, directory: str | None = None, resume: str | None = None, optimizer_state: bool = True,
         schedule: str = "1f1b", microbatches: int = M) -> dict:
    """Train to STEPS on `pp` stages cut at `points` (saving after step K), or resume and train."""
    model = randomize_(GPT(cfg), torch.Generator().manual_seed(seed))
    if mesh is None:  # a pipeline over the whole world
        assert pp == dist.get_world_size()
        pipe = pipedsl.Pipeline(model.stages(pp, points=points), schedule, microbatches=microbatches, loss_fn=gpt_loss)
        opt = torch.optim.Adam([p for m in pipe.local_stages().values() for p in m.parameters()], lr=1e-2)
    else:
        pipe = pipedsl.Pipeline(parallelize_gpt(model, pp, mesh, points=points), schedule, microbatches=microbatches,
                                loss_fn=gpt_loss, parallel=mesh.with_zero(zero))
        opt = pipe.optimizer(torch.optim.Adam, lr=1e-2)
    return cases.resumable_run(pipe, opt, lambda gen: synthetic_batch(BATCH, cfg.block_size, cfg.vocab_size, gen),
                               STEPS, save_at=K, directory=directory, resume=resume, optimizer_state=optimizer_state)


def job(root: str) -> dict:
    out: dict = {"rank": dist.get_rank()}
    dp2 = ParallelMesh(ParallelConfig(dp=2, pp=2))
    dense2 = f"{root}/dense-dp2-pp2"
    out["saved"] = _run(DENSE, 2, None, mesh=dp2, directory=dense2)
    out["to_points"] = _run(DENSE, 2, [2], mesh=dp2, seed=5, resume=dense2)  # [embed, b0] [b1 … head]: 3+3 saved
    out["to_pp4"] = _run(DENSE, 4, [1, 3, 5], seed=5, resume=dense2, schedule="zb-h1")
    out["to_pp4_no_state"] = _run(DENSE, 4, [1, 3, 5], seed=5, resume=dense2, optimizer_state=False)
    z3 = f"{root}/dense-dp2-pp2-z3"
    out["z3_saved"] = _run(DENSE, 2, None, mesh=dp2, zero=3, directory=z3)
    out["z3_to_pp4"] = _run(DENSE, 4, [2, 3, 4], seed=5, resume=z3)
    out["z3_to_z1"] = _run(DENSE, 2, [4], mesh=dp2, zero=1, seed=5, resume=z3)
    ep = f"{root}/moe-ep2"
    ep2 = ParallelMesh(ParallelConfig(dp=2, pp=2, ep=2))
    out["ep_saved"] = _run(MOE, 2, None, mesh=ep2, zero=1, directory=ep)
    out["ep_to_points"] = _run(MOE, 2, [2], mesh=ep2, zero=0, seed=5, resume=ep)
    # the router's loss is per microbatch: microbatches of the dp2 run's size (8 of 2, as its replicas' 4 + 4)
    out["ep_to_pp4"] = _run(MOE, 4, [1, 2, 4], seed=5, resume=ep, microbatches=2 * M)
    for name, cfg in (("fewer_layers", GPTConfig(**{**DENSE.__dict__, "n_layer": 3})),
                      ("wider", GPTConfig(**{**DENSE.__dict__, "n_embd": 24}))):
        try:
            _run(cfg, 4, None, seed=5, resume=dense2)
            out[name] = None
        except checkpoint.CheckpointError as err:
            out[name] = str(err)
    return out


@pytest.fixture(scope="module")
def results(pool, tmp_path_factory) -> list[dict]:
    root: Path = tmp_path_factory.mktemp("repart")
    return pool.run(job, 4, str(root))


def _close(got: dict, want: dict) -> bool:
    return list(got) == list(want) and all(math.isclose(got[k], want[k], rel_tol=RTOL) for k in want)


def _after(losses: dict) -> dict:
    return {k: v for k, v in losses.items() if k > K}


@pytest.mark.parametrize("case,saved", [("to_points", "saved"), ("to_pp4", "saved"), ("z3_to_pp4", "z3_saved"),
                                        ("z3_to_z1", "z3_saved"), ("ep_to_points", "ep_saved"),
                                        ("ep_to_pp4", "ep_saved")])
def test_another_partition_continues_the_run(results, case, saved) -> None:
    """Every rank holding a pipeline's last stage reports the loss: it equals the saved run's continuation, and the
    load says the partition changed."""
    reported = [r for r in results if r[case]["losses"]]
    assert reported
    want = next(r[saved]["losses"] for r in results if r[saved]["losses"])
    for r in reported:
        assert _close(r[case]["losses"], _after(want)), (case, r["rank"], r[case]["losses"], want)
        assert r[case]["changed"] is True


def test_without_the_optimizer_state_the_continuation_differs(results) -> None:
    r = results[0]
    assert r["to_pp4_no_state"]["losses"] and not _close(r["to_pp4_no_state"]["losses"], _after(r["saved"]["losses"]))


def test_a_different_model_is_refused_naming_the_tensor(results) -> None:
    fewer, wider = results[0]["fewer_layers"], results[0]["wider"]
    assert fewer is not None and "'4.attn.proj.bias'" in fewer and "no stage of this pipeline has" in fewer, fewer
    assert wider is not None and "a different model" in wider and "float32[32, 24] here" in wider, wider


def _hf_run(points: list[int] | None, *, seed: int, directory: str | None = None, resume: str | None = None) -> dict:
    """A tied-embedding Llama on 2 ranks cut at `points` (units: embedding, 3 layers, head): Adam to STEPS, saving
    after step K, or resumed."""
    import transformers as tf

    from pipedsl.models.hf.stages import causal_lm_loss, causal_lm_stages, shift_labels

    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config)
    pipe = pipedsl.Pipeline(causal_lm_stages(model, 2, points=points), "1f1b", microbatches=M, loss_fn=causal_lm_loss)
    opt = torch.optim.Adam([p for m in pipe.local_stages().values() for p in m.parameters()], lr=1e-2)

    def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(VOCAB, (BATCH, 8), generator=gen)
        return x, shift_labels(x)

    return {**cases.resumable_run(pipe, opt, batch, STEPS, save_at=K, directory=directory, resume=resume),
            "ties": len(pipe.ties.names)}


def hf_job(root: str) -> dict:
    saved = _hf_run(None, seed=0, directory=f"{root}/hf")  # by count: [embed, l0, l1] [l2, head]
    return {"saved": saved, "resumed": _hf_run([1], seed=3, resume=f"{root}/hf")}  # [embed] [l0, l1, l2, head]


def test_a_hugging_face_model_with_a_tied_head_moves_between_partitions(pool, tmp_path) -> None:
    """The HF stages name their tensors by the model's own names (a tied head by its embedding's): the embedding and
    its tied head, with their Adam moments, load into another cut and the run goes on."""
    results = pool.run(hf_job, 2, str(tmp_path))
    last = results[1]
    assert last["saved"]["ties"] == 1 and last["resumed"]["changed"] is True
    assert _close(last["resumed"]["losses"], _after(last["saved"]["losses"])), last
