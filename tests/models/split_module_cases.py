"""Small models for `split_module` and `split_sequential`, and the check every rank of a pool runs (conftest.py).

`equivalence` builds the same model on every rank (same seed), keeps a deep copy as the unsplit
reference, and compares the pipeline with one process running the same M microbatches (gradient
accumulation: BatchNorm's batch statistics are a microbatch's, as in the pipeline): the loss and
every local parameter's gradient at each of two SGD steps, then the weights and the BatchNorm
running statistics.  Stage parameters and buffers are mapped back to the model by identity.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import pipedsl
from pipedsl.models.split import split_sequential
from pipedsl.models.split_graph import split_module

B, M = 8, 4  # batch, microbatches
LR = 0.5
TOL = 1e-5  # of the loss, and of each gradient relative to its tensor's largest entry (fp32)


# ------------------------------------------------------------ models


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm, a downsampling shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ResNet layout, tiny: stem, layer1-4 of basic blocks, average pool, fc."""

    def __init__(self, w: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, w, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(w, w))
        self.layer2 = nn.Sequential(BasicBlock(w, 2 * w, 2))
        self.layer3 = nn.Sequential(BasicBlock(2 * w, 2 * w))
        self.layer4 = nn.Sequential(BasicBlock(2 * w, 2 * w, 2))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * w, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))  # [mb, w, 8, 8]
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))  # [mb, 2w, 2, 2]
        return self.fc(torch.flatten(self.avgpool(x), 1))  # [mb, classes]


class UNet(nn.Module):
    """Three convolutions down, two up, each up concatenating the skip of its level; the head sees the input too."""

    def __init__(self, w: int = 8) -> None:
        super().__init__()
        self.down = nn.ModuleList([nn.Conv2d(3, w, 3, padding=1), nn.Conv2d(w, 2 * w, 3, padding=1),
                                   nn.Conv2d(2 * w, 2 * w, 3, padding=1)])
        self.up = nn.ModuleList([nn.Conv2d(4 * w, w, 3, padding=1), nn.Conv2d(2 * w, w, 3, padding=1)])
        self.head = nn.Conv2d(w + 3, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips, h = [], x
        for i, down in enumerate(self.down):
            h = torch.relu(down(h))  # [mb, w·2^min(i,1), 8/2^i, …]
            skips.append(h)
            if i < len(self.down) - 1:
                h = F.max_pool2d(h, 2)
        skips.pop()
        for up in self.up:
            h = F.interpolate(h, scale_factor=2, mode="nearest")
            h = torch.relu(up(torch.cat([h, skips.pop()], 1)))
        return self.head(torch.cat([h, x], 1))  # [mb, 2, 8, 8]


class ViT(nn.Module):
    """Patch embedding, a cls token and position embeddings (Parameters), encoder blocks, a head on the cls token."""

    def __init__(self, d: int = 16, depth: int = 4, classes: int = 5, dropout: float = 0.0) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, 4, 4)  # 8x8 image -> 4 patches
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.1)
        self.pos_embed = nn.Parameter(torch.randn(1, 5, d) * 0.1)
        self.blocks = nn.ModuleList([nn.TransformerEncoderLayer(d, 2, 32, dropout=dropout, batch_first=True)
                                     for _ in range(depth)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch(x).flatten(2).transpose(1, 2)  # [mb, 4, d]
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], 1) + self.pos_embed  # [mb, 5, d]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h)[:, 0])


class Encoder(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.gate = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"h": torch.tanh(self.embed(x)) * mask, "g": self.gate(x)}


class Mixer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"h": torch.tanh(self.proj(state["h"])) + state["g"], "g": state["g"]}


class DictNet(nn.Module):
    """Dicts between submodules, a tensor keyword (`mask`) and a float one (`scale`), a dict output, and the
    output projection tied to the first layer's weight (a parameter of the first and the last stage)."""

    def __init__(self, d: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.enc = Encoder(d)
        self.mix = nn.ModuleList([Mixer(d) for _ in range(depth)])
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, scale: float = 1.0) -> dict[str, Any]:
        state = self.enc(x, mask)
        for m in self.mix:
            state = m(state)
        logits = self.norm(state["h"]) @ self.enc.embed.weight.t() * scale  # [mb, d]
        return {"logits": logits, "aux": state["g"].mean(1), "scale": scale}


