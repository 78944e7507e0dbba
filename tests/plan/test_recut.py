"""Re-cutting stages from measured times (plan/partition.py's `unit_costs`, plan/recut.py's `choose_cut`) and timing
units (runtime/unit_clock.py): checked against hand-computed splits and a simulated profile whose truth is known."""

from __future__ import annotations

import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import pipedsl
from pipedsl.models.split import split_sequential
from pipedsl.plan.partition import bounds_of, stage_costs_of, unit_costs
from pipedsl.plan.recut import Room, choose_cut
from pipedsl.runtime.recompute import Recompute
from pipedsl.runtime.unit_clock import UnitClock


def test_unit_costs_split_each_stage_by_its_units_forward_times() -> None:
    per_unit = unit_costs({0: {"F": 3.0, "I": 3.0, "W": 2.0}, 1: {"F": 5.0, "I": 5.0, "W": 4.0}},
                          {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 3.0}, [0, 3, 5])
    assert per_unit[0] == {"F": 1.0, "I": 1.0, "W": pytest.approx(2 / 3)}
    assert per_unit[4] == {"F": 3.75, "I": 3.75, "W": 3.0}
    assert stage_costs_of(per_unit, [0, 4, 5]) == {0: {"F": 4.25, "I": 4.25, "W": pytest.approx(3.0)},
                                                   1: {"F": 3.75, "I": 3.75, "W": 3.0}}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.1, 10.0), min_size=4, max_size=12), st.integers(2, 4), st.data())
def test_unit_costs_keep_every_stage_total(times, S, data) -> None:
    """Whatever the unit times, re-summing the per-unit costs over the measured cut gives each stage's costs."""
    L = len(times)
    cuts = sorted(data.draw(st.lists(st.integers(1, L - 1), min_size=S - 1, max_size=S - 1, unique=True)))
    bounds = [0, *cuts, L]
    measured = {s: {"F": 1.0 + s, "I": 2.0 * s + 0.5, "W": 0.3} for s in range(S)}
    again = stage_costs_of(unit_costs(measured, dict(enumerate(times)), bounds), bounds)
    for s in range(S):
        for k in ("F", "I", "W"):
            assert math.isclose(again[s][k], measured[s][k], rel_tol=1e-9)


def _profile(unit_f: list[float], bounds: list[int], P: int, M: int) -> tuple[pipedsl.Timeline, list]:
    """The timeline ZB-H1 would measure on `bounds` when unit u's F is unit_f[u] and its I and W are F each, and
    each rank's unit report."""
    stage = {s: sum(unit_f[a:b]) for s, (a, b) in enumerate(zip(bounds, bounds[1:]))}
    cost = pipedsl.Cost(F=1.0, I=1.0, W=1.0, comm=0.01,
                        per_stage={s: {"F": f, "I": f, "W": f} for s, f in stage.items()})
    timeline = pipedsl.simulate(pipedsl.load("zb-h1").compile(P=P, M=M), cost)
    reports = [({u: unit_f[u] for u in range(a, b)}, {s: list(range(a, b))}, {}, {})
               for s, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    return timeline, reports


def test_choose_cut_moves_blocks_off_a_heavy_head() -> None:
    """An embedding, 8 blocks and a head of 5 blocks' cost, cut by count ([3, 3, 2, 2] pieces): the head's stage
    is the slowest.  The cut chosen puts the head alone and balances the blocks; its predicted step is shorter."""
    unit_f = [0.05, *[1.0] * 8, 5.0]
    bounds = list(bounds_of([3, 3, 2, 2]))
    timeline, reports = _profile(unit_f, bounds, 4, 8)
    program = pipedsl.load("zb-h1").compile(P=4, M=8)
    decision = choose_cut(timeline, reports, program, {"mem": 4})
    assert decision.points is not None and decision.points[-1] == 9, decision.points  # the head alone
    assert decision.predicted_ms < 0.97 * decision.kept_ms
    chosen = decision.cost
    assert chosen.per_stage[3]["F"] == pytest.approx(5.0)


def test_choose_cut_keeps_a_balanced_cut_and_without_units() -> None:
    unit_f = [0.05, *[1.0] * 6, 0.05]
    bounds = list(bounds_of([3, 2, 3]))  # [e, b0, b1] [b2, b3] [b4, b5, head]: what the balance gives
    timeline, reports = _profile(unit_f, bounds, 3, 6)
    program = pipedsl.load("zb-h1").compile(P=3, M=6)
    assert choose_cut(timeline, reports, program).points is None
    lopsided = [0, 1, 2, 8]
    timeline, reports = _profile(unit_f, lopsided, 3, 6)
    assert choose_cut(timeline, reports, program).points == [3, 5]
    assert choose_cut(timeline, [*reports[:2], None], program).points is None  # a rank without units


def test_unit_clock_on_a_gpu_times_by_events_and_never_waits_for_the_device(monkeypatch) -> None:
    """On a GPU each unit is timed by two CUDA events on the current stream, read after the steps, each waited for
    alone: a device-wide synchronize inside a step would wait for every stream — NCCL sends whose receives the
    peer has not reached among them — and hang the pipeline (the ready-for-GPUs issue).  CUDA is faked here: the
    module is "on a GPU", events are recorded objects, and any device-wide wait fails the test."""
    from pipedsl.runtime import unit_clock

    log: list[str] = []

    class Event:
        made = 0

        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            Event.made += 1
            self.at = Event.made

        def record(self) -> None:
            log.append(f"record {self.at}")

        def synchronize(self) -> None:
            log.append(f"wait {self.at}")

        def elapsed_time(self, end: Event) -> float:
            return 1000.0 * (end.at - self.at)  # milliseconds, one second an event apart

    def device_wide(*_args) -> None:
        raise AssertionError("a device-wide wait inside a step")

    monkeypatch.setattr(unit_clock, "_on_gpu", lambda module: True)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
    stages = split_sequential(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), 1)
    clock = UnitClock(dict(enumerate(stages)))
    stages[0](torch.randn(2, 4, requires_grad=True))
    assert log == ["record 1", "record 2", "record 3", "record 4"]  # unit 0's start and end, then unit 1's
    assert not any(line.startswith("wait") for line in log)  # nothing read while the step runs
    medians, *_ = clock.report()
    assert medians == {0: 1.0, 1: 1.0}  # events 1 → 2 and 3 → 4: one second each, by the fake clock
    assert [line for line in log if line.startswith("wait")] == ["wait 2", "wait 4"]  # each end event alone
    clock.close()


