"""Memory per GPU: model states per precision mode and ZeRO stage (Rajbhandari et al., SC'20) plus activations.

One function, `model_states`, gives the bytes of parameters, gradients and optimizer state (fp32
main parameters included) one rank holds; the planner ranks layouts with it, `pipedsl train`
checks a run fits with it, and tests/parallel/test_state_bytes.py checks it against the bytes of
every tensor the runtime really keeps, per mode and stage.  A parameter costs, before sharding
(`StateBytes`):

    mode (runtime precision=)                          param  grad  main  Adam   total
    AUTOCAST   fp32 params, bf16 autocast              4      4     0     8      16
    MEGATRON   bf16 params, fp32 main + fp32 grads     2      4     4     8      18
    ZERO_PAPER bf16 params, fp32 main + bf16 grads     2      2     4     8      16

Over Nd data-parallel ranks ZeRO 1 shards main + optimizer state, 2 also gradients, 3 also
parameters: MEGATRON at stage 1 is Megatron-LM's distributed optimizer, 6 + 12/Nd bytes;
ZERO_PAPER is the paper's (2 + 2 + K)Ψ with K = 12 (its Figure 1: Ψ = 7.5B, Nd = 64 gives 120,
31.4, 16.6 and 1.9 GB).  Gradients are counted between steps: under ZeRO 2/3 the full
gradient of a stage also lives from its first backward to its reduction (reduce="step").

Mixture-of-Experts (`moe_model_states`): every expert is held, so the states count the total
parameters; with expert parallelism ep the routed experts' Ψ_e is split over ep ranks and
replicated (and ZeRO-sharded) over the dp/ep ranks holding the same experts, the rest over dp:
states(Ψ − Ψ_e, dp) + states(Ψ_e/ep, dp/ep).

An encoder-decoder's rank (`RankMemory`, at its peak): the model states of its stages, plus what the
runtime keeps beyond them: under ZeRO 2/3 the full gradient buffer of its stages from the first
backward to REDUCE_GRAD (`parallel/zero.py`, reduce="step"), under ZeRO-3 the gathered units (the
running one and the next, prefetched; all of them during a W of a split-backward schedule,
`before_weight_pass`, and through the step with reshard="step"); and activations: the most bytes
alive at once on the rank, each stage's own per microbatch from its F to its B (or W), walked over
the schedule's compiled program (`pipeline.live_peaks`; the encoder output counted on decoder
stages), plus one layer's whole activations while it is recomputed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pipedsl.plan.config import Layout
    from pipedsl.plan.cost import EncDecStages


@dataclass(frozen=True)
class StateBytes:
    """Bytes one parameter costs in each piece of training state, before sharding."""

    param: int  # the model's copy
    grad: int  # the gradient accumulated over microbatches
    main: int  # fp32 main copy (0: the parameters are fp32 themselves)
    optimizer: int  # optimizer state (Adam: two fp32 moments)

    @property
    def total(self) -> int:
        return self.param + self.grad + self.main + self.optimizer


AUTOCAST = StateBytes(4, 4, 0, 8)
MEGATRON = StateBytes(2, 4, 4, 8)
ZERO_PAPER = StateBytes(2, 2, 4, 8)
_OPTIMIZER_STATE = {"adam": 8, "adamw": 8, "sgd-momentum": 4, "sgd": 0}

# the ZeRO paper's accounting (the planner's default): the per-parameter constants other modules use
PARAM_BYTES = ZERO_PAPER.param
OPTIMIZER_BYTES = ZERO_PAPER.main + ZERO_PAPER.optimizer  # the ZeRO paper's K


@lru_cache(maxsize=64)  # the search prices every rank of every candidate in one of a few modes
def state_bytes(params: str = "bf16", grads: str = "fp32", optimizer: str = "adam") -> StateBytes:
    """The bytes of a runtime precision mode: `params` the model's dtype ("fp32": autocast), `grads` the
    accumulation dtype (fp32 parameters always have fp32 gradients), `optimizer` "adam"/"adamw" (8),
    "sgd-momentum" (4) or "sgd" (0)."""
    size = {"fp32": 4, "bf16": 2, "fp16": 2}
    if params not in size or grads not in size:
        raise ValueError(f"params and grads are fp32, bf16 or fp16, got {params!r}, {grads!r}")
    if optimizer not in _OPTIMIZER_STATE:
        raise ValueError(f"optimizer is one of {', '.join(_OPTIMIZER_STATE)}, got {optimizer!r}")
    grad = 4 if params == "fp32" else size[grads]
    return StateBytes(size[params], grad, 0 if params == "fp32" else 4, _OPTIMIZER_STATE[optimizer])


@dataclass(frozen=True)
class ModelStates:
    """Bytes of parameters, gradients and optimizer state (fp32 main parameters included) one rank holds."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def __add__(self, other: ModelStates) -> ModelStates:
        return ModelStates(self.params + other.params, self.grads + other.grads, self.optimizer + other.optimizer)


