"""The shared-processor replay (`pipedsl.plan.shared_host`) against what must hold exactly."""

from __future__ import annotations

import pytest

import pipedsl
from pipedsl.ir import RECVS, SENDS, Op
from pipedsl.plan.shared_host import shared_dry_run
from pipedsl.simulate import Cost, simulate

SCHEDULES = [("1f1b", {}), ("gpipe", {}), ("zb-h1", {}), ("interleaved", {"V": 2}), ("chimera", {}),
             ("dualpipev", {})]
COST = Cost(F=1.0, B=2.0, I=1.0, W=1.0, comm=0.25)


def makespan(ends: list[list[float]]) -> float:
    return max(max(e) for e in ends if e)


def alone(ins):
    return COST.compute_time(ins), 0.0


@pytest.mark.parametrize(("name", "params"), SCHEDULES)
def test_a_core_per_rank_is_the_ordinary_simulation(name, params) -> None:
    program = pipedsl.load(name).compile(P=4, M=8, **params)
    starts, ends = shared_dry_run(program, alone, COST.message_time, cores=4)
    timeline = simulate(program, COST)
    assert [e.start for r in timeline.ranks for e in r] == pytest.approx(sum(starts, []), abs=1e-12)
    assert [e.end for r in timeline.ranks for e in r] == pytest.approx(sum(ends, []), abs=1e-12)


@pytest.mark.parametrize(("name", "params"), SCHEDULES)
def test_one_core_runs_all_the_work_one_op_at_a_time(name, params) -> None:
    program = pipedsl.load(name).compile(P=4, M=8, **params)
    work = sum(COST.compute_time(i) for r in program.ranks for i in r if i.op not in RECVS | SENDS)
    _, ends = shared_dry_run(program, alone, COST.message_time, cores=1)
    # never faster than the work done in series; idle only while every rank waits for a message
    messages = sum(1 for r in program.ranks for i in r if i.op in (Op.SEND_F, Op.SEND_B))
    assert work <= makespan(ends) <= work + messages * COST.comm + 1e-9
    _, two = shared_dry_run(program, alone, COST.message_time, cores=2)
    _, poor = shared_dry_run(program, alone, COST.message_time, cores=2, efficiency=0.5)
    assert work / 2 - 1e-9 <= makespan(two) < makespan(poor) <= makespan(ends) + 1e-9


def test_waiting_in_a_collective_takes_no_core() -> None:
    program = pipedsl.load("gpipe").compile(P=2, M=2)
    waiting = shared_dry_run(program, lambda i: (0.0, COST.compute_time(i)), COST.message_time, cores=1)[1]
    computing = shared_dry_run(program, alone, COST.message_time, cores=1)[1]
    ideal = simulate(program, COST)
    assert makespan(waiting) == pytest.approx(ideal.makespan)  # both ranks wait at once: as with a core each
    assert makespan(computing) > makespan(waiting)


def test_the_busy_share_of_a_collective_takes_a_core() -> None:
    """collective_busy = 1: a tensor-parallel all-reduce's wait is compute like any other (it takes
    a core); 0: it leaves the core to the other ranks."""
    from dataclasses import replace

    from pipedsl.plan import Layout
    from pipedsl.plan.cluster import cluster_preset
    from pipedsl.plan.cost import stage_costs
    from pipedsl.plan.pipeline import _shared_timeline, compiled
    from pipedsl.trainer.calibrate import SmallGPT

    costs = stage_costs(SmallGPT().spec(), cluster_preset("a100-80gb"), Layout(1, 2, 2, "1f1b", 2, 4), 2)
    assert all(w["F"] > 0 for w in costs.waits)
    program, cost = compiled("1f1b", 2, 4), costs.simulator_cost()
    free, half, busy = (_shared_timeline(program, cost, costs, 1.0, 1.0, b).makespan for b in (0.0, 0.5, 1.0))
    computed = _shared_timeline(program, cost, replace(costs, waits=()), 1.0, 1.0).makespan
    assert free < half < busy == pytest.approx(computed)


def test_other_pipelines_take_the_cores_for_the_share_of_the_time_they_compute() -> None:
    """A node of 2 cores running 4 one-rank pipelines (dp2 x tp2 at pp1): with no waits every pipeline
    computes all the time and gets half a core, as a fixed share gives; when half of each op is spent
    waiting in a collective, the others compute only part of the time, so the pipeline runs faster than on a
    fixed half core (its waits then left the cores unused) and slower than with the cores alone."""
    from dataclasses import replace

    from pipedsl.plan import Layout
    from pipedsl.plan.cluster import cluster_preset
    from pipedsl.plan.cost import stage_costs
    from pipedsl.plan.pipeline import _shared_timeline, compiled
    from pipedsl.trainer.calibrate import SmallGPT

    costs = stage_costs(SmallGPT().spec(), cluster_preset("a100-80gb"), Layout(2, 1, 2, "1f1b", 2, 4), 1)
    program, cost = compiled("1f1b", 1, 4), costs.simulator_cost()
    computing = replace(costs, waits=())
    fixed_share = _shared_timeline(program, cost, computing, 0.5, 1.0).makespan
    assert _shared_timeline(program, cost, computing, 2.0, 1.0, others=3).makespan == pytest.approx(fixed_share)
    waits = replace(costs, waits=({op: getattr(costs, op)[0] / 2 for op in "FBIW"},))
    alone = _shared_timeline(program, cost, waits, 2.0, 1.0).makespan
    shared = _shared_timeline(program, cost, waits, 2.0, 1.0, others=3).makespan
    on_half_a_core = _shared_timeline(program, cost, waits, 0.5, 1.0).makespan
    assert alone < shared < on_half_a_core