def test_unit_clock_times_training_forwards_only() -> None:
    """Each unit's forward is timed with its global index; evaluation (no grad) and a recomputed forward are not."""
    stages = split_sequential(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.ReLU()), 2)
    clock = UnitClock(dict(enumerate(stages)))
    assert clock.held == {0: [0, 1], 1: [2, 3]}
    x = torch.randn(2, 4, requires_grad=True)
    stages[1](stages[0](x))
    with torch.no_grad():
        stages[0](x)
    recompute = Recompute(stages[1], "full")
    recompute.run(stages[1], (stages[0](x),), None).sum().backward()  # forward once, again in the backward
    medians, held, saved, params = clock.report()
    assert set(medians) == {0, 1, 2, 3} and all(t > 0 for t in medians.values()) and saved == {}  # no counter
    assert params == {0: 20, 1: 0, 2: 20, 3: 0}  # Linear(4, 4): 16 weights and 4 biases
    assert {u: len(v) for u, v in clock.seconds.items()} == {0: 2, 1: 2, 2: 2, 3: 2}
    clock.close()
    stages[0](x)
    assert len(clock.seconds[0]) == 2  # the hooks are gone


class _Preempted(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)  # the thread off the CPU, as a busy machine's scheduler leaves a rank
        return x


def test_unit_clock_on_the_cpu_counts_a_units_work_not_the_time_it_was_preempted() -> None:
    """With one intra-op thread a unit's time is its thread's CPU time: a unit that sleeps 50 ms costs next to
    nothing (under load the clock made a cheap unit look dear and `--schedule auto` kept a lopsided cut); with two
    threads the clock (50 ms or more)."""
    stages = split_sequential(nn.Sequential(nn.Linear(4, 4), _Preempted()), 1)
    x = torch.randn(2, 4, requires_grad=True)
    threads = torch.get_num_threads()
    try:
        for n, (low, high) in ((1, (0.0, 0.01)), (2, (0.05, math.inf))):
            torch.set_num_threads(n)
            clock = UnitClock({0: stages[0]})
            stages[0](x).sum().backward()
            assert low <= clock.medians()[1] < high, (n, clock.medians())
            clock.close()
    finally:
        torch.set_num_threads(threads)


def _reports_with_bytes(unit_f: list[float], unit_b: list[float], bounds: list[int], P: int, M: int,
                        unit_p: list[int] | None = None) -> tuple[pipedsl.Timeline, list]:
    timeline, reports = _profile(unit_f, bounds, P, M)
    return timeline, [(t, held, {u: unit_b[u] for u in t}, {u: unit_p[u] for u in t} if unit_p else {})
                      for t, held, _, _ in reports]


