"""The GPT's Mixture-of-Experts (models/gpt/moe.py) and expert parallelism (parallel/expert.py): the
router's formulas against transformers' reference, and training pipelined — with the experts sharded
over data-parallel ranks, under ZeRO — equal to one process."""

from __future__ import annotations

import copy
import math

import moe_cases as cases
import pytest
import torch
from compared import every_parameter_compared

from pipedsl.models.gpt.model import synthetic_batch
from pipedsl.models.gpt.moe import Router
from pipedsl.runtime.expert_load import ExpertLoad
from pipedsl.runtime.recompute import Recompute


def test_the_router_loss_is_transformers_load_balancing_loss() -> None:
    """One layer's auxiliary loss is transformers' `load_balancing_loss_func` of its logits; the z-loss ST-MoE's."""
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    router = Router(num_experts=8, hidden=16, top_k=2, capacity_factor=None)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(40, 16)
    r = router(x)
    logits = x @ router.weight.T
    want = mixtral.load_balancing_loss_func((logits,), num_experts=8, top_k=2)
    assert torch.allclose(r["aux"], want, rtol=1e-6), (r["aux"], want)
    assert torch.allclose(r["z"], torch.logsumexp(logits, -1).square().mean())
    probs = logits.softmax(-1)
    top, index = probs.topk(2)
    assert torch.equal(r["index"], index) and torch.allclose(r["weight"], top / top.sum(-1, keepdim=True))
    assert r["counts"].sum() == 80 and r["dropped"] == 0


def test_capacity_drops_the_latest_slots_of_a_full_expert() -> None:
    """Capacity ceil(c·N·k/E); an expert's slots beyond it, in token order, get index E and weight 0."""
    router = Router(num_experts=4, hidden=8, top_k=1, capacity_factor=1.0)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[2, 0] = 10.0  # every token whose feature 0 is positive prefers expert 2
    x = torch.zeros(8, 8)
    x[:, 0] = torch.tensor([1.0, -1, 1, 1, 1, -1, 1, 1])
    r = router(x)
    capacity = math.ceil(1.0 * 8 / 4)
    to_two = (x[:, 0] > 0).nonzero().squeeze(1)
    kept = r["index"][to_two, 0]
    assert kept[:capacity].tolist() == [2] * capacity and kept[capacity:].tolist() == [4] * (len(to_two) - capacity)
    assert r["dropped"] == len(to_two) - capacity and (r["weight"][to_two[capacity:]] == 0).all()


def _moe_token_by_token(moe, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE layer's formulas (models/gpt/moe.py's docstring) written token by token, slot by slot: the
    independent reference for its vectorised dispatch and combine.  Returns (y [N, C], aux·coef + z·coef)."""
    E, k, N = moe.router.num_experts, moe.router.top_k, x.shape[0]
    logits = x @ moe.router.weight.T
    probs = logits.float().softmax(-1)
    capacity = math.ceil(moe.router.capacity_factor * N * k / E) if moe.router.capacity_factor else N * k
    queued = [0] * E
    counts = [0] * E
    rows = []
    for n in range(N):
        chosen = sorted(range(E), key=lambda e: -float(probs[n, e].detach()))[:k]
        total = sum(probs[n, e] for e in chosen)
        y = torch.zeros_like(x[n])
        for e in chosen:  # token order, then the token's k slots in the router's order: first come, first served
            counts[e] += 1
            queued[e] += 1
            if queued[e] <= capacity:
                h = torch.nn.functional.gelu(moe.experts.fc[e] @ x[n])
                y = y + (probs[n, e] / total).to(x.dtype) * (moe.experts.proj[e] @ h)
        rows.append(y)
    aux = E / N * sum(counts[e] * probs[:, e].mean() for e in range(E))
    z = torch.logsumexp(logits.float(), -1).square().mean()
    return torch.stack(rows), moe.aux_coef * aux + moe.z_coef * z


@pytest.mark.parametrize("capacity", [None, 0.6])
def test_the_experts_equal_a_token_by_token_loop(capacity: float | None) -> None:
    """Output, router losses and every gradient of the GPT's MoE layer (vectorised dispatch, grouped experts,
    index_add_ combine) equal the formulas computed one token and one slot at a time; with a capacity some slots
    are dropped (else the comparison would not test dropping)."""
    from pipedsl.models.gpt.moe import MoE

    torch.manual_seed(0)
    N, C, E, k = 24, 8, 4, 2
    moe = MoE(C, E, k, ffn=12, capacity_factor=capacity, aux_coef=0.1, z_coef=0.01)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    twin = copy.deepcopy(moe)
    x = torch.randn(1, N, C, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y, loss_sum = moe(x, torch.zeros(()))
    y_ref, loss_ref = _moe_token_by_token(twin, xr[0])
    dropped = int(moe.router(x.detach()[0])["dropped"])
    assert (dropped > 0) == (capacity is not None), dropped
    torch.testing.assert_close(y[0], y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss_sum, loss_ref, rtol=1e-5, atol=1e-7)
    g = torch.randn_like(y)
    ((y * g).sum() + loss_sum).backward()
    ((y_ref * g[0]).sum() + loss_ref).backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(moe.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_stages_compute_the_models_loss_and_router_statistics_count_training_forwards_once() -> None:
    model = cases.tiny_moe(3, capacity=1.0)
    load = ExpertLoad([model], 4)
    x, y = synthetic_batch(4, 8, 32, torch.Generator().manual_seed(0))
    out = model(x)
    assert isinstance(out, tuple) and out[1].item() > 0
    h = x
    for stage in model.stages(3):
        h = stage(h)
    assert torch.equal(h[0], out[0]) and torch.equal(h[1], out[1])
    stats = load.read(reduce=False)
    routed = 2 * 3 * 32 * 2  # two forwards, three layers, 32 tokens, top-2
    assert sum(stats["tokens_per_expert"]) + stats["dropped"] == routed and stats["dropped"] > 0
    assert stats["imbalance"] >= 1.0 and load.read(reduce=False)["dropped"] == 0  # read, then reset
    with torch.no_grad():  # evaluation does not count
        model(x)
    block = model.blocks[0]  # nor does a recomputed forward
    rec = Recompute(block, "full")
    hidden = model.embed(x).detach().requires_grad_()
    out = rec.run(block, (hidden,), None)
    torch.autograd.backward(out[0].sum() + out[1])
    stats = load.read(reduce=False)
    assert sum(stats["tokens_per_expert"]) + stats["dropped"] == 32 * 2


def test_tensor_parallel_experts_need_a_dropless_router() -> None:
    """Under tp each rank routes its share of the tokens: a capacity, filled first come first served over the
    microbatch's tokens, would be filled by each share alone — refused by name (models/gpt/tp.py)."""
    from pipedsl.models.gpt.moe import MoE
    from pipedsl.models.gpt.tp import ParallelMoEBlock
    from pipedsl.parallel import ParallelConfigError

    moe = MoE(8, 4, 2, 16, capacity_factor=1.5)
    with pytest.raises(ParallelConfigError, match="needs a dropless router"):
        ParallelMoEBlock(torch.nn.LayerNorm(8), None, torch.nn.LayerNorm(8), moe, None)  # type: ignore[arg-type]


