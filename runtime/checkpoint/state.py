"""Checkpoints of a pipelined training state: what each rank's part holds, and restoring it.

    from pipedsl.runtime import checkpoint

    checkpoint.save(pipe, "ckpt", step, optimizer, extra={"data": gen.get_state()})   # every rank
    restored = checkpoint.load(pipe, "ckpt", optimizer)   # the latest complete checkpoint in ckpt/
    start = restored.step                                # continue with step start + 1

The files themselves — finding them, writing them atomically, and the commit protocol by which a
checkpoint counts only once rank 0's manifest names every part — are runtime/checkpoint/files.py's;
what ZeRO's slices mean and how they are resharded is parallel/zero_checkpoint.py's.

Parameters and optimizer state are stored per *global stage* (keyed by stage and replica,
with names relative to the stage module), not per rank: a checkpoint loads under any
schedule with the same stage partition (same number of stages, same tensor names and
shapes per stage), whatever the placement — a rank loads each of its stages from whichever
part holds it.  Stages that know their tensors' names in the whole model (`model_name`:
models/split.py's stages, the HF stages) are recorded with them, and such a checkpoint also
loads into another partition — other cut points, another number of stages — each tensor found
by its whole-model name, its ZeRO slices reassembled and its expert shards joined first
(`_moves`, `_repartitioned`; not with tensor parallelism).  A different model is refused with
one clear error naming a tensor one side lacks or has in another shape.  RNG states (torch
CPU and CUDA, Python `random`, NumPy when imported) and `extra` are per rank: restored on
the same rank index when the checkpoint has one.  `shards` is a free-form per-rank section.
Each part also holds the training state a bit-exact resume needs: the fp16 loss scale and its
growth counter (`pipe.loss_scaling`, the same on every rank) and the learning-rate schedule of
`pipe.optimizer()`'s optimizer (a function of `pipe.steps`, which is restored too).

Data × pipeline × tensor parallelism (`Pipeline(parallel=…)`): save and load are collective
over the whole world, one part per rank (`rank-GLOBAL.pt`, with its (dp, pp, tp) coordinates)
and one manifest.  Stage state is keyed by (stage, tp coordinate); RNG and `extra` by the
rank's coordinates.  Without ZeRO the dp replicas are identical, so only dp rank 0 stores
stage state and every dp rank of any dp size loads it.  With ZeRO 1-3 (the optimizer from
`pipe.optimizer(…)`, which must be passed) every dp rank stores its slice of each unit's
flat parameters and optimizer state plus the unit layout (entry names, shapes, offsets,
padded size, dp size): under the same layout the slices are restored as they are (bit-exact
resume); under another dp size or ZeRO stage (or between ZeRO and plain optimizers) every
rank reassembles the full tensors from all saved slices and keeps its new slice — elementwise
optimizer state only (Adam, AdamW, SGD momentum; scalars such as `step` are copied), anything
else is refused naming the state.  Tensor-parallel DTensor stages (parallel/tp_hf.py) record
along which dimension each tensor splits (`tp_dims`): under another 1-D tp size every tensor and
elementwise optimizer state is put together from the saved tp ranks' shards and cut again for
this rank (`_retp`), as torch's distributed checkpoint reshards DTensors.  Layers that slice plain
tensors (the built-in GPT's, models/gpt/tp.py) and 3-D tp load only under the same tp size and
mode: another one is one `CheckpointError` on every rank.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from pipedsl.ir import Program
from pipedsl.parallel import zero_checkpoint
from pipedsl.parallel.config import ParallelConfig
from pipedsl.parallel.expert import expert_shards
from pipedsl.parallel.mesh import ParallelMesh
from pipedsl.parallel.zero import ZeroOptimizer
from pipedsl.parallel.zero_checkpoint import FullState, ReshardError, local_shard
from pipedsl.runtime.checkpoint.files import (
    FORMAT,
    MANIFEST,
    READABLE,
    VERSION,
    CheckpointError,
    CheckpointInfo,
    Commit,
    check,
    checkpoints,
    encode_part,
    fault_point,
    latest,
    part_coords,
    part_reader,
    resolve,
    saved_parallel,
    schedule_name,
    step_dir,
)
from pipedsl.runtime.data_parallel import Flat, Replicated
from pipedsl.runtime.launch.errors import RankFailure
from pipedsl.runtime.optim import PipelineOptimizer
from pipedsl.runtime.precision import LossScaling

__all__ = ["FORMAT", "MANIFEST", "READABLE", "VERSION", "CheckpointError", "CheckpointInfo", "Restored",
           "SavedModel", "check", "check_partition", "checkpoints", "describe_stage", "describe_stage_tensors",
           "fault_point", "fingerprint", "latest", "load", "loads_into", "model_differences", "read_model", "resolve",
           "save", "step_dir"]


@dataclass(frozen=True)
class Restored:
    """What `load` restored: continue training with step `step + 1`."""

    step: int
    path: Path
    extra: Any  # this rank's `extra`; without a part for this rank: dp rank 0's at its (pp, tp), else rank 0's
    shards: Any  # this rank's free-form shard section, or None
    saved_schedule: str  # e.g. "1F1B P=2 M=4"
    schedule_changed: bool  # the placement or the order differs from the saved program's
    rng_restored: bool  # False when the checkpoint has no part for this rank index (its (dp, pp, tp) coordinates)
    partition_changed: bool = False  # loaded into another stage partition, by the whole model's tensor names


# ------------------------------------------------------------------ partition


def describe_stage(module: nn.Module) -> dict[str, list]:
    """{state_dict name: [shape, dtype]} of one stage module: what must match to load it."""
    return {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in module.state_dict().items()}


def fingerprint(stages: dict[int, dict[str, list]]) -> str:
    """A short hash of a stage partition (every stage's tensor names, shapes and dtypes)."""
    text = json.dumps([[s, stages[s]] for s in sorted(stages)], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_partition(manifest: dict[str, Any], stages: dict[int, nn.Module], num_stages: int,
                    where: str = "this pipeline", *, tp: int = 0,
                    described: dict[int, dict[str, list]] | None = None) -> None:
    """Raise `CheckpointError` unless `stages` ({global stage: module}) match the saved partition.

    `tp`: this rank's tensor-parallel coordinate (its shards are compared with the saved ones of the
    same coordinate); `described`: the stages' descriptions when not `describe_stage` (ZeRO owns the
    parameters of its stages)."""
    part = manifest["partition"]
    if part["num_stages"] != num_stages:
        raise CheckpointError(
            f"the checkpoint (step {manifest['step']}, {schedule_name(manifest)}) has {part['num_stages']} stages, "
            f"{where} has {num_stages}: a checkpoint loads only into the same stage partition")
    if tp and "tp_stages" in part:
        saved = {int(k.split("/")[0]): d for k, d in part["tp_stages"].items() if int(k.split("/")[1]) == tp}
    else:
        saved = {int(s): d for s, d in part["stages"].items()}
    for s, module in sorted(stages.items()):
        have, want = (described[s] if described is not None else describe_stage(module)), saved[s]
        if have == want:
            continue
        missing = sorted(set(want) - set(have))
        unexpected = sorted(set(have) - set(want))
        if missing or unexpected:
            what = (f"is missing {missing[0]!r}" if missing else f"has {unexpected[0]!r}, which the checkpoint lacks")
        else:
            name = next(k for k in want if want[k] != have[k])
            what = f"has {name!r} as {_shape(have[name])}, the checkpoint as {_shape(want[name])}"
        at = f" at tp rank {tp}" if tp else ""
        raise CheckpointError(f"stage {s} of {where}{at} {what}: a different stage partition than the checkpoint's "
                              f"(step {manifest['step']}, {schedule_name(manifest)}, partition {part['fingerprint']})")


def loads_into(manifest: dict[str, Any], stages: dict[int, nn.Module], num_stages: int,
               where: str = "this pipeline") -> bool:
    """Whether a checkpoint loads into `stages` (every stage of a pipeline, on one process: the launcher's check
    on the meta device): True when it does into another stage partition (by the whole model's tensor names),
    False under the same one; a `CheckpointError` naming the tensor or the stage when it does not."""
    try:
        check_partition(manifest, stages, num_stages, where)
        return False
    except CheckpointError as refusal:
        described = {s: describe_stage(m) for s, m in stages.items()}
        names = [_model_names(m, described[s]) for s, m in stages.items()]
        everywhere = [None if any(n is None for n in names) else {g for n in names if n for g in n.values()}]
        _moves(manifest, stages, described, saved_parallel(manifest), {"tp": 1}, everywhere, refusal)
        return True


def _shape(d: list) -> str:
    return f"{d[1]}{d[0]}"


# ------------------------------------------------------------------ save


@dataclass(frozen=True)
class _Layout:
    """Where this rank sits for a checkpoint: the group saving together and its (dp, pp, tp) coordinates."""

    group: Any  # the checkpoint's process group: the world under parallel=, else the pipeline's group
    rank: int  # in `group` (the global rank under parallel=)
    size: int
    coords: tuple[int, int, int]  # (dp, pp, tp)
    parallel: dict[str, Any]  # dp, pp, tp, tp_mode, zero (and ep when > 1)


class CheckpointedPipeline(Protocol):
    """What a checkpoint reads and restores of a pipeline (`Pipeline` is one): its program, its stages and their
    copies, where it runs, the data-parallel strategy (ZeRO needs its optimizer), fp16's loss scale and the step."""

    program: Program
    group: dist.ProcessGroup | None
    rank: int
    size: int
    mesh: ParallelMesh | None
    data_parallel: Replicated | Flat
    loss_scaling: LossScaling
    steps: int

    @property
    def parallel(self) -> ParallelConfig | None: ...

    def local_stages(self) -> dict[int, nn.Module]: ...

    def local_copies(self) -> dict[tuple[int, int], nn.Module]: ...


def _layout(pipe: CheckpointedPipeline) -> _Layout:
    cfg = getattr(pipe, "parallel", None)
    if cfg is None:
        par = {"dp": 1, "pp": pipe.size, "tp": 1, "tp_mode": "1d", "zero": 0}
        return _Layout(pipe.group, pipe.rank, pipe.size, (0, pipe.rank, 0), par)
    c = pipe.mesh.coords
    par = {"dp": cfg.dp, "pp": cfg.pp, "tp": cfg.tp, "tp_mode": cfg.tp_mode, "zero": cfg.zero,
           **({"ep": cfg.ep} if cfg.ep > 1 else {})}
    return _Layout(None, dist.get_rank(), dist.get_world_size(), (c.dp, c.pp, c.tp), par)


def save(pipe: CheckpointedPipeline, directory: str | os.PathLike, step: int,
         optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | PipelineOptimizer | None = None, *,
         extra: Any = None, shards: Any = None, timeout: float = 300.0,
         model: dict[str, Any] | None = None) -> CheckpointInfo:
    """Write this rank's part of checkpoint `step` under `directory`; call on every rank of the pipeline
    (under `parallel=`, on every rank of the world: dp × pp × tp).

    `optimizer`: a torch optimizer (or a list of them) over this rank's stages, or what
    `pipe.optimizer(...)` returned (required with ZeRO, which holds the stages' parameters).
    `extra` (returned by `load` on the same rank) and `shards` (free-form) hold
    tensors, numbers, strings and lists, tuples and dicts of them.  Returns once the checkpoint
    is complete (rank 0 wrote the manifest).  `model`: the model's configuration (JSON), recorded in the
    manifest so that a resume under another one is told which fields differ (`model_differences`).  A rank that does not
    report its part within `timeout` seconds makes the others raise an error naming it; the
    half-written checkpoint then has no manifest and never counts.
    """
    lay = _layout(pipe)
    commit = Commit(step_dir(directory, step), step, lay.rank, lay.size, _save_tag(pipe, lay), timeout)
    with commit.reporting():
        _check_plain(extra, f"rank {lay.rank}: extra")
        _check_plain(shards, f"rank {lay.rank}: shards")
        zeros, plain = _optimizers(pipe, optimizer)
        manifest = commit.run(lambda: _part(pipe, lay, step, zeros, plain, optimizer is not None, extra, shards,
                                            _training_state(pipe, optimizer)),
                              lambda metas: {**_manifest(pipe, lay, step, metas),
                                             **({"model": _jsonable(model)} if model is not None else {})})
    return CheckpointInfo(commit.target, step, manifest)


def _save_tag(pipe: CheckpointedPipeline, lay: _Layout) -> str:
    """Names the group saving together, so that its saves meet on the store apart from other groups'."""
    if lay.group is None and getattr(pipe, "parallel", None) is not None:
        return f"world{lay.size}"
    ranks = dist.get_process_group_ranks(pipe.group) if pipe.group is not None else list(range(pipe.size))
    return "-".join(map(str, ranks))


def _optimizers(pipe: CheckpointedPipeline, optimizer: Any
                ) -> tuple[dict[int, ZeroOptimizer], list[torch.optim.Optimizer]]:
    """({stage: ZeroOptimizer}, [plain optimizers]) from what the user passed; ZeRO needs `pipe.optimizer()`'s."""
    if isinstance(optimizer, PipelineOptimizer):
        return dict(optimizer.zero), [optimizer.optimizer] if optimizer.optimizer is not None else []
    strategy = getattr(pipe, "data_parallel", None)
    if strategy is not None and strategy.flat:
        got = "none" if optimizer is None else type(optimizer).__name__
        raise CheckpointError(f"{strategy.reason}: the stages' parameters live in the optimizer's flat buffers; pass "
                              f"the optimizer pipe.optimizer(...) returned (got {got})")
    return {}, _as_list(optimizer)


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.dtype, torch.Size)


def _check_plain(obj: Any, where: str) -> None:
    """`extra` / `shards` are loaded back with torch.load(weights_only=True): tensors, numbers, strings and
    lists, tuples and dicts of them.  Say so now, not when the checkpoint is loaded."""
    if isinstance(obj, _PLAIN):
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_plain(v, f"{where}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _check_plain(k, f"{where} key {k!r}")
            _check_plain(v, f"{where}[{k!r}]")
    else:
        raise CheckpointError(f"{where} is a {type(obj).__name__}: a checkpoint holds tensors, numbers, strings "
                              f"and lists, tuples and dicts of them (convert it, e.g. a NumPy array to a tensor)")


def _stateful(pipe: CheckpointedPipeline, optimizer: Any) -> dict[str, Any]:
    """The components whose `state_dict()` a resumed step needs besides weights and optimizer state, by the key
    each is saved under: the fp16 loss scale (the same on every rank) and `pipe.optimizer()`'s lr schedule."""
    return {"loss_scale": pipe.loss_scaling, **({"lr_schedule": optimizer} if isinstance(optimizer, PipelineOptimizer)
                                                else {})}


def _training_state(pipe: CheckpointedPipeline, optimizer: Any) -> dict[str, Any]:
    return {"lr_schedule": None, **{k: c.state_dict() for k, c in _stateful(pipe, optimizer).items()}}


def _restore_training_state(pipe: CheckpointedPipeline, optimizer: Any, state: dict[str, Any] | None) -> None:
    state = state or {}
    for key, component in _stateful(pipe, optimizer).items():
        component.load_state_dict(state.get(key))


def _part(pipe: CheckpointedPipeline, lay: _Layout, step: int, zeros: dict[int, ZeroOptimizer],
          plain: list[torch.optim.Optimizer], with_optimizer: bool, extra: Any, shards: Any,
          training: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """This rank's part (serialised) and its metadata for the manifest.

    Replicas hold the same stage state: only dp rank 0 stores modules, buffers and plain optimizer
    state — with expert parallelism the first ep dp ranks, which hold every expert shard between them
    (`ep_params` names the shards, cut along dim 0); with ZeRO every dp rank stores its own slices.
    RNG, `extra` and `shards` are per rank."""
    stages = pipe.local_stages()
    copies = pipe.local_copies()
    key = {s: min(c for (c, s2) in copies if s2 == s) for s in stages}  # canonical (stage, replica) per module
    first = lay.coords[0] < lay.parallel.get("ep", 1)
    described = {s: _describe(m, zeros.get(s)) for s, m in stages.items()} if first else {}
    modules = {f"{s}/{key[s]}": m.state_dict() for s, m in stages.items() if s not in zeros} if first else {}
    buffers = {f"{s}/{key[s]}": _buffers(m, zeros[s]) for s, m in stages.items() if s in zeros} if first else {}
    zero = {str(s): z.shard_state(optimizer=with_optimizer) for s, z in sorted(zeros.items())}
    optimizers = [_optimizer_state(o, stages) for o in plain] if first else []
    part = {"format": FORMAT, "version": VERSION, "step": step, "rank": lay.rank, "world_size": lay.size,
            "coords": list(lay.coords), "modules": modules, "buffers": buffers, "zero": zero,
            "optimizers": optimizers, "rng": _rng_state(), "extra": extra, "shards": shards, "training": training}
    data, digest = encode_part(part)
    n_opt = len(plain) + (1 if zeros and with_optimizer else 0)
    meta = {"rank": lay.rank, "coords": list(lay.coords), **digest,
            "modules": sorted(modules), "buffers": sorted(buffers), "zero": sorted(zero),
            "copies": sorted([s, c] for c, s in copies),
            "stages": {str(s): d for s, d in described.items()},
            "names": {str(s): _model_names(stages[s], d) for s, d in described.items()},
            **({"tp_dims": {str(s): tp_dims(m, zeros.get(s)) for s, m in stages.items()}} if lay.parallel["tp"] > 1
               else {}),
            **({"ep_params": {str(s): sorted(expert_shards(m)) for s, m in stages.items()}}
               if lay.parallel.get("ep", 1) > 1 else {}),
            "optimizers": n_opt, "shards": sorted(shards) if isinstance(shards, dict) else None}
    return data, meta


def _buffers(module: nn.Module, zero: ZeroOptimizer | None = None) -> dict[str, torch.Tensor]:
    """A stage's state_dict without its parameters and `zero`'s flat buffers (known by identity): what ZeRO's
    slices do not hold."""
    params = {k for k, _ in module.named_parameters(remove_duplicate=False)}
    flat = {id(t) for t in zero.parameters()} if zero is not None else set()
    held = module.state_dict(keep_vars=True)  # the tensors themselves, where state_dict() gives detached ones
    return {k: v for k, v in module.state_dict().items() if k not in params and id(held[k]) not in flat}


def tp_dims(module: nn.Module, zero: ZeroOptimizer | None = None) -> dict[str, int | None]:
    """{state-dict name: the dimension its tensor-parallel shards split, None for a copy} of a stage's DTensor
    parameters (parallel/tp_hf.py) — ZeRO's packed ones by the placements it kept: what `read_model`
    concatenates the tp ranks' tensors along.  A plain tensor of a tp run has no entry: the same on every tp
    rank (a replicated norm) or, for layers that slice without DTensor (models/gpt/tp.py), not gatherable
    by name."""
    from torch.distributed.tensor import DTensor, Shard

    def dim(placements: Sequence[Any]) -> int | None:
        shard = [p.dim for p in placements if isinstance(p, Shard)]
        return shard[0] if shard else None

    dims = {name: dim(t.placements) for name, t in module.state_dict(keep_vars=True).items()
            if isinstance(t, DTensor)}
    for unit in zero.units if zero is not None else ():
        for e in unit.entries:
            if e.dtensor is not None:
                dims.update(dict.fromkeys((e.name, *e.also), dim(e.dtensor.placements)))
    return dims


def _describe(module: nn.Module, zero: ZeroOptimizer | None) -> dict[str, list]:
    """`describe_stage` by the original parameter names, also when ZeRO has packed them into flat buffers; an
    expert shard by the whole tensor's shape (a partition does not change with ep)."""
    described = describe_stage(module) if zero is None else _describe_zero(module, zero)
    for name, (ep, _) in expert_shards(module).items():
        shape, dtype = described[name]
        described[name] = [[shape[0] * ep, *shape[1:]], dtype]
    return described


def _describe_zero(module: nn.Module, zero: ZeroOptimizer) -> dict[str, list]:
    described = {**zero_checkpoint.describe(zero), **describe_stage_tensors(_buffers(module, zero))}
    for unit in zero.units:  # a DTensor parameter by its whole shape, as describe_stage gives it without ZeRO
        for e in unit.entries:
            if e.dtensor is not None:
                for name in (e.name, *e.also):
                    described[name] = [list(e.dtensor.shape), described[name][1]]
    return described


def describe_stage_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    """{name: [shape, dtype]} of named tensors."""
    return {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in tensors.items()}


def _model_names(module: nn.Module, described: dict[str, list]) -> dict[str, str] | None:
    """{stage name: the whole model's name} of a stage's tensors (`described`'s names), None unless the stage
    names every one (models/split.py: `SequentialStage`, `ModelNamed`)."""
    model_name = getattr(module, "model_name", None)
    if not callable(model_name):
        return None
    names = {k: model_name(k) for k in described}
    return names if all(isinstance(v, str) for v in names.values()) else None


def _manifest(pipe: CheckpointedPipeline, lay: _Layout, step: int, metas: list[dict[str, Any]]) -> dict[str, Any]:
    prog = pipe.program
    stages: dict[int, dict[str, list]] = {}
    names: dict[int, dict[str, str] | None] = {}
    tp_stages: dict[str, dict[str, list]] = {}
    for meta in metas:
        tp = meta["coords"][2]
        for s, d in meta.pop("stages").items():
            tp_stages.setdefault(f"{s}/{tp}", d)
            if tp == 0:
                stages.setdefault(int(s), d)
        for s, n in meta.pop("names").items():
            if tp == 0:
                names.setdefault(int(s), n)
    head = prog.to_dict()
    del head["ranks"]
    partition: dict[str, Any] = {"num_stages": prog.num_stages, "fingerprint": fingerprint(stages),
                                 "stages": {str(s): stages[s] for s in sorted(stages)}}
    if lay.parallel["tp"] == 1 and names and all(n is not None for n in names.values()):
        partition["names"] = {str(s): names[s] for s in sorted(names)}  # what loads it into another partition
    if lay.parallel["tp"] > 1:
        text = json.dumps(sorted(tp_stages.items()), sort_keys=True)
        partition["fingerprint"] = hashlib.sha256(text.encode()).hexdigest()[:16]
        partition["tp_stages"] = dict(sorted(tp_stages.items()))
    return {"format": FORMAT, "version": VERSION, "step": step, "world_size": lay.size, "time": time.time(),
            "schedule": {**head, "fingerprint": _program_fingerprint(prog)}, "parallel": lay.parallel,
            "partition": partition, "parts": metas}


def _jsonable(value: Any) -> Any:
    """`value` as the manifest's JSON holds it (what it cannot hold as text)."""
    return json.loads(json.dumps(value, default=str))


VOLATILE = ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures", "use_cache",
            "output_attentions", "output_hidden_states", "return_dict")  # no bearing on the weights' meaning


def model_differences(manifest: dict[str, Any], model: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, the checkpoint's value, `model`'s) of each configuration field that differs from the one the
    checkpoint recorded (`save(model=…)`), apart from `VOLATILE` ones and dropout rates (regularisation a resumed
    run may change); none when it recorded none."""
    saved = manifest.get("model")
    if not isinstance(saved, dict):
        return []
    now = _jsonable(model)
    keys = sorted(k for k in (set(saved) | set(now)) - set(VOLATILE) if "dropout" not in k)
    return [(k, saved.get(k), now.get(k)) for k in keys if saved.get(k) != now.get(k)]


def _program_fingerprint(prog: Any) -> str:
    return hashlib.sha256(prog.to_text().encode()).hexdigest()[:16]


def _as_list(optimizer: Any) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    return list(optimizer)


def _param_names(stages: dict[int, nn.Module]) -> dict[int, tuple[int, str]]:
    return {id(p): (s, name) for s, m in stages.items() for name, p in m.named_parameters()}


def _optimizer_state(opt: torch.optim.Optimizer, stages: dict[int, nn.Module]) -> dict[str, Any]:
    """An optimizer's state keyed by (stage, parameter name) instead of by position on this rank."""
    names = _param_names(stages)
    sd = opt.state_dict()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    params: dict[str, Any] = {}
    for gi, (group, saved) in enumerate(zip(opt.param_groups, sd["param_groups"])):
        for p, idx in zip(group["params"], saved["params"]):
            if id(p) not in names:
                raise CheckpointError(f"rank {_rank()}: the optimizer holds a parameter ({list(p.shape)}) that "
                                      f"belongs to none of this rank's stages")
            s, name = names[id(p)]
            params[f"{s}/{name}"] = {"group": gi, "state": sd["state"].get(idx, {})}
    return {"type": type(opt).__name__, "groups": groups, "params": params}


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# ------------------------------------------------------------------ load


def load(pipe: CheckpointedPipeline, source: str | os.PathLike,
         optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | PipelineOptimizer | None = None
         ) -> Restored:
    """Restore this rank's stages, optimizer state and RNG from `source`; call on every rank
    (under `parallel=`, on every rank of the world).

    `source` is a checkpoint directory or a directory of checkpoints (the latest complete one
    is used).  Checks the stage partition and the tensor-parallel layout against the checkpoint
    first, on every rank, and raises the same `CheckpointError` on all of them when any rank
    finds a mismatch.  ZeRO slices saved under the same dp size and units are restored as they
    are; under another dp size or ZeRO stage they are reassembled into full tensors and re-sliced.
    """
    lay = _layout(pipe)
    error, restored, finish = None, None, None
    everywhere: list[set[str] | None] = [None] * lay.size  # each rank's tensors by their whole-model names
    try:
        dist.all_gather_object(everywhere, _names_here(pipe, optimizer), group=lay.group)
    except Exception as err:  # noqa: BLE001
        raise RankFailure(f"rank {lay.rank}: loading a checkpoint: lost the other ranks: {err}", lay.rank,
                          peer_failure=True) from err
    try:
        info = resolve(source)
        restored, finish = _load(pipe, lay, info, optimizer, everywhere)
    except CheckpointError as err:
        error = err.message
    errors: list[str | None] = [None] * lay.size
    try:
        dist.all_gather_object(errors, error, group=lay.group)
    except Exception as err:  # noqa: BLE001
        raise RankFailure(f"rank {lay.rank}: loading a checkpoint: lost the other ranks: {err}", lay.rank,
                          peer_failure=True) from err
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        r, message = bad[0]
        everywhere = len(bad) == len(errors) and len({e for _, e in bad}) == 1
        raise CheckpointError(message if everywhere or message.startswith("rank ") else f"rank {r}: {message}")
    assert restored is not None and finish is not None
    try:
        finish()  # collectives (ZeRO's all-gathers of restored slices): only once every rank may go on
    except Exception as err:  # noqa: BLE001
        raise RankFailure(f"rank {lay.rank}: loading a checkpoint: gathering ZeRO parameters failed: {err}",
                          lay.rank, peer_failure=True) from err
    pipe.steps = restored.step
    return restored


def _names_here(pipe: CheckpointedPipeline, optimizer: Any) -> set[str] | None:
    """The whole model's names of this rank's stage tensors; None when a stage does not name them all."""
    try:
        zeros, _ = _optimizers(pipe, optimizer)
    except CheckpointError:
        return None
    out: set[str] = set()
    for s, m in pipe.local_stages().items():
        names = _model_names(m, _describe(m, zeros.get(s)))
        if names is None:
            return None
        out.update(names.values())
    return out


def _load(pipe: CheckpointedPipeline, lay: _Layout, info: CheckpointInfo, optimizer: Any,
          everywhere: list[set[str] | None]) -> tuple[Restored, Any]:
    """Everything that can fail, checked and applied locally; returns the collectives to run afterwards."""
    manifest, path = info.manifest, info.path
    saved_par = saved_parallel(manifest)
    par, (dp, _pp, tp) = lay.parallel, lay.coords
    stages = pipe.local_stages()
    prog = pipe.program
    zeros, plain = _optimizers(pipe, optimizer)
    retp = _retp_needed(manifest, saved_par, par, stages, zeros)
    described = {s: _describe(m, zeros.get(s)) for s, m in stages.items()}
    moves = _partition_moves(manifest, stages, prog.num_stages, 0 if retp else tp, described, saved_par, par,
                             everywhere)
    parts = manifest["parts"]
    held = _held_parts(parts, retp, tp)
    read = part_reader(path)
    want_opt = optimizer is not None
    _check_optimizer_count(parts, plain, zeros, want_opt, held.sliced, retp)
    src = _Source(path, parts, read, held, dp, tp, par["tp"], saved_par.get("ep", 1), want_opt, retp)
    full: dict[int, FullState] = {}  # stage -> full-size state reassembled from ZeRO slices
    finish: list[ZeroOptimizer] = []
    if moves is not None:
        full = _load_moved(stages, zeros, plain, moves, src)
    else:
        for s, module in sorted(stages.items()):
            _load_stage(s, module, zeros.get(s), src, full, finish)
    if want_opt:
        for k, opt in enumerate(plain):
            _load_optimizer(opt, k, stages, held.dense, full, read)
    saved, own = _restore_rank_state(pipe, lay, parts, read, optimizer)
    sched = manifest["schedule"]
    now = _program_fingerprint(prog)
    restored = Restored(step=info.step, path=path, extra=saved.get("extra"),
                        shards=saved.get("shards") if own else None,
                        saved_schedule=schedule_name(manifest), schedule_changed=sched.get("fingerprint") != now,
                        rng_restored=own, partition_changed=moves is not None)
    return restored, _syncing(finish)


@dataclass(frozen=True)
class _Held:
    """Which saved part holds each stage at this rank's tp coordinate, by how it was saved."""

    dense: dict[int, tuple[dict[str, Any], str]]  # stage -> (part, module key): saved without ZeRO
    buffers: dict[int, tuple[dict[str, Any], str]]  # stage -> (part, buffers key): beside ZeRO's slices
    sliced: dict[int, dict[int, dict[str, Any]]]  # stage -> {saved dp rank: part}: ZeRO's slices


@dataclass(frozen=True)
class _Source:
    """What loading a stage reads from and where this rank sits, so each stage's loader takes one argument."""

    path: Path
    parts: list[dict[str, Any]]
    read: Callable[[dict[str, Any]], dict[str, Any]]  # a part's contents, each part read once
    held: _Held
    dp: int
    tp: int
    tp_size: int  # this pipeline's tp size
    saved_ep: int
    want_opt: bool
    retp: bool  # saved under another tp size or mode: every stage is resharded (`_retp`)


def _retp_needed(manifest: dict[str, Any], saved_par: dict[str, Any], par: dict[str, Any],
                 stages: dict[int, nn.Module], zeros: dict[int, ZeroOptimizer]) -> bool:
    """Whether the tp layout differs from the saved one; refused unless both sides can reshard (DTensor stages)."""
    retp = (saved_par["tp"], saved_par["tp_mode"]) != (par["tp"], par["tp_mode"])
    if retp and not _tp_reshardable(manifest, saved_par, par, stages, zeros):
        raise CheckpointError(f"the checkpoint (step {manifest['step']}, {schedule_name(manifest)}) was saved with "
                              f"tp={saved_par['tp']} ({saved_par['tp_mode']}), this pipeline has tp={par['tp']} "
                              f"({par['tp_mode']}): the tp sizes differ, and these tensor-parallel shards load only "
                              f"under the same tp size and layout (DTensor stages, parallel/tp_hf.py, load under "
                              f"any 1-D tp)")
    return retp


def _partition_moves(manifest: dict[str, Any], stages: dict[int, nn.Module], num_stages: int, tp: int,
                     described: dict[int, dict[str, list]], saved_par: dict[str, Any], par: dict[str, Any],
                     everywhere: list[set[str] | None]) -> dict[int, dict[str, tuple[int, str]]] | None:
    """None under the saved stage partition; under another one, where each tensor lies (`_moves`), or its error."""
    try:
        check_partition(manifest, stages, num_stages, tp=tp, described=described)
    except CheckpointError as err:  # another partition: loaded by the whole model's names where both have them
        return _moves(manifest, stages, described, saved_par, par, everywhere, err)
    return None


def _held_parts(parts: list[dict[str, Any]], retp: bool, tp: int) -> _Held:
    """Index the parts at this rank's tp coordinate by the stages they hold (the first part holding one wins)."""
    dense: dict[int, tuple[dict[str, Any], str]] = {}
    buffers: dict[int, tuple[dict[str, Any], str]] = {}
    sliced: dict[int, dict[int, dict[str, Any]]] = {}
    for part in parts:
        d, _, t = part_coords(part)
        if retp or t != tp:  # under another tp size `_retp` reads every saved tp rank's part
            continue
        for key in part.get("modules", []):
            dense.setdefault(int(key.split("/")[0]), (part, key))
        for key in part.get("buffers", []):
            buffers.setdefault(int(key.split("/")[0]), (part, key))
        for key in part.get("zero", []):
            sliced.setdefault(int(key), {}).setdefault(d, part)
    return _Held(dense, buffers, sliced)


def _check_optimizer_count(parts: list[dict[str, Any]], plain: list[torch.optim.Optimizer],
                           zeros: dict[int, ZeroOptimizer], want_opt: bool, sliced: dict[int, dict[int, Any]],
                           retp: bool) -> None:
    """Refuse, before loading anything, optimizers that cannot take the saved optimizer state."""
    n_saved = {p.get("optimizers", 0) for p in parts}
    n_given = len(plain) + (1 if zeros and want_opt else 0)
    if want_opt and n_saved != {n_given}:
        raise CheckpointError(f"the checkpoint holds the state of {max(n_saved)} optimizer(s) per rank, "
                              f"{n_given} were given to load")
    if sliced and plain and len(plain) != 1:
        raise CheckpointError(f"the checkpoint holds ZeRO optimizer state, which loads into one optimizer per "
                              f"rank, not {len(plain)}")
    if retp and want_opt and len(plain) > 1:
        raise CheckpointError(f"loading under another tp size takes one optimizer per rank, not {len(plain)}")


def _load_moved(stages: dict[int, nn.Module], zeros: dict[int, ZeroOptimizer], plain: list[torch.optim.Optimizer],
                moves: dict[int, dict[str, tuple[int, str]]], src: _Source) -> dict[int, FullState]:
    """Load every stage from a checkpoint of another partition; returns their full-size state (for the optimizer)."""
    if src.want_opt and len(plain) > 1:
        raise CheckpointError(f"loading into another stage partition takes one optimizer per rank, not "
                              f"{len(plain)}")
    full = _repartitioned(stages, zeros, moves, src.parts, src.read, src.saved_ep, src.want_opt, src.path)
    for s, module in sorted(stages.items()):
        _load_full(s, module, zeros.get(s), full[s], src.path)
    return full


def _load_stage(s: int, module: nn.Module, z: ZeroOptimizer | None, src: _Source, full: dict[int, FullState],
                finish: list[ZeroOptimizer]) -> None:
    """Stage `s` from however it was saved; adds its full-size state to `full` when reassembled, and its ZeRO
    optimizer to `finish` when its own slices were restored as they are (their all-gather comes later)."""
    sliced = src.held.sliced
    sharded = _ep_params(src.parts, s) | set(expert_shards(module))
    same = _own_slices_restorable(s, z, src)
    if src.retp:
        full[s] = _retp(s, module, z, src.parts, src.read, src.tp, src.tp_size, src.saved_ep, src.want_opt, src.path)
        _load_full(s, module, z, full[s], src.path)
    elif sharded and not same:
        full[s] = _reep(s, module, z, src.parts, src.read, src.tp, src.saved_ep, src.want_opt, src.path)
        _load_full(s, module, z, full[s], src.path)
        if s in sliced:
            _load_buffers(s, module, z, src.held.buffers, src.read, src.path)
    elif s in sliced:
        _load_sliced(s, module, z, same, src, full, finish)
    elif s in src.held.dense:
        _load_dense(s, module, z, src, full)
    else:
        raise CheckpointError(f"{src.path}: no part holds stage {s} at tp rank {src.tp}")


def _own_slices_restorable(s: int, z: ZeroOptimizer | None, src: _Source) -> bool:
    """Whether this rank's own ZeRO slices of stage `s` restore as they are (same dp size and units)."""
    sliced = src.held.sliced
    same = False
    if s in sliced and not src.retp:
        mine, first = sliced[s].get(src.dp), next(iter(sliced[s].values()))
        same = z is not None and mine is not None and zero_checkpoint.restorable(z, _zero_state(src.read, s, first))
    return same


def _load_sliced(s: int, module: nn.Module, z: ZeroOptimizer | None, same: bool, src: _Source,
                 full: dict[int, FullState], finish: list[ZeroOptimizer]) -> None:
    """A stage saved with ZeRO: its own slices as they are, else reassembled from all saved slices; then buffers."""
    path, slices = src.path, src.held.sliced[s]
    mine = slices.get(src.dp)
    if same:
        with _resharding(f"stage {s}: cannot restore the ZeRO slices of {path / mine['file']}: "):
            zero_checkpoint.restore(z, _zero_state(src.read, s, mine), src.want_opt)
        finish.append(z)
    else:
        with _resharding(f"{path}: "):
            full[s] = zero_checkpoint.assemble(s, _zero_states(src.read, s, slices), src.want_opt)
        _load_full(s, module, z, full[s], path)
    _load_buffers(s, module, z, src.held.buffers, src.read, path)


def _load_dense(s: int, module: nn.Module, z: ZeroOptimizer | None, src: _Source,
                full: dict[int, FullState]) -> None:
    """A stage saved without ZeRO: its module state as it is, or re-sliced into a ZeRO stage."""
    part, key = src.held.dense[s]
    if z is None:
        try:
            module.load_state_dict(src.read(part)["modules"][key])
        except (RuntimeError, KeyError) as err:
            raise CheckpointError(f"stage {s}: cannot load {src.path / part['file']}: {err}") from None
    else:
        full[s] = _from_dense(s, z, src.read(part), key, src.want_opt)
        _load_full(s, module, z, full[s], src.path)


def _restore_rank_state(pipe: CheckpointedPipeline, lay: _Layout, parts: list[dict[str, Any]], read: Any,
                        optimizer: Any) -> tuple[dict[str, Any], bool]:
    """RNG and training state from this rank's own part (else dp rank 0's at its (pp, tp), else rank 0's); returns
    that part's contents and whether it was this rank's own (only then is its RNG restored)."""
    dp, pp, tp = lay.coords
    own = next((p for p in parts if part_coords(p) == (dp, pp, tp)), None)
    fallback = next((p for p in parts if part_coords(p) == (0, pp, tp)), None)
    source = own or fallback or next(p for p in parts if p["rank"] == 0)
    saved = read(source)
    if own is not None:
        _set_rng_state(saved["rng"])
    _restore_training_state(pipe, optimizer, saved.get("training"))
    return saved, own is not None


def _syncing(finish: list[ZeroOptimizer]) -> Callable[[], None]:
    """The collectives `load` runs once every rank loaded without error: ZeRO's all-gathers of restored slices."""

    def collectives() -> None:
        for z in finish:  # stages in order, the same on every dp rank
            z.sync_parameters()

    return collectives


def _moves(manifest: dict[str, Any], stages: dict[int, nn.Module], described: dict[int, dict[str, list]],
           saved_par: dict[str, Any], par: dict[str, Any], everywhere: list[set[str] | None],
           refusal: CheckpointError) -> dict[int, dict[str, tuple[int, str]]]:
    """Where each of this rank's stage tensors lies in a checkpoint of another partition: {stage: {name: (saved
    stage, saved name)}}, matched by the whole model's names.  Raises `refusal` (the partition check's error)
    unless both sides name every tensor (no tensor parallelism), and a `CheckpointError` naming the tensor when
    the models differ: a tensor one side lacks (on every rank together) or of another shape or dtype."""
    part = manifest["partition"]
    saved_names = part.get("names")
    mine = {s: _model_names(m, described[s]) for s, m in stages.items()}
    if (saved_names is None or saved_par["tp"] != 1 or par["tp"] != 1 or any(n is None for n in everywhere)
            or any(n is None for n in mine.values())):
        raise refusal
    home: dict[str, tuple[int, str]] = {}
    for s_old in sorted(saved_names, key=int):
        for local, g in saved_names[s_old].items():
            home.setdefault(g, (int(s_old), local))
    what = f"the checkpoint (step {manifest['step']}, {schedule_name(manifest)})"
    moves: dict[int, dict[str, tuple[int, str]]] = {}
    for s, names in sorted(mine.items()):
        assert names is not None
        for local, g in names.items():
            if g not in home:
                raise CheckpointError(f"stage {s} of this pipeline holds {g!r}, which {what} lacks: a different "
                                      f"model than the checkpoint's")
            s_old, old = home[g]
            want, have = part["stages"][str(s_old)][old], described[s][local]
            if want != have:
                raise CheckpointError(f"{g!r} is {_shape(have)} here, {_shape(want)} in {what}: a different model "
                                      f"than the checkpoint's")
        moves[s] = {local: home[g] for local, g in names.items()}
    held = set().union(*(n for n in everywhere if n is not None))
    lacking = sorted(set(home) - held)
    if lacking:
        raise CheckpointError(f"{what} holds {lacking[0]!r} ({len(lacking)} tensor(s) in all), which no stage of "
                              f"this pipeline has: a different model than the checkpoint's")
    return moves


def _repartitioned(stages: dict[int, nn.Module], zeros: dict[int, ZeroOptimizer],
                   moves: dict[int, dict[str, tuple[int, str]]], parts: list[dict[str, Any]], read, saved_ep: int,
                   want_opt: bool, path: Path) -> dict[int, FullState]:
    """This rank's stages' full-size state gathered from the saved stages `moves` points into (each saved stage's
    whole state read once: its ZeRO slices reassembled, its expert shards joined), renamed, and cut to this
    rank's expert shards."""
    saved: dict[int, FullState] = {}

    def whole(s_old: int) -> FullState:
        if s_old not in saved:
            w = _whole(s_old, parts, read, 0, saved_ep, want_opt, path, None)
            buffers = dict(w.buffers or {})
            held = next(((p, k) for p in parts if part_coords(p)[2] == 0 for k in p.get("buffers", [])
                         if int(k.split("/")[0]) == s_old), None)
            if held is not None:  # a ZeRO stage's buffers lie beside its slices
                buffers.update(read(held[0])["buffers"][held[1]])
            saved[s_old] = FullState(w.params, w.state, w.type, w.hyper, buffers)
        return saved[s_old]

    out: dict[int, FullState] = {}
    for s, module in sorted(stages.items()):
        params_here = _param_names_of(module, zeros.get(s))
        params: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}
        state: dict[str, dict[str, Any]] = {}
        kind, hyper = None, None
        for name, (s_old, old) in moves[s].items():
            w = whole(s_old)
            t = w.params[old] if old in w.params else w.buffers[old]
            (params if name in params_here else buffers)[name] = t
            if w.state is not None and old in w.state:
                state[name] = w.state[old]
            kind, hyper = kind or w.type, hyper or w.hyper
        out[s] = _cut_experts(FullState(params, state if want_opt else None, kind, hyper, buffers), module)
    return out


def _tp_reshardable(manifest: dict[str, Any], saved: dict[str, Any], now: dict[str, Any], stages: dict[int, nn.Module],
                    zeros: dict[int, ZeroOptimizer]) -> bool:
    """Both sides 1-D and each either without tp or with DTensor stages, whose parts record how each tensor
    splits (`tp_dims`): the built-in GPT's tp layers (models/gpt/tp.py) slice plain tensors, by other names."""
    if saved["tp_mode"] != "1d" or now["tp_mode"] != "1d":
        return False
    saved_ok = saved["tp"] == 1 or any(d for p in manifest["parts"] for d in p.get("tp_dims", {}).values())
    now_ok = now["tp"] == 1 or any(tp_dims(m, zeros.get(s)) for s, m in stages.items())
    return saved_ok and now_ok


def _retp(s: int, module: nn.Module, z: ZeroOptimizer | None, parts: list[dict[str, Any]], read, tp: int, size: int,
          saved_ep: int, want_opt: bool, path: Path) -> FullState:
    """Stage `s`'s state for tp rank `tp` of `size`, from a checkpoint of another tp size: each saved tp rank's
    state (`_whole`: its ZeRO slices reassembled, or its module and optimizer state, the expert shards joined),
    the whole tensors put together along the dimension each part recorded, this rank's shard cut along the
    dimension its own parameter splits (torch.chunk, as DTensor's Shard does), optimizer state of a parameter's
    shape the same way, and this rank's expert rows cut out (`_cut_experts`; an MoE block is whole on every tp
    rank, parallel/moe_tp.py)."""
    by_tp: dict[int, FullState] = {}
    dims: dict[str, int | None] = {}
    names = _param_names_of(module, z)
    for t in sorted({part_coords(p)[2] for p in parts}):
        mine = [p for p in parts if part_coords(p)[2] == t]
        if not any(str(s) in p.get("zero", []) or any(int(k.split("/")[0]) == s for k in p.get("modules", []))
                   for p in mine):
            raise CheckpointError(f"{path}: no part holds stage {s} at tp rank {t}")
        w = _whole(s, parts, read, t, saved_ep, want_opt, path, names)
        held = next(((p, k) for p in mine for k in p.get("buffers", []) if int(k.split("/")[0]) == s), None)
        buffers = read(held[0])["buffers"][held[1]] if held is not None else w.buffers  # ZeRO's lie beside
        by_tp[t] = FullState(w.params, w.state, w.type, w.hyper, buffers)
        for p in mine:
            dims.update(p.get("tp_dims", {}).get(str(s), {}))
    whole = _join_tp(s, by_tp, dims, path)
    cut = tp_dims(module, z)

    def shard(name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        dim = cut.get(name)
        if dim is None or t.shape != like.shape:
            return t
        return t.chunk(size, dim=dim)[tp].clone()

    params = {n: shard(n, t, t) for n, t in whole.params.items()}
    state = None if whole.state is None else {
        n: {k: shard(n, v, whole.params[n]) if isinstance(v, torch.Tensor) else v for k, v in st.items()}
        for n, st in whole.state.items()}
    return _cut_experts(FullState(params, state, whole.type, whole.hyper, whole.buffers), module)


def _ep_params(parts: list[dict[str, Any]], s: int) -> set[str]:
    """The names of stage `s`'s expert shards in a checkpoint saved with expert parallelism (none without)."""
    return {n for p in parts for n in p.get("ep_params", {}).get(str(s), [])}


def _reep(s: int, module: nn.Module, z: ZeroOptimizer | None, parts: list[dict[str, Any]], read, tp: int,
          saved_ep: int, want_opt: bool, path: Path) -> FullState:
    """Stage `s`'s state for this rank's expert shards, from a checkpoint of any ep (parallel/expert.py): the
    stage's whole state (`_whole`), then this rank's rows cut out (`_cut_experts`).  Exact: only copies."""
    return _cut_experts(_whole(s, parts, read, tp, saved_ep, want_opt, path, _param_names_of(module, z)), module)


def _whole(s: int, parts: list[dict[str, Any]], read, tp: int, saved_ep: int, want_opt: bool, path: Path,
           names: set[str] | None) -> FullState:
    """Saved stage `s`'s whole state at tp coordinate `tp`: each saved ep coordinate's state (its ZeRO slices
    reassembled, or the module and optimizer state of the dp rank holding it) with the expert shards joined
    along dim 0 in coordinate order, the optimizer state of a shard's shape the same way.  `names`: the stage's
    parameters (the rest of a module state are buffers); None takes every tensor as one."""
    mine = [p for p in parts if part_coords(p)[2] == tp]
    slices = {part_coords(p)[0]: p for p in mine if str(s) in p.get("zero", [])}
    states = _zero_states(read, s, slices) if slices else None
    sharded = _ep_params(parts, s)
    by_ep: list[FullState] = []
    for j in range(saved_ep):
        if states is not None:
            with _resharding(f"{path}: "):
                by_ep.append(zero_checkpoint.assemble(s, states, want_opt, experts=(saved_ep, j)))
            continue
        held = next(((p, k) for p in mine if part_coords(p)[0] == j for k in p.get("modules", [])
                     if int(k.split("/")[0]) == s), None)
        if held is None:
            raise CheckpointError(f"{path}: no part holds stage {s} at tp rank {tp}"
                                  + (f" for expert shard {j} of {saved_ep}" if saved_ep > 1 else ""))
        by_ep.append(_dense_state(s, names, read(held[0]), held[1], want_opt))
    first = by_ep[0]

    def joined(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(pieces) if name in sharded and saved_ep > 1 else pieces[0]

    params = {n: joined(n, [b.params[n] for b in by_ep]) for n in first.params}
    state = None
    if first.state is not None:
        state = {n: {k: joined(n, [b.state[n][k] for b in by_ep])
                     if isinstance(v, torch.Tensor) and v.dim() and v.shape == first.params[n].shape else v
                     for k, v in st.items()} for n, st in first.state.items()}
    return FullState(params, state, first.type, first.hyper, first.buffers)


def _cut_experts(full: FullState, module: nn.Module) -> FullState:
    """`full` with each of `module`'s expert shards (and their optimizer state) cut to this rank's rows."""
    params, state = dict(full.params), None if full.state is None else dict(full.state)
    for name, (ep, rank) in expert_shards(module).items():
        whole = params[name]
        params[name] = whole.chunk(ep)[rank].clone()
        if state is not None and name in state:
            state[name] = {k: v.chunk(ep)[rank].clone() if isinstance(v, torch.Tensor) and v.shape == whole.shape
                           else v for k, v in state[name].items()}
    return FullState(params, state, full.type, full.hyper, full.buffers)


def _param_names_of(module: nn.Module, z: ZeroOptimizer | None) -> set[str]:
    """A stage's parameter names (every alias): ZeRO's entries when it holds them, else the module's."""
    if z is not None:
        return {n for unit in z.units for e in unit.entries for n in (e.name, *e.also)}
    return {n for n, _ in module.named_parameters(remove_duplicate=False)}


def _dense_state(s: int, names: set[str] | None, part: dict[str, Any], key: str, want_opt: bool) -> FullState:
    """A stage saved without ZeRO as a `FullState`: parameters (local shards of DTensors), buffers, and the
    first plain optimizer's state by parameter name.  `names`: the parameters' (None: every tensor)."""
    saved = {k: local_shard(v) for k, v in part["modules"][key].items()}
    params = {k: v for k, v in saved.items() if names is None or k in names}
    buffers = {k: v for k, v in saved.items() if k not in params}
    if not want_opt:
        return FullState(params, buffers=buffers)
    opt = part["optimizers"][0] if part["optimizers"] else None
    if opt is None:
        raise CheckpointError(f"stage {s}: the checkpoint holds no optimizer state to load")
    state, hyper = {}, None
    for name in params:
        entry = opt["params"].get(f"{s}/{name}")
        if entry is None:
            continue
        state[name] = {k: local_shard(v) for k, v in entry["state"].items()}
        hyper = hyper or opt["groups"][entry["group"]]
    return FullState(params, state, opt["type"], hyper, buffers)


def _join_tp(s: int, by_tp: dict[int, FullState], dims: dict[str, int | None], path: Path) -> FullState:
    """One stage's whole state from its tp ranks' (`_gather_tp` for a `FullState`, optimizer state included)."""
    ranks = sorted(by_tp)
    first = by_tp[ranks[0]]
    joined = _gather_tp(path, {t: {s: by_tp[t].params} for t in ranks}, {s: dims})[s]
    state = None
    if first.state is not None:
        state = {}
        for name, st in first.state.items():
            state[name] = {}
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.shape == first.params[name].shape and v.dim():
                    pieces = {t: {s: {k: by_tp[t].state[name][k]}} for t in ranks}
                    v = _gather_tp(path, pieces, {s: {k: dims.get(name, "copy")}})[s][k]
                state[name][k] = v
    return FullState(joined, state, first.type, first.hyper, first.buffers)


def _zero_state(read, s: int, part: dict[str, Any]) -> dict[str, Any]:
    """Stage `s`'s ZeRO state (`ZeroOptimizer.shard_state()`) in `part`."""
    return read(part)["zero"][str(s)]


def _zero_states(read, s: int, slices: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Stage `s`'s ZeRO state by saved dp rank, from {saved dp rank: part}."""
    return {d: _zero_state(read, s, part) for d, part in slices.items()}


@contextmanager
def _resharding(prefix: str = "") -> Iterator[None]:
    """ZeRO's refusals to take saved state as this module's errors, `prefix` saying where."""
    try:
        yield
    except ReshardError as err:
        raise CheckpointError(prefix + str(err)) from None


def _from_dense(s: int, z: ZeroOptimizer, part: dict[str, Any], key: str, want_opt: bool) -> FullState:
    """A stage saved without ZeRO, for a ZeRO target: its module state and the plain optimizer's entries."""
    saved = part["optimizers"][0] if want_opt else None
    entries = None
    if saved is not None:
        entries = {}
        for name in zero_checkpoint.trained_names(z):  # frozen ones have none
            entry = saved["params"].get(f"{s}/{name}")
            if entry is None:
                raise CheckpointError(f"optimizer 0: the checkpoint has no state for stage {s} parameter {name!r}")
            entries[name] = entry["state"], saved["groups"][entry["group"]]
    with _resharding():
        return zero_checkpoint.from_dense(s, z, part["modules"][key], entries, saved["type"] if saved else None)


def _load_full(s: int, module: nn.Module, z: ZeroOptimizer | None, full: FullState, path: Path) -> None:
    """Full-size state into a ZeRO stage (re-sliced) or a plain module (its optimizer: `_load_optimizer`)."""
    if z is None:
        held = module.state_dict(keep_vars=True)
        params = {k: _like(held.get(k), t) for k, t in full.params.items()}
        try:
            module.load_state_dict({**params, **(full.buffers if full.buffers is not None else _buffers(module))},
                                   strict=True)
        except (RuntimeError, KeyError) as err:
            raise CheckpointError(f"stage {s}: cannot load the reassembled ZeRO state of {path}: {err}") from None
        return
    with _resharding():
        zero_checkpoint.load_full(s, z, full)
    if full.buffers is not None:
        _copy_buffers(s, module, z, full.buffers, path)


def _like(param: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    """`t` (a tp shard as ZeRO's slices hold it: a plain tensor) as a DTensor like `param` when that is one, so it
    loads into the parameter — or, being of its local shape, into its optimizer state; anything else as it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor) or isinstance(t, DTensor) or t.shape != param.to_local().shape:
        return t
    return DTensor.from_local(t, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def _load_buffers(s: int, module: nn.Module, z: ZeroOptimizer | None, buffers: dict[int, tuple[dict[str, Any], str]],
                  read, path: Path) -> None:
    if s in buffers:
        part, key = buffers[s]
        _copy_buffers(s, module, z, read(part)["buffers"][key], path)


def _copy_buffers(s: int, module: nn.Module, z: ZeroOptimizer | None, saved: dict[str, torch.Tensor],
                  path: Path) -> None:
    here = _buffers(module, z)
    if set(saved) != set(here):
        raise CheckpointError(f"stage {s}: the checkpoint's buffers {sorted(saved)} are not this stage's "
                              f"{sorted(here)} ({path})")
    with torch.no_grad():
        for name, t in saved.items():
            here[name].copy_(t)


def _load_optimizer(opt: torch.optim.Optimizer, k: int, stages: dict[int, nn.Module],
                    dense: dict[int, tuple[dict[str, Any], str]], full: dict[int, FullState], read) -> None:
    """A plain optimizer's state by (stage, parameter name): from the part holding the stage, or from the
    full-size state reassembled from ZeRO slices."""
    names = _param_names(stages)
    current = opt.state_dict()
    state: dict[int, Any] = {}
    groups = []
    for group, cur in zip(opt.param_groups, current["param_groups"]):
        hyper = None
        for p, idx in zip(group["params"], cur["params"]):
            if id(p) not in names:
                raise CheckpointError(f"rank {_rank()}: optimizer {k} holds a parameter ({list(p.shape)}) that "
                                      f"belongs to none of this rank's stages")
            s, name = names[id(p)]
            if s in full:
                f = full[s]
                if f.type is not None and f.type != type(opt).__name__:
                    raise CheckpointError(f"stage {s}: the checkpoint holds {f.type} state, optimizer {k} is "
                                          f"{type(opt).__name__}")
                st = f.state.get(name)
                if st is not None:
                    st = {key: _like(p, v) if isinstance(v, torch.Tensor) else v for key, v in st.items()}
                entry, saved_hyper = (None if st is None else {"state": st}), f.hyper
            else:
                saved = read(dense[s][0])["optimizers"][k]
                entry = saved["params"].get(f"{s}/{name}")
                saved_hyper = None if entry is None else saved["groups"][entry["group"]]
            if entry is None:
                raise CheckpointError(f"optimizer {k}: the checkpoint has no state for stage {s} parameter {name!r}")
            if entry["state"]:
                state[idx] = entry["state"]
            hyper = hyper or saved_hyper
        groups.append({**{k2: v for k2, v in cur.items() if k2 != "params"}, **(hyper or {}), "params": cur["params"]})
    try:
        opt.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as err:
        raise CheckpointError(f"optimizer {k}: cannot load its state: {err}") from None


# ------------------------------------------------------------------ offline reading (export)


@dataclass(frozen=True)
class SavedModel:
    """A checkpoint's whole model, read without a process group: every stage's full tensors by the stage
    module's state-dict names (ZeRO slices reassembled), and rank 0's `extra`."""

    info: CheckpointInfo
    stages: dict[int, dict[str, torch.Tensor]] = field(repr=False)
    extra: Any = field(repr=False)


def read_model(source: str | os.PathLike) -> SavedModel:
    """The model state of the checkpoint at `source` (or the latest under it), from any dp × pp × tp layout and
    ZeRO stage: ZeRO slices reassembled, tensor-parallel shards concatenated along the dimension each part
    recorded (`tp_dims`), expert shards along dim 0 (`ep_params`)."""
    info = resolve(source)
    manifest, path = info.manifest, info.path
    par = saved_parallel(manifest)
    ep = par.get("ep", 1)
    read = _offline(part_reader(path))
    # tp coordinate → expert-shard coordinate (a dp rank < ep holds one) → stage → tensors
    by_tp: dict[int, dict[int, dict[int, dict[str, torch.Tensor]]]] = {}
    sliced: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
    dims: dict[int, dict[str, int | None]] = {}
    for part in manifest["parts"]:
        dp, _, tp = part_coords(part)
        stages = by_tp.setdefault(tp, {}).setdefault(dp % ep, {})
        for key in part.get("modules", []):
            stages.setdefault(int(key.split("/")[0]), {}).update(read(part)["modules"][key])
        for key in part.get("buffers", []):
            stages.setdefault(int(key.split("/")[0]), {}).update(read(part)["buffers"][key])
        for key in part.get("zero", []):
            sliced.setdefault((int(key), tp), {}).setdefault(dp, part)
        for s, d in part.get("tp_dims", {}).items():
            dims.setdefault(int(s), {}).update(d)
    for (s, tp), slices in sorted(sliced.items()):
        states = _zero_states(read, s, slices)
        for j in range(ep):
            with _resharding(f"{path}: "):
                full = zero_checkpoint.assemble(s, states, False, experts=(ep, j))
            by_tp[tp].setdefault(j, {}).setdefault(s, {}).update(full.params)
    joined = {tp: _join_ep(by_ep, manifest["parts"]) for tp, by_ep in by_tp.items()}
    stages = _gather_tp(path, joined, dims) if par["tp"] > 1 else joined.get(0, {})
    missing = sorted(set(range(manifest["partition"]["num_stages"])) - set(stages))
    if missing:
        raise CheckpointError(f"{path}: no part holds stage {missing[0]}")
    first = next(p for p in manifest["parts"] if p["rank"] == 0)
    return SavedModel(info, stages, read(first).get("extra"))


def _join_ep(by_ep: dict[int, dict[int, dict[str, torch.Tensor]]], parts: list[dict[str, Any]]
             ) -> dict[int, dict[str, torch.Tensor]]:
    """Each stage's tensors from its expert-shard coordinates' ({coordinate: stage: tensors}): the expert shards
    (`ep_params`) concatenated along dim 0 in coordinate order, the rest taken from coordinate 0."""
    out = {}
    for s, tensors in by_ep.get(0, {}).items():
        sharded = _ep_params(parts, s)
        out[s] = {n: torch.cat([by_ep[j][s][n] for j in sorted(by_ep)]) if n in sharded else t
                  for n, t in tensors.items()}
    return out


def _offline(read: Any) -> Any:
    """`read`, quiet about the DTensor shards it unpickles with no process group (the warning that their
    DeviceMesh has none concerns torch.compile; only the local tensors are used here)."""
    import logging

    def quiet(part: dict[str, Any]) -> dict[str, Any]:
        log = logging.getLogger("torch.distributed.device_mesh")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            return read(part)
        finally:
            log.setLevel(level)
    return quiet


def _gather_tp(path: Path, by_tp: dict[int, dict[int, dict[str, torch.Tensor]]],
               dims: dict[int, dict[str, int | None]]) -> dict[int, dict[str, torch.Tensor]]:
    """Each stage's whole tensors from its tp ranks' shards: concatenated in tp order along the recorded
    dimension; a copy (a replicated norm) taken once, after checking every tp rank holds the same values."""
    ranks = sorted(by_tp)
    whole: dict[int, dict[str, torch.Tensor]] = {}
    for s in sorted(by_tp[ranks[0]]):
        shards = [by_tp[tp].get(s) for tp in ranks]
        if any(sh is None for sh in shards):
            raise CheckpointError(f"{path}: stage {s} is missing at tp rank {ranks[shards.index(None)]}")
        out = whole.setdefault(s, {})
        for name in shards[0]:
            pieces = [local_shard(sh[name]) for sh in shards]
            dim = dims.get(s, {}).get(name, "copy")
            if dim not in ("copy", None):
                out[name] = torch.cat(pieces, dim=dim)
            elif all(torch.equal(pieces[0], p) for p in pieces[1:]):
                out[name] = pieces[0]
            else:
                raise CheckpointError(f"{path}: stage {s}'s {name!r} differs between tp ranks and no split "
                                      f"dimension was recorded for it: its shards cannot be put together by name "
                                      f"(a layer that slices without DTensor, e.g. the built-in GPT's)")
    return whole