def model_states(psi: float, dp: int, zero: int, mode: StateBytes = ZERO_PAPER) -> ModelStates:
    """Model-state bytes per rank for `psi` parameters replicated over `dp` ranks under ZeRO `zero`."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage is 0..3, got {zero}")
    params = mode.param * psi / (dp if zero >= 3 else 1)
    grads = mode.grad * psi / (dp if zero >= 2 else 1)
    optimizer = (mode.main + mode.optimizer) * psi / (dp if zero >= 1 else 1)
    return ModelStates(params, grads, optimizer)


def moe_model_states(psi: float, expert_psi: float, dp: int, ep: int, zero: int,
                     mode: StateBytes = ZERO_PAPER) -> ModelStates:
    """Model-state bytes per rank when `expert_psi` of the rank's `psi` parameters (both before expert
    parallelism) are routed experts sharded over `ep` ranks: the experts' 1/ep replicated over dp/ep ranks
    (ZeRO shards them over those), the rest over dp."""
    if ep < 1 or dp % ep:
        raise ValueError(f"ep must divide dp, got ep {ep}, dp {dp}")
    if not expert_psi:
        return model_states(psi, dp, zero, mode)
    return model_states(psi - expert_psi, dp, zero, mode) + model_states(expert_psi / ep, dp // ep, zero, mode)


@dataclass(frozen=True)
class MemoryReport:
    """One GPU's peak: model states between steps, what the runtime holds beyond them during the step, and the
    activations alive at the schedule's peak."""

    states: ModelStates
    activations: float  # stored activations at the peak + one block's working set when recomputing
    peak_live: int  # the most microbatch-stage activations alive at once (from the simulated timeline)
    gradient_buffer: float = 0.0  # ZeRO 2-3: the full gradient less the kept shard, first backward → REDUCE_GRAD
    gathered: float = 0.0  # ZeRO-3: the gathered units' full parameters less the kept shard

    @property
    def total(self) -> float:
        return self.states.total + self.gradient_buffer + self.gathered + self.activations

    def describe(self) -> str:
        """The out-of-memory message's account of the total: ZeRO's buffers named only where there are any."""
        gb, st = 1e9, self.states
        during = "".join(f"{name} {value / gb:.1f}, " for name, value in (("gradient buffer", self.gradient_buffer),
                                                                           ("gathered parameters", self.gathered))
                         if value)
        return (f" (params {st.params / gb:.1f}, grads {st.grads / gb:.1f}, optimizer {st.optimizer / gb:.1f}, "
                f"{during}activations {self.activations / gb:.1f} for {self.peak_live} live)")


@dataclass(frozen=True)
class RankMemory:
    """One rank's peak: model states between steps, what the runtime keeps beyond them during the step, and
    activations."""

    rank: int
    stages: tuple[int, ...]
    params_count: float  # parameters of its stages (a tied copy counts on each stage holding it)
    states: ModelStates  # `model_states` over dp: between steps
    gradient_buffer: float  # ZeRO 2/3: the full gradient less the kept shard, first backward → REDUCE_GRAD
    gathered: float  # ZeRO-3: full parameters of the units gathered at once
    activations: float
    peak_live: float

    @property
    def total(self) -> float:
        return self.states.total + self.gradient_buffer + self.gathered + self.activations

    def describe(self) -> str:
        """The out-of-memory message's account of the total: which rank, and every part of it."""
        gb, st = 1e9, self.states
        return (f" on rank {self.rank} (params {st.params / gb:.1f}, grads {st.grads / gb:.1f}, optimizer "
                f"{st.optimizer / gb:.1f}, gradient buffer {self.gradient_buffer / gb:.1f}, gathered "
                f"{self.gathered / gb:.1f}, activations {self.activations / gb:.1f} for {self.peak_live:g} live)")


class PeakMemory(Protocol):
    """What the search, its ranking and the printer read of a rank's peak, whichever way it was counted: a decoder's
    `MemoryReport` (its activations from the schedule's live microbatch count) or an encoder-decoder's `RankMemory`
    (its activations walked over the program)."""

    states: ModelStates
    gradient_buffer: float
    gathered: float
    activations: float

    @property
    def total(self) -> float: ...

    def describe(self) -> str: ...


def rank_memory(stages: EncDecStages, layout: Layout, on_rank: dict[int, list[int]], live_bytes: Sequence[float],
                peaks: Sequence[float], split_backward: bool) -> list[RankMemory]:
    """Every rank's `RankMemory` for a program whose ranks hold `on_rank` stages, keep at most `live_bytes` of
    activations at once and `peaks` live microbatch-stages."""
    mode = state_bytes("bf16", layout.grads)
    out = []
    for r, held in on_rank.items():
        if not held:
            continue
        psi = sum(stages.costs.stage_params[s] for s in held)
        states = model_states(psi, layout.dp, layout.zero, mode)
        buffer = mode.grad * psi * (1 - 1 / layout.dp) if layout.zero >= 2 else 0.0
        gathered = 0.0
        if layout.zero >= 3:  # beyond the shard it holds anyway
            whole = split_backward or layout.reshard == "step"  # a W gathers its stage first; "step" holds it
            gathered = PARAM_BYTES * (psi if whole else max(stages.largest_units[s] for s in held))
            gathered *= 1 - 1 / layout.dp
        act = live_bytes[r] + max(stages.working[s] for s in held)
        out.append(RankMemory(r, tuple(held), psi, states, buffer, gathered, act, peaks[r]))
    return out