def _clean(results: list[dict]) -> None:
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:10])
    assert results[0]["moved"] > 1e-3  # the weights moved: equal after training, not untouched
    every_parameter_compared([n for r in results for n in r["checked"]], results[0]["all"], results[0]["rows"])


@pytest.mark.slow
@pytest.mark.parametrize("schedule,M", [("1f1b", 4), ("zb-v", 4), ("dualpipev", 4), ("interleaved", 4)])
def test_pipelined_moe_equals_one_process(pool2, schedule: str, M: int) -> None:
    """Loss, gradient norm and weights after two SGD steps equal one process training the whole model with gradient
    accumulation (rtol 1e-5, weights atol 2e-5); the router loss crosses stages."""
    results = pool2.run(cases.train_equal, schedule, M)
    _clean(results)
    assert results[0]["stats"] == results[0]["ref_stats"]  # the routings of every rank sum to the model's
    names = set().union(*(r["checked"] for r in results))
    assert any("router" in n for n in names) and any("experts.fc" in n for n in names)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 1, 3])
def test_expert_parallel_equals_one_process(pool4, zero: int) -> None:
    """dp2 × pp2 with the experts sharded over ep=2: each rank holds half of each layer's experts.  Loss, gradient norm
    and weights (a shard against its rows) after two SGD steps equal one process training the whole model."""
    results = pool4.run(cases.train_equal, "1f1b", 2, 2, 2, zero)
    _clean(results)
    assert results[0]["stats"] == results[0]["ref_stats"]
    shards = [n for r in results for n in r["checked"] if "experts" in n]
    assert any("[0:2]" in n for n in shards) and any("[2:4]" in n for n in shards)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,zero,capacity,recompute", [("zb-v", 1, None, None), ("dualpipev", 0, 1.0, None),
                                                             ("interleaved", 3, None, "full")])
def test_expert_parallel_under_other_schedules(pool4, schedule: str, zero: int, capacity: float | None,
                                               recompute: str | None) -> None:
    results = pool4.run(cases.train_equal, schedule, 4, 2, 2, zero, 2, capacity, recompute)
    _clean(results)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,recompute,dropout,capacity", [
    ("dualpipev", None, 0.0, None), ("dualpipev", "full", 0.1, None), ("dualpipe", "selective", 0.1, None),
    ("dualpipev", "full", 0.1, 1.5)])
def test_overlapped_pairs_are_bit_identical_to_sequential_ones(pool4, schedule, recompute, dropout, capacity) -> None:
    """An F&B pair's halves handing over at every expert exchange (runtime/overlap.py) compute exactly what
    forward-then-backward computes: losses and gradients bit for bit over two steps, with dropout (each half's
    random stream kept apart) and full or selective recomputation (whose regions re-run exchanges); dropless
    (the forward starts) and with a capacity (fixed-size exchanges, the backward starts)."""
    results = pool4.run(cases.overlap_identical, schedule, 4, recompute, dropout, capacity)
    assert all(r["same"] for r in results), [r["losses"] for r in results]
    assert all(r["handovers"][0] == 0 and r["handovers"][1] > 0 for r in results), [r["handovers"] for r in results]


