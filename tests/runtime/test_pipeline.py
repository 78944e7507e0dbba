"""Pipelines on real processes equal a one-process run: loss, gradients and Adam steps.

Parametrized over every built-in schedule present when the tests run (new schedules are
covered automatically) and over test schedules that exercise replicas, split backward,
interleaving and local hand-over, at P = 2 and 4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import runtime_cases as cases
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import pipedsl
from pipedsl.errors import PipeSemanticError
from pipedsl.runtime.launch.pool import with_rank

HERE = Path(__file__).parent / "schedules"
SCHEDULES = pipedsl.builtin_names() + sorted(str(p) for p in HERE.glob("*.pipe"))


def _name(s: str) -> str:
    return Path(s).stem if s.endswith(".pipe") else s


def compile_for(schedule: str, P: int) -> pipedsl.Program:
    """The schedule at P with the first M (2P, P, 4P, 3P) its `require`s accept."""
    last = None
    for M in (2 * P, P, 4 * P, 3 * P):
        try:
            return pipedsl.load(schedule).compile(P=P, M=M)
        except PipeSemanticError as err:
            last = err
    pytest.fail(f"{schedule} compiles for no M at P={P}: {last}")


@pytest.mark.slow
@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=_name)
def test_matches_single_process(schedule: str, P: int, pools) -> None:
    """Loss, every gradient and the weights after 3 Adam steps equal one process running the unsplit model (rtol 1e-5);
    the measured peak activations equal the simulator's, and every stage copy sits on the rank its placement names."""
    program = compile_for(schedule, P)
    results = pools[P].run(cases.equivalence, program.to_json())
    problems = [f"rank {r}: {p}" for r, res in enumerate(results) for p in res["problems"]]
    assert not problems, "\n".join(problems[:20])
    # peak live activations measured in the runtime = the simulator's prediction, every step
    predicted = pipedsl.simulate(program).peak_activations
    for r, res in enumerate(results):
        assert res["peaks"] == [predicted[r]] * 3, f"rank {r}: measured {res['peaks']}, predicted {predicted[r]}"
    # every stage copy is on the rank the placement names
    for r, res in enumerate(results):
        assert res["copies"] == sorted(k for k, rank in program.placement.items() if rank == r)
        assert res["stages"] == sorted({s for (_, s), rank in program.placement.items() if rank == r})


FAMILIES = ["1f1b", "interleaved", "zb-h1", "zb-v", "chimera"]  # one schedule of each family (docs/testing.md)


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"lookahead": 0}, {"strict_pair_order": True}],
                         ids=["lookahead=0", "strict_pair_order"])
@pytest.mark.parametrize("schedule", FAMILIES)
def test_issue_order_options_match_single_process(schedule: str, options: dict, pool2) -> None:
    """`lookahead=0` (no receive posted before its own instruction) and `strict_pair_order=True` (none ahead of an
    earlier send to the same peer) change only when the runtime posts its receives: loss, every gradient and Adam
    equal one process, as in test_matches_single_process."""
    program = compile_for(schedule, 2)
    results = pool2.run(cases.equivalence, program.to_json(), 3, options)
    problems = [f"rank {r}: {p}" for r, res in enumerate(results) for p in res["problems"]]
    assert not problems, "\n".join(problems[:20])


def nan_loss_passes(rank: int) -> list[float]:
    """`check_finite=False`: a loss that turns nan is returned, not refused (the fp16 loss scaler's own check)."""
    import torch
    import torch.nn.functional as F  # noqa: N812
    from torch import nn

    torch.manual_seed(0)
    scale = [1.0]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target) * scale[0]
    pipe = pipedsl.Pipeline([nn.Linear(4, 4), nn.Linear(4, 4)], "1f1b", microbatches=2, loss_fn=loss_fn,
                            check_finite=False)
    losses = [pipe.step(torch.randn(4, 4), torch.randn(4, 4))]
    scale[0] = float("nan")
    losses.append(pipe.step(torch.randn(4, 4), torch.randn(4, 4)))
    pipe.close()
    return losses


@pytest.mark.slow
def test_a_nan_loss_is_returned_when_the_check_is_off(pool2) -> None:
    """The finite check is on by default (tests/runtime/test_failures.py: a nan loss names its rank and instruction);
    off, every rank finishes the step and the last stage's rank returns nan."""
    import math

    results = pool2.run(nan_loss_passes)
    assert math.isfinite(results[1][0]) and math.isnan(results[1][1]), results


