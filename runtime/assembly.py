"""A `Pipeline`'s parts, built once from its arguments: the program, the mesh and process groups, this rank's
stages, the channels, the gradient reducers and the step-end reductions (finalize.py).

`assemble` returns them as one `Parts`; `Pipeline` (pipeline.py) takes them over and runs them.  Building
is collective (the mesh's and the pipeline's groups, the replicas' and ties' broadcasts, the ep check), in
the same order on every rank, so every rank of the world builds its pipeline at the same time.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipedsl.compiler import Schedule
from pipedsl.errors import PipeRuntimeError
from pipedsl.ir import Program
from pipedsl.library import load
from pipedsl.nccl_model import edges
from pipedsl.parallel.config import ParallelConfig, ParallelConfigError
from pipedsl.parallel.expert import ExpertParallel, shard_experts_over, why_no_experts
from pipedsl.parallel.mesh import ParallelMesh
from pipedsl.runtime import clip, finalize
from pipedsl.runtime.data_parallel import Flat, Replicated, strategy_for
from pipedsl.runtime.groups import PipelineGroups
from pipedsl.runtime.keys import Copy
from pipedsl.runtime.loss import LossPolicy
from pipedsl.runtime.options import PipelineOptions
from pipedsl.runtime.p2p import Channels
from pipedsl.runtime.precision import LossScaling, MixedPrecision
from pipedsl.runtime.recompute import Recompute
from pipedsl.runtime.reduce import GradReducer
from pipedsl.runtime.stage import ActivationCounter, LossFn, Stage, StageOptions
from pipedsl.runtime.ties import Tie, TieReducer, check_ties, find_ties
from pipedsl.validate import validate

StageSpec = Sequence[nn.Module] | Callable[[int], nn.Module]


@dataclass(frozen=True)
class Parts:
    """What one rank's pipeline is made of (`Pipeline` keeps each under the same name, `_modules` … for the
    private ones)."""

    mesh: ParallelMesh | None
    group: dist.ProcessGroup | None  # the program's ranks: the mesh's pp group under parallel=
    rank: int
    size: int
    program: Program
    device: torch.device
    modules: dict[int, nn.Module]  # {stage: module}, one module per stage index held here
    stages: dict[int, Stage]
    copies: dict[Copy, Stage]  # every (replica, stage) copy placed here, on its stage's Stage
    counter: ActivationCounter
    loss: LossPolicy  # one, shared by the stages
    loss_scaling: LossScaling
    groups: PipelineGroups
    channels: Channels
    loss_group: dist.ProcessGroup | None  # the step's loss sum, reduced while the step runs
    dp_group: dist.ProcessGroup | None
    data_parallel: Replicated | Flat  # the gradients' owner
    ties: TieReducer
    reducer: GradReducer
    ownership: clip.GradientOwnership


def assemble(stages: StageSpec, schedule: str | Schedule | None, microbatches: int | None, loss_fn: LossFn | None,
             program: Program | str | os.PathLike | None, parallel: ParallelConfig | ParallelMesh | None,
             options: PipelineOptions) -> Parts:
    """This rank's parts of the pipeline (see `Pipeline`); collective over the world."""
    if not dist.is_initialized():
        raise PipeRuntimeError("torch.distributed is not initialised: start the ranks with "
                               "pipedsl.launch(fn, nprocs) or torchrun")
    mesh = _mesh(parallel, options.group)
    group = mesh.pp_group if mesh is not None else options.group
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    program = _program(schedule, program, microbatches, options.schedule.params, size, mesh)
    device = _device(options.device, group)
    held = sorted({s for (c, s), r in program.placement.items() if r == rank})
    modules = {s: _module(stages, s, program, rank).to(device) for s in held}
    if mesh is not None and mesh.config.ep > 1:
        _shard_left_experts(modules, mesh)
        _check_expert_peers(modules, mesh, program)
    counter = ActivationCounter(count_bytes=options.activation_bytes)
    loss = LossPolicy(options.loss.reduction, program.num_microbatches, options.loss.ignore_index)
    on_stage = StageOptions(options.precision, device, options.schedule.overlap, release=program.split_backward)
    rec = options.recompute
    built = {s: Stage(m, s, program.num_stages, loss_fn, program.num_microbatches, counter,
                      None if rec.mode is None else Recompute(m, rec.mode, rec.filter), options=on_stage, loss=loss)
             for s, m in modules.items()}
    copies = {Copy(c, s): built[s] for (c, s), r in program.placement.items() if r == rank}
    loss_scaling = LossScaling(options.precision)
    groups = PipelineGroups(group, mesh)
    channels = Channels(group, device, groups, edges(program))
    loss_group = groups.new(range(size))
    dp = mesh.config.dp if mesh is not None else 1
    dp_group = mesh.dp_group if mesh is not None else _solo_group(groups, options.precision, rank, size)
    data_parallel = strategy_for(mesh.config if mesh is not None else None, options.precision, dp_group, dp)
    found = _found_ties(stages, options.ties, program.num_stages)
    ties = TieReducer(found, program, rank, modules, groups, dp, data_parallel.level, flat=data_parallel.flat)
    if found:
        ties.agree(group, size)
    data_parallel.check_program(program)
    reducer = GradReducer(program, rank, modules, groups, ties)
    dp_rank = mesh.coords.dp if mesh is not None else 0
    ownership = clip.GradientOwnership(program, rank, modules, ties.names, dp_rank, data_parallel.level)
    tp, tp_group = (mesh.config.tp, mesh.tp_group) if mesh is not None else (1, None)
    finalize.install(reducer, ties, data_parallel, modules, tp=(tp, tp_group), dp=(dp, dp_group))
    return Parts(mesh, group, rank, size, program, device, modules, built, copies, counter, loss, loss_scaling,
                 groups, channels, loss_group, dp_group, data_parallel, ties, reducer, ownership)


