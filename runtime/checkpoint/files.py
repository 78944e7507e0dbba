"""A checkpoint on disk: its files, how they are found, written and committed.

A checkpoint is a directory `DIR/step-00000020/` holding one part a rank (`rank-00000.pt`, a
torch.save'd dict; what goes into it is runtime/checkpoint/state.py's business) and `manifest.json`.
Every file is written atomically (temporary name, fsync, rename, fsync of the directory).  The
manifest is written last, by rank 0, once every rank has reported its part durable (a wait on
the process group's store, bounded by a timeout); so a checkpoint *counts* only when the
manifest exists and names every part with its size and SHA-256.  A save interrupted at any point
leaves no manifest and `latest()` skips it; the previous checkpoint still loads.

Test hook (tests only): `PIPEDSL_FAULT=POINT:RANK:STEP` makes that rank SIGKILL itself at `POINT`
of that step: `save-part` (its part half written under the temporary name) or `save-manifest`
(rank 0, the manifest written under its temporary name, not yet renamed); `pipedsl train` uses
`step` (killed mid-step) and `hang` (stopped mid-step, SIGSTOP: a stuck rank that never exits),
see train_cli.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipedsl.errors import PipeDSLError, PipeRuntimeError
from pipedsl.limits import load_json
from pipedsl.runtime.launch.errors import _COUNT, RankFailure, record_failure

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
        return schedule_name(self.manifest)


# ------------------------------------------------------------------ what a manifest says


def schedule_name(manifest: dict[str, Any]) -> str:
    s = manifest["schedule"]
    return f"{s['schedule']} " + " ".join(f"{k}={v}" for k, v in s["params"].items())


def part_coords(part: dict[str, Any]) -> tuple[int, int, int]:
    """A part's (dp, pp, tp) coordinates."""
    return tuple(part["coords"]) if "coords" in part else (0, part["rank"], 0)  # version 1: pipeline only


def saved_parallel(manifest: dict[str, Any]) -> dict[str, Any]:
    """The dp, pp, tp, tp_mode, zero and ep it was saved with (version 1: a pipeline alone)."""
    default = {"dp": 1, "pp": manifest.get("world_size", 1), "tp": 1, "tp_mode": "1d", "zero": 0, "ep": 1}
    return {**default, **manifest.get("parallel", {})}


# ------------------------------------------------------------------ discovery


