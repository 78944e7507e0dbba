"""Checks that run on every rank of a process group (see conftest.Pool); module-level so they pickle.

Each returns its findings instead of asserting, so one rank's mismatch never leaves the others
waiting for it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import pipedsl
from pipedsl.errors import PipeRuntimeError
from pipedsl.models.split import split_sequential

WIDTH = 16
RTOL, ATOL = 1e-5, 1e-7


class ResBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [mb, d]
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def make_model(num_stages: int, seed: int = 0, width: int = WIDTH) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(ResBlock(width) for _ in range(num_stages)))


def batch(step: int, n: int, width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """rtol 1e-5 per element, plus an atol of 1e-5 of the tensor's largest entry (fp32 sums in another order)."""
    return torch.allclose(a, b, rtol=RTOL, atol=max(ATOL, RTOL * b.abs().max().item()))


def reference_step(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, M: int) -> float:
    """The single-process run: M microbatches, loss scaled by 1/M, gradients accumulated."""
    total = 0.0
    for xm, ym in zip(x.chunk(M), y.chunk(M)):
        loss = loss_fn(model(xm), ym) / M
        loss.backward()
        total += loss.item()
    return total


def equivalence(rank: int, program_json: str, steps: int = 3, options: dict[str, Any] | None = None,
                width: int = WIDTH, rows: int = 2) -> dict:
    """Loss, every local gradient and every parameter after Adam equal a one-process run.  `width` and `rows` (a
    microbatch's) size each message: rows × width × 4 bytes (benchmarks/gpu_check.py sends 64 MiB ones)."""
    program = pipedsl.Program.from_json(program_json)
    S, M = program.num_stages, program.num_microbatches
    model = make_model(S, width=width)
    ref = copy.deepcopy(model)
    pipe = pipedsl.Pipeline(split_sequential(model, S), program=program, loss_fn=F.mse_loss, **(options or {}))
    ref.to(pipe.device)  # on NCCL (benchmarks/gpu_check.py) one process on the same GPU
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    problems, losses, peaks = [], [], []
    for step in range(steps):
        x, y = batch(step, rows * M, width)
        loss = pipe.step(x, y)
        ref_loss = reference_step(ref, F.mse_loss, x.to(pipe.device), y.to(pipe.device), M)
        losses.append((loss, ref_loss))
        if abs(loss - ref_loss) > RTOL * abs(ref_loss):
            problems.append(f"step {step}: loss {loss} != reference {ref_loss}")
        for s, module in pipe.local_stages().items():
            for (name, p), q in zip(module.named_parameters(), ref[s].parameters()):
                if p.grad is None or not _close(p.grad, q.grad):
                    err = "missing" if p.grad is None else f"max abs diff {(p.grad - q.grad).abs().max().item():.3g}"
                    problems.append(f"step {step}: stage {s} {name}.grad: {err}")
        peaks.append(pipe.peak_activations)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for s, module in pipe.local_stages().items():
        for (name, p), q in zip(module.named_parameters(), ref[s].parameters()):
            if not _close(p.detach(), q.detach()):
                problems.append(f"after {steps} Adam steps: stage {s} {name} differs")
    timeline = pipe.timeline()
    if timeline is not None:
        problems += timeline_problems(program, timeline)
    return {"problems": problems, "losses": losses, "peaks": peaks,
            "stages": sorted(pipe.local_stages()), "copies": sorted(pipe.local_copies())}


def timeline_problems(program: pipedsl.Program, timeline: pipedsl.Timeline) -> list[str]:
    """A measured timeline lists every instruction of every rank, in order, in non-overlapping intervals."""
    out = []
    if timeline.kind != "measured" or timeline.num_ranks != program.num_ranks:
        out.append(f"timeline kind {timeline.kind!r} with {timeline.num_ranks} ranks")
    for r, (events, stream) in enumerate(zip(timeline.ranks, program.ranks)):
        if [e.instr for e in events] != list(stream):
            out.append(f"rank {r}: the timeline's instructions are not the program's")
            continue
        for a, b in zip(events, events[1:]):
            if not (a.start <= a.end <= b.start + 1e-9):
                out.append(f"rank {r}: {a.instr} [{a.start}, {a.end}] overlaps {b.instr} [{b.start}, {b.end}]")
                break
        if events and events[0].start < -1e-3:
            out.append(f"rank {r}: starts at {events[0].start} (before the aligned origin)")
    return out