@settings(max_examples=5, deadline=None)  # slow by construction: it runs on the pool (tests/conftest.py)
@given(P=st.integers(2, 4), M=st.integers(2, 9), extra=st.integers(0, 4),
       F=st.sampled_from([0.5, 1.0, 2.0]), I=st.sampled_from([0.5, 1.0, 2.0]),  # noqa: E741, N803
       W=st.sampled_from([0.3, 1.0]), comm=st.sampled_from([0.0, 0.1, 0.5]))
def test_searched_orders_under_random_costs_match_single_process(pool, P: int, M: int, extra: int, F: float,  # noqa: N803
                                                                  I: float, W: float, comm: float) -> None:  # noqa: E741
    """zb-auto searched under random sizes, op times, message costs and memory caps from P to 2P: each program
    is validated when compiled, trains equal to one process through the runtime, and holds the activations the
    simulator predicts, within its cap."""
    mem = min(P + extra, 2 * P)
    try:
        program = pipedsl.load("zb-auto").compile(P=P, M=M, mem=mem, cost=pipedsl.Cost(F=F, I=I, W=W, comm=comm))
    except PipeSemanticError:  # sizes the schedule's `require`s refuse
        assume(False)
    results = pool.run(with_rank, P, cases.equivalence, program.to_json(), same_world=True)
    problems = [f"rank {r}: {p}" for r, res in enumerate(results) for p in res["problems"]]
    assert not problems, "\n".join(problems[:20])
    predicted = pipedsl.simulate(program).peak_activations
    assert [res["peaks"] for res in results] == [[p] * 3 for p in predicted]
    assert max(predicted) <= program.params["mem"]


@pytest.mark.slow
def test_interleaved_with_m_not_a_multiple_of_p_matches_single_process(pool2) -> None:
    """Megatron's / torch's interleaved 1F1B at P = 2, M = 3 (one group of 3 microbatches): loss, every gradient and
    Adam equal one process (`cases.equivalence`), peak activations as simulated."""
    program = pipedsl.load("interleaved").compile(P=2, M=3, V=2)
    results = pool2.run(cases.equivalence, program.to_json())
    problems = [f"rank {r}: {p}" for r, res in enumerate(results) for p in res["problems"]]
    assert not problems, "\n".join(problems[:20])
    predicted = pipedsl.simulate(program).peak_activations
    assert [res["peaks"] for res in results] == [[p] * 3 for p in predicted]


@pytest.mark.quick
@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_the_loss_is_reduced_only_after_each_ranks_last_instruction(schedule: str, pool4) -> None:
    """No collective of the pipeline group spans the step's messages: the loss sum started at the step's start
    (ranks without the last stage) or after the last loss (ranks with it) occupies its NCCL stream until every
    last-stage loss exists, so a device-wide wait in between deadlocks a GPU (the ready-for-GPUs issue)."""
    results = pool4.run(cases.loss_reduction_points, schedule, 4, 8)
    assert all(r["at"] == [r["last"]] * 2 for r in results), results


@pytest.mark.slow
@pytest.mark.parametrize("lookahead,strict", [(0, False), (0, True), (64, True), (64, False)])
@pytest.mark.parametrize("schedule", ["1f1b", str(HERE / "mixed.pipe")], ids=_name)
def test_any_lookahead_and_pair_order(schedule: str, lookahead: int, strict: bool, pool2) -> None:
    program = compile_for(schedule, 2)
    results = pool2.run(cases.equivalence, program.to_json(), 2, {"lookahead": lookahead, "strict_pair_order": strict})
    problems = [p for res in results for p in res["problems"]]
    assert not problems, "\n".join(problems[:10])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", str(HERE / "zb1.pipe")], ids=_name)
def test_gpt_matches_single_process(schedule: str, pool4) -> None:
    """The small GPT, each rank building its stage from a callable: the loss and every gradient of 2 Adam steps equal
    one process running the whole GPT (rtol 1e-5)."""
    results = pool4.run(cases.gpt_equivalence, schedule, 8)
    problems = [p for res in results for p in res["problems"]]
    assert not problems, "\n".join(problems[:10])