@pytest.mark.slow
def test_ep_peers_that_would_exchange_at_different_points_are_refused(pool4) -> None:
    """Another schedule on one dp replica, or its stages cut elsewhere (other MoE layers a stage): refused on every
    rank, naming the ranks and what differs, where the all-to-alls would otherwise wait for each other forever;
    ep over a dense model is refused, not run with nothing sharded."""
    results = pool4.run(cases.mismatched_peers)
    for r in results:
        assert "would exchange tokens at different points" in r["program"] and "(another program)" in r["program"]
        assert "GPipe" in r["program"] and "1F1B" in r["program"], r["program"]
        assert "(stages built differently)" in r["stages"], r["stages"]
        assert "ep=2 shards nothing, no stage holds an experts module pipedsl can shard" in r["dense"], r["dense"]


@pytest.mark.slow
def test_a_pipeline_given_whole_experts_shards_them_as_the_plan_does_and_says_where_that_belongs(pool4) -> None:
    """Experts sharded by the GPT's plan (`parallelize_gpt`) before the `Pipeline`, and left whole for the
    `Pipeline` (the older call, kept): the same shards and bit-identical losses over two steps; the older call
    warns once per rank with a DeprecationWarning that names the plan and points at the caller's line, the plan
    warns nothing."""
    for r in pool4.run(cases.sharded_by_the_pipeline):
        plan, pipeline = r["plan"], r["pipeline"]
        held = plan["shards"]  # this rank's stage's MoE layers (three over two stages)
        assert plan["losses"] == pipeline["losses"] and held == pipeline["shards"] and held > 0, r
        assert not [w for w in plan["warnings"] if w[0] == "DeprecationWarning"], plan["warnings"]
        (_, message, where), = [w for w in pipeline["warnings"] if w[0] == "DeprecationWarning"]
        assert f"Pipeline sharded {held} experts module(s) over ep=2 itself" in message, message
        assert "parallelize_gpt" in message, message
        assert where.endswith("moe_cases.py"), where


@pytest.mark.slow
def test_expert_shards_with_bf16_parameters_over_fp32_main_parameters(pool4) -> None:
    """bf16 parameters with fp32 main parameters (Megatron's distributed optimizer) and the experts over ep=2, under
    ZeRO-1 and ZeRO-3: the shards are ZeRO units of their own, bf16 with fp32 main copies, and three AdamW steps
    follow the fp32 run without ep to bf16's tolerance."""
    r = pool4.run(cases.bf16_main)[0]
    for zero in ("z1", "z3"):
        assert r[zero]["dtypes"] == ["torch.bfloat16/torch.float32"], r[zero]
        assert r[zero]["losses"] == pytest.approx(r["fp32"]["losses"], rel=3e-3), (zero, r)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,M,ep,zero", [("1f1b", 2, 1, 3), ("dualpipev", 4, 2, 1)])
def test_data_and_expert_parallel_pipelines_equal_one_process_under_nccls_semantics(pool4, schedule, M, ep, zero):
    """dp2 × pp2 under ZeRO-3 (gathers and prefetches beside the pipeline's messages), and ep2 × pp2 with
    DualPipeV's F&B pairs overlapping the expert all-to-alls, against the whole model in one process."""
    import nccl_cases

    both = pool4.run(nccl_cases.by_rendezvous, cases.train_equal, schedule, M, 2, ep, zero)
    _clean([result for result, _ in both])
    assert all(sent > 0 for _, sent in both), both


@pytest.mark.slow
@pytest.mark.parametrize("dp, ep, sp, schedule, zero", [
    (1, 1, False, "1f1b", 0),  # tp2 × pp2: 4 ranks
    (1, 1, True, "interleaved", 0),  # sequence parallel: each block's share is its sequence shard
    (2, 2, True, "dualpipev", 1),  # dp2 × pp2 × tp2, experts over ep2, overlapped F&B pairs: 8 ranks
    (2, 2, False, "zb-v", 3)])
def test_tensor_times_expert_parallel_gpt_equals_one_process(pool, dp, ep, sp, schedule, zero):
    """The GPT's experts under tensor parallelism (models/gpt/tp.py `ParallelMoEBlock`): attention over tp, each MoE
    block whole on its tp rank's share of the tokens, its router's aux and z losses from the microbatch's statistics
    summed over tp, experts over ep, ZeRO-1 and -3: every step's loss and every element of every parameter after two
    SGD steps equal the whole model accumulating the same microbatches.  Without the summed statistics the loss is
    off by 6e-3 and the weights by 5.6e-3 (checked once, by mutation)."""
    problems = pool.run(cases.tp_train_equal, dp * 2 * 2, dp, 2, ep, sp, schedule, zero)
    found = [p for r in problems for p in r]
    assert not found, "\n".join(found[:8])