class FrozenNet(nn.Module):
    """A frozen stem and a frozen middle layer (requires_grad=False) among trainable ones."""

    def __init__(self, d: int = 12) -> None:
        super().__init__()
        self.stem = nn.Linear(6, d)
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(4)])
        self.out = nn.Linear(d, 3)
        for p in [*self.stem.parameters(), *self.layers[1].parameters()]:
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        for layer in self.layers:
            h = h + torch.relu(layer(h))
        return self.out(h)


class Regroup(nn.Module):
    """Rows regrouped by the batch size read at the top of forward: stage 1 receives [mb·4, d] only, so the
    batch size crosses the boundary as a 0-d integer tensor; `n` (an int) is a constant of the trace."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 3)

    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        rows = x.shape[0]
        h = torch.tanh(self.a(x)).reshape(-1, x.shape[-1])  # [mb·4, d]
        h = self.b(h) * n
        return self.c(h.view(rows, 4, -1).mean(1))


class Embed(nn.Module):
    """(x, mask) -> (h, mask): the mask (int64) travels with the hidden states."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(6, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.proj(x) * mask.unsqueeze(-1), mask


class MaskedBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h + torch.tanh(self.proj(h)) * mask.unsqueeze(-1), mask


class Pool(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, 3)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.proj((h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp_min(1))


def tuple_seq(d: int = 8) -> nn.Sequential:
    return nn.Sequential(Embed(d), *(MaskedBlock(d) for _ in range(4)), Pool(d))


def _points(num_stages: int, two: list[str], four: list[str]) -> list[str]:
    return {2: two, 4: four}[num_stages]


def run_sequential(seq: nn.Sequential, *inputs: torch.Tensor) -> Any:
    """The unsplit `seq` called as its stages pass tuples: `layer(*out)` when a layer returned a tuple."""
    out: Any = inputs
    for layer in seq:
        out = layer(*out) if isinstance(out, tuple) else layer(out)
    return out


_BUILT: dict[tuple[str, int], tuple] = {}


def build(case: str, num_stages: int) -> tuple[nn.Module, list[nn.Module], tuple, Any, Any, Any]:
    """(model, its stages, the pipeline's inputs, targets, loss_fn, forward) of `case`: `forward(model, rows)`
    runs the unsplit model on those rows of the batch as its user would.

    Traced once per process and case (a trace is most of a check's time); each call gets a deep copy of the
    model and its stages together, so the copied stages hold the copied model's parameters."""
    if (case, num_stages) not in _BUILT:
        _BUILT[case, num_stages] = _build(case, num_stages)
    built = _BUILT[case, num_stages]
    return (*copy.deepcopy(built[:2]), *built[2:])


def _build(case: str, num_stages: int, seed: int = 0) -> tuple[nn.Module, list[nn.Module], tuple, Any, Any, Any]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    if case == "tuple_seq":
        model = tuple_seq()
        x = torch.randn(B, 5, 6, generator=g)
        mask = (torch.rand(B, 5, generator=g) > 0.3).long()
        y = torch.randint(3, (B,), generator=g)
        return (model, split_sequential(model, num_stages), (x, mask), y, F.cross_entropy,
                lambda m, rows: run_sequential(m, x[rows], mask[rows]))
    if case == "dict":
        model = DictNet()
        x = torch.randn(B, 8, generator=g)
        mask = (torch.rand(B, 8, generator=g) > 0.3).float()
        y = torch.randint(8, (B,), generator=g)
        points = _points(num_stages, ["mix.2"], ["mix.1", "mix.2", "mix.3"])

        def loss_fn(out: dict, target: torch.Tensor) -> torch.Tensor:
            assert out["scale"] == 0.5  # the model's own output structure, constants included
            return F.cross_entropy(out["logits"], target) + 0.1 * out["aux"].square().mean()
        stages = split_module(model, points, (x[:2],), {"mask": mask[:2], "scale": 0.5})
        return model, stages, (x, mask), y, loss_fn, lambda m, rows: m(x[rows], mask=mask[rows], scale=0.5)
    if case == "regroup":
        model, x = Regroup(), torch.randn(B, 4, 8, generator=g)
        y = torch.randint(3, (B,), generator=g)
        stages = split_module(model, _points(num_stages, ["b"], ["b", "c"]), (x, 2))
        return model, stages, (x,), y, F.cross_entropy, lambda m, rows: m(x[rows], 2)
    x = torch.randn(B, 3, 8, 8, generator=g) if case in ("resnet", "unet", "vit") else torch.randn(B, 6, generator=g)
    if case == "resnet":
        model, points = ResNet(), _points(num_stages, ["layer3"], ["layer2", "layer3", "layer4"])
        y, loss_fn = torch.randint(5, (B,), generator=g), F.cross_entropy
    elif case == "unet":
        model, points = UNet(), _points(num_stages, ["down.2"], ["down.1", "down.2", "up.1"])
        y, loss_fn = torch.randn(B, 2, 8, 8, generator=g), F.mse_loss
    elif case == "vit":
        model, points = ViT(), _points(num_stages, ["blocks.2"], ["blocks.1", "blocks.2", "blocks.3"])
        y, loss_fn = torch.randint(5, (B,), generator=g), F.cross_entropy
    elif case == "frozen":
        model, points = FrozenNet(), _points(num_stages, ["layers.2"], ["layers.1", "layers.2", "layers.3"])
        y, loss_fn = torch.randint(3, (B,), generator=g), F.cross_entropy
    else:
        raise ValueError(case)
    return model, split_module(model, points, (x,)), (x,), y, loss_fn, lambda m, rows: m(x[rows])


# ------------------------------------------------------------ the multi-rank check


def equivalence(rank: int, case: str, schedule: str, params: dict[str, int] | None = None, steps: int = 2) -> dict:
    """`steps` pipelined SGD steps of `case` against one process running the same microbatches; returns the
    problems found (never raises on one rank only) and the parameter names this rank checked."""
    P = torch.distributed.get_world_size()
    program = pipedsl.load(schedule).compile(P=P, M=M, **(params or {}))
    model, stages, inputs, y, loss_fn, forward = build(case, program.num_stages)
    ref = copy.deepcopy(model)  # after the split: tracing must have left the model as it was
    names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    ref_params, ref_buffers = dict(ref.named_parameters()), dict(ref.named_buffers())
    problems: list[str] = []
    with pipedsl.Pipeline(stages, program=program, loss_fn=loss_fn) as pipe:
        local = {names[id(p)]: p for m in pipe.local_stages().values() for p in m.parameters()}
        buffers = {names[id(b)]: b for m in pipe.local_stages().values() for b in m.buffers() if id(b) in names}
        for step in range(steps):
            loss = pipe.step(inputs if len(inputs) > 1 else inputs[0], y)
            want = 0.0
            for k in range(M):  # one process, the same microbatches
                rows = _rows(k)
                part = loss_fn(forward(ref, rows), y[rows]) / M
                part.backward()
                want += part.item()
            if abs(loss - want) > TOL * abs(want):
                problems.append(f"rank {rank} step {step}: loss {loss} != one process's {want}")
            for name, p in local.items():
                q = ref_params[name].grad
                if not p.requires_grad:
                    if p.grad is not None:
                        problems.append(f"rank {rank}: frozen {name} got a gradient")
                    continue
                if p.grad is None:
                    problems.append(f"rank {rank} step {step}: {name} has no gradient")
                    continue
                err = ((p.grad - q).abs().max() / q.abs().max().clamp_min(1e-12)).item()
                if err > TOL * 10:
                    problems.append(f"rank {rank} step {step}: {name}.grad differs (max err {err:.3g} of its max)")
            with torch.no_grad():
                for p in [*pipe.parameters(), *ref.parameters()]:
                    if p.grad is not None:
                        p -= LR * p.grad
                        p.grad = None
        for name, p in local.items():
            if not torch.allclose(p, ref_params[name], rtol=1e-4, atol=1e-6):
                problems.append(f"rank {rank}: {name} after {steps} steps differs from one process's")
        for name, b in buffers.items():
            if not torch.allclose(b.float(), ref_buffers[name].float(), rtol=1e-4, atol=1e-6):
                problems.append(f"rank {rank}: buffer {name} differs from one process's after {steps} steps")
        evaluated = None
        if case == "resnet":  # eval mode: the stages switch to their eval graphs (running statistics)
            evaluated = pipe.evaluate(inputs[0], y)
            ref.eval()
            with torch.no_grad():
                want = sum(loss_fn(forward(ref, _rows(k)), y[_rows(k)]).item() for k in range(M)) / M
            if abs(evaluated - want) > TOL * abs(want):
                problems.append(f"rank {rank}: evaluate() gives {evaluated}, one process in eval mode {want}")
        ties = len(pipe.ties.names)
    return {"problems": problems, "checked": sorted(local), "buffers": sorted(buffers), "ties": ties,
            "all": sorted(n for n, _ in model.named_parameters())}


def _rows(k: int) -> slice:
    return slice(k * B // M, (k + 1) * B // M)
