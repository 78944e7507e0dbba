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
the same rank index when the checkpoint has one.  `shards` is a free-form per-rank section
for later ZeRO / tensor-parallel state.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipedsl.errors import PipeRuntimeError

from .errors import _COUNT, RankFailure, record_failure

FORMAT = "pipedsl-checkpoint"
VERSION = 1
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
    extra: Any  # this rank's `extra` (rank 0's when the checkpoint has no part for this rank)
    shards: Any  # this rank's free-form shard section, or None
    saved_schedule: str  # e.g. "1F1B P=2 M=4"
    schedule_changed: bool  # the placement or the order differs from the saved program's
    rng_restored: bool  # False when the checkpoint has no part for this rank index


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
    if (path / MANIFEST).exists():
        return check(path)
    if not path.is_dir():
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
        manifest = json.loads(text)
        ok = manifest.get("format") == FORMAT and isinstance(manifest.get("parts"), list)
    except (json.JSONDecodeError, AttributeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path}: {MANIFEST} is not a pipedsl checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {manifest.get('version')}, "
                              f"this pipedsl reads version {VERSION}")
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
                    where: str = "this pipeline") -> None:
    """Raise `CheckpointError` unless `stages` ({global stage: module}) match the saved partition."""
    part = manifest["partition"]
    if part["num_stages"] != num_stages:
        raise CheckpointError(
            f"the checkpoint (step {manifest['step']}, {_sched(manifest)}) has {part['num_stages']} stages, "
            f"{where} has {num_stages}: a checkpoint loads only into the same stage partition")
    saved = {int(s): d for s, d in part["stages"].items()}
    for s, module in sorted(stages.items()):
        have, want = describe_stage(module), saved[s]
        if have == want:
            continue
        missing = sorted(set(want) - set(have))
        unexpected = sorted(set(have) - set(want))
        if missing or unexpected:
            what = (f"is missing {missing[0]!r}" if missing else f"has {unexpected[0]!r}, which the checkpoint lacks")
        else:
            name = next(k for k in want if want[k] != have[k])
            what = f"has {name!r} as {_shape(have[name])}, the checkpoint as {_shape(want[name])}"
        raise CheckpointError(f"stage {s} of {where} {what}: a different stage partition than the checkpoint's "
                              f"(step {manifest['step']}, {_sched(manifest)}, partition {part['fingerprint']})")


def _shape(d: list) -> str:
    return f"{d[1]}{d[0]}"


def _sched(manifest: dict[str, Any]) -> str:
    s = manifest["schedule"]
    return f"{s['schedule']} " + " ".join(f"{k}={v}" for k, v in s["params"].items())


# ------------------------------------------------------------------ save


_saves: dict[str, int] = {}  # per process group: how many saves this process has started (the same on every rank)


def save(pipe: Any, directory: str | os.PathLike, step: int,
         optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None, *,
         extra: Any = None, shards: Any = None, timeout: float = 300.0) -> CheckpointInfo:
    """Write this rank's part of checkpoint `step` under `directory`; call on every rank of the pipeline.

    `extra` (returned by `load` on the same rank) and `shards` (free-form, e.g. ZeRO shards) hold
    tensors, numbers, strings and lists, tuples and dicts of them.  Returns once the checkpoint
    is complete (rank 0 wrote the manifest).  A rank that does not
    report its part within `timeout` seconds makes the others raise an error naming it; the
    half-written checkpoint then has no manifest and never counts.
    """
    _supported(pipe, "save")
    rank, world = pipe.rank, pipe.size
    target = step_dir(directory, step)
    store, prefix = _begin(pipe)
    seen = _failures(store)
    try:
        _check_plain(extra, f"rank {rank}: extra")
        _check_plain(shards, f"rank {rank}: shards")
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
        data, meta = _part(pipe, step, optimizer, extra, shards)
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
            manifest = _manifest(pipe, step, metas)
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


def _supported(pipe: Any, what: str) -> None:
    """Refuse (on every rank alike) the layouts whose state is not one copy per stage yet."""
    cfg = getattr(pipe, "parallel", None)
    if cfg is None or (cfg.tp == 1 and cfg.zero == 0 and (what == "load" or cfg.dp == 1)):
        return
    raise CheckpointError(f"cannot {what} a checkpoint of a pipeline with dp={cfg.dp}, tp={cfg.tp}, zero={cfg.zero} "
                          f"yet: only pipeline-parallel state (dp=1, or loading with zero=0 and tp=1) is supported")


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


def _begin(pipe: Any) -> tuple[Any, str]:
    store = _store()
    if store is None:
        raise CheckpointError("checkpoints need the process group's store (torch.distributed is not initialised)")
    ranks = dist.get_process_group_ranks(pipe.group) if pipe.group is not None else list(range(pipe.size))
    tag = "-".join(map(str, ranks))
    n = _saves[tag] = _saves.get(tag, 0) + 1
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


def _part(pipe: Any, step: int, optimizer: Any, extra: Any, shards: Any) -> tuple[bytes, dict[str, Any]]:
    """This rank's part (serialised) and its metadata for the manifest."""
    stages = pipe.local_stages()
    copies = pipe.local_copies()
    key = {s: min(c for (c, s2) in copies if s2 == s) for s in stages}  # canonical (stage, replica) per module
    modules = {f"{s}/{key[s]}": m.state_dict() for s, m in stages.items()}
    optimizers = [_optimizer_state(o, stages) for o in _as_list(optimizer)]
    part = {"format": FORMAT, "version": VERSION, "step": step, "rank": pipe.rank, "world_size": pipe.size,
            "modules": modules, "optimizers": optimizers, "rng": _rng_state(), "extra": extra, "shards": shards}
    buf = io.BytesIO()
    torch.save(part, buf)
    data = buf.getvalue()
    meta = {"rank": pipe.rank, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "modules": sorted(modules), "copies": sorted([s, c] for c, s in copies),
            "stages": {str(s): describe_stage(m) for s, m in stages.items()},
            "optimizers": len(optimizers), "shards": sorted(shards) if isinstance(shards, dict) else None}
    return data, meta


