"""The simulator against the zero-bubble paper's own numbers (Qi et al., "Zero Bubble Pipeline Parallelism",
ICLR'24): its Table 6 profiles T_F, T_B (our I), T_W and T_comm in ms for each setup, and its Table 5 gives
each handcrafted schedule's bubble rate under those costs, (cost − m(T_F + T_B + T_W)) / cost with cost the
longest stage's time (`Timeline.rank_spans`).  pipedsl's built-in 1F1B, ZB-H1 and ZB-H2 reproduce the three
columns to the paper's 4 decimals.

Two of the paper's twelve setups (1.5B at m = 32 and 64) are left out: the costs we hold for them do not
reproduce the paper's 1F1B bubble, which depends on nothing but the costs, so they are not the costs the
paper used.

Its searched schedules, ZB-1p and ZB-2p, are measured with steps that overlap (post-validation) under its
memory model, where a pending W holds 32h of the 34h + 5as bytes a token of an activation: zb-auto with
`post=1` and `Cost(wmem=32h / (34h + 5as))` at mem = p and 2p is at or below them (+ 0.002)."""

from __future__ import annotations

import pytest

import pipedsl

# model: hidden size h, attention heads a (the paper's Table 3; sequences of s = 1024 tokens)
MODELS = {"1.5B": (2304, 24), "6.2B": (4096, 32), "14.6B": (5120, 40), "28.3B": (6144, 48)}
# model, p, m: bubble of ZB-1p, ZB-2p (Table 5)
SEARCHED = {
    ("1.5B", 8, 24): (0.1585, 0.0433),
    ("6.2B", 8, 24): (0.1323, 0.0029),
    ("6.2B", 8, 32): (0.1045, 0.0022),
    ("6.2B", 8, 64): (0.0554, 0.0010),
    ("14.6B", 16, 48): (0.1397, 0.0066),
    ("14.6B", 16, 64): (0.1088, 0.0054),
    ("14.6B", 16, 128): (0.0576, 0.0028),
    ("28.3B", 32, 96): (0.1421, 0.0038),
    ("28.3B", 32, 128): (0.1106, 0.0029),
    ("28.3B", 32, 256): (0.0594, 0.0018),
}
# model, p, m: T_F, T_B, T_W, T_comm (Table 6); bubble of 1F1B, ZB-H1, ZB-H2 (Table 5)
SETUPS = {
    ("1.5B", 8, 24): ((18.522, 18.086, 9.337, 0.601), (0.2431, 0.1585, 0.1083)),
    ("6.2B", 8, 24): ((29.718, 29.444, 19.927, 0.527), (0.2347, 0.1323, 0.0698)),
    ("6.2B", 8, 32): ((29.802, 29.428, 19.530, 0.577), (0.1898, 0.1045, 0.0559)),
    ("6.2B", 8, 64): ((29.935, 29.621, 19.388, 0.535), (0.1091, 0.0554, 0.0294)),
    ("14.6B", 16, 48): ((11.347, 11.248, 8.132, 0.377), (0.2552, 0.1397, 0.0672)),
    ("14.6B", 16, 64): ((11.307, 11.254, 8.101, 0.379), (0.2082, 0.1088, 0.0516)),
    ("14.6B", 16, 128): ((11.325, 11.308, 8.109, 0.378), (0.1251, 0.0576, 0.0266)),
    ("28.3B", 32, 96): ((10.419, 10.207, 7.715, 0.408), (0.2646, 0.1421, 0.0641)),
    ("28.3B", 32, 128): ((10.408, 10.204, 7.703, 0.408), (0.2168, 0.1106, 0.0490)),
    ("28.3B", 32, 256): ((10.402, 10.248, 7.698, 0.460), (0.1352, 0.0594, 0.0257)),
}


def paper_bubble(program: pipedsl.Program, cost: pipedsl.Cost, M: int) -> float:
    cost_of_step = max(pipedsl.simulate(program, cost).rank_spans)
    return (cost_of_step - M * (cost.F + cost.I + cost.W)) / cost_of_step


@pytest.mark.parametrize("setup", list(SETUPS), ids=lambda s: f"{s[0]}-p{s[1]}-m{s[2]}")
def test_handcrafted_schedules_reproduce_the_papers_bubble_rates(setup: tuple[str, int, int]) -> None:
    _, P, M = setup
    (F, I, W, comm), published = SETUPS[setup]  # noqa: E741
    cost = pipedsl.Cost(F=F, B=I + W, I=I, W=W, comm=comm)
    for name, bubble in zip(("1f1b", "zb-h1", "zb-h2"), published, strict=True):
        assert round(paper_bubble(pipedsl.load(name).compile(P=P, M=M), cost, M), 4) == bubble, name