def test_close_destroys_the_pipelines_groups_and_refuses_steps(pool2) -> None:
    results = pool2.run(cases.closing)
    assert results[0]["timeline_events"] > 0 and results[1]["timeline_events"] is None  # on the first rank
    for out in results:
        assert out["transport"] == "socket" and out["sockets_left"] == 0  # CPU, one machine: its sockets closed
        assert out["made"] >= 1  # the loss group at least (message groups only when messages go through gloo)
        assert out["left"] == 0 and out["kept"]  # its own groups gone, the world's untouched
        assert "closed pipeline" in out["error"] and "rank " in out["error"]
        assert out["loss_again"] == pytest.approx(out["loss"], rel=1e-6)


@pytest.mark.slow
def test_mistakes_every_rank_makes_are_clear_errors(pool2) -> None:
    for out in pool2.run(cases.uniform_errors):
        assert "the model has 3 stage(s)" in out["stage_count"] and "has 2 stages" in out["stage_count"]
        assert "batch size 6" in out["batch"] and "M=4" in out["batch"]
        assert "microbatches" in out["no_m"]


def test_a_compiled_program_refuses_schedule_parameters_naming_the_likely_option() -> None:
    """Pipeline(program=..., recompue="full") used to drop every keyword silently: a misspelled option did
    nothing.  Refused before anything starts (no process group needed), with the option it resembles."""
    from torch import nn

    program = pipedsl.load("1f1b").compile(P=1, M=2)
    with pytest.raises(pipedsl.PipeRuntimeError, match=r"'recompue' \(did you mean 'recompute'\?\)"):
        pipedsl.Pipeline([nn.Linear(2, 2)], program=program, recompue="full")
    with pytest.raises(pipedsl.PipeRuntimeError, match=r"arguments 'V', 'zz'$"):
        pipedsl.Pipeline([nn.Linear(2, 2)], program=program, V=2, zz=1)


@pytest.mark.slow
@pytest.mark.parametrize("dp, zero", [(1, 0), (2, 1), (2, 3)])
def test_a_rank_whose_stages_are_all_frozen_still_steps(pools, dp, zero) -> None:
    """pipe.optimizer() on a rank with nothing to train is no error (torch's "empty parameter list" was), under
    ZeRO 0, 1 and 3; the other rank trains equal to one process."""
    results = pools[2 * dp].run(cases.frozen_first_stage, dp, zero)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems[:8])


@pytest.mark.slow
def test_batchnorm_running_statistics_agree_over_data_parallel_replicas(pool4) -> None:
    results = pool4.run(cases.batchnorm_replicas)
    assert all(r["equal"] for r in results), results
    assert all(r["moved"] for r in results)


def test_a_steps_inputs_reach_a_gpu_from_pinned_memory(monkeypatch) -> None:
    """A copy from pageable host memory makes the host wait for the GPU's queued kernels, `non_blocking` or not:
    the microbatches (inputs and targets, tuples too) are pinned first, then copied without blocking."""
    import torch

    from pipedsl.runtime.pipeline import _to

    calls: list[tuple[str, object]] = []

    def pin(self):
        calls.append(("pin", self.shape))
        return self

    def to(self, device, non_blocking=False):
        calls.append(("to", non_blocking))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "to", to)
    _to((torch.zeros(2), torch.zeros(3)), torch.device("cuda", 1))
    assert calls == [("pin", (2,)), ("to", True), ("pin", (3,)), ("to", True)]
    calls.clear()
    _to(torch.zeros(2), torch.device("cpu"))
    assert calls == [("to", True)]


def test_groups_made_under_nccl_keep_the_launchers_timeout(monkeypatch) -> None:
    """The timeout of the groups a pipeline makes is read from the backend of the group's device: under NCCL the
    CUDA one (the CPU's has none there, and the groups fell back to torch's default)."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from pipedsl.runtime.groups import timeout_of

    class Group:
        def _get_backend(self, device):
            if device.type != "cuda":
                raise RuntimeError("no backend for the CPU in an NCCL group")
            return SimpleNamespace(options=SimpleNamespace(_timeout=timedelta(seconds=42)))

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert timeout_of(Group()) == timedelta(seconds=42)
