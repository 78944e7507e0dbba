"""Memory per GPU: model states per ZeRO stage (Rajbhandari et al., SC'20) plus activations.

Mixed-precision Adam keeps, per parameter, 2 bytes of fp16 weights, 2 of fp16 gradients and
K = 12 of optimizer state (fp32 weights, momentum, variance).  Over Nd data-parallel ranks:
stage 0 (2 + 2 + K)Ψ, stage 1 (2 + 2)Ψ + KΨ/Nd, stage 2 2Ψ + (2 + K)Ψ/Nd, stage 3 (2 + 2 + K)Ψ/Nd
(the ZeRO paper's Figure 1: Ψ = 7.5B, Nd = 64 gives 120, 31.4, 16.6 and 1.9 GB).
"""

from __future__ import annotations

from dataclasses import dataclass

PARAM_BYTES = 2
GRAD_BYTES = 2
OPTIMIZER_BYTES = 12  # the ZeRO paper's K


@dataclass(frozen=True)
class ModelStates:
    """Bytes of parameters, gradients and optimizer state one GPU holds."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_states(psi: float, dp: int, zero: int) -> ModelStates:
    """Model-state bytes per GPU for `psi` parameters replicated over `dp` ranks under ZeRO `zero`."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage is 0..3, got {zero}")
    params = PARAM_BYTES * psi / (dp if zero >= 3 else 1)
    grads = GRAD_BYTES * psi / (dp if zero >= 2 else 1)
    optimizer = OPTIMIZER_BYTES * psi / (dp if zero >= 1 else 1)
    return ModelStates(params, grads, optimizer)


@dataclass(frozen=True)
class MemoryReport:
    """One GPU's peak: model states plus the activations alive at the schedule's peak."""

    states: ModelStates
    activations: float  # stored activations at the peak + one block's working set when recomputing
    peak_live: int  # the most microbatch-stage activations alive at once (from the simulated timeline)

    @property
    def total(self) -> float:
        return self.states.total + self.activations