def _mesh(parallel: ParallelConfig | ParallelMesh | None, group: dist.ProcessGroup | None) -> ParallelMesh | None:
    if parallel is None:
        return None
    if group is not None:
        raise PipeRuntimeError("pass parallel= (the pipeline then runs on its pp group) or group=, not both")
    if isinstance(parallel, ParallelMesh):
        return parallel
    if not isinstance(parallel, ParallelConfig):
        raise PipeRuntimeError(f"parallel= takes a ParallelConfig or a ParallelMesh, got {type(parallel).__name__}")
    return ParallelMesh(parallel)  # checks world size = dp*pp*tp before any group exists


def _program(schedule: str | Schedule | None, program: Program | str | os.PathLike | None,
             microbatches: int | None, params: Mapping[str, int], size: int, mesh: ParallelMesh | None) -> Program:
    if program is not None:
        program = _as_program(program)  # a Program, or a program file (JSON/CSV/text): validated here
        if microbatches is not None and microbatches != program.num_microbatches:
            raise PipeRuntimeError(f"microbatches={microbatches}, but the program was compiled for "
                                   f"M={program.num_microbatches}")
    else:
        if microbatches is None:
            raise PipeRuntimeError("Pipeline needs microbatches=M (or a compiled program=)")
        sched = schedule if isinstance(schedule, Schedule) else load(schedule or "1f1b")
        program = sched.compile(P=size, M=microbatches, **params)
    if program.num_ranks != size and mesh is not None:
        c = mesh.config
        raise ParallelConfigError(f"the program {program.name!r} has P={program.num_ranks} ranks, but the "
                                  f"parallel layout has pp={c.pp} (dp*pp*tp = {c.dp}*{c.pp}*{c.tp}); compile "
                                  f"the schedule with P=pp")
    if program.num_ranks != size:
        raise PipeRuntimeError(f"the program {program.name!r} has {program.num_ranks} ranks, but the process "
                               f"group has {size}")
    return program


def _as_program(program: Any) -> Program:
    """`program=`: a `Program`, or a path to a program file (JSON, CSV or text; see program_file.py), validated."""
    if isinstance(program, Program):
        return validate(program)
    if isinstance(program, (str, os.PathLike)):
        from pipedsl.runtime.program_file import read_program

        return read_program(program)
    raise PipeRuntimeError(f"program= takes a Program or the path of a program file (JSON, CSV or text), "
                           f"got {type(program).__name__}")


def _device(device: torch.device | str | None, group: dist.ProcessGroup | None) -> torch.device:
    """`device`, by default the current CUDA device under NCCL (else the CPU), made autograd's current device."""
    backend = dist.get_backend(group)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)  # the current device of autograd's threads (cuBLAS's context)
    return device


