"""Worker-side checks of the LLM-training features: per-token loss, recomputation, changing shapes.

Module-level so they pickle (see conftest.Pool); each returns its findings instead of asserting.
The model is one the other runtime tests do not use: a small decoder with RMSNorm, a gated
(SwiGLU) MLP, causal attention with dropout, and untied embedding/head.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from dense_index import gather_dense, index_model
from torch import nn

import pipedsl
from pipedsl.runtime.p2p import OPENING_BYTES, OPENING_TAG

VOCAB, WIDTH, HEADS = 48, 24, 2
IGNORE = -100
RTOL = 2e-5


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [mb, T, d]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [mb, T, d]
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(x).split(C, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(B, T, C))  # [mb, T, d]


class GatedMLP(nn.Module):
    def __init__(self, d: int, dropout: float) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(F.silu(self.gate(x)) * self.up(x)))


class Block(nn.Module):
    def __init__(self, d: int, dropout: float) -> None:
        super().__init__()
        self.n1, self.attn, self.n2, self.mlp = RMSNorm(d), Attention(d, HEADS, dropout), RMSNorm(d), GatedMLP(d, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class Embed(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [mb, T] -> [mb, T, d]
        return self.drop(self.tok(ids))


def tiny_lm(num_stages: int, dropout: float = 0.0, seed: int = 0) -> list[nn.Sequential]:
    """One block per stage; the embedding joins the first, the norm and head the last."""
    torch.manual_seed(seed)
    stages = [nn.Sequential(Block(WIDTH, dropout)) for _ in range(num_stages)]
    stages[0].insert(0, Embed(dropout))
    stages[-1].append(RMSNorm(WIDTH))
    stages[-1].append(nn.Linear(WIDTH, VOCAB, bias=False))
    return stages


def padded_batch(step: int, n: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids [n, T] and next-token targets with a random padded tail per sample (some samples all padding)."""
    g = torch.Generator().manual_seed(700 + step)
    ids = torch.randint(0, VOCAB, (n, T), generator=g)
    targets = torch.randint(0, VOCAB, (n, T), generator=g)
    keep = torch.randint(0, T + 1, (n,), generator=g)
    keep[0] = 0  # one sample without a single token: its microbatch may have none
    targets[torch.arange(T).expand(n, T) >= keep[:, None]] = IGNORE
    return ids, targets


def token_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")


