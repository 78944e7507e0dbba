"""The step that meets a new input shape: it runs the program and learns every message's shapes on the way.

The executor (executor.py) posts each receive with buffers of known shapes, so it needs every
stage's input and output shapes before the step.  The first step at a new input shape runs
instead as a `Discovery` — Megatron's communicate_shapes, on the program's own messages:

- the first forward activation message of each shape kind (`ShapeKey`) on each hop is preceded
  by a small shape message (the `p2p.encode_meta` vector, an ordinary data message on the same
  channel, so the pair's order holds); both ends know which messages those are — the first of
  the kind in the stream, the same message on both sides since a pair's messages match in order;
- the receiver posts the shape message (within the look-ahead; with `strict_pair_order`
  only at its RECV_F instruction), and posts the activation receive once the shapes are there —
  as soon as it sees them between instructions, by the consumer at the latest, or at once with
  strict pair order, so no other message of the pair comes between the two; receives from that
  peer behind it wait in order, and the later activations of that kind are ordinary receives;
- gradient receives need no shape message: they come back as the float subset of this rank's own
  forward outputs (`grad_meta`), known once the forward ran;
- what is observed fills `in_meta` / `out_meta` (keyed by `ShapeKey`), from which the pipeline then
  builds the ordinary executor for that shape and caches it.

Every rank agrees on the step's shapes first (pipeline.py `_use_shapes`) and keeps the same cache,
so all ranks run discovery in the same step.  Errors keep their names: a forward that fails here
is checked on fake tensors (`Stage.infer_outputs`) — if the stage cannot run on inputs of that
shape at all it is "stage s cannot take its input …", else the user's own error; a later
microbatch of the same input shape with other output shapes fails `_check_meta`.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import torch

from pipedsl.ir import Instr, Op
from pipedsl.runtime.comm_record import SHAPES_OF
from pipedsl.runtime.executor import Executor
from pipedsl.runtime.keys import Copy, ShapeKey, Slot
from pipedsl.runtime.launch.errors import RankFailure
from pipedsl.runtime.p2p import META_LEN, Recv, TensorMeta, decode_meta, describe, encode_meta

_SHAPES = (TensorMeta((META_LEN,), torch.int64),)  # the shape message


class Discovery(Executor):
    """One run of the program that learns `in_meta` and `out_meta` (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for op in (Op.F, Op.OVERLAP):
            self.handlers[op] = self._naming_input_errors(self.handlers[op])
        for op, handler in self.handlers.items():
            self.handlers[op] = self._polling(handler)

    def run(self, inputs: list[list[torch.Tensor]], targets: list[Any],
            on_loss: Callable[[torch.Tensor], None] | None = None,
            gate: Callable[[], bool] | None = None) -> torch.Tensor:
        """As `Executor.run`, never gated: a pass that learns shapes with every peer cannot be undone (the pipeline
        reads a post-validated step's verdict before it)."""
        if gate is not None:
            raise ValueError("a Discovery pass cannot be gated")
        self._queue: dict[int, deque[tuple[int, Instr, Slot]]] = defaultdict(deque)  # peer -> receives not posted
        self._queued: set[tuple[Op, Slot]] = set()
        self._unresolved: dict[int, tuple[Slot, Recv]] = {}  # peer -> a shape message posted, its data not
        self._announced: set[ShapeKey] = set()  # the output kinds whose shapes this rank has sent
        self._fed: tuple[Slot, tuple[TensorMeta, ...]] | None = None  # the forward running and its inputs' shapes
        return super().run(inputs, targets, on_loss)

    # ------------------------------------------------------------ receives

    def _post(self, ins: Instr, slot: Slot) -> None:
        """From the look-ahead scan (instruction `self._scan`): posted now if nothing from its peer waits before
        it — with known shapes, or as a shape message (not with strict pair order) — else queued."""
        peer = ins.peer
        if not self._queue[peer] and peer not in self._unresolved:
            meta = self._meta(ins.op, slot)
            if meta is not None:
                self.posted[ins.op][slot] = self._post_recv(ins, meta)
                return
            if ins.op is Op.RECV_F and not self.strict:
                self._unresolved[peer] = (slot, self._post_shapes(ins))
                return
        self._queue[peer].append((self._scan, ins, slot))
        self._queued.add((ins.op, slot))

    def _post_shapes(self, ins: Instr) -> Recv:
        """The shape message that comes before the first activation of its kind from `ins`'s peer, posted."""
        return self._post_recv(ins, _SHAPES, SHAPES_OF)

    def _recv(self, ins: Instr) -> None:
        slot = Slot(ins.mb, ins.stage, ins.replica)
        held = self._held[ins.peer]
        if held and held[0] == self.index:
            held.popleft()
        if slot not in self.posted[ins.op] and (ins.op, slot) not in self._queued and \
                self._unresolved.get(ins.peer, (None,))[0] != slot:
            self._queue[ins.peer].append((self.index, ins, slot))
            self._queued.add((ins.op, slot))
        self._pump(ins.peer)

    def _pump(self, peer: int) -> None:
        """Post the receives waiting from `peer`, in order, within the look-ahead (up to the current instruction
        with strict pair order): a shape message not yet there stops the rest (strict: is waited for at once)."""
        queue = self._queue[peer]
        ahead = 0 if self.strict else self.lookahead
        while True:
            if peer in self._unresolved:
                if not self.strict and not self._unresolved[peer][1].ready():
                    return
                self._resolve(peer)
            if not queue:
                return
            j, ins, slot = queue[0]
            if j > self.index + ahead:
                return
            meta = self._meta(ins.op, slot)
            if meta is not None:
                self.posted[ins.op][slot] = self._post_recv(ins, meta)
            elif ins.op is Op.RECV_F:  # the first activation of its kind from this peer: its shapes come first
                self._unresolved[peer] = (slot, self._post_shapes(ins))
            else:  # a gradient whose forward has not run yet: posted by the backward that takes it
                return
            queue.popleft()
            self._queued.discard((ins.op, slot))

    def _polling(self, handler: Callable[[Instr], None]) -> Callable[[Instr], None]:
        def run(ins: Instr) -> None:
            for peer in [p for p, (_, recv) in self._unresolved.items() if recv.ready()]:
                self._pump(peer)  # a shape message arrived: post its activation receive now
            handler(ins)
        return run

    def _resolve(self, peer: int) -> None:
        """Wait for `peer`'s shape message and post the activation receive it describes."""
        slot, recv = self._unresolved.pop(peer)
        t0 = time.perf_counter()
        try:
            (vector,) = recv.wait()
        except Exception as err:  # noqa: BLE001
            ins = self.stream[self.index]
            raise RankFailure(f"rank {self.rank} instruction {self.index} ({ins}): waiting for the shapes of "
                              f"microbatch {slot.microbatch}'s activation from rank {peer} failed: {err}", self.rank,
                              self.index, ins, peer=peer, peer_failure=True) from err
        self.wait_time += time.perf_counter() - t0
        metas = decode_meta(vector.cpu())
        self.channels.pool.give(vector)
        self.in_meta[ShapeKey(self.kinds[slot.microbatch], slot.replica, slot.stage)] = metas
        self.posted[Op.RECV_F][slot] = self._post_recv(Instr(Op.RECV_F, slot.microbatch, slot.stage, peer,
                                                             slot.replica), metas)
        self._queued.discard((Op.RECV_F, slot))

    def _take(self, op: Op, slot: Slot) -> list[torch.Tensor]:
        posted = self.posted[op]
        if slot not in posted:
            s = slot.stage - 1 if op is Op.RECV_F else slot.stage + 1
            peer = self.rank_of[Copy(slot.replica, s)]
            while slot not in posted:
                if peer in self._unresolved:
                    self._resolve(peer)
                    continue
                waiting = len(self._queue[peer])
                self._pump(peer)
                if len(self._queue[peer]) == waiting and peer not in self._unresolved:  # pragma: no cover
                    ins = self.stream[self.index]
                    raise RankFailure(f"rank {self.rank} instruction {self.index} ({ins}): the receive of microbatch "
                                      f"{slot.microbatch} from rank {peer} cannot be posted: an earlier receive from "
                                      f"that rank waits for shapes not known yet", self.rank, self.index, ins)
        return super()._take(op, slot)

    def _meta(self, op: Op, slot: Slot) -> tuple[TensorMeta, ...] | None:
        """A receive's shapes if known: an activation's once its kind's shape message came, a gradient's once
        the forward it belongs to ran here."""
        key = ShapeKey(self.kinds[slot.microbatch], slot.replica, slot.stage)
        if op is Op.RECV_F:
            return self.in_meta.get(key)
        out = self.out_meta.get(key)
        return None if out is None else tuple(m for m in out if m.is_float)

    # ------------------------------------------------------------ sends and what the forwards show

    def _send(self, ins: Instr) -> None:
        key = ShapeKey(self.kinds[ins.mb], ins.replica, ins.stage)
        if ins.op is Op.SEND_F and key not in self._announced:  # the first of its kind: its shapes go first
            self._announced.add(key)
            outs = self.outbox[Op.F][Slot(ins.mb, ins.stage, ins.replica)]
            vector = encode_meta(tuple(TensorMeta.of(t) for t in outs)).to(self.channels.device)
            self.channels.send(ins.peer, [vector], payload=False, label=self._label(ins, SHAPES_OF))
        super()._send(ins)

    def _forward_inputs(self, slot: Slot) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        inputs, buffers = super()._forward_inputs(slot)
        metas = tuple(TensorMeta.of(t) for t in inputs)
        self.in_meta.setdefault(ShapeKey(self.kinds[slot.microbatch], slot.replica, slot.stage), metas)  # local ones
        self._fed = (slot, metas)
        return inputs, buffers

    def _check_meta(self, ins: Instr, outs: list[torch.Tensor], key: ShapeKey) -> None:
        if key in self.out_meta:
            super()._check_meta(ins, outs, key)
        else:
            self.out_meta[key] = tuple(TensorMeta.of(t) for t in outs)

    def _naming_input_errors(self, handler: Callable[[Instr], None]) -> Callable[[Instr], None]:
        def run(ins: Instr) -> None:
            self._fed = None
            try:
                handler(ins)
            except RankFailure:
                raise
            except Exception as err:
                failure = self._cannot_take(ins, err)
                if failure is None:
                    raise
                raise failure from err
        return run

    def _cannot_take(self, ins: Instr, err: Exception) -> RankFailure | None:
        """A forward failed: if its stage cannot run on inputs of these shapes at all (fake tensors), say so;
        None for the user's own error (the executor reports it with the user's traceback)."""
        if self._fed is None:
            return None
        slot, metas = self._fed
        try:
            self.stages[Copy(slot.replica, slot.stage)].infer_outputs(metas, self.channels.device)
        except Exception:  # noqa: BLE001
            source = "the microbatch" if slot.stage == 0 else f"stage {slot.stage - 1}"
            return RankFailure(f"rank {self.rank} instruction {self.index} ({ins}): stage {slot.stage} cannot take "
                               f"its input {describe(metas)} from {source}: {type(err).__name__}: {err}",
                               self.rank, self.index, ins)
        return None
