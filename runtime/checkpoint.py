"""Checkpoints of a pipelined training state: one file per rank plus a manifest.

    from pipedsl.runtime import checkpoint

    checkpoint.save(pipe, "ckpt", step, optimizer, extra={"data": gen.get_state()})   # every rank
    restored = checkpoint.load(pipe, "ckpt", optimizer)   # the latest complete checkpoint in ckpt/
    start = restored.step                                # continue with step start + 1

A checkpoint is a directory `DIR/step-00000020/` holding `rank-00000.pt` … (each rank's stage
parameters and buffers, optimizer state, RNG state and `extra`) and `manifest.json`.  Every
file is written atomically (temporary name, fsync, rename, fsync of the directory).  The
manifest is written last, by rank 0, once every rank has reported its part durable (a wait
on the process group's store, bounded by `timeout`); so a checkpoint *counts* only when the
manifest exists and names every part with its size and SHA-256.  A save interrupted at any
point leaves no manifest and `latest()` skips it; the previous checkpoint still loads.

Parameters and optimizer state are stored per *global stage* (keyed by stage and replica,
with names relative to the stage module), not per rank: a checkpoint loads under any
schedule with the same stage partition (same number of stages, same tensor names and
shapes per stage), whatever the placement — a rank loads each of its stages from whichever
part holds it.  A different partition is refused with one clear error.  RNG states (torch
CPU and CUDA, Python `random`, NumPy when imported) and `extra` are per rank: restored on
the same rank index when the checkpoint has one.  `shards` is a free-form per-rank section.
Each part also holds the training state a bit-exact resume needs: the fp16 loss scale and its
growth counter (`pipe.scaler`, the same on every rank) and the learning-rate schedule of
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
else is refused naming the state.  Tensor-parallel shards load only under the same tp size
and mode: another one is one `CheckpointError` on every rank.

Test hook (tests only): `PIPEDSL_FAULT=POINT:RANK:STEP` makes that rank SIGKILL itself at
`POINT` of that step: `save-part` (its part half written under the temporary name) or
`save-manifest` (rank 0, the manifest written under its temporary name, not yet renamed);
`pipedsl train` uses `step` (killed mid-step) and `hang` (stopped mid-step, SIGSTOP: a stuck
rank that never exits), see train_cli.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipedsl.errors import PipeDSLError, PipeRuntimeError
from pipedsl.limits import load_json
from pipedsl.parallel.optim import LRSchedule, PipelineOptimizer
from pipedsl.parallel.zero import ZeroOptimizer

from .errors import _COUNT, RankFailure, record_failure

FORMAT = "pipedsl-checkpoint"
VERSION = 2  # 2: data/tensor-parallel layouts and ZeRO slices (1: pipeline only; still read)
READABLE = (1, 2)
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step-(\d+)")
_POLL = 0.02  # seconds between store polls while waiting for the other ranks


class CheckpointError(PipeRuntimeError):
    """A checkpoint that cannot be written, found, or loaded into this pipeline."""

    kind = "checkpoint error"


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint: its directory, step and manifest."""

    path: Path
    step: int
    manifest: dict[str, Any] = field(repr=False)

    @property
    def schedule(self) -> str:
        """The program it was saved with, e.g. "1F1B P=2 M=4"."""
        return _sched(self.manifest)


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


# ------------------------------------------------------------------ discovery


