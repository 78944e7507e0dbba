"""Compute ops timed by device events (runtime/device_clock.py), checked on CPU with events of a fake device whose
queue runs behind the host: the times put on the host's clock are when the device ran each op, not when the host
queued it; instructions without events keep their host stamps, none before the compute op before them ends; a pipeline step records one start and one end per
compute op (the start again once its inputs are waited for)."""

from __future__ import annotations

import pytest
import torch

import pipedsl
from pipedsl.ir import COMPUTE
from pipedsl.runtime.device_clock import DeviceStamps


class FakeDevice:
    """A queue the host feeds: each op runs `cost` device seconds after the previous one ends, however early the
    host queued it; the device starts `lag` seconds behind the host."""

    def __init__(self, lag: float) -> None:
        self.host = 0.0  # the host's clock
        self.busy_until = lag  # when the device's queue is done, on the host's clock

    def queue(self, cost: float) -> None:
        self.busy_until = max(self.busy_until, self.host) + cost


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.at: float | None = None
        self.records = 0

    def record(self) -> None:
        self.at = max(self.device.busy_until, self.device.host)  # when the queue reaches it
        self.records += 1

    def synchronize(self) -> None:
        assert self.at is not None
        self.device.host = max(self.device.host, self.at)

    def elapsed_time(self, later: FakeEvent) -> float:
        assert self.at is not None and later.at is not None
        return (later.at - self.at) * 1e3  # milliseconds, as CUDA's


def test_recorded_ops_are_timed_when_the_device_ran_them() -> None:
    dev = FakeDevice(lag=5.0)
    stamps = DeviceStamps(4, torch.device("cpu"), lambda: FakeEvent(dev))
    host_starts, host_ends = [0.0, 0.1, 0.2, 0.3], [0.05, 0.15, 0.25, 0.35]
    for i in (0, 2):  # 1 is a message, 3 a gradient reduction: host stamps only
        dev.host = host_starts[i]
        stamps.start(i)
        dev.queue(1.0)
        dev.host = host_ends[i]
        stamps.end(i)
    starts, ends = stamps.times(host_starts, host_ends, now=lambda: dev.host)
    # the device ran op 0 from 5 to 6 and op 2 from 6 to 7 (queued at 0.2, behind op 0); the message, stamped at
    # 0.1-0.15 while op 0 still ran, not before op 0's end (its payload leaves after it), and the reduction not
    # before op 2's: the measured timeline's events in program order without overlap, as the H200 showed they were
    # not when they kept their host stamps
    assert starts == pytest.approx([5.0, 6.0, 6.0, 7.0]) and ends == pytest.approx([6.0, 6.0, 7.0, 7.0])
    stamps.begin()  # the next step: nothing recorded yet, the host's stamps; the step before's kept
    assert stamps.times(host_starts, host_ends) == (host_starts, host_ends)
    assert stamps.times(host_starts, host_ends, now=lambda: dev.host, previous=True)[0] == pytest.approx(starts)
    stamps.cancel()  # the step begun undone: the step before is current again
    assert stamps.times(host_starts, host_ends, now=lambda: dev.host)[0] == pytest.approx(starts)


def test_no_device_stamps_on_the_cpu() -> None:
    assert DeviceStamps.for_device(4, torch.device("cpu")) is None


def test_a_step_records_each_compute_op(pool2) -> None:
    results = pool2.run(_stamped_step)
    for r, (starts, ends, ops) in enumerate(results):
        for kind, n_start, n_end in zip(ops, starts, ends):
            if kind in {op.value for op in COMPUTE}:
                assert n_start >= 1 and n_end == 1, (r, kind, n_start, n_end)
            else:
                assert n_start == n_end == 0, (r, kind, n_start, n_end)


def _stamped_step(rank: int) -> tuple[list[int], list[int], list[str]]:
    from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch

    model = GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=2, n_head=1, n_embd=8))
    pipe = pipedsl.Pipeline(model.stages(2), "1f1b", microbatches=2, loss_fn=gpt_loss)
    x, y = synthetic_batch(4, 4, 16, torch.Generator().manual_seed(0))
    pipe.step(x, y)  # learns the shapes: the next step runs the cached executor
    ex = pipe._executors[next(iter(pipe._executors))]
    dev = FakeDevice(lag=0.0)
    ex.device_stamps = DeviceStamps(len(ex.stream), torch.device("cpu"), lambda: FakeEvent(dev))
    pipe.step(x, y)
    stamps = ex.device_stamps
    out = ([e.records for e in stamps.starts], [e.records for e in stamps.ends], [ins.op.value for ins in ex.stream])
    pipe.close()
    return out