def test_zb_auto_at_the_memory_of_1f1b_is_at_or_below_zb_h1_on_the_papers_costs() -> None:
    """At p activations a rank the search finds ZB-H1's bubble or lower (the paper's ZB-1p column is not held
    here; ZB-2p rests on a memory model where I frees most of an activation, which docs/schedules.md discusses)."""
    (F, I, W, comm), (_, zb_h1, _) = SETUPS[("6.2B", 8, 24)]  # noqa: E741
    cost = pipedsl.Cost(F=F, B=I + W, I=I, W=W, comm=comm)
    program = pipedsl.load("zb-auto").compile(P=8, M=24, mem=8, cost=cost)
    assert paper_bubble(program, cost, 24) <= zb_h1 + 5e-5
    assert max(pipedsl.simulate(program, cost).peak_activations) <= 8


@pytest.mark.parametrize("setup", [("1.5B", 8, 24), ("6.2B", 8, 24)], ids=lambda s: f"{s[0]}-p{s[1]}-m{s[2]}")
def test_zb_auto_at_twice_that_memory_reaches_the_steps_lower_bound(setup: tuple[str, int, int]) -> None:
    """Where a collective ends each step (pipedsl's trainer: global-norm clipping), the step is the makespan, and no
    order ends before the last rank's first input arrives, (p − 1)(T_F + T_comm), plus its m microbatches' work.
    At mem = 2p the search reaches that bound on the paper's costs (as ZB-H2 does): the paper's lower ZB-2p bubble
    is measured over rank spans, a step's time only where steps overlap."""
    _, P, M = setup
    (F, I, W, comm), _ = SETUPS[setup]  # noqa: E741
    cost = pipedsl.Cost(F=F, B=I + W, I=I, W=W, comm=comm)
    bound = (P - 1) * (F + comm) + M * (F + I + W)
    program = pipedsl.load("zb-auto").compile(P=P, M=M, mem=2 * P, cost=cost)
    assert pipedsl.simulate(program, cost).makespan == pytest.approx(bound, rel=1e-9)


def paper_cost(setup: tuple[str, int, int]) -> pipedsl.Cost:
    """A setup's Table 6 costs under the paper's memory model (a pending W holds `wmem` of an activation)."""
    (F, I, W, comm), _ = SETUPS[setup]  # noqa: E741
    return pipedsl.Cost(F=F, B=I + W, I=I, W=W, comm=comm, wmem=wmem(setup[0]))


def wmem(model: str, seq: int = 1024) -> float:
    """The share of an activation a pending W holds in the paper's memory model: 32h of 34h + 5as bytes a token."""
    h, a = MODELS[model]
    return 32 * h / (34 * h + 5 * a * seq)


# (setup, which of ZB-1p / ZB-2p): both at p = 8, ZB-2p on the quickest p = 16 and p = 32 setups; the others'
# searches take 10-20 s each: benchmarks/zb_paper.py runs all ten setups
CHECKS = [(s, k) for s in SEARCHED for k in (0, 1) if s[1] == 8 or (k == 1 and s in (("14.6B", 16, 48),
                                                                                      ("28.3B", 32, 256)))]


@pytest.mark.parametrize("setup,which", [pytest.param(s, k, marks=pytest.mark.slow) if s[1] > 8 else (s, k)
                                         for s, k in CHECKS], ids=lambda v: f"{v[0]}-p{v[1]}-m{v[2]}"
                         if isinstance(v, tuple) else ("ZB-1p", "ZB-2p")[v])
def test_zb_auto_with_overlapping_steps_reaches_the_papers_searched_schedules(setup: tuple[str, int, int],
                                                                              which: int) -> None:
    """`post=1` searches the longest rank span (the period of overlapped steps) and the cap counts a pending W at
    `wmem` of an activation: at mem = p the bubble is ZB-1p's, at 2p ZB-2p's (+ 0.002), within the cap so counted."""
    _, P, M = setup
    cost = paper_cost(setup)
    mem, published = (P, 2 * P)[which], SEARCHED[setup][which]
    program = pipedsl.load("zb-auto").compile(P=P, M=M, mem=mem, cost=cost, post=1)
    assert paper_bubble(program, cost, M) <= published + 0.002, (mem, paper_bubble(program, cost, M), published)
    assert max(pipedsl.simulate(program, cost).peak_activations) <= mem + 1e-9


def test_the_memory_model_gives_the_papers_share() -> None:
    """32h / (34h + 5as): 0.37 for the 1.5B model, 0.43 for the others (the issue's 0.37-0.43)."""
    assert [round(wmem(m), 3) for m in MODELS] == [0.366, 0.432, 0.432, 0.432]