def step_dir(directory: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of `step` lives under `directory`."""
    return Path(directory) / f"step-{step:08d}"


def check(path: str | os.PathLike, verify: bool = False) -> CheckpointInfo:
    """The checkpoint at `path` if it is complete (manifest present, every part present with its size);
    with `verify`, also every part's SHA-256.  Raises `CheckpointError` saying what is missing."""
    path = Path(path)
    manifest = _read_manifest(path)
    for part in manifest["parts"]:
        f = path / part["file"]
        try:
            size = f.stat().st_size
        except OSError:
            raise CheckpointError(f"{path}: part {part['file']} of rank {part['rank']} is missing") from None
        if size != part["bytes"]:
            raise CheckpointError(f"{path}: part {part['file']} has {size} bytes, the manifest says {part['bytes']}")
        if verify:
            _read_part(path, part)
    return CheckpointInfo(path, int(manifest["step"]), manifest)


def checkpoints(directory: str | os.PathLike) -> list[CheckpointInfo]:
    """The complete checkpoints under `directory`, oldest first (incomplete ones are skipped)."""
    found = []
    for _step, path in _step_dirs(directory):
        try:
            found.append(check(path))
        except CheckpointError:
            continue
    return found


def latest(directory: str | os.PathLike) -> CheckpointInfo | None:
    """The complete checkpoint with the highest step under `directory`, or None."""
    for _step, path in reversed(_step_dirs(directory)):
        try:
            return check(path)
        except CheckpointError:
            continue
    return None


def resolve(source: str | os.PathLike) -> CheckpointInfo:
    """`source` is a checkpoint (a directory with a manifest) or a directory of them (the latest complete one)."""
    path = Path(source)
    if os.path.exists(path / MANIFEST):  # os.path: False, not OSError, for a path too long to exist
        return check(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    info = latest(path)
    if info is None:
        incomplete = [p.name for _, p in _step_dirs(path)]
        why = f" ({len(incomplete)} incomplete: {', '.join(incomplete[-3:])})" if incomplete else ""
        raise CheckpointError(f"{path}: no complete checkpoint{why}")
    return info


def _step_dirs(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return []
    out = [(int(m[1]), p) for p in entries if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir()]
    return sorted(out)


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        text = (path / MANIFEST).read_text()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: incomplete (no {MANIFEST}: the save did not finish)") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read {MANIFEST}: {err.strerror}") from None
    try:
        manifest = load_json(text)
        ok = manifest.get("format") == FORMAT and isinstance(manifest.get("parts"), list)
    except (PipeDSLError, AttributeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path}: {MANIFEST} is not a pipedsl checkpoint manifest")
    if manifest.get("version") not in READABLE:
        raise CheckpointError(f"{path}: checkpoint format version {manifest.get('version')}, "
                              f"this pipedsl reads versions {', '.join(map(str, READABLE))}")
    return manifest


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
            f"the checkpoint (step {manifest['step']}, {_sched(manifest)}) has {part['num_stages']} stages, "
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
                              f"(step {manifest['step']}, {_sched(manifest)}, partition {part['fingerprint']})")


def _shape(d: list) -> str:
    return f"{d[1]}{d[0]}"


def _sched(manifest: dict[str, Any]) -> str:
    s = manifest["schedule"]
    return f"{s['schedule']} " + " ".join(f"{k}={v}" for k, v in s["params"].items())


# ------------------------------------------------------------------ save


@dataclass(frozen=True)
class _Layout:
    """Where this rank sits for a checkpoint: the group saving together and its (dp, pp, tp) coordinates."""

    group: Any  # the checkpoint's process group: the world under parallel=, else the pipeline's group
    rank: int  # in `group` (the global rank under parallel=)
    size: int
    coords: tuple[int, int, int]  # (dp, pp, tp)
    parallel: dict[str, Any]  # dp, pp, tp, tp_mode, zero


def _layout(pipe: Any) -> _Layout:
    cfg = getattr(pipe, "parallel", None)
    if cfg is None:
        par = {"dp": 1, "pp": pipe.size, "tp": 1, "tp_mode": "1d", "zero": 0}
        return _Layout(pipe.group, pipe.rank, pipe.size, (0, pipe.rank, 0), par)
    c = pipe.mesh.coords
    par = {"dp": cfg.dp, "pp": cfg.pp, "tp": cfg.tp, "tp_mode": cfg.tp_mode, "zero": cfg.zero}
    return _Layout(None, dist.get_rank(), dist.get_world_size(), (c.dp, c.pp, c.tp), par)


def save(pipe: Any, directory: str | os.PathLike, step: int,
         optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | PipelineOptimizer | None = None, *,
         extra: Any = None, shards: Any = None, timeout: float = 300.0) -> CheckpointInfo:
    """Write this rank's part of checkpoint `step` under `directory`; call on every rank of the pipeline
    (under `parallel=`, on every rank of the world: dp × pp × tp).

    `optimizer`: a torch optimizer (or a list of them) over this rank's stages, or what
    `pipe.optimizer(...)` returned (required with ZeRO, which holds the stages' parameters).
    `extra` (returned by `load` on the same rank) and `shards` (free-form) hold
    tensors, numbers, strings and lists, tuples and dicts of them.  Returns once the checkpoint
    is complete (rank 0 wrote the manifest).  A rank that does not
    report its part within `timeout` seconds makes the others raise an error naming it; the
    half-written checkpoint then has no manifest and never counts.
    """
    lay = _layout(pipe)
    rank, world = lay.rank, lay.size
    target = step_dir(directory, step)
    store, prefix = _begin(pipe, lay)
    seen = _failures(store)
    try:
        _check_plain(extra, f"rank {rank}: extra")
        _check_plain(shards, f"rank {rank}: shards")
        zeros, plain = _optimizers(pipe, optimizer)
        if rank == 0:
            try:
                target.mkdir(parents=True, exist_ok=True)
                (target / MANIFEST).unlink(missing_ok=True)  # overwriting: it no longer counts
                _fsync_dir(target)
            except OSError as err:
                raise CheckpointError(f"rank 0: cannot prepare {target}: {err.strerror or err}") from None
            store.set(prefix + "begin", "1")
        else:
            _wait(store, [prefix + "begin"], timeout, seen, rank, step, lambda missing: [0],
                  "preparing the checkpoint directory")
        data, meta = _part(pipe, lay, step, zeros, plain, optimizer is not None, extra, shards,
                           _training_state(pipe, optimizer))
        meta["file"] = f"rank-{rank:05d}.pt"
        try:
            _write_atomic(target / meta["file"], data, fault=("save-part", rank, step))
        except OSError as err:
            raise CheckpointError(f"rank {rank}: cannot write {target / meta['file']}: "
                                  f"{err.strerror or err}") from None
        store.set(prefix + f"part/{rank}", json.dumps(meta))
        keys = [prefix + f"part/{r}" for r in range(world)]
        _wait(store, keys, timeout, seen, rank, step,
              lambda missing: [int(k.rsplit("/", 1)[1]) for k in missing], "writing its part")
        if rank == 0:
            metas = [json.loads(store.get(k)) for k in keys]
            manifest = _manifest(pipe, lay, step, metas)
            text = json.dumps(manifest, indent=1).encode()
            try:
                _write_atomic(target / MANIFEST, text, fault=("save-manifest", rank, step), whole_first=True)
            except OSError as err:
                raise CheckpointError(f"rank 0: cannot write {target / MANIFEST}: {err.strerror or err}") from None
            store.set(prefix + "done", "1")
            for stale in target.glob(".*.tmp-*"):  # left by an earlier, interrupted save of this step
                stale.unlink(missing_ok=True)
        else:
            _wait(store, [prefix + "done"], timeout, seen, rank, step, lambda missing: [0], "writing the manifest")
            manifest = _read_manifest(target)
    except CheckpointError as err:
        record_failure(rank, err.message)
        raise
    return CheckpointInfo(target, step, manifest)


def _optimizers(pipe: Any, optimizer: Any) -> tuple[dict[int, ZeroOptimizer], list[torch.optim.Optimizer]]:
    """({stage: ZeroOptimizer}, [plain optimizers]) from what the user passed; ZeRO needs `pipe.optimizer()`'s."""
    cfg = getattr(pipe, "parallel", None)
    if isinstance(optimizer, PipelineOptimizer):
        return dict(optimizer.zero), [optimizer.optimizer] if optimizer.optimizer is not None else []
    if cfg is not None and cfg.zero:
        got = "none" if optimizer is None else type(optimizer).__name__
        raise CheckpointError(f"zero={cfg.zero}: the stages' parameters live in the ZeRO optimizer; pass the "
                              f"optimizer pipe.optimizer(...) returned (got {got})")
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


def _begin(pipe: Any, lay: _Layout) -> tuple[Any, str]:
    """The store and this save's key prefix.  The n-th save of every rank of the group shares a prefix; n is
    counted in the store itself, so a new process group (a new store) starts from 1 on every rank."""
    store = _store()
    if store is None:
        raise CheckpointError("checkpoints need the process group's store (torch.distributed is not initialised)")
    if lay.group is None and getattr(pipe, "parallel", None) is not None:
        tag = f"world{lay.size}"
    else:
        ranks = dist.get_process_group_ranks(pipe.group) if pipe.group is not None else list(range(pipe.size))
        tag = "-".join(map(str, ranks))
    try:
        n = int(store.add(f"pipedsl/ckpt/{tag}/saves/{lay.rank}", 1))
    except Exception as err:  # noqa: BLE001 - the store went away with its host
        raise RankFailure(f"rank {lay.rank}: checkpoint: lost the process group's store: {err}", lay.rank,
                          peer_failure=True) from err
    return store, f"pipedsl/ckpt/{tag}/{n}/"


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - not initialised
        return None


def _failures(store: Any) -> int:
    try:
        return int(store.add(_COUNT, 0))
    except Exception:  # noqa: BLE001
        return 0


def _wait(store: Any, keys: list[str], timeout: float, seen: int, rank: int, step: int, culprits, what: str) -> None:
    """Wait until every key is set; raise `RankFailure` naming the ranks that did not set theirs in time,
    or at once the rank that recorded a failure meanwhile."""
    deadline = time.monotonic() + timeout
    pending = list(keys)
    while True:
        try:
            pending = [k for k in pending if not store.check([k])]
            if not pending:
                return
            if int(store.add(_COUNT, 0)) > seen:
                who, _, message = store.get(f"{_COUNT}/{seen + 1}").decode().partition("\n")
                if int(who) != rank:
                    raise RankFailure(f"rank {rank}: checkpoint step {step} abandoned because rank {who} failed: "
                                      f"{message}", rank, peer=int(who), peer_failure=True)
        except RankFailure:
            raise
        except Exception as err:  # noqa: BLE001 - the store went away with its host
            raise RankFailure(f"rank {rank}: checkpoint step {step}: lost the process group's store: {err}",
                              rank, peer_failure=True) from err
        if time.monotonic() > deadline:
            ranks = sorted(set(culprits(pending)))
            names = ", ".join(map(str, ranks))
            raise RankFailure(f"rank {rank}: checkpoint step {step}: rank{'s' if len(ranks) > 1 else ''} {names} "
                              f"did not finish {what} within {timeout:g} s (dead or stuck); "
                              f"the checkpoint is incomplete and does not count",
                              rank, peer=ranks[0], peer_failure=True)
        time.sleep(_POLL)


def _training_state(pipe: Any, optimizer: Any) -> dict[str, Any]:
    """What a resumed step needs besides weights and optimizer state: the fp16 loss scale (the same on every
    rank) and the learning-rate schedule of `pipe.optimizer()`'s optimizer."""
    scaler = getattr(pipe, "scaler", None)
    schedule = getattr(optimizer, "lr_schedule", None)
    return {"loss_scale": scaler.state_dict() if scaler is not None else None,
            "lr_schedule": asdict(schedule) if schedule is not None else None}


def _restore_training_state(pipe: Any, optimizer: Any, state: dict[str, Any] | None) -> None:
    state = state or {}
    scaler = getattr(pipe, "scaler", None)
    if scaler is not None and state.get("loss_scale") is not None:
        scaler.load_state_dict(state["loss_scale"])
    if isinstance(optimizer, PipelineOptimizer) and state.get("lr_schedule") is not None:
        optimizer.lr_schedule = LRSchedule(**state["lr_schedule"])


def _part(pipe: Any, lay: _Layout, step: int, zeros: dict[int, ZeroOptimizer], plain: list[torch.optim.Optimizer],
          with_optimizer: bool, extra: Any, shards: Any, training: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """This rank's part (serialised) and its metadata for the manifest.

    Replicas hold the same stage state: only dp rank 0 stores modules, buffers and plain optimizer
    state; with ZeRO every dp rank stores its own slices.  RNG, `extra` and `shards` are per rank."""
    stages = pipe.local_stages()
    copies = pipe.local_copies()
    key = {s: min(c for (c, s2) in copies if s2 == s) for s in stages}  # canonical (stage, replica) per module
    first = lay.coords[0] == 0
    modules = {f"{s}/{key[s]}": m.state_dict() for s, m in stages.items() if s not in zeros} if first else {}
    buffers = {f"{s}/{key[s]}": _buffers(m) for s, m in stages.items() if s in zeros} if first else {}
    zero = {str(s): z.shard_state(optimizer=with_optimizer) for s, z in sorted(zeros.items())}
    optimizers = [_optimizer_state(o, stages) for o in plain] if first else []
    part = {"format": FORMAT, "version": VERSION, "step": step, "rank": lay.rank, "world_size": lay.size,
            "coords": list(lay.coords), "modules": modules, "buffers": buffers, "zero": zero,
            "optimizers": optimizers, "rng": _rng_state(), "extra": extra, "shards": shards, "training": training}
    buf = io.BytesIO()
    torch.save(part, buf)
    data = buf.getvalue()
    n_opt = len(plain) + (1 if zeros and with_optimizer else 0)
    meta = {"rank": lay.rank, "coords": list(lay.coords), "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "modules": sorted(modules), "buffers": sorted(buffers), "zero": sorted(zero),
            "copies": sorted([s, c] for c, s in copies),
            "stages": {str(s): _describe(m, zeros.get(s)) for s, m in stages.items()} if first else {},
            "optimizers": n_opt, "shards": sorted(shards) if isinstance(shards, dict) else None}
    return data, meta


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """A stage's state_dict without its parameters (for ZeRO, its flat buffers): what ZeRO does not save."""
    params = {k for k, _ in module.named_parameters(remove_duplicate=False)}
    return {k: v for k, v in module.state_dict().items()
            if k not in params and not k.rsplit(".", 1)[-1].startswith("_zero_flat")}


def _describe(module: nn.Module, zero: ZeroOptimizer | None) -> dict[str, list]:
    """`describe_stage` by the original parameter names, also when ZeRO has packed them into flat buffers."""
    if zero is None:
        return describe_stage(module)
    out = {}
    for unit in zero.layout():
        for name, shape, _offset, _numel, *also in unit["entries"]:
            for n in [name, *(also[0] if also else [])]:  # a parameter held twice in the stage: both names
                out[n] = [shape, unit["dtype"]]
    out.update(describe_stage_tensors(_buffers(module)))
    return out


def describe_stage_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, list]:
    """{name: [shape, dtype]} of named tensors."""
    return {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in tensors.items()}


def _manifest(pipe: Any, lay: _Layout, step: int, metas: list[dict[str, Any]]) -> dict[str, Any]:
    prog = pipe.program
    stages: dict[int, dict[str, list]] = {}
    tp_stages: dict[str, dict[str, list]] = {}
    for meta in metas:
        tp = meta["coords"][2]
        for s, d in meta.pop("stages").items():
            tp_stages.setdefault(f"{s}/{tp}", d)
            if tp == 0:
                stages.setdefault(int(s), d)
    head = prog.to_dict()
    del head["ranks"]
    partition: dict[str, Any] = {"num_stages": prog.num_stages, "fingerprint": fingerprint(stages),
                                 "stages": {str(s): stages[s] for s in sorted(stages)}}
    if lay.parallel["tp"] > 1:
        text = json.dumps(sorted(tp_stages.items()), sort_keys=True)
        partition["fingerprint"] = hashlib.sha256(text.encode()).hexdigest()[:16]
        partition["tp_stages"] = dict(sorted(tp_stages.items()))
    return {"format": FORMAT, "version": VERSION, "step": step, "world_size": lay.size, "time": time.time(),
            "schedule": {**head, "fingerprint": _program_fingerprint(prog)}, "parallel": lay.parallel,
            "partition": partition, "parts": metas}


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


# ------------------------------------------------------------------ files


def _write_atomic(path: Path, data: bytes, fault: tuple[str, int, int] | None = None,
                  whole_first: bool = False) -> None:
    """Write under a temporary name, fsync, rename over `path`, fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        cut = len(data) if whole_first else len(data) // 2
        f.write(data[:cut])
        if fault is not None:
            f.flush()
            fault_point(*fault)
        f.write(data[cut:])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fault_point(point: str, rank: int, step: int) -> None:
    """Test-only hook: if PIPEDSL_FAULT is `point:rank:step`, SIGKILL this process (`hang`, or a `stop-`
    prefix: SIGSTOP it, e.g. `stop-save-part:1:4` freezes rank 1 with its step-4 part half written)."""
    fault = os.environ.get("PIPEDSL_FAULT", "")
    stop = fault.startswith("stop-")
    if fault.removeprefix("stop-") == f"{point}:{rank}:{step}":
        os.kill(os.getpid(), signal.SIGSTOP if point == "hang" or stop else signal.SIGKILL)


def _read_part(path: Path, part: dict[str, Any]) -> dict[str, Any]:
    f = path / part["file"]
    try:
        data = f.read_bytes()
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read part {part['file']}: {err.strerror}") from None
    if hashlib.sha256(data).hexdigest() != part["sha256"]:
        raise CheckpointError(f"{path}: part {part['file']} of rank {part['rank']} is corrupt "
                              f"(SHA-256 differs from the manifest)")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - an unreadable file, whatever torch says
        raise CheckpointError(f"{path}: cannot load part {part['file']}: {type(err).__name__}: {err}") from None


# ------------------------------------------------------------------ load


def load(pipe: Any, source: str | os.PathLike,
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
    try:
        info = resolve(source)
        restored, finish = _load(pipe, lay, info, optimizer)
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


def _coords(part: dict[str, Any]) -> tuple[int, int, int]:
    return tuple(part["coords"]) if "coords" in part else (0, part["rank"], 0)  # version 1: pipeline only


def _saved_parallel(manifest: dict[str, Any]) -> dict[str, Any]:
    default = {"dp": 1, "pp": manifest.get("world_size", 1), "tp": 1, "tp_mode": "1d", "zero": 0}
    return {**default, **manifest.get("parallel", {})}


def _load(pipe: Any, lay: _Layout, info: CheckpointInfo, optimizer: Any) -> tuple[Restored, Any]:
    """Everything that can fail, checked and applied locally; returns the collectives to run afterwards."""
    manifest, path = info.manifest, info.path
    saved_par = _saved_parallel(manifest)
    par, (dp, _pp, tp) = lay.parallel, lay.coords
    if (saved_par["tp"], saved_par["tp_mode"]) != (par["tp"], par["tp_mode"]):
        raise CheckpointError(f"the checkpoint (step {manifest['step']}, {_sched(manifest)}) was saved with "
                              f"tp={saved_par['tp']} ({saved_par['tp_mode']}), this pipeline has tp={par['tp']} "
                              f"({par['tp_mode']}): the tp sizes differ, and tensor-parallel shards load only "
                              f"under the same tp size and layout")
    stages = pipe.local_stages()
    prog = pipe.program
    zeros, plain = _optimizers(pipe, optimizer)
    described = {s: _describe(m, zeros.get(s)) for s, m in stages.items()}
    check_partition(manifest, stages, prog.num_stages, tp=tp, described=described)
    parts = manifest["parts"]
    dense: dict[int, tuple[dict[str, Any], str]] = {}  # stage -> (part, module key) at this tp coordinate
    buffers: dict[int, tuple[dict[str, Any], str]] = {}
    sliced: dict[int, dict[int, dict[str, Any]]] = {}  # stage -> {saved dp rank: part}
    for part in parts:
        d, _, t = _coords(part)
        if t != tp:
            continue
        for key in part.get("modules", []):
            dense.setdefault(int(key.split("/")[0]), (part, key))
        for key in part.get("buffers", []):
            buffers.setdefault(int(key.split("/")[0]), (part, key))
        for key in part.get("zero", []):
            sliced.setdefault(int(key), {}).setdefault(d, part)
    cache: dict[int, dict[str, Any]] = {}

    def read(part: dict[str, Any]) -> dict[str, Any]:
        if part["rank"] not in cache:
            cache[part["rank"]] = _read_part(path, part)
        return cache[part["rank"]]

    n_saved = {p.get("optimizers", 0) for p in parts}
    n_given = len(plain) + (1 if zeros and optimizer is not None else 0)
    if optimizer is not None and n_saved != {n_given}:
        raise CheckpointError(f"the checkpoint holds the state of {max(n_saved)} optimizer(s) per rank, "
                              f"{n_given} were given to load")
    if sliced and plain and len(plain) != 1:
        raise CheckpointError(f"the checkpoint holds ZeRO optimizer state, which loads into one optimizer per "
                              f"rank, not {len(plain)}")
    want_opt = optimizer is not None
    full: dict[int, dict[str, Any]] = {}  # stage -> full-size state reassembled from ZeRO slices
    finish: list[ZeroOptimizer] = []
    for s, module in sorted(stages.items()):
        if s in sliced:
            slices = sliced[s]
            mine = slices.get(dp)
            saved_layout = read(next(iter(slices.values())))["zero"][str(s)]["layout"]
            z = zeros.get(s)
            if z is not None and mine is not None and saved_layout == z.layout() and z.stage != 0:
                state = read(mine)["zero"][str(s)]
                if not want_opt:
                    state = {**state, "optimizer": None}
                try:
                    z.load_shard_state(state)
                except ValueError as err:
                    raise CheckpointError(f"stage {s}: cannot restore the ZeRO slices of {path / mine['file']}: "
                                          f"{err}") from None
                finish.append(z)
            else:
                full[s] = _assemble(s, slices, read, path, want_opt)
                _load_full(s, module, z, full[s], want_opt, path)
            _load_buffers(s, module, buffers, read, path)
        elif s in dense:
            part, key = dense[s]
            z = zeros.get(s)
            if z is None:
                try:
                    module.load_state_dict(read(part)["modules"][key])
                except (RuntimeError, KeyError) as err:
                    raise CheckpointError(f"stage {s}: cannot load {path / part['file']}: {err}") from None
            else:
                full[s] = _from_dense(s, z, read(part), key, want_opt)
                _load_full(s, module, z, full[s], want_opt, path)
        else:
            raise CheckpointError(f"{path}: no part holds stage {s} at tp rank {tp}")
    if want_opt:
        for k, opt in enumerate(plain):
            _load_optimizer(opt, k, stages, dense, full, read)
    own_coords = (dp, lay.coords[1], tp)
    own = next((p for p in parts if _coords(p) == own_coords), None)
    fallback = next((p for p in parts if _coords(p) == (0, lay.coords[1], tp)), None)
    source = own or fallback or next(p for p in parts if p["rank"] == 0)
    saved = read(source)
    if own is not None:
        _set_rng_state(saved["rng"])
    _restore_training_state(pipe, optimizer, saved.get("training"))
    sched = manifest["schedule"]
    now = _program_fingerprint(prog)
    restored = Restored(step=info.step, path=path, extra=saved.get("extra"),
                        shards=saved.get("shards") if own is not None else None,
                        saved_schedule=_sched(manifest), schedule_changed=sched.get("fingerprint") != now,
                        rng_restored=own is not None)

    def collectives() -> None:
        for z in finish:  # stages in order, the same on every dp rank
            z.sync_parameters()

    return restored, collectives


def _assemble(s: int, slices: dict[int, dict[str, Any]], read, path: Path, want_opt: bool) -> dict[str, Any]:
    """Full-size parameters and optimizer state of stage `s` from the ZeRO slices of every saved dp rank."""
    states = {d: read(part)["zero"][str(s)] for d, part in slices.items()}
    first = states[min(states)]
    n = first["layout"][0]["n"] if first["layout"] else 1
    if sorted(states) != list(range(n)):
        raise CheckpointError(f"{path}: stage {s} has ZeRO slices of dp ranks {sorted(states)}, "
                              f"the layout needs all of 0..{n - 1}")
    if want_opt and first.get("optimizer") is None:
        raise CheckpointError(f"{path}: stage {s} was saved without optimizer state")
    params: dict[str, torch.Tensor] = {}
    opt: dict[str, dict[str, Any]] = {}
    for u, unit in enumerate(first["layout"]):
        flat = torch.cat([states[d]["units"][u]["params"] for d in range(n)])
        sharded: dict[str, torch.Tensor] = {}
        if want_opt:  # a unit of frozen parameters has no optimizer state
            for k in first["units"][u].get("sharded", {}):
                sharded[k] = torch.cat([states[d]["units"][u]["sharded"][k] for d in range(n)])
        for name, shape, offset, numel, *also in unit["entries"]:
            params[name] = flat[offset:offset + numel].view(shape).clone()
            for other in also[0] if also else []:  # the same parameter under its other names (state_dict's)
                params[other] = params[name]
            if want_opt:
                st = {k: v[offset:offset + numel].view(shape).clone() for k, v in sharded.items()}
                # a tensor per parameter: torch's Adam increments its `step` tensor in place, per parameter
                st.update({k: v.clone() if isinstance(v, torch.Tensor) else v
                           for k, v in first["units"][u].get("scalar", {}).items()})
                opt[name] = st
    return {"params": params, "state": opt if want_opt else None, "type": first.get("optimizer"),
            "hyper": first["groups"][0] if want_opt and first.get("groups") else None}


def _from_dense(s: int, z: ZeroOptimizer, part: dict[str, Any], key: str, want_opt: bool) -> dict[str, Any]:
    """The same full-size form as `_assemble`, from a stage saved without ZeRO (for a ZeRO target)."""
    module_state = part["modules"][key]
    layout = z.layout()
    names = [e[0] for unit in layout for e in unit["entries"]]
    also = {a for unit in layout for e in unit["entries"] for a in (e[4] if len(e) > 4 else [])}
    params = {n: module_state[n] for n in names if n in module_state}
    out: dict[str, Any] = {"params": params, "state": None, "type": None, "hyper": None,
                           "buffers": {k: v for k, v in module_state.items() if k not in params and k not in also}}
    if want_opt:
        saved = part["optimizers"][0]
        trained = [e[0] for unit in layout if not unit.get("frozen") for e in unit["entries"]]
        entries = {n: saved["params"].get(f"{s}/{n}") for n in trained}  # frozen ones have none
        missing = [n for n, e in entries.items() if e is None]
        if missing:
            raise CheckpointError(f"optimizer 0: the checkpoint has no state for stage {s} parameter {missing[0]!r}")
        hypers = {json.dumps(saved["groups"][e["group"]], sort_keys=True, default=str) for e in entries.values()}
        if len(hypers) > 1:
            raise CheckpointError(f"stage {s}: the saved optimizer has parameter groups with different "
                                  f"hyperparameters; ZeRO runs one group per stage, so it cannot take them")
        first = next(iter(entries.values()), None)  # None: every parameter of the stage is frozen
        out.update(state={n: e["state"] for n, e in entries.items()}, type=saved["type"],
                   hyper=saved["groups"][first["group"]] if first is not None else None)
    return out


def _load_full(s: int, module: nn.Module, z: ZeroOptimizer | None, full: dict[str, Any], want_opt: bool,
               path: Path) -> None:
    """Full-size state into a ZeRO stage (re-sliced) or a plain module (its optimizer: `_load_optimizer`)."""
    if z is None:
        try:
            module.load_state_dict({**full["params"], **full.get("buffers", _buffers(module))}, strict=True)
        except (RuntimeError, KeyError) as err:
            raise CheckpointError(f"stage {s}: cannot load the reassembled ZeRO state of {path}: {err}") from None
        return
    if want_opt and full["type"] is not None and full["type"] != type(z.optimizer).__name__:
        raise CheckpointError(f"stage {s}: the checkpoint holds {full['type']} state, the optimizer is "
                              f"{type(z.optimizer).__name__}")
    try:
        z.load_full_state(full["params"], full["state"] if want_opt else None, full["hyper"] if want_opt else None)
    except ValueError as err:
        raise CheckpointError(f"stage {s}: cannot reshard the saved state into this ZeRO layout: {err}") from None
    if "buffers" in full:
        _copy_buffers(s, module, full["buffers"], path)


def _load_buffers(s: int, module: nn.Module, buffers: dict[int, tuple[dict[str, Any], str]], read,
                  path: Path) -> None:
    if s in buffers:
        part, key = buffers[s]
        _copy_buffers(s, module, read(part)["buffers"][key], path)


def _copy_buffers(s: int, module: nn.Module, saved: dict[str, torch.Tensor], path: Path) -> None:
    here = _buffers(module)
    if set(saved) != set(here):
        raise CheckpointError(f"stage {s}: the checkpoint's buffers {sorted(saved)} are not this stage's "
                              f"{sorted(here)} ({path})")
    with torch.no_grad():
        for name, t in saved.items():
            here[name].copy_(t)


def _load_optimizer(opt: torch.optim.Optimizer, k: int, stages: dict[int, nn.Module],
                    dense: dict[int, tuple[dict[str, Any], str]], full: dict[int, dict[str, Any]], read) -> None:
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
                if f["type"] is not None and f["type"] != type(opt).__name__:
                    raise CheckpointError(f"stage {s}: the checkpoint holds {f['type']} state, optimizer {k} is "
                                          f"{type(opt).__name__}")
                st = f["state"].get(name)
                entry, saved_hyper = (None if st is None else {"state": st}), f["hyper"]
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
    """The model state of the checkpoint at `source` (or the latest under it), from any dp × pp layout and
    ZeRO stage; tensor-parallel checkpoints are refused (their shards would need the layers' split rule)."""
    info = resolve(source)
    manifest, path = info.manifest, info.path
    par = _saved_parallel(manifest)
    if par["tp"] > 1:
        raise CheckpointError(f"{path}: saved with tp={par['tp']}; reading the whole model back needs tp=1")
    cache: dict[int, dict[str, Any]] = {}

    def read(part: dict[str, Any]) -> dict[str, Any]:
        if part["rank"] not in cache:
            cache[part["rank"]] = _read_part(path, part)
        return cache[part["rank"]]

    stages: dict[int, dict[str, torch.Tensor]] = {}
    sliced: dict[int, dict[int, dict[str, Any]]] = {}
    for part in manifest["parts"]:
        for key in part.get("modules", []):
            stages.setdefault(int(key.split("/")[0]), {}).update(read(part)["modules"][key])
        for key in part.get("buffers", []):
            stages.setdefault(int(key.split("/")[0]), {}).update(read(part)["buffers"][key])
        for key in part.get("zero", []):
            sliced.setdefault(int(key), {}).setdefault(_coords(part)[0], part)
    for s, slices in sorted(sliced.items()):
        stages.setdefault(s, {}).update(_assemble(s, slices, read, path, False)["params"])
    missing = sorted(set(range(manifest["partition"]["num_stages"])) - set(stages))
    if missing:
        raise CheckpointError(f"{path}: no part holds stage {missing[0]}")
    first = next(p for p in manifest["parts"] if p["rank"] == 0)
    return SavedModel(info, stages, read(first).get("extra"))
