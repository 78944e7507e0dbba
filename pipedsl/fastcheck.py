"""The validator's per-instruction checks on whole arrays: the common case, a valid program, fast.

`validate.py` walks every instruction in Python so that a failure names its rank, index and
op; on a million instructions that walk takes seconds.  `streams_pass` asks the same questions
of numpy arrays — fields in range, each op on its placed rank and routed right, every message
one the placement needs, each op exactly once, every op and message present, each input made
earlier on the same rank, REDUCE_GRAD after its stage's backwards, OPTIMIZER_STEP last — and
answers True only when every answer is yes.  Otherwise (or for anything unusual: a field that
is not an int, an instruction that is not an `Instr`) it answers False and the Python passes run
to say what is wrong.  So it can cost time, never a message; tests/pipedsl/test_validate.py
checks that it never passes a program the Python passes refuse.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import attrgetter, itemgetter

import numpy as np

from pipedsl.ir import Instr, Op, Program

_CODE = {op: k for k, op in enumerate(Op)}
F, B, I, W = (_CODE[o] for o in (Op.F, Op.B, Op.I, Op.W))
SEND_F, SEND_B, RECV_F, RECV_B = (_CODE[o] for o in (Op.SEND_F, Op.SEND_B, Op.RECV_F, Op.RECV_B))
REDUCE, STEP, OVERLAP = _CODE[Op.REDUCE_GRAD], _CODE[Op.OPTIMIZER_STEP], _CODE[Op.OVERLAP]
_PLAIN_TYPES = {int, type(None)}
_SUB = attrgetter("sub")


def streams_pass(p: Program) -> bool:
    """Does `p` pass the checks of `validate._check_streams` (given `_check_header` passed)?"""
    cols = _columns(p)
    if cols is None:
        return False
    rank, idx, op, mb, stage, peer, rep = cols
    P, S, C, M = p.num_ranks, p.num_stages, p.num_replicas, p.num_microbatches
    home = np.array([[p.placement[(c, s)] for s in range(S)] for c in range(C)], dtype=np.int64)
    route = np.array(p.microbatch_replica, dtype=np.int64)
    last = np.array([len(stream) - 1 for stream in p.ranks], dtype=np.int64)
    if not all(stream[-1].op is Op.OPTIMIZER_STEP for stream in p.ranks):
        return False

    # 1. fields in range, each op on its placed rank and routed right, only needed messages
    step = op == STEP
    if not np.array_equal(idx[step], last[rank[step]]) or (op == OVERLAP).any():
        return False
    keep = ~step
    rank, idx, op, mb, stage, peer, rep = (a[keep] for a in (rank, idx, op, mb, stage, peer, rep))
    if (stage < 0).any() or (stage >= S).any() or (rep < 0).any() or (rep >= C).any():
        return False
    if (home[rep, stage] != rank).any():  # REDUCE_GRAD and every op of a microbatch: on the stage's rank
        return False
    reduce = op == REDUCE
    work = ~reduce
    mb = np.where(reduce, 0, mb)  # REDUCE_GRAD's key ignores its microbatch, as the passes do
    if (mb[work] < 0).any() or (mb[work] >= M).any() or (route[mb[work]] != rep[work]).any():
        return False
    comm = np.isin(op, [SEND_F, SEND_B, RECV_F, RECV_B])
    cp, cr, cs, cc, co = peer[comm], rank[comm], stage[comm], rep[comm], op[comm]
    other = np.where((co == SEND_F) | (co == RECV_B), cs + 1, cs - 1)
    inside = (other >= 0) & (other < S)
    if ((cp < 0) | (cp >= P) | (cp == cr) | ~inside).any():
        return False
    if (home[cc, np.where(inside, other, 0)] != cp).any():
        return False

    # 2. each op exactly once, every one present
    key = ((op * M + mb) * S + stage) * C + rep
    order = np.argsort(key, kind="stable")
    skey, srank, sidx = key[order], rank[order], idx[order]
    if (skey[1:] == skey[:-1]).any():
        return False
    counts = np.bincount(op, minlength=STEP + 1)
    split = counts[I]
    cuts = [sum(p.placement[(c, s)] != p.placement[(c, s + 1)] for s in range(S - 1)) for c in range(C)]
    messages = sum(cuts[c] for c in p.microbatch_replica)
    if (counts[F] != M * S or counts[B] + split != M * S or counts[W] != split or counts[REDUCE] != S * C
            or any(counts[k] != messages for k in (SEND_F, SEND_B, RECV_F, RECV_B))):
        return False
    split_rows = op == I
    both = _key(B, mb[split_rows], stage[split_rows], rep[split_rows], M, S, C)  # a full and a split backward
    if split and counts[B] and _found(skey, both).any():
        return False

    # 3. each input made earlier on the same rank; sends after what they send; reductions last
    lookup = (skey, srank, sidx)
    f, w, back = op == F, op == W, (op == B) | (op == I)
    rows = f & (stage > 0)
    m, s, c, r, i = mb[rows], stage[rows], rep[rows], rank[rows], idx[rows]
    local = home[c, s - 1] == r
    need = np.where(local, _key(F, m, s - 1, c, M, S, C), _key(RECV_F, m, s, c, M, S, C))
    if not _before(lookup, need, r, i).all():
        return False
    m, s, c, r, i = mb[w], stage[w], rep[w], rank[w], idx[w]
    if not _before(lookup, _key(I, m, s, c, M, S, C), r, i).all():
        return False
    m, s, c, r, i = mb[back], stage[back], rep[back], rank[back], idx[back]
    if not _before(lookup, _key(F, m, s, c, M, S, C), r, i).all():
        return False
    up = s < S - 1
    m, s, c, r, i = m[up], s[up], c[up], r[up], i[up]
    local = home[c, s + 1] == r
    grad = (_before(lookup, _key(B, m, s + 1, c, M, S, C), r, i)
            | _before(lookup, _key(I, m, s + 1, c, M, S, C), r, i))
    received = _before(lookup, _key(RECV_B, m, s, c, M, S, C), r, i)
    if not np.where(local, grad, received).all():
        return False
    for send, made in ((SEND_F, (F,)), (SEND_B, (B, I))):
        rows = op == send
        m, s, c, r, i = mb[rows], stage[rows], rep[rows], rank[rows], idx[rows]
        if not np.logical_or.reduce([_before(lookup, _key(k, m, s, c, M, S, C), r, i) for k in made]).all():
            return False
    released = (op == B) | (op == W)
    stage_copy = rep * S + stage
    done = np.bincount(stage_copy[released], minlength=C * S)
    latest = np.full(C * S, -1, dtype=np.int64)
    np.maximum.at(latest, stage_copy[released], idx[released])
    per_replica = np.bincount(route, minlength=C)
    sc = stage_copy[reduce]
    return bool((done[sc] == per_replica[rep[reduce]]).all() and (latest[sc] < idx[reduce]).all())


def _key(kind: int | np.ndarray, m: np.ndarray, s: np.ndarray, c: np.ndarray, M: int, S: int, C: int) -> np.ndarray:
    return ((kind * M + m) * S + s) * C + c


def _found(skey: np.ndarray, keys: np.ndarray) -> np.ndarray:
    at = np.minimum(np.searchsorted(skey, keys), len(skey) - 1)
    return skey[at] == keys


def _before(lookup: tuple[np.ndarray, np.ndarray, np.ndarray], keys: np.ndarray, r: np.ndarray,
            i: np.ndarray) -> np.ndarray:
    """Which `keys` run on rank r before instruction i (each of the same length)."""
    skey, srank, sidx = lookup
    if not len(keys):
        return np.ones(0, dtype=bool)
    at = np.minimum(np.searchsorted(skey, keys), len(skey) - 1)
    return (skey[at] == keys) & (srank[at] == r) & (sidx[at] < i)


def _columns(p: Program) -> tuple[np.ndarray, ...] | None:
    """(rank, index, op code, mb, stage, peer, replica) of every single op, a pair's halves at the
    pair's index, missing fields as -1; None when anything is not plainly an `Instr` of ints."""
    parts: list[Sequence[Instr]] = []
    where: list[tuple[int, Sequence[int]]] = []
    for r, stream in enumerate(p.ranks):
        if not stream or set(map(type, stream)) != {Instr}:
            return None
        if any(map(_SUB, stream)):  # overlapped pairs: their halves, each at the pair's index
            flat, index = [], []
            for k, ins in enumerate(stream):
                if ins.sub is None:
                    flat.append(ins)
                    index.append(k)
                elif ins.op is not Op.OVERLAP or set(map(type, ins.sub)) != {Instr} or [
                        (h.op, h.sub) for h in ins.sub] != [(Op.F, None), (Op.B, None)]:
                    return None  # only a forward and a full backward make a pair
                else:
                    flat.extend(ins.sub)
                    index.extend((k, k))
            parts.append(flat)
            where.append((r, index))
        else:
            parts.append(stream)
            where.append((r, range(len(stream))))
    every = list(chain.from_iterable(parts))
    ops, mbs, stages, peers, reps = (list(map(itemgetter(k), every)) for k in range(5))  # zip(*every) is slower
    if set(map(type, ops)) != {Op} or not set(map(type, chain(mbs, stages, peers, reps))) <= _PLAIN_TYPES:
        return None
    try:
        op = np.fromiter(map(_CODE.__getitem__, ops), dtype=np.int64, count=len(ops))
        fields = np.array([mbs, stages, peers, reps], dtype=float)  # one call: None becomes nan, then -1
    except (KeyError, TypeError, OverflowError):
        return None
    np.nan_to_num(fields, copy=False, nan=-1.0)
    if len(every) and np.abs(fields).max() >= 2 ** 52:  # ints beyond this lose digits as floats
        return None
    mb, stage, peer, rep = fields.astype(np.int64)
    rank = np.repeat(np.arange(len(where), dtype=np.int64), [len(ix) for _, ix in where])
    idx = np.fromiter(chain.from_iterable(ix for _, ix in where), dtype=np.int64, count=len(every))
    return rank, idx, op, mb, stage, peer, rep