def _module(stages: StageSpec, s: int, program: Program, rank: int) -> nn.Module:
    """Global stage `s`'s module: built by the callable, or taken from the list of every stage's."""
    if callable(stages) and not isinstance(stages, (nn.Module, Sequence)):
        module = stages(s)
    else:
        if isinstance(stages, nn.Module) and not isinstance(stages, (nn.ModuleList, nn.Sequential)):
            raise PipeRuntimeError("stages must be a list of modules (one per stage) or a callable "
                                   "stage -> module; split a model with pipedsl.models.split")
        if len(stages) != program.num_stages:
            raise PipeRuntimeError(
                f"rank {rank}: the model has {len(stages)} stage(s), but schedule {program.name!r} with "
                f"{', '.join(f'{k}={v}' for k, v in program.params.items())} has {program.num_stages} stages")
        module = stages[s]
    if not isinstance(module, nn.Module):
        raise PipeRuntimeError(f"rank {rank}: stage {s} is a {type(module).__name__}, not an nn.Module")
    return module


def _shard_left_experts(modules: dict[int, nn.Module], mesh: ParallelMesh) -> None:
    """Experts modules the caller left whole under ep > 1, sharded here as before, with a pointer to where that
    belongs now: the model source's parallelize.py (`parallelize_gpt`, `parallelize_hf`) or, for any module,
    `shard_experts_over(stages, mesh)` (docs/parallelism.md)."""
    left = shard_experts_over(modules.values(), mesh)
    if left:
        warnings.warn(f"Pipeline sharded {left} experts module(s) over ep={mesh.config.ep} itself; shard them "
                      f"before: pipedsl.models.gpt.parallelize.parallelize_gpt, pipedsl.models.hf.parallelize."
                      f"parallelize_hf, or pipedsl.parallel.expert.shard_experts_over(stages, mesh) for any module",
                      DeprecationWarning, stacklevel=4)


def _check_expert_peers(modules: dict[int, nn.Module], mesh: ParallelMesh, program: Program) -> None:
    """Refuse, on every rank, ep peers that would exchange tokens at different points — another program, or
    other MoE layers on a stage (stages built differently per replica) — which would hang in an all-to-all.
    Equal programs and layers are what makes every exchange matched (docs/parallelism.md).  Gathered over
    the world, so that the ranks of groups that agree stop too."""
    layers = {s: [f"{name or '<stage>'} ({m.num_experts} experts)" for name, m in module.named_modules()
                  if isinstance(m, ExpertParallel)] for s, module in sorted(modules.items())}
    mine = (dist.get_process_group_ranks(mesh.ep_group),
            hashlib.sha256(program.to_text().encode()).hexdigest()[:16], program.name, layers)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if not any(found for *_, stages in everyone for found in stages.values()):  # ep over dense stages
        why = "; ".join(dict.fromkeys(why_no_experts(m) for m in modules.values()))
        raise PipeRuntimeError(f"expert parallelism: ep={mesh.config.ep} shards nothing, no stage holds "
                               f"an experts module pipedsl can shard: {why}")
    for rank, (ranks, key, name, stages) in enumerate(everyone):
        first = ranks[0]
        _, key0, name0, stages0 = everyone[first]
        if (key, stages) == (key0, stages0):
            continue
        if key != key0:
            what = f"rank {first} runs {name0}, rank {rank} runs {name} (another program)"
        else:
            s = next(s for s in stages if stages0.get(s) != stages[s])
            what = (f"stage {s} has MoE layers {stages0.get(s)} on rank {first} and {stages[s]} on rank {rank} "
                    f"(stages built differently)")
        raise PipeRuntimeError(f"expert parallelism: the ranks {ranks} of an ep group would exchange tokens at "
                               f"different points — {what}; every rank of an ep group must run the same program "
                               f"with the same MoE layers on each stage")


def _solo_group(groups: PipelineGroups, precision: MixedPrecision, rank: int, size: int) -> dist.ProcessGroup | None:
    """Without a mesh, low-precision parameters still live in a `ZeroOptimizer` (stage 0): over a group of
    this rank alone (one per program rank, made collectively)."""
    if not precision.keeps_main:
        return None
    return [groups.new([r]) for r in range(size)][rank]


def _found_ties(stages: StageSpec, ties: Sequence[Sequence[tuple[int, str]]] | None, num_stages: int) -> list[Tie]:
    """Parameters shared between stages: named by `ties=`, or found in a list of stage modules."""
    if ties is not None:
        return check_ties(ties, num_stages)
    if isinstance(stages, Sequence) and len(stages) == num_stages:
        return find_ties(stages)
    return []
