"""How a pipeline holds its gradients and reduces them over data parallelism: one strategy per pipeline.

The choice is made once, when the pipeline is built (`strategy_for`), and everything that depends
on it asks the strategy instead of deciding again:

    Replicated  every parameter keeps its own `.grad`; at each stage's REDUCE_GRAD an averaging
                all-reduce over dp (reduce.py's DataParallelReducer; expert shards over their own group,
                ExpertReducer); any torch optimizer steps them
    Flat        one `ZeroOptimizer` per stage (parallel/zero.py) packs the parameters into flat
                buffers: ZeRO 1-3, or ZeRO 0 when the model holds bf16/fp16 parameters and the
                optimizer fp32 main copies; its reduction is the REDUCE_GRAD hook, its gathers the
                ZeRO-3 weight-pass hooks, and it steps the owned slices

It is the one reader of the ZeRO level (`level`, `check_program`); it owns the reduction hooks (wired at
the step end by finalize.py), the optimizer's construction over the right tensors, the gradients
a global norm counts and clipping scales (clip.py), and tells the ties (ties.py) whether a tie sums
dp-reduced slices within one replica (flat) or averages full gradients over every replica.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from pipedsl.errors import PipeRuntimeError
from pipedsl.ir import Program
from pipedsl.parallel.config import ParallelConfig, ParallelConfigError
from pipedsl.parallel.expert import expert_units
from pipedsl.parallel.weight_decay import Decay, split_decay
from pipedsl.parallel.zero import ZeroOptimizer
from pipedsl.runtime import clip
from pipedsl.runtime.precision import MixedPrecision
from pipedsl.runtime.reduce import DataParallelReducer, ExpertReducer, GradReducer
from pipedsl.runtime.ties import TieReducer


class HeldStages(Protocol):
    """What building an optimizer reads of a pipeline (`Pipeline` is one): this rank's stages, their ties, and
    where the weight-pass hooks go."""

    ties: TieReducer

    def local_stages(self) -> dict[int, nn.Module]: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def register_weight_pass_hook(self, stage: int, before: Callable[[], None], after: Callable[[], None],
                                  early: bool = False) -> None: ...


class Replicated:
    """Parameters with their own `.grad`, averaged over dp at REDUCE_GRAD (without dp: nothing to reduce)."""

    flat = False
    level = 0  # the ZeRO level

    def __init__(self, group: dist.ProcessGroup | None, dp: int, ep: int = 1) -> None:
        self.group, self.dp, self.ep = group, dp, ep
        self.zero: dict[int, ZeroOptimizer] = {}  # none: the optimizer steps the parameters themselves

    def check_program(self, program: Program) -> None:
        """Every program runs with replicated gradients."""

    def install(self, reducer: GradReducer, ties: TieReducer) -> None:
        if self.dp > 1:
            reducer.add_hook(DataParallelReducer(self.group, ties.skip))
        if self.ep > 1:
            reducer.add_hook(ExpertReducer())

    def build(self, pipe: HeldStages, optimizer_class: Callable[..., torch.optim.Optimizer], kwargs: dict[str, Any],
              exempt: dict[int, set[str]]) -> tuple[torch.optim.Optimizer | None, Decay | None]:
        """The optimizer over the trainable parameters, and the weight decay that replaces its own when `exempt`
        ({stage: parameter names}, weight_decay.py) spares some."""
        # frozen parameters stay out: no optimizer (weight decay included) touches them; a rank whose stages are
        # all frozen (a frozen embedding stage under adapters) has nothing to step
        trainable = [p for p in pipe.parameters() if p.requires_grad]
        if not trainable:
            return None, None
        kwargs, decay = split_decay(optimizer_class, kwargs) if any(exempt.values()) else (kwargs, None)
        if decay is not None:
            spared = {id(p) for s, module in pipe.local_stages().items()
                      for name, p in module.named_parameters(remove_duplicate=False) if name in exempt.get(s, ())}
            decay.spans = [(p, None) for p in trainable if id(p) not in spared]
        optimizer = optimizer_class(trainable, **kwargs)
        if decay is not None:
            decay.hold(optimizer)
        return optimizer, decay

    def gradients(self, ownership: clip.GradientOwnership) -> clip.Gradients:
        return ownership.gradients({})


class Flat:
    """A `ZeroOptimizer` per local stage over the dp group (made with the optimizer, which it needs)."""

    flat = True

    def __init__(self, group: dist.ProcessGroup | None, level: int, reduce: str, precision: MixedPrecision,
                 reason: str, reshard: str = "unit") -> None:
        self.group, self.level, self.reduce, self.reason, self.reshard = group, level, reduce, reason, reshard
        self.lowp = ({"param_dtype": precision.param_dtype, "grad_dtype": precision.grad_dtype}
                     if precision.keeps_main else {})
        self.zero: dict[int, ZeroOptimizer] = {}

    def check_program(self, program: Program) -> None:
        """Refuse the ZeRO settings this program cannot run, with the reason (every rank alike)."""
        if self.level == 0 or self.reduce != "microbatch":
            return
        if any(len({program.placement[(c, s)] for c in range(program.num_replicas)}) > 1
               for s in range(program.num_stages)):
            raise ParallelConfigError(
                f"zero_reduce='microbatch' does not support stage replicas on different ranks (schedule "
                f"{program.name!r}): the replicas sum full gradients at REDUCE_GRAD, which 'microbatch' has already "
                f"reduce-scattered; use zero_reduce='step'")

    def install(self, reducer: GradReducer, ties: TieReducer) -> None:
        reducer.add_hook(self._reduce)

    def _reduce(self, stage: int, module: nn.Module) -> ZeroOptimizer:
        zero = self.zero[stage]
        zero.reduce_gradients(async_op=True)
        return zero  # its wait() completes the reduction at the step end

    def build(self, pipe: HeldStages, optimizer_class: Callable[..., torch.optim.Optimizer], kwargs: dict[str, Any],
              exempt: dict[int, set[str]]) -> tuple[None, None]:
        """A ZeroOptimizer per local stage (each applies its own weight decay, sparing `exempt`'s names)."""
        own_copies(pipe.local_stages())
        for s, module in sorted(pipe.local_stages().items()):  # the same order on every dp peer
            shards = expert_units(module)
            self.zero[s] = ZeroOptimizer(module, optimizer_class, group=self.group, stage=self.level,
                                         reduce=self.reduce, reshard=self.reshard, separate=pipe.ties.separate(s),
                                         groups=shards,
                                         no_decay=exempt.get(s, set()), **self.lowp, **kwargs)
        pipe.ties.use_zero(self.zero)  # a tie's copies are now the stages' own units of it (ties.py)
        # split backward: W reads parameters ZeRO-3 frees after forwards (I gathers its own), and a microbatch's
        # gradients are complete after its W
        if self.level == 3 or self.reduce == "microbatch":
            for s, zero in sorted(self.zero.items()):
                pipe.register_weight_pass_hook(s, zero.before_weight_pass, zero.after_weight_pass, early=True)
        return None, None

    def gradients(self, ownership: clip.GradientOwnership) -> clip.Gradients:
        if not self.zero:
            raise PipeRuntimeError(f"{self.reason}: the gradients live in the optimizer's flat buffers; create it "
                                   f"with pipe.optimizer(...) first")
        return ownership.gradients(self.zero)


def own_copies(modules: dict[int, nn.Module]) -> None:
    """Give every stage its own object of a parameter that several local stages hold (a weight tied between a
    V schedule's first and last stage, both on rank 0): each stage's ZeroOptimizer moves its parameters'
    storage into its own flat buffers, and ties.py keeps the copies equal, as between ranks."""
    owner: dict[int, int] = {}  # parameter id -> the first stage holding it
    for s, module in sorted(modules.items()):
        copies: dict[int, nn.Parameter] = {}
        for m in module.modules():
            for attr, p in list(m._parameters.items()):
                if p is None:
                    continue
                if owner.setdefault(id(p), s) != s:
                    if id(p) not in copies:
                        copies[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                    m._parameters[attr] = copies[id(p)]


def strategy_for(parallel: ParallelConfig | None, precision: MixedPrecision, group: dist.ProcessGroup | None,
                 dp: int) -> Replicated | Flat:
    """Flat buffers for ZeRO 1-3 and for low-precision parameters (their fp32 main copies live there);
    replicated parameters otherwise."""
    level = parallel.zero if parallel is not None else 0
    if level == 0 and not precision.keeps_main:
        return Replicated(group, dp, parallel.ep if parallel is not None else 1)
    reason = f"zero={level}" if level else f"params={precision.params!r} (fp32 main parameters)"
    if parallel is None:
        return Flat(group, level, "step", precision, reason)
    return Flat(group, level, parallel.zero_reduce, precision, reason, parallel.reshard)