def test_choose_cut_gives_a_memory_bound_rank_fewer_layers() -> None:
    """An embedding, 8 blocks and a head whose logits make its activation 3 blocks' bytes; rank 0 (which holds
    the most activations) has room for 8 block activations, the others for 100.  Cut [3, 3, 2, 2], stage 0's
    activation is 2.1 blocks', so 3 fit and ZB-auto runs at mem=3; the cut chosen gives stage 0 the embedding
    and one block (1.1: 7 fit), and its step is shorter.  Every rank's predicted peak is within its room."""
    unit_f, unit_b = [0.05, *[1.0] * 8, 1.5], [0.1, *[1.0] * 8, 3.0]
    timeline, reports = _reports_with_bytes(unit_f, unit_b, list(bounds_of([3, 3, 2, 2])), 4, 8)
    program = pipedsl.load("zb-h1").compile(P=4, M=8)
    budget = (8.0, 100.0, 100.0, 100.0)
    decision = choose_cut(timeline, reports, program, {}, Room(budget, (0.0,) * 4))
    assert decision.points == [2, 5, 8] and decision.mem == decision.fit == 7, decision
    assert decision.stage_bytes == pytest.approx([1.1, 3.0, 3.0, 4.0])
    assert all(p <= b for p, b in zip(decision.peak_bytes, budget))
    assert decision.predicted_ms < 0.97 * decision.kept_ms
    kept = choose_cut(timeline, reports, program, {"mem": 3})  # the current cut's own cap, fixed: what it runs at
    assert kept.points is None and decision.kept_ms == pytest.approx(kept.kept_ms)
    unbounded = choose_cut(timeline, reports, program, {}, Room((100.0,) * 4, (0.0,) * 4))
    assert unbounded.points is None and unbounded.mem == 8 and unbounded.fit == 25


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.floats(0.1, 3.0), st.floats(0.1, 4.0), st.integers(0, 5)), min_size=4, max_size=8),
       st.integers(2, 3), st.lists(st.floats(1.0, 30.0), min_size=3, max_size=3), st.sampled_from([0.0, 0.5]),
       st.sampled_from([None, 0.4, 0.9, 1.2]))
