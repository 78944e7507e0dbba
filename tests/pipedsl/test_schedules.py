"""The named schedules in schedules/*.pipe against independent references.

References are re-derived here from their sources, never from the .pipe files: Megatron-LM's
interleaved microbatch/chunk arithmetic, the Chimera authors' generator (and the published
P = 4 order), torch.distributed.pipelining's ScheduleLoopedBFS and ScheduleZBVZeroBubble,
and the bubble / memory formulas of docs/schedules.md (Summary).
"""

from __future__ import annotations

from collections import defaultdict, deque
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pipedsl
from pipedsl.cli import main
from pipedsl.ir import COMPUTE, RECVS, SENDS, Op, Program

UNIT = pipedsl.Cost(F=1, B=1)  # "uniform costs" (docs/schedules.md)
F1B2 = pipedsl.Cost(F=1, B=2)


def frac(x: float) -> Fraction:
    return Fraction(x).limit_denominator(100_000)


# ---------------------------------------------------------------- an independent program check


def check_program(program: Program, placement: dict[tuple[int, int], int], routes: list[int]) -> None:
    """Completeness, placement, per-pair message order and deadlock freedom, checked from scratch."""
    P, S = program.num_ranks, program.num_stages
    assert program.placement == placement
    assert list(program.microbatch_replica) == routes
    seen = defaultdict(list)
    for r, stream in enumerate(program.ranks):
        for ins in stream:
            if ins.op in COMPUTE:
                seen[(ins.op, ins.mb, ins.stage, ins.replica)].append(r)
    for m, c in enumerate(routes):
        for s in range(S):
            home = placement[(c, s)]
            full = seen.get((Op.B, m, s, c), [])
            split = seen.get((Op.I, m, s, c), []), seen.get((Op.W, m, s, c), [])
            assert seen[(Op.F, m, s, c)] == [home]
            assert full == [home] or split == ([home], [home])
    assert sum(len(v) for v in seen.values()) == len(routes) * S * (2 + program.split_backward)
    # the k-th receive on b from a is the k-th message a sends to b
    sends, recvs = defaultdict(list), defaultdict(list)
    for r, stream in enumerate(program.ranks):
        for ins in stream:
            if ins.op in SENDS:
                nxt = ins.stage + (1 if ins.op is Op.SEND_F else -1)
                sends[(r, ins.peer)].append((ins.mb, nxt, ins.replica, ins.op is Op.SEND_F))
            elif ins.op in RECVS:
                recvs[(ins.peer, r)].append((ins.mb, ins.stage, ins.replica, ins.op is Op.RECV_F))
    assert sends == recvs
    # every stage boundary between ranks carries one activation and one gradient per microbatch
    crossings = sum(placement[(c, s)] != placement[(c, s + 1)] for c in set(routes) for s in range(S - 1))
    per_replica = defaultdict(int)
    for c in routes:
        per_replica[c] += 1
    expected = 2 * sum(n * sum(placement[(c, s)] != placement[(c, s + 1)] for s in range(S - 1))
                       for c, n in per_replica.items())
    assert sum(map(len, sends.values())) == expected and (crossings > 0 or expected == 0)
    # blocking receives, buffered sends: every rank must reach its end
    pc, queues, progress = [0] * P, defaultdict(deque), True
    while progress:
        progress = False
        for r, stream in enumerate(program.ranks):
            while pc[r] < len(stream):
                ins = stream[pc[r]]
                if ins.op in RECVS:
                    q = queues[(ins.peer, r)]
                    if not q:
                        break
                    q.popleft()
                elif ins.op in SENDS:
                    queues[(r, ins.peer)].append(ins)
                pc[r] += 1
                progress = True
    assert pc == [len(s) for s in program.ranks], "deadlock"


# ---------------------------------------------------------------- interleaved 1F1B (Megatron-LM)


