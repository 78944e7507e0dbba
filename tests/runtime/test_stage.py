"""The stage wrapper alone (one process): split backward equals full backward, activations are counted."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipedsl.runtime.stage import ActivationCounter, ActivationToken, Stage, StageOptions


class Shared(nn.Module):
    """One weight used twice, a branch that never sees the input, and two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(6, 6)
        self.u = nn.Linear(6, 6)
        self.bias_only = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.w(x))
        h = self.w(h) + self.u(x) * self.bias_only
        return h, self.bias_only.exp().expand_as(h) * 1.0


class OutputOffPath(nn.Module):
    """A norm whose bias also makes an output that no input reaches: the norm's weight shares the norm's node with
    a parameter W must compute, so it is not I's either (found in review: it was computed twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.norm(self.lin(x)), self.norm.bias.expand_as(x) * 1.0


class InPlaceOnSlice(nn.Module):
    """An in-place multiply on a slice in a weight-only branch: a CopySlices node W runs, whose saved tensors Python
    cannot read (found in review: I dropped them)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6) * 0.3)
        self.v = nn.Parameter(torch.randn(6, 6) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.v * 1.0
        m[:3].mul_(self.w[:3])
        return torch.tanh(x) @ m


def _block() -> nn.Module:
    return nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)


CASES = {
    "mlp": (lambda: nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 6)), (3, 6)),
    "shared": (Shared, (3, 6)),
    "block": (_block, (2, 5, 8)),
    "output_off_path": (OutputOffPath, (3, 6)),
    "in_place_on_slice": (InPlaceOnSlice, (3, 6)),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("last", [False, True])
@pytest.mark.parametrize("release", [False, True])
def test_split_backward_equals_full(name: str, last: bool, release: bool) -> None:
    """Also where I drops what W does not read (`release`): W reads nothing I dropped."""
    torch.manual_seed(0)
    make, shape = CASES[name]
    module = make()
    twin = copy.deepcopy(module)
    x = torch.randn(shape)

    def loss_fn(out, target):
        outs = out if isinstance(out, tuple) else (out,)
        return sum((o * target).sum() for o in outs)

    target = torch.randn(shape)
    num = 2 if last else 3
    full = Stage(module, 1, num, loss_fn, 2, ActivationCounter())
    split = Stage(twin, 1, num, loss_fn, 2, ActivationCounter(), options=StageOptions(release=release))
    act_a, outs = full.forward([x], target)
    act_b, _ = split.forward([x], target)
    grads = None if last else [torch.randn_like(o) for o in outs if o.is_floating_point()]
    ga = full.backward(act_a, grads)
    gb = split.backward_input(act_b, grads)
    # I leaves to W the gradients of every parameter but those its plan computes in I (only with `release`: vectors,
    # and the weight `shared` uses twice along the input path)
    [plan] = split._plans.values()
    assert {i for i, p in enumerate(twin.parameters()) if p.grad is not None} == set(plan.early)
    if name == "shared":
        assert (twin.w.weight.grad is not None) == release
    assert all(p.dim() <= 1 for i, p in enumerate(twin.parameters()) if i in plan.early) or name == "shared"
    split.backward_weight(act_b)
    for a, b in zip(ga, gb, strict=True):
        torch.testing.assert_close(a, b)
    for (n, p), q in zip(module.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=n: f"{n}: {m}")


def test_byte_counting_is_a_hook_only_when_asked_for(monkeypatch) -> None:
    """Off (the Pipeline default): no saved-tensor hook runs and no byte is counted; activations are still counted.
    On: the saved input and tanh's output, each storage once (the weight is a parameter)."""
    packed: list[torch.Tensor] = []
    real = ActivationToken.pack
    monkeypatch.setattr(ActivationToken, "pack", lambda self, t: (packed.append(t), real(self, t))[1])
    results = {}
    for count_bytes in (False, True):
        packed.clear()
        counter = ActivationCounter(count_bytes=count_bytes)
        stage = Stage(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), 1, 3, None, 1, counter)
        act, outs = stage.forward([torch.randn(2, 4)])
        results[count_bytes] = (counter.live, counter.peak_bytes, len(packed))
        stage.backward(act, [torch.ones_like(outs[0])])
    assert results[False] == (1, 0, 0)
    assert results[True][0] == 1 and results[True][2] >= 2 and results[True][1] == 2 * (2 * 4 * 4)


