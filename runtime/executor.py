"""The per-rank interpreter of one instruction stream (docs/architecture.md, "The runtime").

A dispatch table maps each op kind to a handler.  Receives are *posted* (`irecv`) ahead of
their place in the stream, within a bounded look-ahead and in the stream's order per peer,
and *waited* just before the compute op that consumes them; sends complete in the
background and are waited at the step end.

When to post matters on gloo: an `irecv` or `isend` call takes the connection's lock, which
the transport's own thread holds while it handles the peer's traffic, so a call now and then
stalls its caller for milliseconds (measured: 2–4 ms, about one call in ten, on an idle
machine).  Posting the whole look-ahead before the first op put such a stall at the start of
every step, on the critical path.  So receives are posted at RECV instructions (the window
from there on) and right before the executor would block waiting for one — when the rank
is idle anyway — never before a compute op or a send.  Adjacent stages on one rank hand tensors over
directly (the program has no messages for them).  An activation is released at the op the
schedule names (B, or W when the backward is split), together with its receive buffers.
An overlapped pair F&B waits for both halves' inputs, then runs `stage.overlapped_forward_backward`
(sequential unless the stage modules define DeepSeek's hook; see there).

With `strict_pair_order` a receive is never posted ahead of an earlier send to the same peer, so
every pair's operations are issued exactly in program order: what a transport with one stream per
pair of ranks would need.  NCCL's communicators are per directed edge instead (docs/runtime.md,
"NCCL"), so it is off by default everywhere.

State is keyed by the named tuples of keys.py: per microbatch, a `Slot` (microbatch, stage,
replica) — activations, gradient buffers, and per direction the tensors handed over, waiting in a
receive or waiting for their send; a stage copy by `Copy` (replica, stage: `Program.placement`'s
order); the shapes learned per input shape by `ShapeKey` (discovery.py learns them in the first
step at a shape).  They are built positionally here (once per op where possible: this runs per
instruction) and always read by field name.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import torch

from pipedsl.ir import COMPUTE, RECVS, SENDS, Instr, Op, Program
from pipedsl.runtime.device_clock import DeviceStamps, ThreadStamps
from pipedsl.runtime.keys import Copy, ShapeKey, Slot
from pipedsl.runtime.launch.errors import RankFailure, failure_at
from pipedsl.runtime.p2p import Channels, Recv, TensorMeta, describe
from pipedsl.runtime.reduce import GradReducer
from pipedsl.runtime.stage import Activation, Stage, overlapped_forward_backward
from pipedsl.steps import Gates, gates


def _num_losses(stream: list[Instr], last: int) -> int:
    return sum(1 for whole in stream for ins in whole.parts if ins.op is Op.F and ins.stage == last)


_POLL_S = 2e-4  # a gated pass's poll of the openings while it waits for a peer (see `_take`)


class StepRedoneError(Exception):
    """Raised by `Executor.run` at its gate when the previous step's verdict undid that step: this pass's forward
    work is dropped (runtime/post_validate.py redoes the previous step, then runs this one again)."""


def loss_ranks(program: Program) -> list[int]:
    """The ranks that compute losses (they hold the last stage), in rank order."""
    return [r for r, stream in enumerate(program.ranks) if _num_losses(stream, program.num_stages - 1)]


class Executor:
    """Interprets `program.ranks[rank]` once per `run`."""

    def __init__(self, program: Program, rank: int, stages: dict[Copy, Stage], channels: Channels,
                 reducer: GradReducer, in_meta: dict[ShapeKey, tuple[TensorMeta, ...]],
                 out_meta: dict[ShapeKey, tuple[TensorMeta, ...]], lookahead: int = 16,
                 strict_pair_order: bool = False, check_finite: bool = True, kinds: list[int] | None = None,
                 count: Callable[[Any], int] | None = None,
                 device_stamps: DeviceStamps | ThreadStamps | None = None) -> None:
        """`count(target)`: a forward-only program (`Program.forward_only()`, evaluation) runs each stage
        without autograd and sums the last stage's losses and `count(target)` per microbatch instead.
        `device_stamps`: compute ops timed by device events or the thread's CPU time too (runtime/device_clock.py)."""
        self.program = program
        self.rank = rank
        self.stream = program.ranks[rank]
        self.stages = stages  # Copy -> Stage (copies of a stage on this rank share one)
        self.channels = channels
        self.reducer = reducer
        self.in_meta, self.out_meta = in_meta, out_meta  # ShapeKey -> metas
        self.kinds = kinds or [0] * program.num_microbatches  # per microbatch: which shapes it has
        self.grad_meta = {k: tuple(m for m in v if m.is_float) for k, v in out_meta.items()}
        self.lookahead = max(0, lookahead)
        self.strict = strict_pair_order
        self.check_finite = check_finite
        self.last = program.num_stages - 1
        self.rank_of = program.placement  # the IR's (replica, stage) -> rank: read with a Copy
        self.num_losses = _num_losses(self.stream, self.last)
        n = len(self.stream)
        self.starts = [0.0] * n
        self.ends = [0.0] * n
        self.previous: tuple[list[float], list[float]] | None = None  # the run before's stamps
        self.runs = 0  # runs begun (an undone one is not counted)
        self.device_stamps = device_stamps
        self.wait_time = 0.0
        self.handlers: dict[Op, Callable[[Instr], None]] = {
            Op.F: self._forward, Op.B: self._backward, Op.I: self._backward_input, Op.W: self._backward_weight,
            Op.SEND_F: self._send, Op.SEND_B: self._send, Op.RECV_F: self._recv, Op.RECV_B: self._recv,
            Op.REDUCE_GRAD: self._reduce_grad, Op.OPTIMIZER_STEP: self._step_end, Op.OVERLAP: self._overlapped,
        }
        self.count = count
        if count is not None:
            self.handlers.update({Op.F: self._forward_only, Op.OPTIMIZER_STEP: self._forward_only_end})
        self.counted = 0  # forward-only: the last stage's count(target) summed over this rank's microbatches
        self._gates: Gates | None = None  # made at the first gated run (post-validated steps)
        self._post_limit = n  # receives are posted only before this index (a gated run's gate, until it passes)

    # ------------------------------------------------------------ the loop

    def run(self, inputs: list[list[torch.Tensor]], targets: list[Any],
            on_loss: Callable[[torch.Tensor], None] | None = None,
            gate: Callable[[], bool] | None = None) -> torch.Tensor:
        """One pass over the stream; returns the sum of this rank's (1/M-scaled) microbatch losses.

        `on_loss(sum)` is called after the rank's last instruction, on every rank: a collective issued
        earlier (at the start on a rank without the last stage, as it once was, to overlap the cooldown)
        occupies its NCCL stream until the last stage's losses exist, which wait for this rank's later
        sends — so any device-wide wait in between (a profiler's synchronize, the allocator's retry)
        deadlocks the GPU.  A scalar's reduction costs microseconds at the step's end.

        `gate()` (post-validated steps): called at the rank's gate (`pipedsl.steps.gates`), before its first
        instruction that is not forward work; until then only the receives before the gate are posted.  When it
        returns False the forward work is undone — receives completed and dropped, the messages sent to this rank
        before its peers' gates drained, sends completed, activations freed — and `StepRedoneError` is raised.
        """
        self.mb_inputs, self.targets = inputs, targets
        self._losses_left = self.num_losses
        # per direction (F: activations, B: gradients): tensors a stage on this rank handed to the slot
        # that takes them, tensors waiting for their SEND by the slot that sends them, receives posted
        # by the slot they are for
        self.local: dict[Op, dict[Slot, list[torch.Tensor]]] = {Op.F: {}, Op.B: {}}
        self.outbox: dict[Op, dict[Slot, list[torch.Tensor]]] = {Op.F: {}, Op.B: {}}
        self.posted: dict[Op, dict[Slot, Recv]] = {Op.RECV_F: {}, Op.RECV_B: {}}
        self.acts: dict[Slot, Activation] = {}
        self.grad_buffers: dict[Slot, list[torch.Tensor]] = {}
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self._losses: list[tuple[torch.Tensor, float, int, Instr]] = []  # (loss, factor, index, F) until the last
        self.counted = 0
        self._scan = 0
        self._pending_sends: dict[int, int] = defaultdict(int)  # peer -> sends scanned but not issued
        self._held: dict[int, deque[int]] = defaultdict(deque)  # peer -> receive indices not posted early
        self.wait_time = 0.0
        self.previous = (self.starts, self.ends) if self.runs else None  # the step before's, for a 2-step timeline
        self.starts, self.ends = [0.0] * len(self.stream), [0.0] * len(self.stream)
        self.runs += 1
        stream, handlers, starts, ends = self.stream, self.handlers, self.starts, self.ends
        clock = time.perf_counter
        stamps = self.device_stamps
        if stamps is not None:
            stamps.begin()
        self.index = 0
        gate_at, self._post_limit = -1, len(stream)
        self._unchecked_loss: RankFailure | None = None  # a gated pass's non-finite loss, held until its gate
        if gate is not None:
            if self._gates is None:
                self._gates = gates(self.program)
            gate_at = self._post_limit = self._gates.at[self.rank]
        for i, ins in enumerate(stream):
            self.index = i
            if i == gate_at:
                self._post_limit = len(stream)
                if not self._pass_gate(gate, i, ins):
                    raise StepRedoneError()
                if self._unchecked_loss is not None:  # the weights it came from stand: report it now
                    raise self._unchecked_loss
            if ins.op in RECVS:
                if self._scan <= i + self.lookahead:
                    self._post_ahead(i)
            elif self._scan <= i:
                self._post_ahead(i, 0)  # accounts for this send or compute op; posts nothing
            starts[i] = clock()
            timed = stamps is not None and ins.op in COMPUTE
            if timed:
                stamps.start(i)  # type: ignore[union-attr]
            try:
                handlers[ins.op](ins)
            except RankFailure:
                raise
            except Exception as err:  # noqa: BLE001 - every failure is reported with where it happened
                raise failure_at(self.rank, i, ins, err) from err
            ends[i] = clock()
            if timed:
                stamps.end(i)  # type: ignore[union-attr]
        if on_loss is not None:
            on_loss(self.loss_sum)
        return self.loss_sum

    # ------------------------------------------------------------ receives

    def _post_ahead(self, i: int, lookahead: int | None = None) -> None:
        """Post the receives of instructions up to `i + lookahead`, in stream order per peer."""
        ahead = self.lookahead if lookahead is None else lookahead
        stream, end = self.stream, min(self._post_limit, i + ahead + 1)
        while self._scan < end:
            j = self._scan
            ins = stream[j]
            op = ins.op
            if op in RECVS:
                slot = Slot(ins.mb, ins.stage, ins.replica)
                if slot not in self.posted[op]:
                    peer = ins.peer
                    if self._held[peer] or (self.strict and self._pending_sends[peer]):
                        self._held[peer].append(j)
                    else:
                        self._post(ins, slot)
            elif op in SENDS:
                self._pending_sends[ins.peer] += 1
            self._scan += 1

    def _post(self, ins: Instr, slot: Slot) -> None:
        shapes = ShapeKey(self.kinds[slot.microbatch], slot.replica, slot.stage)
        meta = self.in_meta[shapes] if ins.op is Op.RECV_F else self.grad_meta[shapes]
        self.posted[ins.op][slot] = self._post_recv(ins, meta)

    def _post_recv(self, ins: Instr, metas: list, what: str = "") -> Any:
        """`ins`'s receive of tensors `metas`, posted.  A peer that stopped and closed its connections makes gloo
        refuse the post itself: a peer's failure, named as a wait for it is (the pipeline then reports the reason
        the peer recorded), not gloo's "Connection closed by peer"."""
        try:
            return self.channels.post_recv(ins.peer, metas, self._label(ins, what))
        except Exception as err:  # noqa: BLE001
            raise RankFailure(f"rank {self.rank} instruction {self.index} ({self.stream[self.index]}): posting the "
                              f"receive of {ins} from rank {ins.peer} failed: {err}", self.rank, self.index,
                              self.stream[self.index], peer=ins.peer, peer_failure=True) from err

    def _label(self, ins: Instr, what: str = "") -> str | None:
        """A message's instruction in words, where the channels name their operations (else None: no cost)."""
        return f"{what}{ins}" if self.channels.labelled else None

    def _recv(self, ins: Instr) -> None:
        slot = Slot(ins.mb, ins.stage, ins.replica)
        if slot in self.posted[ins.op]:
            return
        held = self._held[ins.peer]
        if held and held[0] == self.index:
            held.popleft()
        self._post(ins, slot)

    def _arrived(self, recv: Any) -> bool:
        """Whether a gated pass's receive is complete.  A peer gone while others' openings are unchecked may have
        stopped on their shapes (it found a rank whose shapes differ and ended before sending what this rank waits
        for; under load that rank's opening can reach this one later than the closed connection): the openings are
        then waited for, and a disagreement they show is raised instead of the lost connection."""
        try:
            return recv.ready()
        except Exception as lost:
            try:
                self.channels.settle()
            except RankFailure as failure:
                if not failure.peer_failure:  # every rank's shapes, named: why the peer stopped
                    raise failure from lost
            raise

    def _take(self, op: Op, slot: Slot) -> list[torch.Tensor]:
        """The tensors of a received message (`op`: RECV_F or RECV_B) for `slot`, waiting for them now."""
        recv = self.posted[op].pop(slot)
        t0 = time.perf_counter()
        # the step's openings before it first waits for a peer (p2p.py, `Channels.open_step`); a gated pass's
        # forward work checks only the peer's it waits for: all of them would wait for every rank to end the
        # previous step, which the forward work of overlapped steps must not.  While others are unchecked it polls
        # them as they arrive (a rank whose shapes differ may stop before it sends what this rank waits for)
        if self._post_limit < len(self.stream):
            self.channels.settle(recv.peer)
            while not self._arrived(recv) and not self.channels.settle_arrived():
                time.sleep(_POLL_S)
        else:
            self.channels.settle()
        if self._scan <= self.index + self.lookahead and not recv.ready():
            self._post_ahead(self.index)  # about to wait: post the look-ahead now, while idle
        try:
            out = recv.wait()
        except Exception as err:  # noqa: BLE001
            ins = self.stream[self.index]
            what = "the activation" if op is Op.RECV_F else "the gradient"
            raise RankFailure(f"rank {self.rank} instruction {self.index} ({ins}): waiting for {what} of microbatch "
                              f"{slot.microbatch} from rank {recv.peer} failed: {err}", self.rank, self.index, ins,
                              peer=recv.peer, peer_failure=True) from err
        t1 = time.perf_counter()
        self.wait_time += t1 - t0
        self.starts[self.index] = t1  # a compute op's event starts when its input is there: waiting is idle
        if self.device_stamps is not None and self.stream[self.index].op in COMPUTE:
            self.device_stamps.start(self.index)  # and on the device, where the stream waits for it
        return out

    # ------------------------------------------------------------ compute

    def _forward_inputs(self, slot: Slot) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A forward's inputs and the receive buffers holding them (to give back on release)."""
        s = slot.stage
        if s == 0:
            return self.mb_inputs[slot.microbatch], []
        if self.rank_of[Copy(slot.replica, s - 1)] == self.rank:
            return self.local[Op.F].pop(slot), []
        buffers = self._take(Op.RECV_F, slot)
        return buffers, buffers

    def _forward(self, ins: Instr) -> None:
        slot = Slot(ins.mb, ins.stage, ins.replica)
        inputs, buffers = self._forward_inputs(slot)
        act, outs = self.stages[Copy(ins.replica, ins.stage)].forward(
            inputs, self.targets[ins.mb] if ins.stage == self.last else None, buffers)
        self._forward_done(ins, slot, act, outs)

    def _forward_done(self, ins: Instr, slot: Slot, act: Activation, outs: list[torch.Tensor]) -> None:
        """Keep the activation; count the loss (last stage) or hand the outputs on."""
        m, s, c = slot.microbatch, slot.stage, slot.replica
        self.acts[slot] = act
        if s == self.last:
            self._losses.append((act.loss, self.stages[Copy(c, s)].loss.factor, self.index, ins))
            self._losses_left -= 1
            if not self._losses_left:
                self._sum_losses()
            return
        self._check_meta(ins, outs, ShapeKey(self.kinds[m], c, s))
        if self.rank_of[Copy(c, s + 1)] == self.rank:
            self.local[Op.F][Slot(m, s + 1, c)] = outs
        else:
            self.outbox[Op.F][slot] = outs
        self.channels.reap_sends()

    def _sum_losses(self) -> None:
        """The rank's loss sum once its last loss is there: one device-to-host copy a step, not one (and a finite
        check) a microbatch; summed in float64 in microbatch order, as one process would."""
        losses, self._losses = self._losses, []
        values = torch.stack([loss.to(torch.float64) for loss, *_ in losses]).cpu().tolist()
        total = 0.0
        for v, (_, factor, i, ins) in zip(values, losses):
            if self.check_finite and not math.isfinite(v):
                failure = RankFailure(f"rank {self.rank} instruction {i} ({ins}): the loss of microbatch {ins.mb} is "
                                      f"{v} (not finite)", self.rank, i, ins)
                if self._post_limit == len(self.stream):  # not a gated pass before its gate
                    raise failure
                self._unchecked_loss = failure  # before the gate: from weights a rollback may undo
            total += v * factor
        self.loss_sum = torch.tensor(total, dtype=torch.float64)

    def _forward_only(self, ins: Instr) -> None:
        """Evaluation: no autograd graph and no activation kept; the receive buffers are given back at the end
        (an output may alias its input until its send completes)."""
        slot = Slot(ins.mb, ins.stage, ins.replica)
        inputs, buffers = self._forward_inputs(slot)
        stage = self.stages[Copy(ins.replica, ins.stage)]
        if ins.stage == self.last:
            target = self.targets[ins.mb]
            self.loss_sum += stage.evaluate(inputs, target).double().cpu()
            self.counted += self.count(target)
            self.acts[slot] = Activation(inputs, [], None, buffers)
        else:
            self._forward_done(ins, slot, Activation(inputs, [], None, buffers), stage.evaluate(inputs))

    def _forward_only_end(self, ins: Instr) -> None:
        self.channels.settle()
        try:
            self.channels.wait_sends()
        except Exception as err:  # noqa: BLE001
            raise RankFailure(f"rank {self.rank} instruction {self.index} ({ins}): completing this evaluation's "
                              f"sends failed: {err}", self.rank, self.index, ins, peer_failure=True) from err
        for slot in list(self.acts):
            self._release(slot)

    def _output_grads(self, slot: Slot) -> list[torch.Tensor] | None:
        s = slot.stage
        if s == self.last:
            return None
        if self.rank_of[Copy(slot.replica, s + 1)] == self.rank:
            return self.local[Op.B].pop(slot)
        grads = self._take(Op.RECV_B, slot)
        self.grad_buffers[slot] = grads
        return grads

    def _pass_back(self, slot: Slot, grads: list[torch.Tensor]) -> None:
        s = slot.stage
        if s == 0:
            return
        if self.rank_of[Copy(slot.replica, s - 1)] == self.rank:
            self.local[Op.B][Slot(slot.microbatch, s - 1, slot.replica)] = grads
        else:
            self.outbox[Op.B][slot] = grads

    def _release(self, slot: Slot) -> None:
        act = self.acts.pop(slot)
        pool = self.channels.pool
        for b in act.buffers:
            pool.give(b)
        for b in self.grad_buffers.pop(slot, ()):
            pool.give(b)

    def _backward(self, ins: Instr) -> None:
        slot = Slot(ins.mb, ins.stage, ins.replica)
        grads = self._output_grads(slot)
        self._pass_back(slot, self.stages[Copy(ins.replica, ins.stage)].backward(self.acts[slot], grads))
        self._release(slot)
        self.channels.reap_sends()

    def _overlapped(self, ins: Instr) -> None:
        f, b = ins.sub
        fwd, bwd = Slot(f.mb, f.stage, f.replica), Slot(b.mb, b.stage, b.replica)
        inputs, buffers = self._forward_inputs(fwd)
        grads = self._output_grads(bwd)
        act, outs, input_grads = overlapped_forward_backward(
            self.stages[Copy(f.replica, f.stage)], inputs, self.targets[f.mb] if f.stage == self.last else None,
            buffers, self.stages[Copy(b.replica, b.stage)], self.acts[bwd], grads)
        self._pass_back(bwd, input_grads)
        self._release(bwd)
        self._forward_done(f, fwd, act, outs)

    def _backward_input(self, ins: Instr) -> None:
        slot = Slot(ins.mb, ins.stage, ins.replica)
        grads = self._output_grads(slot)
        self._pass_back(slot, self.stages[Copy(ins.replica, ins.stage)].backward_input(self.acts[slot], grads))
        self.channels.reap_sends()

    def _backward_weight(self, ins: Instr) -> None:
        slot = Slot(ins.mb, ins.stage, ins.replica)
        self.stages[Copy(ins.replica, ins.stage)].backward_weight(self.acts[slot])
        self._release(slot)

    def _pass_gate(self, gate: Callable[[], bool], i: int, ins: Instr) -> bool:
        try:
            passed = gate()
            if not passed:
                self._undo_forward_work()
        except RankFailure:
            raise
        except Exception as err:  # noqa: BLE001 - reported with where it happened
            raise failure_at(self.rank, i, ins, err) from err
        return passed

    def _undo_forward_work(self) -> None:
        """Drop what this pass did before its gate, leaving no message in flight (see `run`)."""
        pool = self.channels.pool
        assert self._gates is not None
        self.channels.settle()  # the step's openings (p2p.py): consumed, as the pass run again sends its own
        for posted in self.posted.values():
            for recv in posted.values():
                for b in recv.wait():
                    pool.give(b)
            posted.clear()
        for j in self._gates.drains[self.rank]:
            ins = self.stream[j]
            self.index = j
            slot = Slot(ins.mb, ins.stage, ins.replica)
            self._post(ins, slot)
            for b in self.posted[ins.op].pop(slot).wait():
                pool.give(b)
        self.channels.wait_sends()
        for slot in list(self.acts):
            self._release(slot)
        for by_op in (self.local, self.outbox):
            for d in by_op.values():
                d.clear()
        self._losses = []
        self.runs -= 1  # the pass run again is this one: the stamps before it stay the step before's
        if self.previous is not None:
            self.starts, self.ends = self.previous
        if self.device_stamps is not None:
            self.device_stamps.cancel()

    def _check_meta(self, ins: Instr, outs: list[torch.Tensor], key: ShapeKey) -> None:
        got, expected = tuple(TensorMeta.of(t) for t in outs), self.out_meta[key]
        if got != expected:
            raise RankFailure(f"rank {self.rank} instruction {self.index} ({ins}): stage {ins.stage} produced "
                              f"{describe(got)} for microbatch {ins.mb}, but {describe(expected)} for the first "
                              f"microbatch of this input shape (a stage's output shapes must follow from its input "
                              f"shapes: the pipeline learns them once per input shape)", self.rank, self.index, ins)

    # ------------------------------------------------------------ messages, reduction, step end

    def _send(self, ins: Instr) -> None:
        direction = Op.F if ins.op is Op.SEND_F else Op.B
        self.channels.send(ins.peer, self.outbox[direction].pop(Slot(ins.mb, ins.stage, ins.replica)),
                           label=self._label(ins))
        self._pending_sends[ins.peer] -= 1

    def _reduce_grad(self, ins: Instr) -> None:
        self.reducer.on_reduce_grad(ins.stage, ins.replica)

    def _step_end(self, ins: Instr) -> None:
        self.channels.settle()
        try:
            self.channels.wait_sends()
            self.reducer.finish()
        except Exception as err:  # noqa: BLE001
            raise RankFailure(f"rank {self.rank} instruction {self.index} ({ins}): completing this step's "
                              f"sends and gradient reductions failed: {err}", self.rank, self.index, ins,
                              peer_failure=True) from err
        left = [f"activation {slot}" for slot in self.acts]
        left += [f"{what} {op} {slot}" for what, by_op in (("hand-over", self.local), ("outbox", self.outbox),
                                                            ("posted", self.posted))
                 for op, d in by_op.items() for slot in d]
        if left:  # pragma: no cover - the validator rules this out
            raise RankFailure(f"rank {self.rank}: the step ended with state left over: {left[:4]}", self.rank)