def gpt_equivalence(rank: int, schedule: str, M: int, steps: int = 2) -> dict:
    """The small GPT (token ids in, cross-entropy out), stages built by a callable, vs one process."""
    from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch

    P = torch.distributed.get_world_size()
    program = pipedsl.load(schedule).compile(P=P, M=M)
    S = program.num_stages
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=max(S - 1, 1), n_head=2, n_embd=16)

    def build(s: int) -> nn.Module:  # builds the model, keeps one stage (as a real script would)
        torch.manual_seed(0)
        return GPT(cfg).stages(S)[s]

    torch.manual_seed(0)
    ref = GPT(cfg)
    pipe = pipedsl.Pipeline(build, program=program, loss_fn=gpt_loss)
    problems = []
    opt, ref_opt = torch.optim.Adam(pipe.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    ref_stages = ref.stages(S)
    for step in range(steps):
        x, y = synthetic_batch(2 * M, cfg.block_size, cfg.vocab_size, gen)
        loss = pipe.step(x, y)
        ref_loss = reference_step(ref, gpt_loss, x, y, M)
        if abs(loss - ref_loss) > RTOL * abs(ref_loss):
            problems.append(f"step {step}: loss {loss} != {ref_loss}")
        for s, module in pipe.local_stages().items():
            for (name, p), q in zip(module.named_parameters(), ref_stages[s].parameters()):
                if not _close(p.grad, q.grad):
                    problems.append(f"step {step}: stage {s} {name}.grad differs "
                                    f"(max abs diff {(p.grad - q.grad).abs().max().item():.3g})")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return {"problems": problems}


def uniform_errors(rank: int) -> dict[str, str]:
    """Mistakes every rank makes alike: each is a clear PipeRuntimeError before any message."""
    out = {}
    P = torch.distributed.get_world_size()
    try:
        pipedsl.Pipeline(split_sequential(make_model(P + 1), P + 1), "1f1b", microbatches=4, loss_fn=F.mse_loss)
    except PipeRuntimeError as err:
        out["stage_count"] = err.message
    pipe = pipedsl.Pipeline(split_sequential(make_model(P), P), "1f1b", microbatches=4, loss_fn=F.mse_loss)
    try:
        pipe.step(*batch(0, 6))
    except PipeRuntimeError as err:
        out["batch"] = err.message
    try:
        pipedsl.Pipeline(split_sequential(make_model(P), P), "gpipe", loss_fn=F.mse_loss)
    except PipeRuntimeError as err:
        out["no_m"] = err.message
    pipe.step(*batch(0, 8))  # still usable after a refused batch
    return out


def closing(rank: int) -> dict:
    """close() destroys the groups a pipeline made (and only those); a closed pipeline refuses steps."""
    from torch.distributed import distributed_c10d as c10d

    P = torch.distributed.get_world_size()
    before = set(c10d._world.pg_map)
    with pipedsl.Pipeline(split_sequential(make_model(P), P), "1f1b", microbatches=4, loss_fn=F.mse_loss) as pipe:
        loss = pipe.step(*batch(0, 8))
        made = len(set(c10d._world.pg_map) - before)
    out = {"made": made, "left": len(set(c10d._world.pg_map) - before), "kept": before <= set(c10d._world.pg_map),
           "loss": loss, "transport": pipe.channels.kind,
           "sockets_left": len(getattr(pipe.channels.transport, "links", {}))}
    pipe.close()  # twice is fine
    timeline = pipe.timeline()  # the last step's, still (gathered over the world, not a closed group)
    out["timeline_events"] = sum(map(len, timeline.ranks)) if timeline is not None else None
    try:
        pipe.step(*batch(0, 8))
    except PipeRuntimeError as err:
        out["error"] = err.message
    again = pipedsl.Pipeline(split_sequential(make_model(P), P), "1f1b", microbatches=4, loss_fn=F.mse_loss)
    out["loss_again"] = again.step(*batch(0, 8))  # the world still works for a new pipeline
    again.close()
    return out


def lookahead_stats(rank: int, program_json: str, lookahead: int, strict: bool) -> dict:
    """Run a step with a given look-ahead and report how many receive buffers were allocated."""
    res = equivalence(rank, program_json, steps=2, options={"lookahead": lookahead, "strict_pair_order": strict})
    return res


def _example(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf_llama_example(rank: int, schedule: str, params: dict[str, int], steps: int, out: str) -> dict:
    """examples/hf_llama.py trains like one process: the unsplit HF model, the same batches,
    `model(ids, attention_mask=, labels=).loss`, torch's clip_grad_norm_ and AdamW, step by step."""
    ex = _example("hf_llama")
    M = 4
    losses = ex.train(rank, "llama", schedule, params, M, steps, "fp32", "none", out if rank == 0 else None)
    model = ex.tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    ref = []
    for _ in range(steps):
        ids, mask, labels = ex.padded_batch(2 * M, gen)
        loss = model(ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    return {"losses": losses, "reference": ref}


def nanogpt_example(rank: int, schedule: str = "1f1b", clip: float | None = None,
                    post_validate: bool = False) -> list[float]:
    from pipedsl.models.gpt.model import GPTConfig

    ex = _example("nanogpt")
    return ex.train(rank, schedule, 4, 3, GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16), 8,
                    clip, post_validate)


def evaluation(rank: int, program_json: str, token: bool = False) -> dict:
    """`pipe.evaluate` is the one-process model's loss in eval mode (dropout off) and changes nothing: no
    gradient, no step count, the same parameters, dropout back on; a training step after it reuses the shapes
    evaluation learned (one handshake per shape)."""
    program = pipedsl.Program.from_json(program_json)
    S, M = program.num_stages, program.num_microbatches
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(ResBlock(WIDTH), nn.Dropout(0.5)) for _ in range(S)))
    ref = copy.deepcopy(model).eval()
    if token:
        def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(out, y, ignore_index=-100, reduction="sum")
    else:
        loss_fn = F.mse_loss
    pipe = pipedsl.Pipeline(split_sequential(model, S), program=program, loss_fn=loss_fn,
                            loss_reduction="token" if token else "microbatch")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    problems = []
    for n in (2 * M, 3 * M):  # two shapes: each learned once, shared with training
        x, y = batch(n, n)
        if token:
            y = torch.randint(WIDTH, (n,), generator=torch.Generator().manual_seed(n))
            y[::3] = -100
        with torch.no_grad():
            if token:
                want = (F.cross_entropy(ref(x), y, ignore_index=-100, reduction="sum") / (y != -100).sum()).item()
            else:
                want = sum(F.mse_loss(ref(xm), ym).item() for xm, ym in zip(x.chunk(M), y.chunk(M))) / M
        got = pipe.evaluate(x, y)
        if abs(got - want) > RTOL * abs(want):
            problems.append(f"rank {rank}: evaluate() = {got}, one process (eval mode) {want}")
        count = int((y != -100).sum()) if token else M
        if pipe.eval_count != count:
            problems.append(f"rank {rank}: eval_count {pipe.eval_count} != {count}")
    if any(p.grad is not None for p in pipe.parameters()):
        problems.append(f"rank {rank}: evaluate() left gradients")
    if pipe.steps != 0 or any(not torch.equal(v, before[k]) for k, v in model.state_dict().items()):
        problems.append(f"rank {rank}: evaluate() changed the step count or the parameters")
    if not all(m.training for m in pipe.local_stages().values()):
        problems.append(f"rank {rank}: evaluate() left a stage in eval mode")
    x, y = batch(0, 2 * M)
    if token:
        y = torch.randint(WIDTH, (2 * M,), generator=torch.Generator().manual_seed(0))
    pipe.step(x, y)
    if pipe.steps != 1 or any(p.grad is None for p in pipe.parameters()):
        problems.append(f"rank {rank}: the training step after evaluate() did not train")
    return {"problems": problems, "handshakes": pipe.shape_handshakes}