def test_activation_lives_until_backward_frees_the_graph() -> None:
    counter = ActivationCounter()
    stage = Stage(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), 1, 3, None, 1, counter)
    acts = [stage.forward([torch.randn(2, 4)]) for _ in range(3)]
    assert counter.live == 3
    act, outs = acts.pop(0)
    stage.backward(act, [torch.ones_like(outs[0])])
    del act, outs
    assert counter.live == 2 and counter.peak == 3
    act, outs = acts.pop(0)
    stage.backward_input(act, [torch.ones_like(outs[0])])
    del outs
    assert counter.live == 2, "after I the graph W needs is still alive"
    stage.backward_weight(act)
    del act
    assert counter.live == 1


class Branchy(nn.Module):
    """A graph whose shape depends on the data: the split-backward plan must follow it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h) if x.sum() > 0 else self.b(h) * self.a(h)


def test_split_backward_plan_is_reused_per_graph_shape() -> None:
    """One plan per graph structure (not per microbatch), and every microbatch's gradients still exact."""
    torch.manual_seed(0)
    module = Branchy()
    twin = copy.deepcopy(module)
    full = Stage(module, 1, 3, None, 4, ActivationCounter())
    split = Stage(twin, 1, 3, None, 4, ActivationCounter())
    xs = [torch.randn(3, 6).abs() * sign for sign in (1, 1, -1, 1, -1)]
    for k, x in enumerate(xs):
        act_a, outs = full.forward([x])
        act_b, _ = split.forward([x])
        g = [torch.randn_like(outs[0])]
        ga = full.backward(act_a, g)
        gb = split.backward_input(act_b, g)
        split.backward_weight(act_b)
        torch.testing.assert_close(ga[0], gb[0], msg=lambda m, k=k: f"microbatch {k} input grad: {m}")
        for p, q in zip(module.parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, k=k: f"microbatch {k}: {m}")
    assert len(split._plans) == 2, "one plan for each of the two graph shapes"


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-v"])
def test_compiled_blocks_under_split_backward(pool2, schedule) -> None:
    import runtime_cases

    """torch.compile'd blocks under 1F1B, ZB-H1 and ZB-V: no donated-buffer crash, gradients equal one process,
    each block's backward once per microbatch (2 blocks a rank, M=2)."""
    results = pool2.run(runtime_cases.compiled_blocks, schedule)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    assert [r["backward_runs"] for r in results] == [4, 4]


@pytest.mark.quick
@pytest.mark.parametrize("level", [1, 2])
def test_flat_buffers_keep_their_gradient_in_w(pool2, level) -> None:
    import runtime_cases

    problems = [p for r in pool2.run(runtime_cases.flat_buffer_split, level) for p in r["problems"]]
    assert not problems, "\n".join(problems)