def token_mean(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def is_attention(m: nn.Module) -> bool:
    return isinstance(m, (Attention, nn.LayerNorm))  # the attention here; tie_cases' model has LayerNorms


def _model(name: str, S: int, dropout: float) -> list[nn.Module]:
    if name == "tied":  # tie_cases' model: the token embedding is also the last stage's output projection
        import tie_cases

        return tie_cases.tied_model(S)
    return tiny_lm(S, dropout=dropout)


def _grads(pipe: pipedsl.Pipeline) -> dict[str, torch.Tensor]:
    return {f"{s}.{n}": p.grad.detach().clone() for s, m in sorted(pipe.local_stages().items())
            for n, p in m.named_parameters() if p.grad is not None}


def _compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> list[str]:
    bad = []
    if got.keys() != want.keys():
        return [f"{what}: gradients of {sorted(got)} != {sorted(want)}"]
    for k in got:
        err, mag = float((got[k] - want[k]).abs().max()), float(want[k].abs().max())
        if not err <= 1e-7 + RTOL * mag:
            bad.append(f"{what}: grad {k} max error {err:.3g} (magnitude {mag:.3g})")
    return bad


def token_loss_check(rank: int, program_json: str, options: dict[str, Any] | None = None) -> list[str]:
    """Per-token loss and gradients of the pipeline = one process's `F.cross_entropy(ignore_index)` over the batch."""
    program = pipedsl.Program.from_json(program_json)
    S, M = program.num_stages, program.num_microbatches
    stages = tiny_lm(S)
    ref = nn.Sequential(*copy.deepcopy(stages))
    pipe = pipedsl.Pipeline(stages, program=program, loss_fn=token_sum, loss_reduction="token", **(options or {}))
    problems = []
    for step in range(2):
        problems += _step_like_one_process(pipe, ref, *padded_batch(step, 2 * M, 6), f"step {step}")
    return problems


def _step_like_one_process(pipe: pipedsl.Pipeline, ref: nn.Sequential, x: torch.Tensor, y: torch.Tensor,
                           what: str) -> list[str]:
    """One pipeline step and one process's step of `ref` on the same batch: the differences in loss and
    in this rank's gradients."""
    for p in [*pipe.parameters(), *ref.parameters()]:
        p.grad = None
    loss = pipe.step(x, y)
    want = token_mean(ref(x), y)
    want.backward()
    problems = [] if abs(loss - want.item()) <= RTOL * abs(want.item()) else \
        [f"{what}: loss {loss} != one process {want.item()}"]
    expected = {f"{s}.{n}": p.grad for s in pipe.local_stages() for n, p in ref[s].named_parameters()}
    return problems + _compare(_grads(pipe), expected, what)


def recompute_check(rank: int, program_json: str, modes: tuple[str, ...], options: dict[str, Any] | None = None,
                    model: str = "tiny") -> dict[str, Any]:
    """With dropout: gradients and losses under each recompute mode = without recomputation (same RNG seeds).

    Also the peak saved-activation bytes of each mode on this rank."""
    program = pipedsl.Program.from_json(program_json)
    S, M = program.num_stages, program.num_microbatches
    opts = {"loss_fn": token_sum, "loss_reduction": "token", **(options or {})}
    out: dict[str, Any] = {"problems": [], "bytes": {}}
    results = {}
    for mode in (None, *modes):
        stages = _model(model, S, dropout=0.3)
        pipe = pipedsl.Pipeline(stages, program=program, recompute=mode, activation_bytes=True,
                                recompute_filter=is_attention if mode == "selective" else None, **opts)
        losses = []
        for step in range(2):
            x, y = padded_batch(step, 2 * M, 6)
            if model == "tied":  # tie_cases' vocabulary of 24
                x, y = x % 16, torch.where(y == IGNORE, y, y % 16)
            for p in pipe.parameters():
                p.grad = None
            torch.manual_seed(1000 * step + rank)
            losses.append(pipe.step(x, y))
        results[mode] = (losses, _grads(pipe))
        out["bytes"][str(mode)] = pipe.counter.peak_bytes
    base_losses, base = results[None]
    for mode in modes:
        losses, grads = results[mode]
        if losses != base_losses:
            out["problems"].append(f"recompute={mode}: losses {losses} != without {base_losses}")
        out["problems"] += _compare(grads, base, f"recompute={mode}")
    if all(not g.abs().max() for g in base.values()):
        out["problems"].append("all gradients are zero")
    return out


def shapes_check(rank: int, program_json: str, shapes: list[tuple[int, int]]) -> dict[str, Any]:
    """Batch size and sequence length change between steps: every step's per-token loss and gradients equal
    one process's; returns the problems and how many shapes the pipeline learned."""
    program = pipedsl.Program.from_json(program_json)
    stages = tiny_lm(program.num_stages)
    ref = nn.Sequential(*copy.deepcopy(stages))
    pipe = pipedsl.Pipeline(stages, program=program, loss_fn=token_sum, loss_reduction="token")
    problems = []
    for step, (n, T) in enumerate(shapes):
        problems += _step_like_one_process(pipe, ref, *padded_batch(step, n, T), f"step {step} ({n}x{T})")
    return {"problems": problems, "learned": pipe.shape_handshakes}


def disagreeing_shapes(rank: int, how: str) -> str:
    """Rank 1 passes a shorter sequence than rank 0: every rank stops with the reason, whether rank 1's shape is
    `new` (it waits for every rank's opening message), `known` to both (neither waits: each finds the other's
    opening before it first waits for the other), or in an `evaluate` (forward only: rank 0 never waits for a
    peer's message, and checks at the end); `dist`: over torch.distributed (the same openings, over gloo);
    `nccl`: the NCCL code path, whose openings are host tensors over a gloo group of their own (reading a device
    tensor waits for the GPU); `post`: known shapes in a post-validated step
    (runtime/post_validate.py), whose forward work checks a peer's opening before it first waits for that peer, and
    the others' as they arrive while it waits (`post4`: four ranks, rank 0 alone differs; `post4-late`: rank 0's
    openings to ranks 2 and 3 a second late, after rank 1 found the difference and stopped — ranks 2 and 3 see a
    closed connection first, as a loaded machine made one do; `dist-late`: over torch.distributed, rank 0's first
    receive of the step posted a second late, when rank 1 has stopped: gloo refuses the post itself, as a loaded
    machine made it do)."""
    four = how in ("post4", "post4-late")
    late_post = how == "dist-late"  # rank 0's first receive posted a second late: rank 1 stopped and closed by then
    how = "dist" if late_post else how
    P = 4 if four else 2  # post4: rank 0 alone differs, and rank 3's forward work waits for rank 2 only
    program = pipedsl.load("1f1b").compile(P=P, M=2)
    os.environ["PIPEDSL_P2P"] = how if how in ("dist", "nccl") else "auto"
    try:
        pipe = pipedsl.Pipeline(tiny_lm(P), program=program, loss_fn=token_sum, loss_reduction="token")
    finally:
        os.environ.pop("PIPEDSL_P2P")
    assert pipe.channels.kind == ("dist" if how in ("dist", "nccl") else "socket")
    run = pipe.evaluate if how == "evaluate" else pipe.step
    if how == "post" or four:  # a post-validated step's forward work checks the openings of the peers it waits for
        from pipedsl.runtime.post_validate import TrainingSteps

        run = TrainingSteps(pipe, pipe.optimizer(torch.optim.SGD, lr=0.01), post_validate=True).step
    run(*padded_batch(0, 4, 6))
    if how in ("known", "post") or four:
        run(*padded_batch(0, 4, 5))
    if how == "post4-late" and rank == 0:
        send = pipe.channels.transport.send

        def late(peer: int, tensors: list[torch.Tensor]) -> None:
            if peer == 2 and tensors[0].dtype == torch.uint8 and tensors[0].numel() == OPENING_BYTES:
                time.sleep(1.0)
            send(peer, tensors)

        pipe.channels.transport.send = late
    if late_post and rank == 0:
        post = pipe.channels.post_recv

        def late_recv(*args: Any, **kwargs: Any) -> Any:
            pipe.channels.post_recv = post
            time.sleep(1.0)
            return post(*args, **kwargs)

        pipe.channels.post_recv = late_recv
    opened: list[tuple[str, bool]] = []  # each opening message sent: its tensor's device, over the messages' group?
    isend = dist.isend

    def recorded(t, *args, group=None, tag=0, **kw):
        if tag == OPENING_TAG:
            opened.append((t.device.type, group is pipe.channels.group))
        return isend(t, *args, group=group, tag=tag, **kw)

    dist.isend = recorded
    try:
        run(*padded_batch(1, 4, 6 if rank == 0 else 5))
    except pipedsl.PipeRuntimeError as err:
        if how == "nccl" and opened != [("cpu", False)]:
            return f"the opening messages: {opened}"
        return err.message
    finally:
        dist.isend = isend
    return "no error"


def api_errors(rank: int) -> dict[str, str]:
    """Mistakes every rank makes alike: clear errors before any message."""
    program = pipedsl.load("1f1b").compile(P=2, M=2)

    def message(**kw: Any) -> str:
        try:
            pipe = pipedsl.Pipeline(tiny_lm(2), program=program, loss_fn=token_sum, **kw)
            pipe.step(*padded_batch(0, 4, 6)[:1], None)
        except pipedsl.PipeRuntimeError as err:
            return err.message
        return "no error"

    return {"reduction": message(loss_reduction="per-sample"), "recompute": message(recompute="some"),
            "selective": message(recompute="selective")}


def bytes_prediction(rank: int, program_json: str, mode: str | None) -> dict[str, Any]:
    """Peak saved-activation bytes measured on this rank, and the prediction: the simulator's peak count of
    live activations × the bytes one activation of this rank's stage keeps, plus (recomputation) the bytes
    one recomputed forward brings back during its backward."""
    from pipedsl.runtime.loss import LossPolicy
    from pipedsl.runtime.recompute import Recompute
    from pipedsl.runtime.stage import ActivationCounter, Stage

    program = pipedsl.Program.from_json(program_json)
    S, M = program.num_stages, program.num_microbatches
    (stage,) = {s for (_, s), r in program.placement.items() if r == rank}
    stages = tiny_lm(S, dropout=0.3)
    x, y = padded_batch(0, 2 * M, 8)
    xm, ym = x[:2], y[:2]
    one = copy.deepcopy(nn.Sequential(*stages[:stage]))(xm).detach() if stage else xm  # this stage's input

    def kept(policy: str | None) -> int:
        module = copy.deepcopy(stages[stage])
        rc = None if policy is None else Recompute(module, policy, is_attention)
        st = Stage(module, stage, S, token_sum, M, ActivationCounter(), rc, loss=LossPolicy("token", M))
        act, _ = st.forward([one], ym)
        return act.token.nbytes

    full, mine = kept(None), kept(mode)
    pipe = pipedsl.Pipeline(stages, program=program, loss_fn=token_sum, loss_reduction="token", recompute=mode,
                            recompute_filter=is_attention if mode == "selective" else None, activation_bytes=True)
    pipe.step(x, y)
    peak = pipedsl.simulate(program).peak_activations[rank]
    predicted = peak * mine + (full - mine)
    return {"measured": pipe.counter.peak_bytes, "predicted": predicted, "peak": peak, "full": full, "kept": mine}


# ------------------------------------------------------------------ dp x pp x tp, ZeRO (the session's `pool`)


def parallel_job(dp: int, pp: int, tp: int, runs: tuple, steps: int = 2) -> dict:
    """Each run (schedule, M, zero, batch mode, recompute) trains the small GPT with per-token loss on padded
    targets for a few SGD steps (changing sequence lengths, then a partial batch); on rank 0 the problems against one process (`F.cross_entropy(ignore_index)`
    over the whole global batch): every step's loss and the final parameters, put back into the dense layout."""
    import torch.distributed as dist

    from pipedsl.models.gpt.model import GPT, CausalSelfAttention, GPTConfig
    from pipedsl.models.gpt.parallelize import tp_gpt_loss
    from pipedsl.parallel import ParallelConfig, ParallelMesh

    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    mesh = ParallelMesh(ParallelConfig(dp=dp, pp=pp, tp=tp))
    torch.manual_seed(0)
    model = GPT(cfg)
    batches = []
    for step in range(steps + 1):  # the last: a partial batch of 14, unequal microbatches (4 and 3 per replica)
        g = torch.Generator().manual_seed(50 + step)
        n, T = (16 if step < steps else 14), cfg.block_size - step % 2  # the sequence length changes too
        x = torch.randint(0, cfg.vocab_size, (n, T), generator=g)
        y = torch.randint(0, cfg.vocab_size, (n, T), generator=g)
        keep = torch.randint(0, T + 1, (n,), generator=g)
        keep[:4] = torch.tensor([0, 1, T, 2])  # uneven over microbatches and replicas
        y[torch.arange(T).expand(n, -1) >= keep[:, None]] = IGNORE
        batches.append((x, y))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_losses = []
    for x, y in batches:
        loss = token_mean(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    want = torch.cat([p.detach().reshape(-1) for p in ref.parameters()]).double()
    index, n = index_model(model)
    out = {}
    for schedule, M, zero, batch, recompute in runs:
        program = pipedsl.load(schedule).compile(P=pp, M=M)
        S = program.num_stages
        pipe = pipedsl.Pipeline(copy.deepcopy(model).tp_stages(S, mesh), program=program,
                                loss_fn=tp_gpt_loss(mesh, reduction="sum", ignore_index=IGNORE),
                                parallel=mesh.with_zero(zero, "step"), batch=batch, loss_reduction="token",
                                recompute=recompute,
                                recompute_filter=(lambda m: type(m).__name__ == "ParallelSelfAttention"
                                                  or isinstance(m, CausalSelfAttention)))
        opt = pipe.optimizer(torch.optim.SGD, lr=0.5)
        problems = []
        for step, (x, y) in enumerate(batches):
            if batch == "local":
                d, k = mesh.coords.dp, x.shape[0] // dp
                x, y = x[d * k:(d + 1) * k], y[d * k:(d + 1) * k]
            loss = pipe.step(x, y)
            opt.step()
            opt.zero_grad()
            if not abs(loss - ref_losses[step]) <= RTOL * abs(ref_losses[step]):
                problems.append(f"step {step}: loss {loss!r} != one process {ref_losses[step]!r}")
        got = gather_dense(opt.stage_parameters(), index.tp_stages(S, mesh), n)
        if got["uncovered"]:
            problems.append(f"{got['uncovered']} parameter elements held by no rank")
        err = float((got["values"] - want).abs().max())
        if not err <= 2e-6:
            problems.append(f"final parameters: max |parallel - one process| = {err:.3g}")
        out[f"{schedule} zero={zero} batch={batch} recompute={recompute}"] = problems
    return out if dist.get_rank() == 0 else {}