def frozen_first_stage(rank: int, dp: int, zero: int) -> dict:
    """Stage 0 all frozen (a frozen embedding under trainable stages): its rank still makes `pipe.optimizer()`
    and steps; the trainable stages train as one process, the frozen one stays bit for bit."""
    from pipedsl.parallel import ParallelConfig, ParallelMesh

    model = make_model(4)
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)
    ref = copy.deepcopy(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    program = pipedsl.load("1f1b").compile(P=2, M=2)
    mesh = ParallelMesh(ParallelConfig(dp=dp, pp=2, zero=zero)) if dp > 1 else None
    pipe = pipedsl.Pipeline(split_sequential(model, 2), program=program, loss_fn=F.mse_loss, parallel=mesh)
    opt = pipe.optimizer(torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    problems = []
    for step in range(2):
        x, y = batch(step, 4 * dp)
        loss = pipe.step(x, y)
        opt.step()
        opt.zero_grad()
        want = reference_step(ref, F.mse_loss, x, y, 2 * dp)
        ref_opt.step()
        ref_opt.zero_grad()
        if abs(loss - want) > RTOL * abs(want):
            problems.append(f"rank {rank} step {step}: loss {loss} != {want}")
    ref_params = dict(ref.named_parameters())
    for s, named in opt.stage_parameters().items():
        for name, v in named.items():
            hf = f"{2 * s + int(name[0])}{name[1:]}"  # stage s holds the model's layers 2s and 2s + 1
            if hf in frozen and not torch.equal(v, frozen[hf]):
                problems.append(f"rank {rank}: frozen {hf} changed")
            if not _close(v, ref_params[hf].detach()):
                problems.append(f"rank {rank}: {hf} differs from one process")
    pipe.close()
    return {"problems": problems}


def batchnorm_replicas(rank: int) -> dict:
    """dp2 × pp2 with BatchNorm in both stages: after two steps every replica holds the same running statistics
    (dp rank 0's, broadcast at each step's end as DDP does), and they moved from their initial values."""
    import torch.distributed as dist

    from pipedsl.parallel import ParallelConfig, ParallelMesh

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH),
                          nn.BatchNorm1d(WIDTH))
    mesh = ParallelMesh(ParallelConfig(dp=2, pp=2))
    pipe = pipedsl.Pipeline(split_sequential(model, 2, points=[2]), program=pipedsl.load("1f1b").compile(P=2, M=2),
                            loss_fn=F.mse_loss, parallel=mesh)
    opt = pipe.optimizer(torch.optim.SGD, lr=0.1)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, WIDTH, generator=g) * torch.arange(1, 9).unsqueeze(1)  # rows of growing scale: the
        pipe.step(x, torch.randn(8, WIDTH, generator=g))  # replicas' halves of the batch have unlike statistics
        opt.step()
        opt.zero_grad()
    stats = torch.cat([b.float().reshape(-1) for m in pipe.local_stages().values() for b in m.buffers()])
    others = [torch.empty_like(stats) for _ in range(2)]
    dist.all_gather(others, stats, group=mesh.dp_group)
    pipe.close()
    initial = torch.cat([torch.zeros(WIDTH), torch.ones(WIDTH), torch.zeros(1)])  # BatchNorm's mean, var, count
    return {"equal": torch.equal(others[0], others[1]), "moved": not torch.equal(stats, initial)}