def test_input_gradient_drops_what_the_weight_gradient_does_not_read() -> None:
    """Split backward's memory (docs/runtime.md): after I, of everything a GPT block's forward saved only the
    inputs of its linear layers stay (W reads them for the weight gradients: found here by forward pre-hooks,
    not by the runtime's graph walk) and the stage input; attention's, GELU's and the second norm's saved
    tensors are freed (I computed the norms' and biases' gradients).  Without `release` everything stays
    until W.  The gradients equal a full backward either way."""
    from saved_storages import saved_storages

    from pipedsl.models.gpt.model import Block, GPTConfig

    B, T, C = 2, 16, 32
    torch.manual_seed(0)
    block = Block(GPTConfig(n_embd=C, n_head=4, block_size=T))
    reference = copy.deepcopy(block)
    x = torch.randn(B, T, C)
    g = torch.randn(B, T, C)
    out = reference(x.clone().requires_grad_())
    out.backward(g)
    for release in (False, True):
        module = copy.deepcopy(block)
        read_by_w: set[int] = set()
        for m in module.modules():
            if isinstance(m, nn.Linear):
                m.register_forward_pre_hook(lambda _m, args, seen=read_by_w: seen.add(args[0].untyped_storage().data_ptr()))
        stage = Stage(module, 1, 3, None, 1, ActivationCounter(), options=StageOptions(release=release))
        act, outs = stage.forward([x])
        weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
        saved = saved_storages(outs, weights, min_numel=B * T * C)  # (norms' statistics are smaller)
        del outs
        stage.backward_input(act, [g])
        alive = {k for k, (ref, _) in saved.items() if not ref.expired()}
        assert read_by_w < set(saved)  # attention's and GELU's saved tensors besides
        assert alive == (read_by_w | {x.untyped_storage().data_ptr()} if release else set(saved)), release
        stage.backward_weight(act)
        for (n, p), q in zip(reference.named_parameters(), module.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=n: f"{n}: {m}")


def test_the_share_of_an_activation_a_pending_w_holds_is_measured_after_input_gradient() -> None:
    """`ActivationCounter.w_shares` (what --schedule auto gives zb-auto as `Cost.wmem`): after I, the bytes of the
    saved tensors still alive and of the gradients captured for W over the bytes the forward counted, each storage
    once — the same as counted independently by weak references to what the graph saved.  From I on the byte
    counter counts those bytes (the schedules' memory model: `Cost.wmem` of an activation until W)."""
    from saved_storages import saved_storages

    from pipedsl.models.gpt.model import Block, GPTConfig

    B, T, C = 2, 16, 32
    torch.manual_seed(0)
    for release in (True, False):
        module = Block(GPTConfig(n_embd=C, n_head=4, block_size=T))
        counter = ActivationCounter()
        counter.measure_w_shares = True  # --schedule auto's profile steps ask for it
        stage = Stage(module, 1, 3, None, 1, counter, options=StageOptions(release=release))
        x = torch.randn(B, T, C)
        act, outs = stage.forward([x])
        weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
        saved = saved_storages(outs, weights)
        saved.setdefault(x.untyped_storage().data_ptr(), (None, x.untyped_storage().nbytes()))  # the stage input
        counted = counter.live_bytes
        assert counted == sum(n for _, n in saved.values()) == counter.largest_bytes
        del outs
        stage.backward_input(act, [torch.randn(B, T, C)])
        alive = {k: n for k, (ref, n) in saved.items() if ref is None or not ref.expired()}  # x: held by the stage
        grads = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                 for _, gs, _, _ in act.boundary for g in gs if isinstance(g, torch.Tensor)}
        held = sum(alive.values()) + sum(n for k, n in grads.items() if k not in alive)
        if release:
            assert list(counter.w_shares) == [pytest.approx(held / counted)]
            assert 0 < counter.w_shares[0]  # 1.05 here: the captured gradients outweigh what I freed
            assert counter.live_bytes == held and counter.peak_bytes == max(counted, held)
        else:  # every saved tensor stays until W: not measured (W's share is not what I kept)
            assert not counter.w_shares
            assert counter.live_bytes == counted
        stage.backward_weight(act)
        del act
        assert counter.live == 0 and counter.live_bytes == 0  # W gave back what I recounted
    unasked = ActivationCounter()  # not asked: nothing walked at I
    stage = Stage(Block(GPTConfig(n_embd=C, n_head=4, block_size=T)), 1, 3, None, 1, unasked,
                  options=StageOptions(release=True))
    act, outs = stage.forward([torch.randn(B, T, C)])
    del outs
    stage.backward_input(act, [torch.randn(B, T, C)])
    assert not unasked.w_shares
    stage.backward_weight(act)