def megatron_interleaved(P: int, M: int, V: int, r: int, G: int | None = None) -> list[str]:
    """forward_backward_pipelining_with_interleaving (megatron/core/pipeline_parallel/schedules.py):
    get_schedule_table lists, per group of G microbatches (microbatch_group_size_per_vp_stage,
    the last group what is left), chunk 0 for each, then chunk 1, …; iteration k forwards
    table[k] and backwards table[k] with the chunk reversed; get_pp_rank_microbatches' warmup
    is 2(P-r-1) + (V-1)G capped at MV."""
    G = P if G is None else G
    total = M * V
    warmup = min(2 * (P - r - 1) + (V - 1) * G, total)
    table = []
    for first in range(0, M, G):
        last = M if first + G >= M else first + G
        table += [(m, c) for c in range(V) for m in range(first, last)]

    def f(k: int) -> str:
        m, c = table[k]
        return f"F{m}.{c * P + r}"

    def b(k: int) -> str:
        m, c = table[k]
        return f"B{m}.{(V - 1 - c) * P + r}"

    order = [f(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [f(k + warmup), b(k)]
    return order + [b(k) for k in range(total - warmup, total)]


def torch_interleaved(P: int, M: int, V: int) -> list[list[str]]:
    """torch's own ScheduleInterleaved1F1B._calculate_single_rank_operations (reads only sizes):
    rounds = max(1, M // P) groups of M / rounds microbatches."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    schedule = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    schedule.pp_group_size, schedule._n_microbatches, schedule.n_local_stages = P, M, V
    schedule.microbatches_per_round = M // max(1, M // P)
    assert M % max(1, M // P) == 0, "torch refuses this size"
    return [[f"{a.computation_type.value}{a.microbatch_index}.{a.stage_index}"
             for a in schedule._calculate_single_rank_operations(r) if a is not None] for r in range(P)]


interleaved_sizes = st.tuples(st.integers(1, 8), st.integers(1, 4), st.integers(1, 4))  # P, M/P, V


@given(interleaved_sizes)
def test_interleaved_is_megatrons_order(size):
    P, k, V = size
    M = k * P
    program = pipedsl.load("interleaved").compile(P=P, M=M, V=V)
    assert program.compute_orders() == [megatron_interleaved(P, M, V, r) for r in range(P)]
    check_program(program, {(0, s): s % P for s in range(V * P)}, [0] * M)


# (P, V, M) with M % P != 0 that torch accepts (M a multiple of its rounds, max(1, M // P))
UNEVEN = [(2, 2, 3), (3, 2, 4), (3, 3, 5), (4, 2, 6), (4, 2, 7), (4, 3, 10), (4, 2, 15), (5, 2, 12), (8, 2, 18)]


@pytest.mark.parametrize("P,V,M", UNEVEN)
def test_interleaved_with_m_not_a_multiple_of_p_is_torchs_and_megatrons_order(P, V, M):
    program = pipedsl.load("interleaved").compile(P=P, M=M, V=V)
    G = M // max(1, M // P)
    assert program.compute_orders() == torch_interleaved(P, M, V)
    assert program.compute_orders() == [megatron_interleaved(P, M, V, r, G) for r in range(P)]
    check_program(program, {(0, s): s % P for s in range(V * P)}, [0] * M)
    t = pipedsl.simulate(program, F1B2)
    assert frac(t.bubble_ratio) == Fraction(P - 1, V * M + P - 1)


@pytest.mark.parametrize("P,V,M,G", [(2, 2, 5, 3), (4, 2, 10, 6), (4, 3, 11, 7), (3, 2, 8, 5)])
def test_interleaved_group_size_with_a_partial_last_group_is_megatrons_table(P, V, M, G):
    """Megatron's own knob: groups of G and a last group of M % G >= P microbatches."""
    program = pipedsl.load("interleaved").compile(P=P, M=M, V=V, G=G)
    assert program.compute_orders() == [megatron_interleaved(P, M, V, r, G) for r in range(P)]
    check_program(program, {(0, s): s % P for s in range(V * P)}, [0] * M)


@given(interleaved_sizes, st.sampled_from([UNIT, F1B2]))
def test_interleaved_bubble_and_memory(size, cost):
    P, k, V = size
    M = k * P
    t = pipedsl.simulate(pipedsl.load("interleaved").compile(P=P, M=M, V=V), cost)
    assert frac(t.bubble_ratio) == Fraction(P - 1, V * M + P - 1)
    assert t.makespan == (cost.F + cost.B) * (V * M + P - 1)
    assert t.peak_activations == [min(M * V, 2 * (P - r - 1) + (V - 1) * P + 1) for r in range(P)]


@pytest.mark.parametrize("P", range(2, 9))
def test_interleaved_with_fewer_microbatches_than_ranks_is_torchs_one_round(P):
    """torch 2.13 accepts M < P (one round of all M: G = M); Megatron refuses it (its G lies in P..M)."""
    for M in range(1, P):
        for V in (1, 2, 3, 4):
            program = pipedsl.load("interleaved").compile(P=P, M=M, V=V)
            assert program.params["G"] == M
            assert program.compute_orders() == torch_interleaved(P, M, V), (P, M, V)
            check_program(program, {(0, s): s % P for s in range(V * P)}, [0] * M)
            t = pipedsl.simulate(program, F1B2)
            slots = V * M + P - 1 + (V - 1) * (P - M)  # each chunk's round waits P - M slots
            assert t.makespan == (F1B2.F + F1B2.B) * slots
            assert t.peak_activations == [min(M * V, 2 * (P - r - 1) + (V - 1) * M + 1) for r in range(P)]


@pytest.mark.parametrize("sizes,message", [
    ({"P": 4, "M": 9}, "last microbatch group, M % G, must be 0 or at least P"),  # torch: 9 % 2 rounds
    ({"P": 4, "M": 14}, "last microbatch group"),
    ({"P": 4, "M": 3, "G": 2}, r"group size G must be between P and M, or M when M < P"),  # torch: one round of M
    ({"P": 4, "M": 8, "G": 3}, "group size G must be between P and M"),
    ({"P": 4, "M": 8, "G": 9}, "group size G must be between P and M"),
    ({"P": 4, "M": 10, "G": 8}, "last microbatch group"),  # Megatron: remainder 2 < P
])
def test_interleaved_rejects_what_megatron_and_torch_reject(sizes, message):
    P, M = sizes["P"], sizes["M"]
    if "G" not in sizes and M >= P:  # torch's own rule: M a multiple of its rounds
        assert M % max(1, M // P) != 0
    with pytest.raises(pipedsl.PipeSemanticError, match=message):
        pipedsl.load("interleaved").compile(**sizes)


# ---------------------------------------------------------------- Chimera


CHIMERA_P4 = """\
r0: F0.0 F1.0 F2.3 B2.3 F3.3 B3.3 B0.0 B1.0
r1: F0.1 F2.2 F1.1 F3.2 B2.2 B0.1 B3.2 B1.1
r2: F2.1 F0.2 F3.1 F1.2 B0.2 B2.1 B1.2 B3.1
r3: F2.0 F3.0 F0.3 B0.3 F1.3 B1.3 B2.0 B3.0"""  # docs/schedules.md (Chimera), from the authors' generator


def chimera_authors(P: int) -> list[list[str]]:
    """The authors' generator (Shigangli/Chimera, chimera_pipeline_rank.py) for M = P, as a
    time-stepped walk: each direction injects its P/2 microbatches at its first device every
    other step; in flight a microbatch moves one device per step, turns around on the last
    stage (its backward runs the step after the forward there) and walks back; each step
    every device runs what is on it.  Down (replica 0): stage s on device s; up: device P-1-s."""
    half = P // 2
    slots: dict[int, dict[int, str]] = defaultdict(dict)
    for c in (0, 1):
        for j in range(half):
            m = c * half + j
            device = (lambda s: s) if c == 0 else (lambda s: P - 1 - s)
            step, s, direction = 2 * j, 0, 1
            while True:
                tag = "r1" if c else ""
                assert step not in slots[device(s)], "two ops on one device in one step"
                slots[device(s)][step] = f"{'F' if direction > 0 else 'B'}{m}.{s}{tag}"
                step += 1
                if direction > 0 and s == P - 1:
                    direction = -1  # turn: the backward of the last stage, same device
                elif direction < 0 and s == 0:
                    break
                else:
                    s += direction
    return [[slots[d][t] for t in sorted(slots[d])] for d in range(P)]


def test_chimera_p4_is_the_published_order():
    program = pipedsl.load("chimera").compile(P=4, M=4)
    published = [line.split()[1:] for line in CHIMERA_P4.splitlines()]
    assert [[op.replace("r1", "") for op in order] for order in program.compute_orders()] == published
    assert list(program.microbatch_replica) == [0, 0, 1, 1]  # microbatches 2 and 3 go up
    # and the reference generator below reproduces the published order too
    assert [[op.replace("r1", "") for op in order] for order in chimera_authors(4)] == published


@pytest.mark.parametrize("P", [2, 4, 6, 8])
def test_chimera_is_the_authors_order_at_m_equals_p(P):
    """At M = P (2 to 8) every rank's compute order equals, op for op, the reference: the authors' generator
    (`chimera_authors`, after Shigangli/Chimera's chimera_pipeline_rank.py)."""
    program = pipedsl.load("chimera").compile(P=P, M=P)
    assert program.compute_orders() == chimera_authors(P)


chimera_sizes = st.tuples(st.sampled_from([2, 4, 6, 8]), st.integers(1, 4))  # P, M/P


@given(chimera_sizes)
def test_chimera_placement_bubble_and_memory(size):
    P, k = size
    M = k * P
    program = pipedsl.load("chimera").compile(P=P, M=M)
    placement = {(c, s): (s if c == 0 else P - 1 - s) for c in (0, 1) for s in range(P)}
    check_program(program, placement, [(m % P) // (P // 2) for m in range(M)])
    assert program.num_replicas == 2
    for r, stream in enumerate(program.ranks):  # gradients of both copies of each stage are reduced
        assert sorted((i.stage, i.replica) for i in stream if i.op is Op.REDUCE_GRAD) == \
            sorted((s, c) for (c, s), home in placement.items() if home == r)
    t = pipedsl.simulate(program, UNIT)
    assert frac(t.bubble_ratio) == Fraction(P - 2, 2 * M + P - 2)
    assert t.peak_activations == [P // 2 + 1 + min(r, P - 1 - r) for r in range(P)]  # (P/2+1) … P


def test_chimera_requires_even_ranks():
    with pytest.raises(pipedsl.PipeSemanticError, match="even number of ranks"):
        pipedsl.load("chimera").compile(P=3, M=6)


# ---------------------------------------------------------------- Hanayo


def hanayo_rank(P: int, s: int) -> int:
    v, q = divmod(s, P)
    return q if v % 2 == 0 else P - 1 - q


hanayo_sizes = st.tuples(st.integers(1, 8), st.integers(1, 4), st.integers(0, 3), st.integers(1, 3))  # P, M/P, +M, W


@given(hanayo_sizes)
def test_hanayo_reaches_the_bound_with_uniform_costs(size):
    P, k, extra, W = size
    M = k * P + extra
    program = pipedsl.load("hanayo").compile(P=P, M=M, W=W)
    S = 2 * W * P
    check_program(program, {(0, s): hanayo_rank(P, s) for s in range(S)}, [0] * M)
    # no message at the turns: only P-1 of every P stage boundaries cross ranks
    assert sum(1 for stream in program.ranks for i in stream if i.op in SENDS) == 2 * M * 2 * W * (P - 1)
    t = pipedsl.simulate(program, UNIT)
    assert frac(t.bubble_ratio) == Fraction(P - 1, 2 * W * M + P - 1)  # the lower bound, docs/schedules.md (Summary)


def hanayo_peaks(P: int, M: int, W: int) -> list[int]:
    """Live activations of the folded-wave 1F1B, counted from its definition: in step t stage s
    runs the forward of m with 2m + s = t, then the backward of m with 2m + 2S-2-s = t."""
    S = 2 * W * P
    peaks = [0] * P
    for r in range(P):
        mine = [s for s in range(S) if hanayo_rank(P, s) == r]
        for t in range(2 * M + 2 * S):
            live = sum(1 for s in mine for m in range(M) if 2 * m + s <= t <= 2 * m + 2 * S - 2 - s)
            peaks[r] = max(peaks[r], live)
    return peaks


@given(st.tuples(st.integers(1, 6), st.integers(1, 4), st.integers(1, 2)))
def test_hanayo_memory_is_balanced(size):
    P, k, W = size
    M = k * P
    t = pipedsl.simulate(pipedsl.load("hanayo").compile(P=P, M=M, W=W))
    assert t.peak_activations == hanayo_peaks(P, M, W)
    M = 4 * W * P
    t = pipedsl.simulate(pipedsl.load("hanayo").compile(P=P, M=M, W=W + 1))
    assert t.peak_activations == hanayo_peaks(P, M, W + 1)
    if W == 1:  # from M >= 4WP on, the same on every rank
        assert t.peak_activations == [2 * (W + 1) ** 2 * P] * P


@given(st.tuples(st.integers(1, 8), st.integers(0, 16)), st.sampled_from([1, 1.5, 2, 3, 4]))
def test_hanayo_with_slower_backwards(size, B):
    P, extra = size
    M = 2 * P + extra
    # one wave: the turn rank runs out of forwards before the first backward comes back, once
    t = pipedsl.simulate(pipedsl.load("hanayo").compile(P=P, M=M, W=1), pipedsl.Cost(F=1, B=B))
    assert t.makespan == (1 + B) * (2 * M + P - 1) + (P - 1) * (B - 1)
    # two or more waves: with B = 2F the extra chunks' forwards cover that wait: the bound again
    for W in (2, 3):
        t = pipedsl.simulate(pipedsl.load("hanayo").compile(P=P, M=M, W=W), F1B2)
        assert frac(t.bubble_ratio) == Fraction(P - 1, 2 * W * M + P - 1)


@given(st.tuples(st.integers(2, 8), st.integers(0, 16)))
def test_hanayo_faster_entry_reaches_the_bound_with_slower_backwards(size):
    P, extra = size
    M, W = 2 * P + extra, 1
    lean = pipedsl.simulate(pipedsl.load("hanayo").compile(P=P, M=M, W=W), F1B2)
    fast = pipedsl.simulate(pipedsl.load("hanayo").compile(P=P, M=M, W=W, E=4), F1B2)
    assert frac(fast.bubble_ratio) == Fraction(P - 1, 2 * W * M + P - 1)  # at the bound with B = 2F
    assert frac(pipedsl.simulate(pipedsl.load("hanayo").compile(P=P, M=M, W=W, E=4), UNIT).bubble_ratio) == \
        Fraction(P - 1, 2 * W * M + P - 1)  # and still with F = B
    assert max(fast.peak_activations) <= 3 * max(lean.peak_activations) // 2  # at most 1.5x the memory


# ---------------------------------------------------------------- zero bubble


zb_costs = st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)).filter(lambda c: c[2] <= min(c[0], c[1]))


@given(st.tuples(st.integers(1, 8), st.integers(0, 24)), zb_costs)
def test_zb_h1_bubble_and_memory(size, costs):
    P, extra = size
    M = P + extra
    Tf, Ti, Tw = costs
    program = pipedsl.load("zb-h1").compile(P=P, M=M)
    check_program(program, {(0, s): s for s in range(P)}, [0] * M)
    assert program.split_backward
    t = pipedsl.simulate(program, pipedsl.Cost(F=Tf, I=Ti, W=Tw))
    # the paper's bubble (P-1)(T_F + T_B - T_W), its T_B being our I (gradient w.r.t. the input)
    assert t.makespan - M * (Tf + Ti + Tw) == (P - 1) * (Tf + Ti - Tw)
    assert t.peak_activations == [min(P, M)] * P  # <= P: an activation lives until its W


def torch_zbv(P: int, M: int, r: int) -> list[str]:
    """torch.distributed.pipelining ScheduleZBVZeroBubble._calculate_single_rank_operations,
    re-derived: F/I/W counters per chunk; microbatches >= M pruned at the end."""
    n = max(2 * P - 1, M)
    s0, s1 = r, 2 * P - 1 - r
    ops: list[tuple[str, int, int]] = []
    cnt = defaultdict(int)

    def add(kind: str, stage: int) -> None:
        ops.append((kind, cnt[(kind, stage)], stage))
        cnt[(kind, stage)] += 1

    for _ in range(2 * (P - r) - 1):
        add("F", s0)
    for _ in range(r):
        add("F", s1)
        add("F", s0)
    for _ in range(P - r):
        add("F", s1)
        add("I", s1)
        add("W", s1)
    while cnt[("F", s1)] < cnt[("F", s0)] or cnt[("F", s0)] < n:
        if cnt[("F", s0)] < n:
            add("F", s0)
        add("I", s0)
        add("W", s0)
        add("F", s1)
        add("I", s1)
        add("W", s1)
    for _ in range(r):
        add("I", s0)
        add("I", s1)
    for _ in range(P - r):
        add("I", s0)
        add("W", s0)
    for stage in (s1, s0):
        while cnt[("W", stage)] < cnt[("I", stage)]:
            add("W", stage)
    return [f"{k}{m}.{s}" for k, m, s in ops if m < M]


@given(st.tuples(st.integers(1, 8), st.integers(1, 32)))
def test_zb_v_is_torchs_order(size):
    P, M = size
    program = pipedsl.load("zb-v").compile(P=P, M=M)
    check_program(program, {(0, s): (s if s < P else 2 * P - 1 - s) for s in range(2 * P)}, [0] * M)
    assert program.compute_orders() == [torch_zbv(P, M, r) for r in range(P)]


@given(st.tuples(st.integers(2, 8), st.integers(0, 16)))
def test_zb_v_idles_only_the_ramp_up(size):
    P, extra = size
    M = 2 * P + extra
    t = pipedsl.simulate(pipedsl.load("zb-v").compile(P=P, M=M), pipedsl.Cost(F=1, I=1, W=1))
    # the last rank cannot start before (P-1) T_F; with T_F = T_I = T_W nothing else idles
    assert t.makespan - 2 * M * 3 == P - 1
    assert t.peak_activations == [2 * P] * P


# ---------------------------------------------------------------- looped BFS


def torch_looped_bfs(P: int, M: int, V: int, r: int) -> list[str]:
    """torch.distributed.pipelining ScheduleLoopedBFS: every microbatch through each local stage
    in turn, then the backwards, last local stage and last microbatch first."""
    stages = range(r, P * V, P)
    return [f"F{m}.{s}" for s in stages for m in range(M)] + \
        [f"B{m}.{s}" for s in reversed(stages) for m in reversed(range(M))]


@given(st.tuples(st.integers(1, 8), st.integers(1, 16), st.integers(1, 4)))
def test_looped_bfs_is_torchs_order(size):
    P, M, V = size
    program = pipedsl.load("looped-bfs").compile(P=P, M=M, V=V)
    assert program.compute_orders() == [torch_looped_bfs(P, M, V, r) for r in range(P)]
    check_program(program, {(0, s): s % P for s in range(V * P)}, [0] * M)
    assert pipedsl.simulate(program).peak_activations == [V * M] * P


# ---------------------------------------------------------------- every built-in, every size


@pytest.mark.parametrize("name", pipedsl.builtin_names())
def test_check_passes_for_every_builtin(name, capsys):
    ranks = [2, 4] if pipedsl.load(name).searched else [2, 4, 8]  # a search per M: P=8 is compile_scale's (suite time)
    status = main(["check", name, "--ranks", ",".join(map(str, ranks))])
    out = capsys.readouterr().out
    assert status == 0, out
    assert [line.split(":")[0] for line in out.splitlines() if line.endswith(" 0 failed")] == [f"P={P}" for P in ranks]


def test_the_compiler_names_no_schedule():
    from pipedsl import compiler, expr, lowering, nodes, parser
    code = "".join(Path(mod.__file__).read_text(encoding="utf-8") for mod in (compiler, expr, lowering, nodes, parser))
    for name in pipedsl.builtin_names():
        for word in {name, pipedsl.load(name).name}:
            assert f'"{word}"' not in code and f"'{word}'" not in code, word


# ---------------------------------------------------------------- the `merge` declaration


def _schedule(body: str) -> pipedsl.Schedule:
    return pipedsl.Schedule.from_text("schedule T(P, M) {\n" + body + "\n}", "t.pipe")


@given(st.integers(1, 6), st.integers(1, 12))
def test_merge_sorts_forwards_and_backwards_together(P, M):
    # GPipe's order written as times: forward m at m, every backward after the last forward
    program = _schedule("  place s\n  order F by m\n  order B by M + m\n  merge").compile(P=P, M=M)
    assert program.compute_orders() == [[f"F{m}.{r}" for m in range(M)] + [f"B{m}.{r}" for m in range(M)]
                                        for r in range(P)]
    # 1F1B as steps: forward m at step 2m + r, backward at step 2m + 2P-2-r, the forward first
    one = _schedule("  place s\n  order F by 2 * m + s\n  order B by 2 * m + 2 * P - 2 - s\n  merge").compile(P=P, M=M)
    assert one.compute_orders() == pipedsl.load("1f1b").compile(P=P, M=M).compute_orders()


def test_merge_with_split_backward():
    program = _schedule("  place s\n  order F by m\n  order B by M + m\n  merge\n  wlag 1").compile(P=2, M=2)
    assert program.compute_orders()[1] == ["F0.1", "F1.1", "I0.1", "I1.1", "W0.1", "W1.1"]


@pytest.mark.parametrize("body, message, line", [
    ("  order F by m\n  order B by m\n  merge\n  warmup 1", "'warmup' has no effect with 'merge'", 5),
    ("  order F by m\n  merge", "needs both ('order B' is missing)", 3),
    ("  merge\n  compute { F(0, r) B(0, r) }", "'merge' has no effect next to an explicit 'compute'", 2),
    ("  merge\n  merge\n  order F by m\n  order B by m", "'merge' is declared twice", 3),
])
def test_merge_errors_point_at_the_declaration(body, message, line):
    with pytest.raises(pipedsl.PipeSemanticError) as err:
        _schedule(body)
    assert message in err.value.message
    assert err.value.span.line == line


def test_merge_that_cannot_run_blames_merge():
    # each forward sorted before the backward it needs on the next rank… but backwards come first
    bad = _schedule("  place s\n  order F by M + m\n  order B by m\n  merge")
    with pytest.raises(pipedsl.PipeSemanticError) as err:
        bad.compile(P=2, M=2)
    assert "merging them by their keys" in err.value.message
    assert err.value.span.line == 5
    assert "merge" in err.value.render()


def test_merge_is_a_keyword():
    with pytest.raises(pipedsl.PipeSyntaxError):
        pipedsl.Schedule.from_text("schedule T(P, M, merge = 1) { }")


# ---------------------------------------------------------------- docs/schedules.md stays true


def test_docs_show_the_current_sources_and_tables():
    from pipedsl.compare import compare_table
    doc = (Path(__file__).resolve().parents[2] / "docs" / "schedules.md").read_text(encoding="utf-8")
    blocks = doc.split("```")[1::2]
    sources = {b.split("\n", 1)[1].strip() for b in blocks if b.startswith("pipe\n")}
    for name in pipedsl.builtin_names():
        assert pipedsl.load(name).source.strip() in sources, f"docs/schedules.md shows an old {name}.pipe"
    tables = [b.strip() for b in blocks if b.lstrip("\n").startswith("P=")]
    assert len(tables) == 4
    names = ["gpipe", "1f1b", "interleaved", "looped-bfs", "chimera", "hanayo", "zb-h1", "zb-v", "dualpipev", "dualpipe",
             "v-half", "v-min"]
    for table in tables:
        head = table.splitlines()[0].split()
        P, M = int(head[0][2:]), int(head[1][2:])
        cost = ",".join(head[3:7])
        assert table == compare_table(names, P, M, {}, cost)


def test_zb_h2_has_no_idle_time_at_equal_costs_within_2p_activations():
    """ZB-H2 (the paper's section 2.2): with T_F = T_I = T_W and free messages every rank is busy from its first op
    to its last once M >= 2P, holding at most 2P activations; ZB-H1 at the same sizes idles."""
    cost = pipedsl.Cost(F=1, B=2, I=1, W=1)

    def idle(name: str, P: int, M: int) -> tuple[list[float], list[int]]:
        t = pipedsl.simulate(pipedsl.load(name).compile(P=P, M=M), cost)
        out = []
        for events in t.ranks:
            ops = [e for e in events if e.instr.op.value in ("F", "I", "W")]
            out.append(round(ops[-1].end - ops[0].start - sum(e.end - e.start for e in ops), 9))
        return out, t.peak_activations

    for P in range(2, 9):
        for M in range(2 * P, 4 * P + 3):
            gaps, peaks = idle("zb-h2", P, M)
            assert gaps == [0.0] * P and max(peaks) <= 2 * P, (P, M, gaps, peaks)
            assert sum(idle("zb-h1", P, M)[0]) > 0  # ZB-H1 at P activations idles
    with pytest.raises(pipedsl.PipeSemanticError, match="M >= 2P-1"):
        pipedsl.load("zb-h2").compile(P=4, M=6)
