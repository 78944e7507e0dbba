"""An overlapped pair F&B on one rank: the user's `overlapped_forward_backward` (DeepSeek's
contract) gives the same outputs and gradients as the sequential forward-then-backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from pipedsl.runtime.stage import ActivationCounter, Stage, overlapped_forward_backward


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [mb, 8]
        return torch.tanh(self.fc(x))


class HookedBlock(Block):
    calls: list[str] = []

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1,
                                    output_grads1):
        """DeepSeek's example order: module0's forward, then module1's backward."""
        cls.calls.append("hook")
        outputs0 = module0(*inputs0)
        outputs0 = [outputs0] if isinstance(outputs0, torch.Tensor) else outputs0
        loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        if loss1 is not None:
            loss1.backward()
            loss1.detach_()
        else:
            torch.autograd.backward(outputs1, output_grads1)
        return outputs0, loss0


def _run(block: type[nn.Module], last_backward: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
    """Stage 1 of 3 runs forward of microbatch 1 overlapped with the backward of microbatch 0 on
    stage 2 (the last, loss) or on stage 1 itself (with an output gradient)."""
    torch.manual_seed(0)
    mods = [block(), block(), block()]
    counter = ActivationCounter()
    stages = [Stage(m, i, 3, F.mse_loss, 2, counter) for i, m in enumerate(mods)]
    g = torch.Generator().manual_seed(1)
    x0, x1, y0 = (torch.randn(4, 8, generator=g) for _ in range(3))
    bwd = stages[2] if last_backward else stages[1]
    act, _ = bwd.forward([x0], y0 if last_backward else None)
    grads = None if last_backward else [torch.randn(4, 8, generator=g)]
    act1, outs, input_grads = overlapped_forward_backward(stages[1], [x1], None, None, bwd, act, grads)
    assert act1.inputs[0].requires_grad and counter.live >= 1
    return outs, input_grads, [p.grad.clone() for p in bwd.module.parameters()]


def test_the_users_overlap_hook_equals_the_sequential_pair():
    """A block class's `overlapped_forward_backward` (DeepSeek's contract): outputs, input gradients and parameter
    gradients equal the sequential forward-then-backward pair's bit for bit, the backward on the last stage or not."""
    for last in (True, False):
        HookedBlock.calls.clear()
        plain = _run(Block, last)
        hooked = _run(HookedBlock, last)
        assert HookedBlock.calls == ["hook"]
        for a, b in zip(plain, hooked):
            assert len(a) == len(b) > 0
            for x, y in zip(a, b):
                assert torch.equal(x, y)


def test_the_hook_needs_both_modules_of_its_class():
    torch.manual_seed(0)
    counter = ActivationCounter()
    s0, s1 = Stage(HookedBlock(), 0, 2, None, 1, counter), Stage(Block(), 1, 2, F.mse_loss, 1, counter)
    act, _ = s1.forward([torch.randn(2, 8)], torch.zeros(2, 8))
    HookedBlock.calls.clear()
    overlapped_forward_backward(s0, [torch.randn(2, 8)], None, None, s1, act, None)
    assert HookedBlock.calls == []  # DeepSeek's rule: one class for both, else sequential
    assert s1.module.fc.weight.grad is not None


def test_both_halves_of_a_pair_run_on_the_callers_gpu(monkeypatch):
    """A new thread starts on GPU 0: a pair's halves on rank 3's GPU 3 ran their kernels, and recomputation saved
    and restored the random state of, GPU 0 (silently wrong dropout).  Two fake GPUs: the caller's thread is on
    GPU 1; each half must find itself there and draw from GPU 1's random state."""
    import threading

    from pipedsl.runtime import overlap

    local = threading.local()
    states = {0: torch.tensor([0]), 1: torch.tensor([1])}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(local, "device", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: setattr(local, "device", int(d)))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [states[0], states[1]])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda all_: None)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda d: states[d])
    from pipedsl.runtime import recompute

    def where() -> tuple[int, int]:  # the half's device, and the device whose state recomputation would save
        return torch.cuda.current_device(), recompute._rng_state()[1][0]

    torch.cuda.set_device(1)
    assert overlap.PairOverlap().run(where, where) == ((1, 1), (1, 1))


def test_a_backward_run_on_autograds_device_thread_hands_over_too():
    """On a GPU autograd runs the backward on its device thread while the backward half waits in backward(): an
    exchange waited for there must hand over to the forward half as one on the half's own thread does (it did
    not, and the overlap shrank to the forward's first exchange).  The device thread is a plain thread here."""
    import threading

    from pipedsl.runtime import overlap

    order: list[str] = []

    class Work:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait(self) -> None:
            order.append(f"{self.name} done")

    pair = overlap.PairOverlap()

    def forward() -> None:
        order.append("forward starts")
        pair.wait(Work("forward exchange"), 0.0)
        order.append("forward ends")

    def backward() -> None:
        def device_thread() -> None:  # autograd's worker, running the backward's exchange
            order.append("backward exchange issued")
            pair.wait(Work("backward exchange"), 0.0)

        worker = threading.Thread(target=device_thread)
        worker.start()
        worker.join()

    before = overlap.PairOverlap.handovers
    pair.run(forward, backward, first="backward")
    assert order.index("forward starts") < order.index("backward exchange done"), order  # handed over meanwhile
    assert overlap.PairOverlap.handovers - before >= 1


def test_every_pair_runs_its_halves_on_the_same_two_threads():
    """Each pair's halves run on two threads kept for the calling thread, not fresh ones: torch caches DTensor's
    sharding propagation per thread, so fresh threads propagated every op of a tensor-parallel half anew each step.
    A half that raises leaves them usable; another calling thread gets its own two."""
    import threading

    import pytest

    from pipedsl.runtime import overlap

    def where() -> threading.Thread:
        return threading.current_thread()

    def fails() -> None:
        raise ValueError("a half failed")

    first = overlap.PairOverlap().run(where, where)
    assert first[0] is not first[1] and threading.current_thread() not in first
    with pytest.raises(ValueError, match="a half failed"):
        overlap.PairOverlap().run(where, fails)
    assert overlap.PairOverlap().run(where, where) == first
    elsewhere: list = []
    caller = threading.Thread(target=lambda: elsewhere.append(overlap.PairOverlap().run(where, where)))
    caller.start()
    caller.join()
    assert not set(elsewhere[0]) & set(first), "another calling thread shares this one's carriers"