def test_a_weight_used_along_the_input_path_twice_is_computed_in_input_gradient() -> None:
    """`Shared` applies w to x and again to tanh(w(x)): from the second use, W would run I's path back to the first
    again (keeping tanh's output alive until W).  Where I drops what W does not read, w's gradient is computed in
    I instead, and tanh's output is freed at I; without, it lives until W."""
    from saved_storages import saved_storages

    for release in (False, True):
        torch.manual_seed(0)
        module = Shared()
        inputs: list[torch.Tensor] = []
        module.w.register_forward_pre_hook(lambda _m, args, seen=inputs: seen.append(args[0]))
        stage = Stage(module, 1, 3, None, 1, ActivationCounter(), options=StageOptions(release=release))
        act, outs = stage.forward([torch.randn(3, 6)])
        saved = saved_storages(outs, {p.untyped_storage().data_ptr() for p in module.parameters()})
        tanh_out = inputs.pop().untyped_storage().data_ptr()
        inputs.clear()
        assert tanh_out in saved
        grads = [torch.randn_like(o) for o in outs]
        del outs
        stage.backward_input(act, grads)
        assert saved[tanh_out][0].expired() == release
        stage.backward_weight(act)


def test_a_weight_pass_hook_added_later_leaves_every_gradient_to_w() -> None:
    """With weight-pass hooks (ZeRO-3 gathers and reduces around W), I computes no parameter's gradient, also when
    the hook comes after plans were derived without it (`Pipeline.register_weight_pass_hook` is public)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 6))
    stage = Stage(module, 1, 3, None, 1, ActivationCounter(), options=StageOptions(release=True))
    calls: list[str] = []
    for hooked in (False, True):
        if hooked:
            stage.add_weight_pass_hook(lambda: calls.append("before"), lambda: calls.append("after"))
        module.zero_grad(set_to_none=True)
        act, outs = stage.forward([torch.randn(3, 6)])
        stage.backward_input(act, [torch.ones_like(outs[0])])
        assert (module[0].weight.grad is None) == hooked, "the norm's gradient comes from I only without hooks"
        stage.backward_weight(act)
        assert all(p.grad is not None for p in module.parameters())
    assert calls == ["before", "after"]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_split_backward_drops_what_w_does_not_read_of_a_recomputed_region(mode: str) -> None:
    """Under recomputation I recomputes a region and W needs only part of what it saved again (each linear's input):
    I lets go of the rest, as it does of a forward's saved tensors without recomputation, and W's gradients are
    those of the whole backward."""
    from pipedsl.models.gpt.model import Block, GPTConfig
    from pipedsl.runtime.recompute import Recompute

    B, T, C = 2, 8, 16
    torch.manual_seed(0)
    dense = Block(GPTConfig(n_embd=C, n_head=2, block_size=T))
    x, g = torch.randn(B, T, C), torch.randn(B, T, C)
    ref = copy.deepcopy(dense)
    xr = x.clone().requires_grad_()
    ref(xr).backward(g)
    module = copy.deepcopy(dense)
    policy = Recompute(module, mode, (lambda m: type(m).__name__ == "CausalSelfAttention") if mode == "selective"
                       else None)
    stage = Stage(module, 1, 3, None, 1, ActivationCounter(), policy, options=StageOptions(release=True))
    act, outs = stage.forward([x])
    regions = list(act.regions)
    assert regions  # the forward opened its regions and the activation keeps them
    del outs
    dx = stage.backward_input(act, [g])
    kept = [t is not None for r in regions if r.saved is not None for t in r.saved]
    assert kept and 0 < sum(kept) < len(kept), kept  # W reads some of what was recomputed, not all
    stage.backward_weight(act)
    assert torch.allclose(dx[0], xr.grad, atol=1e-6)
    for (name, p), q in zip(module.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name