def _manifest(pipe: Any, step: int, metas: list[dict[str, Any]]) -> dict[str, Any]:
    prog = pipe.program
    stages: dict[int, dict[str, list]] = {}
    for meta in metas:
        for s, d in meta.pop("stages").items():
            stages.setdefault(int(s), d)
    head = prog.to_dict()
    del head["ranks"]
    return {"format": FORMAT, "version": VERSION, "step": step, "world_size": pipe.size, "time": time.time(),
            "schedule": {**head, "fingerprint": _program_fingerprint(prog)},
            "partition": {"num_stages": prog.num_stages, "fingerprint": fingerprint(stages),
                          "stages": {str(s): stages[s] for s in sorted(stages)}},
            "parts": metas}


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
    """Test-only hook: if PIPEDSL_FAULT is `point:rank:step`, SIGKILL this process (`hang`: SIGSTOP it)."""
    if os.environ.get("PIPEDSL_FAULT") == f"{point}:{rank}:{step}":
        os.kill(os.getpid(), signal.SIGSTOP if point == "hang" else signal.SIGKILL)


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
         optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None) -> Restored:
    """Restore this rank's stages, optimizer state and RNG from `source`; call on every rank.

    `source` is a checkpoint directory or a directory of checkpoints (the latest complete one
    is used).  Checks the stage partition against the checkpoint first, on every rank, and
    raises the same `CheckpointError` on all of them when any rank finds a mismatch.
    """
    _supported(pipe, "load")
    error, restored = None, None
    try:
        info = resolve(source)
        restored = _load(pipe, info, _as_list(optimizer))
    except CheckpointError as err:
        error = err.message
    errors: list[str | None] = [None] * pipe.size
    try:
        dist.all_gather_object(errors, error, group=pipe.group)
    except Exception as err:  # noqa: BLE001
        raise RankFailure(f"rank {pipe.rank}: loading a checkpoint: lost the other ranks: {err}", pipe.rank,
                          peer_failure=True) from err
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        r, message = bad[0]
        everywhere = len(bad) == len(errors) and len({e for _, e in bad}) == 1
        raise CheckpointError(message if everywhere or message.startswith("rank ") else f"rank {r}: {message}")
    assert restored is not None
    pipe.steps = restored.step
    return restored


def _load(pipe: Any, info: CheckpointInfo, optimizers: list[torch.optim.Optimizer]) -> Restored:
    manifest, path = info.manifest, info.path
    stages = pipe.local_stages()
    prog = pipe.program
    check_partition(manifest, stages, prog.num_stages)
    # which part holds each stage (any replica: copies of a stage hold the same weights)
    holder: dict[int, tuple[dict[str, Any], str]] = {}
    for part in manifest["parts"]:
        for key in part["modules"]:
            holder.setdefault(int(key.split("/")[0]), (part, key))
    by_rank = {p["rank"]: p for p in manifest["parts"]}
    own = by_rank.get(pipe.rank)
    cache: dict[int, dict[str, Any]] = {}

    def read(part: dict[str, Any]) -> dict[str, Any]:
        if part["rank"] not in cache:
            cache[part["rank"]] = _read_part(path, part)
        return cache[part["rank"]]

    for s, module in stages.items():
        part, key = holder[s]
        try:
            module.load_state_dict(read(part)["modules"][key])
        except (RuntimeError, KeyError) as err:
            raise CheckpointError(f"stage {s}: cannot load {path / part['file']}: {err}") from None
    n_saved = {p.get("optimizers", 0) for p in manifest["parts"]}
    if optimizers and n_saved != {len(optimizers)}:
        raise CheckpointError(f"the checkpoint holds the state of {max(n_saved)} optimizer(s) per rank, "
                              f"{len(optimizers)} were given to load")
    for k, opt in enumerate(optimizers):
        _load_optimizer(opt, k, stages, holder, read)
    source = own or by_rank[0]
    saved = read(source)
    if own is not None:
        _set_rng_state(saved["rng"])
    sched = manifest["schedule"]
    now = _program_fingerprint(prog)
    return Restored(step=info.step, path=path, extra=saved.get("extra"),
                    shards=saved.get("shards") if own is not None else None,
                    saved_schedule=_sched(manifest), schedule_changed=sched.get("fingerprint") != now,
                    rng_restored=own is not None)


def _load_optimizer(opt: torch.optim.Optimizer, k: int, stages: dict[int, nn.Module],
                    holder: dict[int, tuple[dict[str, Any], str]], read) -> None:
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
            saved = read(holder[s][0])["optimizers"][k]
            entry = saved["params"].get(f"{s}/{name}")
            if entry is None:
                raise CheckpointError(f"optimizer {k}: the checkpoint has no state for stage {s} parameter {name!r}")
            if entry["state"]:
                state[idx] = entry["state"]
            hyper = hyper or saved["groups"][entry["group"]]
        groups.append({**{k2: v for k2, v in cur.items() if k2 != "params"}, **(hyper or {}), "params": cur["params"]})
    try:
        opt.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as err:
        raise CheckpointError(f"optimizer {k}: cannot load its state: {err}") from None