def step_dir(directory: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of `step` lives under `directory`."""
    return Path(directory) / f"step-{step:08d}"


def check(path: str | os.PathLike, verify: bool = False) -> CheckpointInfo:
    """The checkpoint at `path` if it is complete (manifest present, every part present with its size);
    with `verify`, also every part's SHA-256.  Raises `CheckpointError` saying what is missing."""
    path = Path(path)
    manifest = read_manifest(path)
    for part in manifest["parts"]:
        f = path / part["file"]
        try:
            size = f.stat().st_size
        except OSError:
            raise CheckpointError(f"{path}: part {part['file']} of rank {part['rank']} is missing") from None
        if size != part["bytes"]:
            raise CheckpointError(f"{path}: part {part['file']} has {size} bytes, the manifest says {part['bytes']}")
        if verify:
            read_part(path, part)
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


def prune(directory: str | os.PathLike, keep: int) -> list[Path]:
    """Remove all but the newest `keep` complete checkpoints under `directory`, and every incomplete step older
    than the newest complete one (an abandoned save); returns what was removed.  Call once the newest is
    complete (`save` returned), on one process."""
    import shutil

    complete = checkpoints(directory)
    if not complete:
        return []
    newest = complete[-1].step
    kept = {info.path for info in complete[-keep:]} if keep else {info.path for info in complete}
    removed = []
    for step, path in _step_dirs(directory):
        if path not in kept and step < newest:  # an older complete one beyond `keep`, or an abandoned step
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


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


def read_manifest(path: Path) -> dict[str, Any]:
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


# ------------------------------------------------------------------ parts


def encode_part(part: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """A part's bytes, and the size and SHA-256 the manifest records for them."""
    buf = io.BytesIO()
    torch.save(part, buf)
    data = buf.getvalue()
    return data, {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def read_part(path: Path, part: dict[str, Any]) -> dict[str, Any]:
    """The part the manifest entry `part` names, checked against its SHA-256."""
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


def part_reader(path: Path) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """`read_part` under `path`, each part read once (a rank may need one part for several stages)."""
    cache: dict[int, dict[str, Any]] = {}

    def read(part: dict[str, Any]) -> dict[str, Any]:
        if part["rank"] not in cache:
            cache[part["rank"]] = read_part(path, part)
        return cache[part["rank"]]

    return read


# ------------------------------------------------------------------ atomic files


def write_atomic(path: Path, data: bytes, fault: tuple[str, int, int] | None = None,
                 whole_first: bool = False) -> None:
    """Write under a temporary name, fsync, rename over `path`, fsync the directory.  A write that fails (a full
    disk) removes its temporary file: a failed save leaves no bytes behind."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
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
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
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


# ------------------------------------------------------------------ the commit protocol


class Commit:
    """One save of checkpoint `step` into `target` by `rank` of `world` ranks: parts first, manifest last.

    The ranks meet on the process group's store under a prefix shared by the n-th save of every rank of
    the group (`tag` names the group); n is counted in the store itself, so a new process group (a new
    store) starts from 1 on every rank.  A rank that fails records it there, and the others stop waiting."""

    def __init__(self, target: Path, step: int, rank: int, world: int, tag: str, timeout: float) -> None:
        self.target, self.step, self.rank, self.world, self.timeout = target, step, rank, world, timeout
        self.store = _store()
        if self.store is None:
            raise CheckpointError("checkpoints need the process group's store (torch.distributed is not initialised)")
        try:
            n = int(self.store.add(f"pipedsl/ckpt/{tag}/saves/{rank}", 1))
        except Exception as err:  # noqa: BLE001 - the store went away with its host
            raise RankFailure(f"rank {rank}: checkpoint: lost the process group's store: {err}", rank,
                              peer_failure=True) from err
        self.prefix = f"pipedsl/ckpt/{tag}/{n}/"
        self.seen = _failures(self.store)

    @contextmanager
    def reporting(self) -> Iterator[None]:
        """A `CheckpointError` raised inside is recorded for the other ranks, which then give up at once."""
        try:
            yield
        except CheckpointError as err:
            record_failure(self.rank, err.message)
            raise

    def run(self, part: Callable[[], tuple[bytes, dict[str, Any]]],
            manifest: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> dict[str, Any]:
        """Write this rank's part (`part()`: its bytes and manifest entry); rank 0 then writes `manifest(entries)`
        of every rank's entry.  Returns the manifest once it is durable."""
        store, rank, target = self.store, self.rank, self.target
        if rank == 0:
            try:
                target.mkdir(parents=True, exist_ok=True)
                (target / MANIFEST).unlink(missing_ok=True)  # overwriting: it no longer counts
                fsync_dir(target)
            except OSError as err:
                raise CheckpointError(f"rank 0: cannot prepare {target}: {err.strerror or err}") from None
            store.set(self.prefix + "begin", "1")
        else:
            self._wait([self.prefix + "begin"], lambda missing: [0], "preparing the checkpoint directory")
        data, meta = part()
        meta["file"] = f"rank-{rank:05d}.pt"
        written = target / meta["file"]
        try:
            write_atomic(written, data, fault=("save-part", rank, self.step))
        except OSError as err:
            raise CheckpointError(f"rank {rank}: cannot write {written}: {err.strerror or err}") from None
        try:
            return self._commit(meta, manifest)
        except BaseException:  # abandoned: this rank's part never counts, so it takes no disk
            if not (target / MANIFEST).exists():
                with contextlib.suppress(OSError):
                    written.unlink(missing_ok=True)
                    target.rmdir()  # when it was the last file of the step (not an older, complete one's)
            raise

    def _commit(self, meta: dict[str, Any], manifest: Callable[[list[dict[str, Any]]], dict[str, Any]]
                ) -> dict[str, Any]:
        """After this rank's part is durable: report it, and on rank 0 write the manifest once every part is."""
        store, rank, target = self.store, self.rank, self.target
        store.set(self.prefix + f"part/{rank}", json.dumps(meta))
        keys = [self.prefix + f"part/{r}" for r in range(self.world)]
        self._wait(keys, lambda missing: [int(k.rsplit("/", 1)[1]) for k in missing], "writing its part")
        if rank != 0:
            self._wait([self.prefix + "done"], lambda missing: [0], "writing the manifest")
            return read_manifest(target)
        done = manifest([json.loads(store.get(k)) for k in keys])
        text = json.dumps(done, indent=1).encode()
        try:
            write_atomic(target / MANIFEST, text, fault=("save-manifest", rank, self.step), whole_first=True)
        except OSError as err:
            raise CheckpointError(f"rank 0: cannot write {target / MANIFEST}: {err.strerror or err}") from None
        store.set(self.prefix + "done", "1")
        for stale in target.glob(".*.tmp-*"):  # left by an earlier, interrupted save of this step
            stale.unlink(missing_ok=True)
        return done

    def _wait(self, keys: list[str], culprits: Callable[[list[str]], list[int]], what: str) -> None:
        """Wait until every key is set; raise `RankFailure` naming the ranks that did not set theirs in time,
        or at once the rank that recorded a failure meanwhile."""
        store, rank, step, timeout = self.store, self.rank, self.step, self.timeout
        deadline = time.monotonic() + timeout
        pending = list(keys)
        while True:
            try:
                pending = [k for k in pending if not store.check([k])]
                if not pending:
                    return
                if int(store.add(_COUNT, 0)) > self.seen:
                    who, _, message = store.get(f"{_COUNT}/{self.seen + 1}").decode().partition("\n")
                    if int(who) != rank:
                        raise RankFailure(f"rank {rank}: checkpoint step {step} abandoned because rank {who} "
                                          f"failed: {message}", rank, peer=int(who), peer_failure=True)
            except RankFailure:
                raise
            except Exception as err:  # noqa: BLE001 - the store went away with its host
                raise RankFailure(f"rank {rank}: checkpoint step {step}: lost the process group's store: {err}",
                                  rank, peer_failure=True) from err
            if time.monotonic() > deadline:
                ranks = sorted(set(culprits(pending)))
                names = ", ".join(map(str, ranks))
                raise RankFailure(f"rank {rank}: checkpoint step {step}: rank{'s' if len(ranks) > 1 else ''} "
                                  f"{names} did not finish {what} within {timeout:g} s (dead or stuck); "
                                  f"the checkpoint is incomplete and does not count",
                                  rank, peer=ranks[0], peer_failure=True)
            time.sleep(_POLL)


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
