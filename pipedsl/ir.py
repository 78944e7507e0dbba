"""The intermediate representation (a contract): instructions and per-rank programs.

An `Instr` is a tiny frozen record with a one-line text form that parses back
(`F2.3` = forward of microbatch 2 through stage 3, `SEND_F2.3>1` = its activation sent to
rank 1, `RECV_B2.3<4`, `F2.3r1` = on replica 1, `REDUCE_GRAD.3`, `OPTIMIZER_STEP`).
`F4.0&B1.7` is an overlapped pair (torch's OVERLAP_F_B, DeepSeek's F&B): the forward of one
microbatch and stage run together with the full backward of another, so that communication
inside one (an expert all-to-all) can hide behind the other's compute.
A `Program` holds one instruction stream per rank plus the placement it was built for,
and round-trips through text, JSON and CSV.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple

from pipedsl.errors import ValidationError
from pipedsl.limits import (
    MAX_COMPUTE_OPS,
    MAX_INSTRUCTIONS,
    MAX_MICROBATCHES,
    MAX_RANKS,
    MAX_STAGES,
    load_json,
    shorten,
)
from pipedsl.perf import no_gc


class Op(StrEnum):
    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the zero-bubble papers' name for the input-gradient backward
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    REDUCE_GRAD = "REDUCE_GRAD"
    OPTIMIZER_STEP = "OPTIMIZER_STEP"
    OVERLAP = "OVERLAP_F_B"  # a forward and a full backward in one instruction: `sub` holds both


COMPUTE = frozenset({Op.F, Op.B, Op.I, Op.W, Op.OVERLAP})
SENDS = frozenset({Op.SEND_F, Op.SEND_B})
RECVS = frozenset({Op.RECV_F, Op.RECV_B})
COMMS = SENDS | RECVS
BACKWARD_INPUT = frozenset({Op.B, Op.I})  # ops that produce the gradient for stage - 1
RELEASES = frozenset({Op.B, Op.W})  # ops after which a stage's activation can be freed


class Instr(NamedTuple):
    """One instruction.  `stage` is global (0 … S-1); `peer` only on SEND/RECV; `sub` only on
    OVERLAP_F_B: its forward and its full backward (the pair itself has no mb or stage).

    An immutable named tuple rather than a frozen dataclass: programs hold millions of
    them and a tuple is built four times faster.
    """

    op: Op
    mb: int | None = None
    stage: int | None = None
    peer: int | None = None
    replica: int = 0
    sub: tuple[Instr, Instr] | None = None

    @classmethod
    def pair(cls, forward: Instr, backward: Instr) -> Instr:
        """The overlapped pair `forward&backward` (an F and a B)."""
        instr = cls(Op.OVERLAP, sub=(forward, backward))
        instr.check_fields()
        return instr

    @property
    def parts(self) -> tuple[Instr, ...]:
        """The compute ops this instruction runs: both halves of a pair, else itself."""
        return self.sub if self.sub is not None else (self,)

    def __str__(self) -> str:
        if self.sub is not None:
            return f"{self.sub[0]}&{self.sub[1]}"
        rep = f"r{self.replica}" if self.replica else ""
        if self.op == Op.OPTIMIZER_STEP:
            return "OPTIMIZER_STEP"
        if self.op == Op.REDUCE_GRAD:
            return f"REDUCE_GRAD.{self.stage}{rep}"
        text = f"{self.op.value}{self.mb}.{self.stage}{rep}"
        if self.op in SENDS:
            return f"{text}>{self.peer}"
        if self.op in RECVS:
            return f"{text}<{self.peer}"
        return text

    @property
    def key(self) -> tuple[int | None, int | None, int]:
        """(mb, stage, replica): what a compute op or a message is about."""
        return (self.mb, self.stage, self.replica)

    def to_dict(self, with_replica: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {"op": self.op.value}
        if self.sub is not None:
            d["sub"] = [part.to_dict(with_replica) for part in self.sub]
            return d
        if self.mb is not None:
            d["mb"] = self.mb
        if self.stage is not None:
            d["stage"] = self.stage
        if with_replica and self.op != Op.OPTIMIZER_STEP:
            d["replica"] = self.replica
        if self.peer is not None:
            d["peer"] = self.peer
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Instr:
        if not isinstance(d, dict) or "op" not in d:
            raise ValueError(f"an instruction is an object with an 'op', got {d!r}")
        op = _op(d["op"])
        if op is Op.OVERLAP:
            sub = d.get("sub")
            if not isinstance(sub, list) or len(sub) != 2:
                raise ValueError(f"OVERLAP_F_B needs 'sub': [its forward, its backward], got {sub!r}")
            return cls.pair(cls.from_dict(sub[0]), cls.from_dict(sub[1]))
        fields = {k: d.get(k) for k in ("mb", "stage", "peer")}
        for k, v in fields.items():
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"'{k}' must be a non-negative integer, got {shorten(v)}")
        replica = d.get("replica", 0)
        if not isinstance(replica, int) or isinstance(replica, bool) or replica < 0:
            raise ValueError(f"'replica' must be a non-negative integer, got {shorten(replica)}")
        instr = cls(op, fields["mb"], fields["stage"], fields["peer"], replica)
        instr.check_ranges()
        instr.check_fields()
        return instr

    @classmethod
    def parse(cls, text: str) -> Instr:
        """Inverse of `str()`."""
        if "&" in text:
            first, _, second = text.strip().partition("&")
            return cls.pair(cls.parse(first), cls.parse(second))
        m = _INSTR_RE.fullmatch(text.strip())
        if m and max(map(len, filter(None, (m["rstage"], m["rep"], m["crep"], m["mb"], m["stage"], m["peer"]))),
                     default=0) > 9:
            raise ValueError(f"{text[:40]!r}: a number of more than 9 digits (the limits are MAX_MICROBATCHES="
                             f"{MAX_MICROBATCHES:,}, MAX_STAGES={MAX_STAGES:,}, MAX_RANKS={MAX_RANKS:,})")
        if not m:
            raise ValueError(f"not an instruction: {text!r} (expected e.g. F0.1, SEND_F0.1>2, REDUCE_GRAD.1)")
        if m["step"]:
            return cls(Op.OPTIMIZER_STEP)
        replica = int(m["rep"] or m["crep"] or 0)
        if m["reduce"]:
            return cls(Op.REDUCE_GRAD, stage=int(m["rstage"]), replica=replica)
        op = _op(m["op"])
        peer = int(m["peer"]) if m["peer"] else None
        instr = cls(op, int(m["mb"]), int(m["stage"]), peer, replica)
        if (op in SENDS and m["dir"] != ">") or (op in RECVS and m["dir"] != "<"):
            raise ValueError(f"{text!r}: a send names its peer with '>', a receive with '<'")
        instr.check_fields()
        instr.check_ranges()
        return instr

    def check_ranges(self) -> None:
        """Raise ValueError when a field is over its limit (limits.py): a loader allocates by them."""
        for name, most, limit in (("mb", MAX_MICROBATCHES, "MAX_MICROBATCHES"), ("stage", MAX_STAGES, "MAX_STAGES"),
                                  ("peer", MAX_RANKS, "MAX_RANKS"), ("replica", MAX_STAGES, "MAX_STAGES")):
            v = getattr(self, name)
            if v is not None and v >= most:
                raise ValueError(f"'{name}' {shorten(v)} is over the limit: below {most:,} ({limit})")

    def check_fields(self) -> None:
        """Raise ValueError when the fields present do not fit the op."""
        if self.op is Op.OVERLAP or self.sub is not None:
            if self.op is not Op.OVERLAP or self.sub is None:
                raise ValueError(f"only OVERLAP_F_B has sub-instructions, not {self.op.value}")
            if any(x is not None for x in (self.mb, self.stage, self.peer)) or self.replica:
                raise ValueError("OVERLAP_F_B names its microbatches and stages in its two parts only")
            forward, backward = self.sub
            if forward.op is not Op.F or backward.op is not Op.B:
                raise ValueError(f"an overlapped pair is a forward and a full backward (F…&B…), "
                                 f"not {forward.op.value}&{backward.op.value}")
            return
        need_mb = self.op not in (Op.REDUCE_GRAD, Op.OPTIMIZER_STEP)
        need_stage = self.op != Op.OPTIMIZER_STEP
        need_peer = self.op in COMMS
        for name, needed in (("mb", need_mb), ("stage", need_stage), ("peer", need_peer)):
            present = getattr(self, name) is not None
            if needed and not present:
                raise ValueError(f"{self.op.value} needs '{name}'")
            if present and not needed:
                raise ValueError(f"{self.op.value} takes no '{name}'")


_INSTR_RE = re.compile(
    r"(?P<step>OPTIMIZER_STEP)"
    r"|(?P<reduce>REDUCE_GRAD)\.(?P<rstage>\d+)(?:r(?P<rep>\d+))?"
    r"|(?P<op>SEND_F|SEND_B|RECV_F|RECV_B|F|B|I|W)(?P<mb>\d+)\.(?P<stage>\d+)(?:r(?P<crep>\d+))?"
    r"(?:(?P<dir>[<>])(?P<peer>\d+))?"
)


def _op(value: object) -> Op:
    try:
        return Op(value)
    except ValueError:
        known = ", ".join(o.value for o in Op)
        raise ValueError(f"unknown op {value!r} (known: {known})") from None


_OPS = {op.value: op for op in Op}
# (needs mb, needs stage, needs peer) of each single op: what check_fields demands
_SHAPES = {op: (op not in (Op.REDUCE_GRAD, Op.OPTIMIZER_STEP), op is not Op.OPTIMIZER_STEP, op in COMMS)
           for op in Op if op is not Op.OVERLAP}
_new = tuple.__new__


def _plain(op: Op, mb: object, stage: object, peer: object, replica: object) -> Instr | None:
    """The instruction when every field is what `check_fields` and `check_ranges` accept (an int in
    range, present exactly when `op` needs it), else None: the loaders' cheap common case, leaving
    the full checks to say what is wrong.  `type(x) is int` refuses bools as the full checks do."""
    shape = _SHAPES.get(op)
    if shape is None or type(replica) is not int or not 0 <= replica < MAX_STAGES:
        return None
    need_mb, need_stage, need_peer = shape
    if not ((type(mb) is int and 0 <= mb < MAX_MICROBATCHES) if need_mb else mb is None):
        return None
    if not ((type(stage) is int and 0 <= stage < MAX_STAGES) if need_stage else stage is None):
        return None
    if not ((type(peer) is int and 0 <= peer < MAX_RANKS) if need_peer else peer is None):
        return None
    return _new(Instr, (op, mb, stage, peer, replica, None))


# F2.3, SEND_F2.3>1, RECV_B0.1r1<4: the text form of nearly every instruction, at most 9 digits a number
_PLAIN_TEXT = re.compile(r"(SEND_F|SEND_B|RECV_F|RECV_B|F|B|I|W)(\d{1,9})\.(\d{1,9})(?:r(\d{1,9}))?"
                         r"(?:([<>])(\d{1,9}))?")
_ARROW = {Op.SEND_F: ">", Op.SEND_B: ">", Op.RECV_F: "<", Op.RECV_B: "<"}


def _parse_token(token: str) -> Instr:
    """`Instr.parse` for a whitespace-free token, the common forms without its general regex."""
    m = _PLAIN_TEXT.fullmatch(token)
    if m is not None:
        name, mb, stage, replica, arrow, peer = m.groups()
        op = _OPS[name]
        if arrow == _ARROW.get(op):
            instr = _plain(op, int(mb), int(stage), int(peer) if peer else None, int(replica) if replica else 0)
            if instr is not None:
                return instr
    return Instr.parse(token)


@dataclass(frozen=True)
class Program:
    """One instruction stream per rank, with the placement and routing it was built for.

    `placement[(replica, stage)]` is the rank holding that copy of the stage;
    `microbatch_replica[m]` is the replica (pipeline direction) microbatch m goes through.
    """

    name: str
    params: dict[str, int]
    num_stages: int
    num_replicas: int
    placement: dict[tuple[int, int], int]
    microbatch_replica: tuple[int, ...]
    ranks: tuple[tuple[Instr, ...], ...]
    meta: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_size(len(self.ranks), len(self.microbatch_replica), self.num_stages, self.num_replicas)

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatch_replica)

    @property
    def split_backward(self) -> bool:
        return any(i.op == Op.I for stream in self.ranks for i in stream)

    def forward_only(self) -> Program:
        """The program of an evaluation pass: each rank's forwards and their messages in the same order, the
        forward half of every overlapped pair, and the step end; no backward, gradient message or
        reduction.  Valid whenever this program is: only waits are removed, and the remaining messages
        keep their order per pair of ranks."""
        keep = (Op.F, Op.SEND_F, Op.RECV_F, Op.OPTIMIZER_STEP)
        ranks = tuple(tuple(i.sub[0] if i.op is Op.OVERLAP else i for i in stream
                            if i.op in keep or i.op is Op.OVERLAP) for stream in self.ranks)
        return Program(self.name, dict(self.params), self.num_stages, self.num_replicas, dict(self.placement),
                       self.microbatch_replica, ranks, dict(self.meta))

    def stages_of(self, rank: int) -> list[tuple[int, int]]:
        """(replica, stage) pairs held by `rank`, in stage order."""
        return sorted((k for k, r in self.placement.items() if r == rank), key=lambda k: (k[1], k[0]))

    def num_instructions(self) -> int:
        return sum(len(s) for s in self.ranks)

    def compute_orders(self) -> list[list[str]]:
        """Per rank, the compute ops only, as text: what schedule papers draw."""
        return [[str(i) for i in stream if i.op in COMPUTE] for stream in self.ranks]

    # ------------------------------------------------------------ text

    def to_text(self) -> str:
        header = f"# {self.name} " + " ".join(f"{k}={v}" for k, v in self.params.items())
        return "\n".join([header, *(f"r{r}: " + " ".join(map(str, s)) for r, s in enumerate(self.ranks))]) + "\n"

    @classmethod
    @no_gc()  # a million tuples without cycles: collections would only rescan them
    def from_text(cls, text: str, name: str = "program") -> Program:
        """Parse `to_text` output; placement and routing are read off the compute ops."""
        streams: list[list[Instr]] = []
        for lineno, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if line.startswith("#") and not streams:
                name = line[1:].split()[0] if line[1:].split() else name
                continue
            if not line or line.startswith("#"):
                continue
            head, sep, rest = line.partition(":")
            if not sep or not re.fullmatch(r"r\d{1,9}", head.strip()) or int(head.strip()[1:]) != len(streams):
                raise ValidationError(f"line {lineno}: expected 'r{len(streams)}: <instructions>', got {line[:40]!r}")
            if len(streams) >= MAX_RANKS:
                raise ValidationError(f"line {lineno}: more than {MAX_RANKS:,} ranks (MAX_RANKS)")
            try:
                streams.append(list(map(_parse_token, rest.split())))
            except ValueError as err:
                raise ValidationError(f"line {lineno}: {err}") from None
        return cls.from_streams(streams, name)

    @classmethod
    def from_streams(cls, streams: Sequence[Iterable[Instr]], name: str = "program",
                     params: dict[str, int] | None = None) -> Program:
        """Build a program from bare streams, deriving placement and routing from compute ops."""
        ranks = tuple(tuple(s) for s in streams)
        check_size(len(ranks), 1, 1, 1, sum(map(len, ranks)))
        placement: dict[tuple[int, int], int] = {}
        routes: dict[int, int] = {}
        place, route, single = placement.setdefault, routes.setdefault, _SINGLE_COMPUTE
        for r, stream in enumerate(ranks):
            for idx, ins in enumerate(stream):
                for i in (ins,) if ins.sub is None else ins.sub:
                    if i.op not in single:
                        continue
                    _, m, s, _, c, _ = i
                    if place((c, s), r) != r:
                        first = _first_compute(ranks, c, s)
                        raise ValidationError(
                            f"rank {r} instruction {idx} ({i}): stage {s} replica {c} also has ops on "
                            f"rank {first[0]} (instruction {first[1]}); a stage lives on one rank")
                    if route(m, c) != c:
                        raise ValidationError(f"rank {r} instruction {idx} ({i}): microbatch {m} runs on two replicas")
        num_mb = max(routes, default=-1) + 1
        check_size(len(ranks), num_mb, max((s for _, s in placement), default=0) + 1,
                   max((c for c, _ in placement), default=0) + 1)
        missing = [m for m in range(num_mb) if m not in routes]
        if missing:
            raise ValidationError(f"microbatch {missing[0]} has no compute op on any rank")
        num_stages = max((s for _, s in placement), default=-1) + 1
        num_replicas = max((c for c, _ in placement), default=-1) + 1
        params = params or {"P": len(ranks), "M": num_mb}
        return cls(name, params, num_stages, num_replicas, placement,
                   tuple(routes[m] for m in range(num_mb)), ranks)

    # ------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        rep = self.num_replicas > 1
        return {
            "schedule": self.name,
            "params": dict(self.params),
            "num_stages": self.num_stages,
            "num_replicas": self.num_replicas,
            "placement": [{"replica": c, "stage": s, "rank": r} for (c, s), r in sorted(self.placement.items())],
            "microbatch_replica": list(self.microbatch_replica),
            "ranks": [[i.to_dict(rep) for i in stream] for stream in self.ranks],
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: Any) -> Program:
        """Inverse of `to_dict`; malformed input raises `ValidationError` saying what and where."""
        if not isinstance(d, dict):
            raise ValidationError("a program is a JSON object with 'ranks'")
        if "ranks" not in d or not isinstance(d["ranks"], list):
            raise ValidationError("a program needs 'ranks': a list of instruction lists, one per rank")
        check_size(len(d["ranks"]), 1, 1, 1, sum(len(s) for s in d["ranks"] if isinstance(s, list)))
        streams = []
        for r, stream in enumerate(d["ranks"]):
            if not isinstance(stream, list):
                raise ValidationError(f"rank {r}: expected a list of instructions")
            instrs = []
            append = instrs.append
            for idx, item in enumerate(stream):
                instr = None
                if type(item) is dict:  # the common case first: no Instr.from_dict and its checks by name
                    op = item.get("op")
                    op = _OPS.get(op) if type(op) is str else None
                    if op is not None:
                        instr = _plain(op, item.get("mb"), item.get("stage"), item.get("peer"), item.get("replica", 0))
                if instr is None:
                    try:
                        instr = Instr.from_dict(item)
                    except ValueError as err:
                        raise ValidationError(f"rank {r} instruction {idx}: {err}") from None
                append(instr)
            streams.append(instrs)
        derived = cls.from_streams(streams, str(d.get("schedule", "program")))
        if "placement" not in d:
            return derived
        try:
            placement = {(int(p.get("replica", 0)), int(p["stage"])): int(p["rank"]) for p in d["placement"]}
            routes = tuple(int(c) for c in d.get("microbatch_replica", derived.microbatch_replica))
            params = {str(k): int(v) for k, v in d.get("params", derived.params).items()}
            num_stages = int(d.get("num_stages", derived.num_stages))
            num_replicas = int(d.get("num_replicas", derived.num_replicas))
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as err:  # inf: OverflowError
            raise ValidationError(f"malformed program header: {shorten(err)}") from None
        check_size(len(derived.ranks), len(routes), num_stages, num_replicas)
        return cls(derived.name, params, num_stages, num_replicas, placement, routes, derived.ranks)

    @classmethod
    @no_gc()  # a million tuples without cycles: collections would only rescan them
    def from_json(cls, text: str) -> Program:
        return cls.from_dict(load_json(text, error=ValidationError))

    # ------------------------------------------------------------ CSV

    CSV_COLUMNS = ("rank", "index", "op", "mb", "stage", "replica", "peer")

    def to_csv(self) -> str:
        out = io.StringIO()
        w = csv.writer(out, lineterminator="\n")
        w.writerow(self.CSV_COLUMNS)
        for r, stream in enumerate(self.ranks):
            for idx, i in enumerate(stream):
                if i.sub is not None:  # a pair: "forward;backward" in the mb, stage and replica cells
                    f, b = i.sub
                    w.writerow([r, idx, i.op.value, f"{f.mb};{b.mb}", f"{f.stage};{b.stage}",
                                f"{f.replica};{b.replica}", ""])
                    continue
                w.writerow([r, idx, i.op.value, _blank(i.mb), _blank(i.stage), i.replica, _blank(i.peer)])
        return out.getvalue()

    @classmethod
    @no_gc()  # a million tuples without cycles: collections would only rescan them
    def from_csv(cls, text: str, name: str = "program") -> Program:
        try:
            rows = list(csv.reader(io.StringIO(text, newline="")))
        except csv.Error as err:
            raise ValidationError(f"not CSV: {err}") from None
        if not rows or tuple(c.strip() for c in rows[0]) != cls.CSV_COLUMNS:
            raise ValidationError(f"CSV header must be {','.join(cls.CSV_COLUMNS)}")
        streams: list[list[Instr]] = []
        for lineno, row in enumerate(rows[1:], 2):
            if not row:
                continue
            instr = None
            if len(row) == 7 and row[2] in _OPS:  # the common case, without building a dict
                try:
                    rank, index, _, mb, stage, replica, peer = row
                    rank, index = int(rank), int(index)
                    if 0 <= rank < MAX_RANKS and index >= 0:
                        instr = _plain(_OPS[row[2]], int(mb) if mb else None, int(stage) if stage else None,
                                       int(peer) if peer else None, int(replica) if replica else 0)
                except ValueError:
                    instr = None
            if instr is None:
                try:
                    rank, index, instr = _csv_row(row)
                except ValueError as err:
                    raise ValidationError(f"CSV line {lineno}: {err}") from None
            while len(streams) <= rank:
                streams.append([])
            if index != len(streams[rank]):
                raise ValidationError(f"CSV line {lineno}: rank {rank} index {index} out of sequence "
                                      f"(expected {len(streams[rank])})")
            streams[rank].append(instr)
        return cls.from_streams(streams, name)


def check_size(ranks: int, microbatches: int, stages: int, replicas: int, instructions: int = 0) -> None:
    """Refuse a program larger than any the compiler builds (limits.py), before anything loops
    over its ranks, microbatches or stages."""
    if ranks > MAX_RANKS:
        raise ValidationError(f"{ranks:,} ranks, over the limit of {MAX_RANKS:,} (MAX_RANKS)")
    if instructions > MAX_INSTRUCTIONS:
        raise ValidationError(f"{instructions:,} instructions, over the limit of {MAX_INSTRUCTIONS:,} "
                              f"(MAX_INSTRUCTIONS)")
    if not all(isinstance(v, int) for v in (microbatches, stages, replicas)):
        return  # not sizes at all: validate() says what is wrong
    if max(microbatches, 1) * max(stages, 1) * max(replicas, 1) > MAX_COMPUTE_OPS:
        raise ValidationError(f"{shorten(microbatches)} microbatches × {shorten(stages)} stages × {shorten(replicas)} "
                              f"replica(s) is over the limit of {MAX_COMPUTE_OPS:,} forwards (MAX_COMPUTE_OPS)")


_SINGLE_COMPUTE = frozenset({Op.F, Op.B, Op.I, Op.W})


def _first_compute(ranks: Sequence[Sequence[Instr]], replica: int, stage: int) -> tuple[int, int]:
    """Rank and index of the first compute op of a stage copy (for an error message)."""
    return next((r, idx) for r, stream in enumerate(ranks) for idx, ins in enumerate(stream)
                for i in ins.parts if i.op in _SINGLE_COMPUTE and (i.replica, i.stage) == (replica, stage))


def _blank(v: int | None) -> str | int:
    return "" if v is None else v


def _csv_row(row: list[str]) -> tuple[int, int, Instr]:
    """A CSV row's rank, index and instruction; ValueError says what is wrong."""
    if len(row) != len(Program.CSV_COLUMNS):
        raise ValueError(f"expected {len(Program.CSV_COLUMNS)} columns, got {len(row)}")
    rank, index = int(row[0]), int(row[1])
    if rank < 0 or index < 0:
        raise ValueError(f"rank and index are non-negative, got {shorten(rank)} and {shorten(index)}")
    if rank >= MAX_RANKS:
        raise ValueError(f"rank {shorten(rank)} is over the limit: below {MAX_RANKS:,} (MAX_RANKS)")
    if row[2].strip() == Op.OVERLAP.value:
        return rank, index, _csv_pair(row)
    d = {"op": row[2].strip(), "replica": int(row[5] or 0)}
    for col, key in ((3, "mb"), (4, "stage"), (6, "peer")):
        if row[col].strip():
            d[key] = int(row[col])
    return rank, index, Instr.from_dict(d)


def _csv_pair(row: list[str]) -> Instr:
    """An OVERLAP_F_B row: "forward;backward" in the mb, stage and replica cells."""
    cells = [row[col].split(";") for col in (3, 4, 5)]
    if any(len(c) != 2 for c in cells) or row[6].strip():
        raise ValueError("an OVERLAP_F_B row holds 'forward;backward' in its mb, stage and replica cells")
    (fm, bm), (fs, bs), (fc, bc) = cells
    return Instr.pair(Instr.from_dict({"op": "F", "mb": int(fm), "stage": int(fs), "replica": int(fc or 0)}),
                      Instr.from_dict({"op": "B", "mb": int(bm), "stage": int(bs), "replica": int(bc or 0)}))