def compiled_blocks(rank: int, schedule: str) -> dict:
    """torch.compile'd blocks (aot_eager: the same autograd node inductor makes, no C++ compiler needed) under a
    split-backward schedule: a compiled region computes its input and weight gradients in one call, so I does
    the stage's whole backward and W nothing (no donated-buffer crash, no second run); gradients equal one
    process's, and each compiled backward runs once per microbatch."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)) for _ in range(4)]
    ref = nn.Sequential(*copy.deepcopy(blocks))
    model = nn.Sequential(*(torch.compile(b, backend="aot_eager") for b in blocks))
    program = pipedsl.load(schedule).compile(P=2, M=2)
    per_stage = len(blocks) // program.num_stages
    pipe = pipedsl.Pipeline(split_sequential(model, program.num_stages), program=program, loss_fn=F.mse_loss)
    runs = []
    for m in pipe.local_stages().values():
        for block in m:
            block.register_full_backward_pre_hook(lambda *_: runs.append(1))  # the compiled region's backward
    x, y = batch(0, 8)
    loss = pipe.step(x, y)
    want = reference_step(ref, F.mse_loss, x, y, 2)
    refp = dict(ref.named_parameters())
    problems = [] if abs(loss - want) <= RTOL * abs(want) else [f"rank {rank}: loss {loss} != {want}"]
    for s, m in pipe.local_stages().items():
        for n, p in m.named_parameters():
            name = f"{per_stage * s + int(n[0])}{n[n.index('.'):].replace('._orig_mod', '')}"
            if not _close(p.grad, refp[name].grad):
                problems.append(f"rank {rank}: {name}.grad differs from one process")
    pipe.close()
    return {"problems": problems, "backward_runs": len(runs)}


def flat_buffer_split(rank: int, level: int) -> dict:
    """A GPT block under ZeRO-`level` (its parameters' storage moved into one flat buffer), split backward with I
    dropping what W does not read: I takes the gradients it takes without ZeRO (vectors': the norms'), W the
    rest; every gradient lands in its parameter's slice of the
    unit's flat gradient and equals a full backward's on a twin (and the plain block's)."""
    import torch.distributed as dist

    from pipedsl.models.gpt.model import Block, GPTConfig
    from pipedsl.parallel.zero import ZeroOptimizer
    from pipedsl.runtime.stage import ActivationCounter, Stage, StageOptions

    torch.manual_seed(0)
    block = Block(GPTConfig(n_embd=16, n_head=2, block_size=8))
    twin, plain = copy.deepcopy(block), copy.deepcopy(block)
    stages, zeros = {}, {}
    for name, module in (("split", block), ("full", twin), ("plain", plain)):
        if name != "plain":
            zeros[name] = ZeroOptimizer(module, torch.optim.SGD, group=dist.group.WORLD, stage=level, lr=0.1)
        stages[name] = Stage(module, 1, 3, None, 1, ActivationCounter(), options=StageOptions(release=True))
    x, g = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    plans = {}
    for name in ("split", "plain"):
        act, _ = stages[name].forward([x])
        got = stages[name].backward_input(act, [g])
        [plans[name]] = stages[name]._plans.values()
        stages[name].backward_weight(act)
    act, _ = stages["full"].forward([x])
    want = stages["full"].backward(act, [g])
    vectors = {i for i, p in enumerate(block.parameters()) if p.dim() == 1}
    problems = []
    if not (plans["split"].groups and plans["split"].early == plans["plain"].early and plans["plain"].early
            and set(plans["plain"].early) <= vectors):
        problems.append(f"ZeRO-{level}: I took {sorted(plans['split'].early)}, without ZeRO "
                        f"{sorted(plans['plain'].early)} (the vectors are {sorted(vectors)})")
    if not torch.allclose(got[0], want[0], atol=1e-6):
        problems.append(f"ZeRO-{level}: input gradients differ")
    [unit] = zeros["split"].units
    for (name, p), q, r in zip(block.named_parameters(), twin.parameters(), plain.parameters(), strict=True):
        e = next(e for e in unit.entries if e.name == name)
        in_flat = unit.grad[e.offset:e.offset + e.numel].view(e.shape)
        if not (torch.equal(p.grad, in_flat) and torch.allclose(p.grad, q.grad, atol=1e-6)
                and torch.allclose(p.grad, r.grad, atol=1e-6)):
            problems.append(f"ZeRO-{level}: {name}'s gradient differs (or is not in the flat gradient)")
    return {"problems": problems}


def loss_reduction_points(rank: int, schedule: str, P: int, M: int) -> dict:
    """Where in its stream each rank starts the step's loss reduction (a collective of the pipeline group): the
    instruction the executor is at, and the stream's length."""
    program = pipedsl.load(schedule).compile(P, M)
    pipe = pipedsl.Pipeline(split_sequential(make_model(program.num_stages), program.num_stages), program=program,
                            loss_fn=F.mse_loss)
    seen: list[int] = []
    start = pipe._reduce_loss

    def recording(loss_sum: torch.Tensor) -> None:
        seen.append(pipe._executor.index)
        start(loss_sum)

    pipe._reduce_loss = recording
    for step in range(2):  # a step that learns the shapes, then a step at known shapes
        x, y = batch(step, 2 * M)
        pipe.step(x, y)
    pipe.close()
    return {"at": seen, "last": len(program.ranks[rank]) - 1}
