"""Compute ops timed by device events or, on the CPU with one thread, by the thread's CPU time (runtime/device_clock.py);
the device events checked on CPU with events of a fake device whose
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


def test_the_cpu_with_one_thread_times_compute_ops_by_the_threads_cpu_time() -> None:
    """ThreadStamps: an F that ran 20 ms of wall but slept (as a preempted thread waits) ends its CPU time after
    its start, far less; an op that worked ends the CPU time it took after its start (the thread's own clock read
    around it: the same whatever other processes' load stretched its wall); a message and an overlapped pair (two
    threads) keep their host stamps; the step before is kept, and a cancel makes it current again.  CUDA gets
    device events; several intra-op threads, none."""
    import time

    from pipedsl.ir import Op
    from pipedsl.runtime.device_clock import ThreadStamps, compute_stamps

    ops = [Op.F, Op.SEND_F, Op.B, Op.OVERLAP]
    stamps = ThreadStamps(ops)
    stamps.begin()
    host_starts, host_ends, cpu = [0.0] * 4, [0.0] * 4, [0.0] * 4
    for i, work in enumerate([lambda: time.sleep(0.02), lambda: time.sleep(0.01),
                              lambda: sum(range(300_000)), lambda: time.sleep(0.01)]):
        host_starts[i], cpu[i] = time.perf_counter(), time.thread_time()
        stamps.start(i)
        work()
        stamps.end(i)
        host_ends[i], cpu[i] = time.perf_counter(), time.thread_time() - cpu[i]
    starts, ends = stamps.times(host_starts, host_ends)
    assert starts == host_starts and ends[1] == host_ends[1] and ends[3] == host_ends[3]
    assert host_ends[0] - host_starts[0] >= 0.02 and ends[0] - starts[0] < 0.005  # slept: next to no CPU time
    assert cpu[2] - 1e-3 <= ends[2] - starts[2] <= cpu[2] and ends[2] - starts[2] > ends[0] - starts[0]
    stamps.begin()  # the next step: nothing timed yet; the step before's kept
    assert stamps.times(host_starts, host_ends) == (host_starts, host_ends)
    assert stamps.times(host_starts, host_ends, previous=True)[1] == ends
    stamps.cancel()
    assert stamps.times(host_starts, host_ends)[1] == ends
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert isinstance(compute_stamps(ops, torch.device("cpu")), ThreadStamps)
        torch.set_num_threads(2)
        assert compute_stamps(ops, torch.device("cpu")) is None
    finally:
        torch.set_num_threads(threads)


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


def test_a_pipelines_timeline_counts_a_compute_ops_cpu_work_when_asked(pool2) -> None:
    """On the CPU with one thread: a stage that sleeps 20 ms a forward (a stand-in for a preempted rank's wait)
    shows each F ≥ 20 ms by the host's clock, as `timeline()` draws it, and under 10 ms of its own CPU work in
    `timeline(cpu_work=True)` (what `pipedsl train --schedule auto` profiles); the B ops' and the messages' starts
    are the same in both."""
    host, work, clocks = pool2.run(_sleeping_stages)[0]
    assert clocks == (None, "thread CPU time")
    forwards = [(h, w) for h, w in zip(host, work) if h[0] == "F"]
    assert forwards and all(h[2] - h[1] >= 0.02 and w[2] - w[1] < 0.01 for h, w in forwards), forwards
    assert [e[:2] for e in host] == [e[:2] for e in work]


def _sleeping_stages(rank: int) -> tuple[list, list, tuple]:
    import time

    from torch import nn

    class Sleepy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.02)
            return self.lin(x)

    torch.manual_seed(0)
    pipe = pipedsl.Pipeline([Sleepy(), Sleepy()], "1f1b", microbatches=2, loss_fn=lambda out, y: (out - y).pow(2).mean())
    x = torch.randn(4, 4)
    pipe.step(x, x)
    pipe.step(x, x)
    host, work = pipe.timeline(), pipe.timeline(cpu_work=True)
    pipe.close()
    if host is None:
        return [], [], ()
    flat = [[(e.instr.op.value, e.start, e.end) for events in tl.ranks for e in events] for tl in (host, work)]
    return flat[0], flat[1], (host.meta["per_rank"][0].get("compute_clock"), work.meta["per_rank"][0].get("compute_clock"))
