"""`Pipeline`: the public API of the runtime, one instance per rank.

    pipe = pipedsl.Pipeline(stages, schedule="1f1b", microbatches=8, loss_fn=F.cross_entropy)
    loss = pipe.step(inputs, targets)      # same batch on every rank; mean loss on every rank
    optimizer.step(); optimizer.zero_grad()  # the optimizer is the user's

Built by assembly.py (the program, the mesh and groups, the stages, channels and reducers), run here.
How it runs is one `PipelineOptions` (options.py: `ScheduleOptions`, `MixedPrecision`, `RecomputeOptions`,
`LossOptions`, the batch mode, ties, …) passed as `options=`; the keywords named below (`precision=`,
`loss_reduction=`, `recompute=`, `lookahead=`, …) are its flat spelling, each setting one field of it.

`stages` is a list of `nn.Module` (one per global stage), or a callable `stage -> nn.Module`
that builds only what this rank holds.  `local_stages()` maps each global stage index held
here to its module.  With replicas (Chimera), the copies of a stage on *different* ranks are
separate modules (all starting from replica 0's weights, broadcast at init) whose gradients
are summed at REDUCE_GRAD; copies of a stage on the *same* rank share one module, so a
stage index always names one module per rank (`local_copies()` gives (replica, stage) keys).
Gradients accumulate into `.grad` (call `optimizer.zero_grad()` between steps).
`precision="bf16"|"fp16"` runs the stages under autocast with fp32 weights and gradients and
sends activations in the compute dtype (precision.py); `clip_grad_norm_(max_norm)` clips by
the whole model's norm over every rank (clip.py).  Parameters
shared between stages (tied embeddings) are found in the stage list or named with `ties=`;
their gradients are summed between the ranks holding them at the step end (see ties.py).

Data × pipeline × tensor parallelism: `parallel=ParallelConfig(dp, pp, tp, zero=…)` (or a
`ParallelMesh` built from one) makes the schedule run on the mesh's pp group (program rank k
is global rank `mesh.pp_ranks[k]`) with P = pp, and reduces gradients over the dp group at
each stage's REDUCE_GRAD: an averaging all-reduce for zero=0, `ZeroOptimizer.reduce_gradients`
for zero ≥ 1 (the optimizer then comes from `pipe.optimizer(torch.optim.Adam, lr=…)`).

    mesh = ParallelMesh(ParallelConfig(dp=2, pp=2, tp=2, zero=1))  # build stages on mesh.tp_group
    pipe = pipedsl.Pipeline(stages, "1f1b", microbatches=4, loss_fn=loss, parallel=mesh)
    opt = pipe.optimizer(torch.optim.Adam, lr=1e-3)
    loss = pipe.step(x, y)          # x, y: the global batch, the same on every rank
    opt.step(); opt.zero_grad()

The batch: by default (`batch="global"`) every rank passes the same *global* batch, as
without parallelism; data-parallel replica d trains on its contiguous share, rows
[d·B/dp, (d+1)·B/dp), split into M microbatches, so B must divide by dp·M — the
global-batch-size rule of Megatron-LM.  With a data loader that already shards by dp rank
(torchtitan's `local_batch_size`, Megatron's per-rank data iterator), pass `batch="local"`:
each replica passes its own B/dp samples (the same on its pp and tp ranks).  The first step
checks that the ranks which must see the same data do, and says which mode fits otherwise.
`step` returns the mean loss over the global batch on every rank: the pipeline's loss summed
over its microbatches (each scaled 1/M), averaged over dp — with the dp averaging of the
gradients, exactly the gradient of that mean.  Tensor-parallel stages must return the
microbatch's true loss on every tp rank of the last stage (its backward may be each rank's
share: see `pipedsl.models.gpt.tp`).

`loss_reduction="token"`: the loss function returns the microbatch's summed token losses and
the step's loss and gradients are the mean over every target != `ignore_index` of the global
batch (see `_count_tokens`).  `recompute="full"|"selective"` (with `recompute_filter`):
activation recomputation per stage (recompute.py).  `overlap` (default on): an F&B pair whose stages
exchange tokens (expert parallelism) hides each half's exchanges behind the other's compute (overlap.py).
`activation_bytes=True` counts the bytes every
stage's saved tensors hold (`pipe.counter.peak_bytes`): a Python hook on every tensor autograd
saves, ~6 % of a small GPT's step on CPU, so it is off unless asked for; the number of live
activations (`peak_activations`) is always counted.  Input shapes may change between steps:
the ranks agree on them every step and learn a new one in the step that meets it (see `_use_shapes`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipedsl.compiler import Schedule
from pipedsl.errors import PipeDSLError, PipeRuntimeError
from pipedsl.ir import Program
from pipedsl.parallel.config import ParallelConfig
from pipedsl.parallel.mesh import ParallelMesh
from pipedsl.runtime import clip
from pipedsl.runtime.assembly import StageSpec, assemble
from pipedsl.runtime.device_clock import ThreadStamps, compute_stamps
from pipedsl.runtime.discovery import Discovery
from pipedsl.runtime.executor import Executor, StepRedoneError, loss_ranks
from pipedsl.runtime.launch.errors import RankFailure, explain_peer_failure, record_failure
from pipedsl.runtime.options import KEYWORDS, PipelineOptions, with_keywords
from pipedsl.runtime.p2p import TensorMeta, describe
from pipedsl.runtime.precision import LossScaler, MixedPrecision
from pipedsl.runtime.reduce import Hook
from pipedsl.runtime.stage import LossFn
from pipedsl.runtime.tracer import Tracer
from pipedsl.steps import consecutive
from pipedsl.timeline import Timeline

_MAX_SHAPES = 8  # input shapes whose executors are kept (length bucketing alternates between a few)


class Pipeline:
    """Run a pipeline schedule over this rank's stages (see the module docstring)."""

    def __init__(self, stages: StageSpec, schedule: str | Schedule | None = "1f1b",
                 microbatches: int | None = None, loss_fn: LossFn | None = None, *,
                 program: Program | str | os.PathLike | None = None,
                 parallel: ParallelConfig | ParallelMesh | None = None,
                 options: PipelineOptions | None = None, **keywords: Any) -> None:
        """`options`: how it runs (options.py).  `keywords`: the older flat options (`precision=`, `recompute=`,
        `group=`, …, each setting the field `options.KEYWORDS` names) and the schedule's own parameters (`V=2`)."""
        self.options = with_keywords(options, keywords)
        if program is not None and self.options.schedule.params:
            raise PipeRuntimeError(_not_for_a_program(dict(self.options.schedule.params)))
        parts = assemble(stages, schedule, microbatches, loss_fn, program, parallel, self.options)
        # built once (assembly.py); from here on each piece is the pipeline's
        self.mesh, self.group, self.rank, self.size = parts.mesh, parts.group, parts.rank, parts.size
        self.program, self.device, self.loss_fn = parts.program, parts.device, loss_fn
        self._modules, self._stages, self._copies = parts.modules, parts.stages, parts.copies
        self.counter, self.loss, self.loss_scaling = parts.counter, parts.loss, parts.loss_scaling
        self.groups, self.channels, self._loss_group = parts.groups, parts.channels, parts.loss_group
        self.dp_group, self.data_parallel, self.ties = parts.dp_group, parts.data_parallel, parts.ties
        self.reducer, self.ownership = parts.reducer, parts.ownership
        # what running changes
        self.tracer = Tracer(self.group)
        self._optimizer = None
        self._checked_batch = False
        self._executor: Executor | None = None
        # by (microbatch shapes, forward only)
        self._executors: OrderedDict[tuple[tuple[TensorMeta, ...], bool], Executor] = OrderedDict()
        self._loss_ranks = loss_ranks(self.program)  # the ranks holding the last stage: they alone have losses to sum
        self._forward_program = self.program.forward_only()  # evaluation passes
        self.shape_handshakes = 0  # input shapes learned so far (one discovery step each, discovery.py)
        self.eval_count = 0  # the last evaluate()'s microbatches (or tokens, per-token mode) over the global batch
        self.steps = 0
        self.closed = False

    # ------------------------------------------------------------ the options and layout, as read before

    @property
    def parallel(self) -> ParallelConfig | None:
        return self.mesh.config if self.mesh is not None else None

    @property
    def dp(self) -> int:
        return self.mesh.config.dp if self.mesh is not None else 1

    @property
    def dp_rank(self) -> int:
        return self.mesh.coords.dp if self.mesh is not None else 0

    @property
    def num_microbatches(self) -> int:
        return self.program.num_microbatches

    @property
    def batch_mode(self) -> str:
        return self.options.batch

    @property
    def precision(self) -> MixedPrecision:
        return self.options.precision

    @property
    def recompute(self) -> str | None:
        return self.options.recompute.mode

    @property
    def lookahead(self) -> int:
        return self.options.schedule.lookahead

    @property
    def strict_pair_order(self) -> bool:
        """Receives may be posted ahead of sends to the same peer unless set: on NCCL each direction of a pair
        has a communicator of its own (nccl_model.LAYOUT), so no receive queues behind a send on one stream."""
        return self.options.schedule.strict_pair_order

    @property
    def check_finite(self) -> bool:
        """Refuse a non-finite loss, but under fp16 loss scaling: there it is an overflow like any other, and the
        step is skipped on every rank (torch.amp.GradScaler's behaviour) instead of failing the run."""
        return self.options.loss.check_finite and self.loss_scaling.scaler is None

    # ------------------------------------------------------------ public

    def local_stages(self) -> dict[int, nn.Module]:
        """{global stage index: module} for the stages this rank holds (one module per stage index)."""
        return dict(self._modules)

    def local_copies(self) -> dict[tuple[int, int], nn.Module]:
        """{(replica, stage): module} for every stage copy placed on this rank."""
        return {k: st.module for k, st in self._copies.items()}

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters, each once (a parameter tied between two local stages is one object)."""
        seen: set[int] = set()
        for m in self._modules.values():
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def register_reduce_grad_hook(self, hook: Hook) -> None:
        """`hook(stage, module)` after a stage's gradients are complete and reduced between replicas.

        It may return a handle with `.wait()` (e.g. an async all-reduce over a data-parallel
        group); handles are waited at the step end.  Hooks run at points the program fixes (a
        stage's REDUCE_GRAD, or the step end for a stage with copies on other ranks), so ranks
        running the same program call them in the same order: they may issue collectives.
        """
        self.reducer.add_hook(hook)

    def register_weight_pass_hook(self, stage: int, before: Callable[[], None], after: Callable[[], None],
                                  early: bool = False) -> None:
        """`before()` and `after()` around every W (weight-gradient pass) of local `stage` — e.g. ZeRO-3
        gathers the parameters W reads.  They run at W instructions, which every data-parallel peer runs in
        the same order, so they may issue collectives.  I then leaves every parameter's gradient to W, unless
        `early`: it computes the norms' and biases' as without hooks."""
        if stage not in self._stages:
            raise PipeRuntimeError(f"rank {self.rank} does not hold stage {stage}")
        self._stages[stage].add_weight_pass_hook(before, after, early)

    def optimizer(self, optimizer_class: Callable[..., torch.optim.Optimizer], **kwargs: Any):
        """The optimizer of this rank's stages: a `PipelineOptimizer` with `step()` and `zero_grad()`.

        The pipeline's data-parallel strategy (data_parallel.py) decides what it steps: without ZeRO
        and with fp32 parameters, `optimizer_class` over `parameters()`; under ZeRO 1-3 or with
        bf16/fp16 parameters, one `ZeroOptimizer` per local stage over the dp group, which takes
        the stage's parameters over now (so call this before the first step) and reduces its
        gradients at REDUCE_GRAD.  `no_decay=` kinds of parameters weight decay spares ("biases", "norms",
        "embeddings"; parallel/weight_decay.py), default none: torch's optimizers decay every one.
        """
        from pipedsl.runtime.optim import PipelineOptimizer

        if self._optimizer is not None:
            raise PipeRuntimeError("this pipeline already has its optimizer (pipe.optimizer() makes one per pipeline)")
        if self.data_parallel.flat and self._executor is not None:
            raise PipeRuntimeError(f"{self.data_parallel.reason}: create the optimizer before the first step (it "
                                   f"takes over the stages' parameters)")
        self._optimizer = PipelineOptimizer(self, optimizer_class, **kwargs)
        return self._optimizer

    @property
    def peak_activations(self) -> int:
        """Most microbatch-stage activations alive at once on this rank during the last step."""
        return self.counter.peak

    def close(self) -> None:
        """Destroys the process groups this pipeline made (messages, loss, replicas, ties).

        Each gloo group keeps threads and sockets until it is destroyed, and a finished pipeline's
        reference cycles keep them alive until the garbage collector runs: a process that builds
        many pipelines should close each one.  Call it on every rank after its last step; a closed
        pipeline refuses further steps; its parameters, optimizer and last timeline stay usable.
        Also `with Pipeline(...) as pipe:`.
        """
        if not self.closed:
            self.closed = True
            self.channels.close()
            self.groups.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise PipeRuntimeError(f"rank {self.rank}: {what} on a closed pipeline (close() destroyed its process "
                                   f"groups); build a new Pipeline")

    def step(self, inputs: Any, targets: Any = None) -> float:
        """Run the schedule once over the batch; returns the mean loss (on every rank)."""
        self._check_open("step()")
        with self._failures_told():
            self._train_pass(inputs, targets, self._reduce_loss)
            total, work = self._loss_reduction
            try:
                work.wait()
                if self.dp > 1:  # the mean over the replicas' shares of the global batch
                    dist.all_reduce(total, group=self.mesh.dp_group)
                    total /= self.dp
            except Exception as err:  # noqa: BLE001
                raise RankFailure(f"rank {self.rank}: summing the loss over ranks failed: {err}", self.rank,
                                  peer_failure=True) from err
        self.steps += 1
        return float(total.item())

    def _train_pass(self, inputs: Any, targets: Any, on_loss: Callable[[torch.Tensor], None] | None = None,
                    gate: Callable[[], bool] | None = None) -> torch.Tensor:
        """One run of the training program over the batch (`step` without the loss's reduction and the step
        count); returns this rank's loss sum.  `gate`: `Executor.run`'s (post_validate.py), called before the
        pass when its shapes are new (a `Discovery` learns them with every peer and cannot be undone)."""
        if self.loss_reduction == "token":
            self._count_tokens(targets)
        mb_inputs, tgt = self._microbatches(inputs, targets)
        shapes = tuple(tuple(TensorMeta.of(t) for t in x) for x in mb_inputs)
        if gate is not None and (shapes, False) not in self._executors:
            if not gate():
                raise StepRedoneError()
            gate = None
        ex = self._use_shapes(shapes)
        self.counter.reset()
        self.reducer.start_step()
        self._scale_loss()
        loss_sum = ex.run(mb_inputs, tgt, on_loss, gate)
        self._learned(ex, shapes)
        return loss_sum

    def _microbatches(self, inputs: Any, targets: Any) -> tuple[list[list[torch.Tensor]], list[Any]]:
        """This rank's share of the batch (dp) cut into the M microbatches, on the device."""
        if self.data_parallel.flat and self._optimizer is None:
            raise PipeRuntimeError(f"{self.data_parallel.reason}: create the optimizer with pipe.optimizer("
                                   f"torch.optim.Adam, lr=...) before the first step (it takes over the stages' "
                                   f"parameters: flat buffers, sharded over dp by ZeRO)")
        M = self.num_microbatches
        if self.parallel is not None:
            inputs, targets = self._data_parallel_share(inputs, targets)
        uneven = self.loss_reduction == "token"
        mb_inputs = [list(x) for x in zip(*(_split(t, M, "inputs", self.rank, uneven) for t in _tensors(inputs)))]
        tgt = [_to(t, self.device) for t in _split_any(targets, M, self.rank, uneven)]
        return [[_to(t, self.device) for t in x] for x in mb_inputs], tgt

    @contextlib.contextmanager
    def _failures_told(self) -> Iterator[None]:
        """A failure of this rank is recorded for the others; one caused by another rank names that rank."""
        try:
            yield
        except RankFailure as err:
            if err.peer_failure:
                raise explain_peer_failure(err) from err
            record_failure(self.rank, err.message)
            raise
        except PipeDSLError as err:
            record_failure(self.rank, err.message)
            raise

    def evaluate(self, inputs: Any, targets: Any = None) -> float:
        """The batch's mean loss without training: a forward-only pass (no autograd graph, no gradient, no
        optimizer step, no step count, dropout off), on every rank.  Same batch rules as `step`.

        The mean is over the same units as the training loss — microbatches (each a mean), or every
        target != ignore_index of the global batch (loss_reduction="token") — and the number of them
        is `self.eval_count` afterwards, so batches combine exactly: sum(loss_i·count_i)/sum(count_i).
        Collective: every rank of the world calls it with its batch, like `step`."""
        self._check_open("evaluate()")
        modes = {m: m.training for m in self._modules.values()}
        try:
            with self._failures_told():
                mb_inputs, tgt = self._microbatches(inputs, targets)
                shapes = tuple(tuple(TensorMeta.of(t) for t in x) for x in mb_inputs)
                ex = self._use_shapes(shapes, forward_only=True)
                for m in modes:
                    m.eval()
                loss_sum = ex.run(mb_inputs, tgt)
                self._learned(ex, shapes, forward_only=True)
                totals = torch.tensor([float(loss_sum), float(ex.counted)], dtype=torch.float64, device=self.device)
                try:
                    self.channels.sum_over(totals, self._loss_ranks, group=self._loss_group)
                    if self.dp > 1:
                        dist.all_reduce(totals, group=self.mesh.dp_group)
                except Exception as err:  # noqa: BLE001
                    raise RankFailure(f"rank {self.rank}: summing the evaluation loss over ranks failed: {err}",
                                      self.rank, peer_failure=True) from err
        finally:
            for m, training in modes.items():
                m.train(training)
        self.eval_count = int(totals[1])
        return float(totals[0] / max(totals[1], 1.0))

    # ------------------------------------------------------------ gradients: norm, clipping, fp16 scaling

    def _scale_loss(self) -> None:
        """fp16: this step's loss is multiplied by the current scale (its gradients are unscaled by `unscale_`)."""
        self.loss.loss_scale = self.loss_scaling.begin_step()

    @property
    def scaler(self) -> LossScaler | None:
        """fp16's dynamic loss scale (`loss_scaling` owns it), or None."""
        return self.loss_scaling.scaler

    def _norm_group(self) -> dist.ProcessGroup | None:
        return None if self.mesh is not None else self.group  # the whole world under parallel=

    def gradients(self) -> clip.Gradients:
        """This rank's gradients as its optimizer will use them (ZeRO: the owned slices, after the step's
        reduction) and the views it counts in global norms (runtime/clip.py)."""
        return self.data_parallel.gradients(self.ownership)

    def unscale_(self) -> bool:
        """fp16: divide this step's gradients by the loss scale, once; returns whether any rank of the world
        found an inf/NaN (then every rank skips the step).  Collective; no-op (False) without loss scaling."""
        return self.loss_scaling.unscale_(self._stepped, self._norm_group(), self.device)

    def update_scale(self) -> None:
        """fp16: after the optimizer step (or its skip), grow or back off the loss scale, once per step.
        `pipe.optimizer()`'s step calls it; with an optimizer of your own: `if not pipe.unscale_():
        optimizer.step()`, then `pipe.update_scale()`."""
        self.loss_scaling.update(self._stepped, self._norm_group(), self.device)

    def _stepped(self) -> list[torch.Tensor]:
        return self.gradients().stepped

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The whole model's gradient norm (every stage, tp shard, ZeRO slice, tie and replica once), the
        same on every rank; collective over the world.  fp16: of the unscaled gradients."""
        self.unscale_()
        return clip.global_norm(self.gradients().counted, norm_type, self._norm_group(), self.device)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over the whole pipelined model: returns the global norm (before
        clipping, the same on every rank) and scales every gradient by min(1, max_norm / (norm + 1e-6)).
        Call on every rank after `step()`, before the optimizer step; fp16: unscales first, and an overflowed
        step (norm inf/NaN) is left for the optimizer to skip.  Collective over the world."""
        self.unscale_()
        grads = self.gradients()
        norm = clip.global_norm(grads.counted, norm_type, self._norm_group(), self.device)
        if torch.isfinite(norm):
            clip.clip_(grads.stepped, norm, float(max_norm))
        return norm

    def _count_tokens(self, targets: Any) -> None:
        """Per-token mode: the last stage's ranks count the targets of the global batch (loss.py)."""
        if self.program.num_stages - 1 in self._stages:
            local = self.batch_mode == "local" and self.dp > 1
            self.loss.count_tokens(targets, self.dp, self.mesh.dp_group if local else None, self.rank, self.device)

    @property
    def tokens(self) -> int | None:
        """Per-token mode: the last step's targets != ignore_index over the global batch (last-stage ranks)."""
        return self.loss.tokens

    @property
    def loss_reduction(self) -> str:
        return self.loss.reduction

    @property
    def ignore_index(self) -> int:
        return self.loss.ignore_index

    def _reduce_loss(self, loss_sum: torch.Tensor) -> None:
        """Start summing the loss over the pipeline once this rank's step is done (the executor calls it after its
        last instruction: no collective of the pipeline group spans the step's messages, runtime/executor.py);
        over the sockets the last stage's ranks send theirs and only they wait for each other."""
        total = loss_sum.to(self.device, copy=True)
        self._loss_reduction = (total, self.channels.sum_over(total, self._loss_ranks, group=self._loss_group,
                                                              async_op=True))

    def _data_parallel_share(self, inputs: Any, targets: Any) -> tuple[Any, Any]:
        """This dp replica's samples (batch="global") or the local batch as given; checks the sizes."""
        cfg, M, d, dp = self.parallel, self.num_microbatches, self.dp_rank, self.dp
        ins = _tensors(inputs)
        tgts = [] if targets is None else _tensors(targets) if isinstance(targets, (tuple, list)) else [targets]
        glob = self.batch_mode == "global"
        uneven = self.loss_reduction == "token"  # microbatches may differ by a sample (see _split)
        parts = dp * M if glob else M
        for what, t in [*(("inputs", t) for t in ins), *(("targets", t) for t in tgts)]:
            if not isinstance(t, torch.Tensor):
                raise PipeRuntimeError(f"targets is a {type(t).__name__}; pass a tensor, a tuple of tensors or None")
            n = t.shape[0] if t.dim() else None
            if n is not None and uneven and (n % dp == 0 or not glob) and n // (dp if glob else 1) >= M:
                share = n // dp if glob else n
                sizes = {share // M, -(-share // M)}
            elif n is None or n % parts:
                size = "a scalar" if n is None else f"batch size {n} (dim 0)"
                if uneven:
                    need = "give every microbatch a sample" + (f" after splitting evenly over dp={dp}" if glob else "")
                    raise PipeRuntimeError(f"rank {dist.get_rank()}: {what} with {size} do not split: the batch must "
                                           f"{need} (dp={dp}, M={M})")
                if glob:
                    raise PipeRuntimeError(
                        f"rank {dist.get_rank()}: {what} with {size} do not split into dp*M = {dp}*{M} = {parts} "
                        f"equal microbatches (batch='global': every rank passes the global batch, each dp replica "
                        f"trains on 1/{dp} of it; loss_reduction='token' allows unequal microbatches)")
                raise PipeRuntimeError(f"rank {dist.get_rank()}: {what} with {size} do not split into M={M} equal "
                                       f"microbatches (batch='local': this dp replica's own samples; "
                                       f"loss_reduction='token' allows unequal microbatches)")
            else:
                sizes = {n // parts}
            if cfg.tp_mode == "3d" and any(k % (cfg.q ** 2) for k in sizes):
                shown = " or ".join(map(str, sorted(sizes)))
                raise PipeRuntimeError(f"rank {dist.get_rank()}: microbatches of {shown} samples ({what}) "
                                       f"are not divisible by q*q={cfg.q ** 2} (3-D tensor parallelism splits every "
                                       f"microbatch over q^2 ranks)")
        if not self._checked_batch:
            self._check_same_data(ins, tgts)
            self._checked_batch = True
        if not glob or dp == 1:
            return inputs, targets

        def share(t: torch.Tensor) -> torch.Tensor:
            n = t.shape[0] // dp
            return t[d * n:(d + 1) * n]

        inputs = tuple(map(share, ins)) if isinstance(inputs, (tuple, list)) else share(inputs)
        if targets is not None:
            targets = tuple(map(share, tgts)) if isinstance(targets, (tuple, list)) else share(targets)
        return inputs, targets

    def _check_same_data(self, ins: list[torch.Tensor], tgts: list[torch.Tensor]) -> None:
        """First step: ranks that consume the same samples were given the same samples.

        The inputs of every rank holding stage 0, the targets of every rank holding the last
        stage — all such ranks for batch="global", those of one dp replica for "local".  One
        all-gather over the world; every rank reaches the same verdict, so all stop at once.
        """
        prog, rank = self.program, self.rank
        held = {s for (_, s), r in prog.placement.items() if r == rank}
        first = [_fingerprint(t) for t in ins] if 0 in held else None
        last = [_fingerprint(t) for t in tgts] if prog.num_stages - 1 in held else None
        key = self.dp_rank if self.batch_mode == "local" else 0
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (key, first, last, dist.get_rank()))
        for what, k in (("inputs", 1), ("targets", 2)):
            seen: dict[int, tuple] = {}
            for item in everyone:
                if item[k] is None:
                    continue
                r0, fp0 = seen.setdefault(item[0], (item[3], item[k]))
                if item[k] == fp0:
                    continue
                if self.batch_mode == "global":
                    hint = ("batch='global' expects the same global batch on every rank (each dp replica takes its "
                            "share); with a data loader that shards by dp rank, pass batch='local'")
                else:
                    hint = ("batch='local' expects the same samples on every pp and tp rank of one dp replica; "
                            "shard the data by the dp rank only (mesh.coords.dp)")
                raise PipeRuntimeError(f"ranks {r0} and {item[3]} passed different {what}: {hint}")

    @property
    def timed_steps(self) -> int:
        """How many of the last steps `timeline(steps=)` can draw: 2 after two at the same input shapes, else 1."""
        return 2 if self._executor is not None and self._executor.previous is not None else 1

    def timeline(self, steps: int = 1, cpu_work: bool = False) -> Timeline | None:
        """The last step's measured timeline, on the group's first rank (collective: call on all ranks).  `steps=2`:
        the last two, as `pipedsl.steps.consecutive(program, 2)` (where post-validated steps overlap:
        runtime/post_validate.py); they must have run at the same input shapes.  On a GPU each compute op is
        where the device ran it.  `cpu_work`: on the CPU with one intra-op thread, each compute op ends the CPU
        time it took after its start (runtime/device_clock.py's `ThreadStamps`: what a loaded machine's other
        processes do not stretch, as `pipedsl train --schedule auto` profiles; a stage that sleeps reads as none)."""
        ex = self._executor
        if ex is None:
            raise PipeRuntimeError("no step has run yet")
        if steps not in (1, 2):
            raise PipeRuntimeError(f"timeline(steps=) is 1 or 2, got {steps!r}")
        if steps > self.timed_steps:
            raise PipeRuntimeError("timeline(steps=2) needs the last two steps at the same input shapes")
        meta = {"wait_s": ex.wait_time, "peak_activations": self.counter.peak,
                "recv_buffers": self.channels.pool.allocated}
        stamps = ex.device_stamps
        if isinstance(stamps, ThreadStamps) and not cpu_work:
            stamps = None
        starts, ends = stamps.times(ex.starts, ex.ends) if stamps is not None else (ex.starts, ex.ends)
        program = self.program
        if steps == 2:
            assert ex.previous is not None
            before = stamps.times(*ex.previous, previous=True) if stamps is not None else ex.previous
            starts, ends = before[0] + starts, before[1] + ends
            program = consecutive(program, 2)
        if stamps is not None:
            meta["compute_clock"] = stamps.clock
        return self.tracer.gather(program, self.rank, starts, ends, meta)

    # ------------------------------------------------------------ shapes

    def _use_shapes(self, meta: tuple[tuple[TensorMeta, ...], ...], forward_only: bool = False) -> Executor:
        """The executor for this step's microbatch shapes: a cached one, or for a new shape a `Discovery`
        (discovery.py) that learns the shapes while it runs the step (then `_learned` caches the executor).

        Shapes may change between steps (a last partial batch, length bucketing).  Every rank of
        the pipeline agrees on them (`Channels.open_step`: a fingerprint of them sent to every peer,
        checked before the step first waits for a peer; a step at a known shape does not wait for
        the others to start), so a rank passed other shapes than its peers is a named error on every
        rank, never a receive one side waits for.  Executors of the last few shapes are kept (the
        same on every rank, since every rank saw the same agreed sequence), so every rank meets a
        new shape in the same step, and returning to a known shape costs nothing but the agreement.
        `meta`: per microbatch, its tensors' shapes (they differ by a sample when the batch does not
        split evenly: loss_reduction="token").  `forward_only`: the evaluation pass's executor (not
        the training one), sharing the shapes learned by either."""
        ex = self._executors.get((meta, forward_only))
        known = self._executors.get((meta, not forward_only))  # the other pass's executor: its shapes are learned
        description = " | ".join(map(describe, dict.fromkeys(meta)))
        self.channels.open_step(_shape_key(meta), description, wait=ex is None and known is None)
        if ex is None:
            if known is None:
                kinds_of = list(dict.fromkeys(meta))  # distinct microbatch shapes, in order (the same on every rank)
                ex = self._make_executor({}, {}, [kinds_of.index(m) for m in meta], forward_only, Discovery)
            else:
                ex = self._cache(meta, forward_only, known.in_meta, known.out_meta, known.kinds)
        else:
            self._executors.move_to_end((meta, forward_only))
        if not forward_only:
            self._executor = ex
        return ex

    def _learned(self, ex: Executor, meta: tuple[tuple[TensorMeta, ...], ...], forward_only: bool = False) -> None:
        """After a step run by a `Discovery`: the executor for its shapes, from what it learned."""
        if isinstance(ex, Discovery):
            self._cache(meta, forward_only, ex.in_meta, ex.out_meta, ex.kinds)
            self.shape_handshakes += 1

    def _cache(self, meta: tuple[tuple[TensorMeta, ...], ...], forward_only: bool, in_meta: dict, out_meta: dict,
               kinds: list[int]) -> Executor:
        ex = self._executors[(meta, forward_only)] = self._make_executor(in_meta, out_meta, kinds, forward_only)
        if len(self._executors) > _MAX_SHAPES:
            self._executors.popitem(last=False)
            received = {m for e in self._executors.values() for metas in (*e.in_meta.values(),
                                                                          *e.grad_meta.values()) for m in metas}
            self.channels.trim(received)  # the evicted shape's buffers go with it
        return ex

    def _make_executor(self, in_meta: dict, out_meta: dict, kinds: list[int], forward_only: bool,
                       kind: type[Executor] = Executor) -> Executor:
        if not forward_only:
            return kind(self.program, self.rank, self._copies, self.channels, self.reducer, in_meta, out_meta,
                        self.lookahead, self.strict_pair_order, self.check_finite, kinds,
                        device_stamps=compute_stamps([i.op for i in self.program.ranks[self.rank]], self.device))
        if self.loss_reduction == "token":
            def count(target: Any) -> int:
                t = target[0] if isinstance(target, (tuple, list)) else target
                return int((t != self.ignore_index).sum())
        else:
            def count(target: Any) -> int:
                return 1
        return kind(self._forward_program, self.rank, self._copies, self.channels, self.reducer, in_meta,
                    out_meta, self.lookahead, self.strict_pair_order, False, kinds, count=count)


def _shape_key(metas: tuple[tuple[TensorMeta, ...], ...]) -> int:
    """A 63-bit fingerprint of the microbatches' shapes and dtypes, the same in every process (no salted hash)."""
    text = "|".join(";".join(f"{tuple(m.shape)}/{m.dtype}" for m in meta) for meta in metas).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def _fingerprint(t: torch.Tensor) -> tuple:
    """Shape, dtype and two sums: equal tensors give equal fingerprints, different ones almost never."""
    flat = t.detach().reshape(-1).to("cpu", torch.float64)
    w = torch.arange(flat.numel(), dtype=torch.float64).remainder_(7919).add_(1)
    return tuple(t.shape), str(t.dtype), float(flat.sum()), float((flat * w).sum())


def _tensors(x: Any) -> list[torch.Tensor]:
    items = list(x) if isinstance(x, (tuple, list)) else [x]
    for k, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise PipeRuntimeError(f"inputs[{k}] is a {type(t).__name__}; pass a tensor or a tuple of tensors")
    return items


def _split(t: torch.Tensor, M: int, what: str, rank: int, uneven: bool = False) -> list[torch.Tensor]:
    """M microbatches along dim 0: equal, or with `uneven` (per-token loss) sizes differing by at most one
    (a last partial batch), as `torch.tensor_split` cuts them."""
    if uneven and t.dim() and t.shape[0] >= M:
        return list(t.tensor_split(M, dim=0))
    if t.dim() == 0 or t.shape[0] % M:
        n = t.shape[0] if t.dim() else "a scalar"
        hint = "" if uneven else "; loss_reduction='token' allows unequal microbatches"
        raise PipeRuntimeError(f"rank {rank}: {what} with batch size {n} (dim 0) do not split into "
                               f"M={M} {'microbatches of at least one sample' if uneven else 'equal microbatches'}"
                               f"{hint}")
    return list(t.chunk(M, dim=0))


def _to(x: Any, device: torch.device) -> Any:
    """`x` (a tensor or a tuple of them) on `device`, the host going on while it copies: staged in pinned memory,
    since a copy from pageable host memory to a GPU makes the host wait for the kernels already queued (the
    previous step's optimizer), whatever `non_blocking` says."""
    if isinstance(x, torch.Tensor):
        if x.device.type == "cpu" and device.type == "cuda":
            x = x.pin_memory()
        return x.to(device, non_blocking=True)
    if isinstance(x, tuple):
        return tuple(_to(t, device) for t in x)
    return x


def _split_any(targets: Any, M: int, rank: int, uneven: bool = False) -> list[Any]:
    if targets is None:
        return [None] * M
    if isinstance(targets, torch.Tensor):
        return _split(targets, M, "targets", rank, uneven)
    if isinstance(targets, (tuple, list)):
        parts = [_split(t, M, "targets", rank, uneven) for t in _tensors(targets)]
        return [tuple(p[m] for p in parts) for m in range(M)]
    raise PipeRuntimeError(f"targets is a {type(targets).__name__}; pass a tensor, a tuple of tensors or None")


def _not_for_a_program(params: dict[str, int]) -> str:
    """A compiled program= has its schedule's parameters already: any other keyword is a mistake (most often
    a misspelled option, which would otherwise do nothing)."""
    import difflib
    import inspect

    explicit = inspect.signature(Pipeline.__init__).parameters
    options = [n for n in explicit if n not in ("self", "keywords")] + list(KEYWORDS)
    words = []
    for name in sorted(params):
        close = difflib.get_close_matches(name, options, n=1)
        words.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (f"Pipeline(program=...) takes no schedule parameters, the program was compiled with its own: "
            f"unexpected keyword argument{'s' if len(words) > 1 else ''} {', '.join(words)}")