def test_choose_cut_keeps_every_rank_within_its_memory(units, P, budgets, per_param, wmem) -> None:
    """Whatever the units' times, bytes and parameters, the ranks' rooms and the share of an activation a pending W
    holds (`wmem`, measured; None: whole): each stage's bytes are its units' sum on the chosen cut, the cap is the
    activations of those stages that fit (at most 2P, at least what one activation and its pending W need) in each
    rank's room less the model states of the units it gained, and wherever that fits every rank's simulated peak (a
    pending W counted at its share) plus those states is within its room."""
    unit_f, unit_b, unit_p = [t for t, _, _ in units], [b for _, b, _ in units], [p for _, _, p in units]
    L = len(units)
    bounds = list(bounds_of([L // P] * (P - 1) + [L - L // P * (P - 1)]))
    timeline, reports = _reports_with_bytes(unit_f, unit_b, bounds, P, 2 * P, unit_p)
    budget = tuple(budgets[:P])
    room = Room(budget, (0.0,) * P, per_param)
    decision = choose_cut(timeline, reports, pipedsl.load("zb-h1").compile(P=P, M=2 * P), {}, room, wmem)
    assert decision.cost.wmem == (1.0 if wmem is None else wmem)
    cut = [0, *(decision.points or bounds[1:-1]), L]
    parts = list(zip(cut, cut[1:]))
    assert decision.stage_bytes == pytest.approx([sum(unit_b[a:b]) for a, b in parts])
    gained = [per_param * (sum(unit_p[a:b]) - sum(unit_p[c:d])) for (a, b), (c, d) in zip(parts, zip(bounds, bounds[1:]))]
    room_left = [b - g for b, g in zip(budget, gained)]
    fit = min(max(int(r // s), 0) for r, s in zip(room_left, decision.stage_bytes))
    least = 2 if wmem == 1.2 else 1  # a pending W holding more than its activation needs room for both
    assert decision.fit == fit and decision.mem == max(least, min(2 * P, fit))
    if fit >= least:
        assert all(p <= r * (1 + 1e-9) for p, r in zip(decision.peak_bytes, room_left)), decision


def test_without_unit_bytes_the_cap_is_from_each_stages_measured_bytes() -> None:
    """Under recomputation the units report no bytes: the cap still comes from each stage's measured activation
    (2.1, 3, 2, 4 against rooms 8, 100, 100, 100: 3 fit), for the current cut and a re-cut alike, not the 2P of no
    limit."""
    unit_f = [0.05, *[1.0] * 8, 1.5]
    timeline, reports = _profile(unit_f, list(bounds_of([3, 3, 2, 2])), 4, 8)
    program = pipedsl.load("zb-h1").compile(P=4, M=8)
    decision = choose_cut(timeline, reports, program, {}, Room((8.0, 100.0, 100.0, 100.0), (2.1, 3.0, 2.0, 4.0)))
    assert decision.mem == decision.fit == 3 and decision.stage_bytes == [2.1, 3.0, 2.0, 4.0], decision


def test_unit_bytes_predict_the_saved_bytes_of_every_cut() -> None:
    """GPT blocks, a norm and a head on runtime stages counting their saved bytes: the unit clock's figures, taken
    on one cut, add up to what each stage of any other cut counts for one activation (exactly)."""
    from pipedsl.models.gpt.model import Block, GPTConfig
    from pipedsl.runtime.stage import ActivationCounter, Stage

    torch.manual_seed(0)
    cfg = GPTConfig(n_embd=32, n_head=4, block_size=16)
    layers = nn.Sequential(*[Block(cfg) for _ in range(4)], nn.LayerNorm(32), nn.Linear(32, 64))

    def run(points: list[int]) -> tuple[list[int], dict[int, float]]:
        stages = split_sequential(layers, points=points)
        counter = ActivationCounter()
        clock = UnitClock(dict(enumerate(stages)), counter)
        x, counted, kept = torch.randn(2, 16, 32), [], []
        for s, module in enumerate(stages):
            before = counter.live_bytes
            act, outs = Stage(module, s, len(stages) + 1, None, 1, counter).forward([x])
            kept.append(act)
            counted.append(counter.live_bytes - before)
            x = outs[0]
        clock.close()
        return counted, clock.saved_bytes()

    _, unit_bytes = run([1, 3])
    for points in ([1, 3], [2, 5], [3, 4], [1, 2]):
        edges = [0, *points, 6]
        counted, _ = run(points)
        assert counted == [sum(unit_bytes[u] for u in range(a, b)) for a, b in zip(edges, edges[1:])], points


def test_unit_bytes_of_a_hugging_face_decoder_predict_every_cut_within_its_rotary_tables() -> None:
    """A Llama's stages compute their rotary tables once, before their first layer, which saves them: taken on one
    cut, the units' figures give each stage of another cut its counted bytes within those tables (1 KiB here, under
    1 % of a stage)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipedsl.models.hf.stages import causal_lm_stages
    from pipedsl.runtime.stage import ActivationCounter, Stage

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))

    def run(points: list[int]) -> tuple[list[int], dict[int, float]]:
        stages = causal_lm_stages(model, len(points) + 1, points=points)
        counter = ActivationCounter()
        clock = UnitClock(dict(enumerate(stages)), counter)
        inputs, counted, kept = [torch.randint(0, 128, (2, 16))], [], []
        for s, module in enumerate(stages):
            before = counter.live_bytes
            act, inputs = Stage(module, s, len(stages) + 1, None, 1, counter).forward(inputs)
            kept.append(act)
            counted.append(counter.live_bytes - before)
        clock.close()
        return counted, clock.saved_bytes()

    _, unit_bytes = run([2, 4])
    tables = 2 * 16 * 8 * 4  # cos and sin, [16 positions, head_dim 8], fp32
    for points in ([1, 3], [3, 5], [1, 2]):
        edges = [0, *points, 6]
        counted, _ = run(points)
        predicted = [sum(unit_bytes[u] for u in range(a, b)) for a, b in zip(edges, edges[1:])]
        assert all(abs(p - c) <= tables for p, c in zip(predicted, counted)), (points, predicted, counted)
        assert all(abs(p - c) <= 0.01 * c for p, c in zip(predicted, counted) if c > 1000), (points, predicted, counted)


def test_op_time_spread_is_the_median_relative_deviation_of_like_ops() -> None:
    """--schedule auto says how noisy its profile was: per (op kind, stage), the standard deviation of the measured
    times over their mean, the median of those; sends and single samples do not count."""
    from pipedsl.ir import Instr, Op
    from pipedsl.timeline import Event, Timeline
    from pipedsl.trainer.train import op_time_spread

    def ev(op: Op, mb: int, stage: int, start: float, duration: float) -> Event:
        return Event(Instr(op, mb, stage), start, start + duration)

    rank0 = (ev(Op.F, 0, 0, 0, 1.0), ev(Op.F, 1, 0, 1, 3.0), ev(Op.B, 0, 0, 4, 2.0), ev(Op.B, 1, 0, 6, 2.0),
             Event(Instr(Op.SEND_F, 0, 0, 1), 7, 9))
    rank1 = (ev(Op.F, 0, 1, 0, 1.0), ev(Op.F, 1, 1, 1, 1.0), ev(Op.F, 2, 1, 2, 4.0), ev(Op.W, 0, 1, 6, 5.0))
    spread = op_time_spread(Timeline("t", {}, (rank0, rank1), "measured"))
    # F stage 0: 1, 3 -> 0.5; B stage 0: 2, 2 -> 0; F stage 1: 1, 1, 4 -> sqrt(2)/2; W stage 1: one sample
    assert spread == pytest.approx(0.5)
    assert op_time_spread(Timeline("t", {}, ((ev(Op.F, 0, 0, 0, 1.0),),), "measured")) is None
