"""Checks for parameters tied between stages, run on every rank of a pool (see conftest.py).

The model is a tiny language model whose output projection *is* its token embedding (as in
GPT-2): the first and the last stage share one weight.  Each check returns its findings.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import pipedsl
from pipedsl.errors import PipeRuntimeError

VOCAB, WIDTH, TOKENS = 24, 16, 5
RTOL = 1e-5


class Embed(nn.Module):
    def __init__(self, wte: nn.Embedding) -> None:
        super().__init__()
        self.wte = wte

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # [B, T] → [B, T, C]
        return self.wte(idx)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C]
        return x + torch.tanh(self.fc(self.ln(x)))


class Head(nn.Module):
    """Logits through the embedding matrix: the tied use."""

    def __init__(self, wte: nn.Embedding) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.wte = wte

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C] → [B, T, V]
        return F.linear(self.ln(x), self.wte.weight)


def tied_model(num_stages: int, seed: int = 0) -> list[nn.Module]:
    """Stages embed, blocks…, head; stage 0 and the last share one `wte`."""
    torch.manual_seed(seed)
    wte = nn.Embedding(VOCAB, WIDTH)
    return [Embed(wte), *(Block() for _ in range(num_stages - 2)), Head(wte)]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    return torch.randint(VOCAB, (n, TOKENS), generator=g), torch.randint(VOCAB, (n, TOKENS), generator=g)


def _reference_step(stages: list[nn.Module], x: torch.Tensor, y: torch.Tensor, M: int) -> float:
    total = 0.0
    for xm, ym in zip(x.chunk(M), y.chunk(M)):
        h = xm
        for st in stages:
            h = st(h)
        loss = loss_fn(h, ym) / M
        loss.backward()
        total += loss.item()
    return total


def _params(stages: list[nn.Module]) -> list[nn.Parameter]:
    seen, out = set(), []
    for st in stages:
        for p in st.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def tied_equivalence(rank: int, schedule: str, P: int, M: int, explicit: bool = False, steps: int = 3,
                     params: dict | None = None, parallel: dict | None = None) -> dict:
    """Losses, the tied weight's gradient and every parameter after Adam equal a one-process run of
    the tied model.  `explicit`: each rank builds separate stage modules (a stage function) and the tie
    is named with `ties=` — the copies start from different values and the broadcast must align them."""
    program = pipedsl.load(schedule).compile(P=P, M=M, **(params or {}))
    S = program.num_stages
    ref = tied_model(S)
    ref_opt = torch.optim.Adam(_params(ref), lr=1e-2)
    kw: dict = {"program": program, "loss_fn": loss_fn}
    dp, dp_rank = 1, 0
    if parallel:
        from pipedsl.parallel import ParallelConfig, ParallelMesh

        mesh = ParallelMesh(ParallelConfig(**parallel))
        kw = {"parallel": mesh, "loss_fn": loss_fn}
        kw["schedule"], kw["microbatches"] = schedule, M
        dp, dp_rank = mesh.config.dp, mesh.coords.dp
    if explicit:
        def stage_fn(s: int) -> nn.Module:
            built = tied_model(S, seed=0 if s == 0 else 1000 + s)  # a wrong, different copy of wte
            return built[s]
        pipe = pipedsl.Pipeline(stage_fn, ties=[[(0, "wte.weight"), (S - 1, "wte.weight")]], **kw)
    else:
        pipe = pipedsl.Pipeline(copy.deepcopy(ref), **kw)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    problems = []
    for step in range(steps):
        x, y = batch(step, 2 * M * dp)
        loss = pipe.step(x, y)
        ref_loss = _reference_step(ref, x, y, M * dp)
        if abs(loss - ref_loss) > RTOL * abs(ref_loss):
            problems.append(f"step {step}: loss {loss} != reference {ref_loss}")
        for s, module in pipe.local_stages().items():
            for (name, p), q in zip(module.named_parameters(), ref[s].parameters()):
                if p.grad is None or not torch.allclose(p.grad, q.grad, rtol=RTOL, atol=1e-6):
                    problems.append(f"step {step} stage {s} {name}: gradient differs")
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    for s, module in pipe.local_stages().items():
        for (name, p), q in zip(module.named_parameters(), ref[s].parameters()):
            if not torch.allclose(p, q, rtol=RTOL, atol=1e-6):
                problems.append(f"stage {s} {name}: parameter differs after {steps} Adam steps")
    local_params = list(pipe.parameters())
    return {"problems": problems, "ties": len(pipe.ties.names), "params": len(local_params),
            "distinct": len({id(p) for p in local_params}), "dp_rank": dp_rank}


def tie_error(rank: int, ties: list) -> str:
    """The error for a bad `ties=` (every rank must raise it; none may hang)."""
    try:
        pipedsl.Pipeline(tied_model(2), "1f1b", microbatches=2, loss_fn=loss_fn, ties=ties)
    except PipeRuntimeError as err:
        return err.message
    return "no error"
