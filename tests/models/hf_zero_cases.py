"""Hugging Face stages under dp × pp with ZeRO 0-3: tied embeddings and frozen parameters, against one process.

Each job runs on every rank of a dp2 × pp2 world (the session pool, tests/conftest.py): it builds
the same tiny random model on every rank, keeps a copy as the unsplit reference, and trains both
for a few AdamW steps with global-norm clipping — the pipeline on its share of the global batch,
the reference on all of it.  Each rank compares the losses, the clipped norms and, at the end,
every parameter it holds (by its HF name, ZeRO's buffers unpacked) with the reference's, checks
that frozen parameters kept their initial values bit for bit, and returns its tied copies so the
test can check they are bitwise equal on every rank.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
from hf_cases import VOCAB, tiny_model
from torch import nn

import pipedsl
from pipedsl.models.hf.stages import causal_lm_loss, causal_lm_stages, shift_labels
from pipedsl.parallel import ParallelConfig, ParallelMesh
from pipedsl.runtime import checkpoint

T, M, DP, PP = 8, 4, 2, 2
LR, EPS, DECAY = 1e-2, 1e-4, 0.1  # eps: a near-zero gradient's rounding noise must not become a full Adam step
MAX_NORM = 0.05  # below every variant's gradient norm (0.1-3), so clipping scales every step
LOSS_RTOL, NORM_RTOL, PARAM_ATOL = 2e-6, 2e-6, 2e-6  # fp32: summation order only (parameters are O(0.1))


class LoRALinear(nn.Module):
    """PEFT's LoRA in place of a Linear: the frozen base plus a trainable low-rank update B·A (B random, not
    zero as PEFT starts it, so that both factors get a gradient from the first step)."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [mb, T, in] → [mb, T, out]
        return self.base(x) + self.lora_B(self.lora_A(x))


def model_for(family: str, variant: str) -> nn.Module:
    """`tied`: the tiny model with its embedding tied to the head.  `lora`: every base weight frozen except the
    norms and the tied embedding, LoRA on the attention's q and v projections.  `lora-frozen-tie`: the same
    with the tied embedding frozen too."""
    model = tiny_model(family, tie=True)
    if variant == "tied":
        return model
    for name, p in model.named_parameters():
        p.requires_grad_("norm" in name or (variant == "lora" and "embed_tokens" in name))
    torch.manual_seed(1)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj)
    return model


def _batch(step: int) -> torch.Tensor:
    return torch.randint(VOCAB, (DP * M * 2, T), generator=torch.Generator().manual_seed(10 + step))


def _pipeline(model: nn.Module, schedule: str, params: dict | None, zero: int, reduce: str,
              recompute: str | None, dp: int = DP) -> pipedsl.Pipeline:
    mesh = ParallelMesh(ParallelConfig(dp=dp, pp=PP, zero=zero, zero_reduce=reduce))
    program = pipedsl.load(schedule).compile(P=PP, M=M, **(params or {}))
    stages = causal_lm_stages(model, program.num_stages)
    return pipedsl.Pipeline(stages, program=program, loss_fn=causal_lm_loss, parallel=mesh, recompute=recompute)


def _hf_names(pipe: pipedsl.Pipeline, model: nn.Module) -> dict[int, dict[str, str]]:
    """{stage: {name in the stage module: HF name}}, before ZeRO takes the parameters over."""
    hf = {id(p): n for n, p in model.named_parameters()}
    return {s: {n: hf[id(p)] for n, p in m.named_parameters(remove_duplicate=False)}
            for s, m in pipe.local_stages().items()}


def _reference_step(ref: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> tuple[float, float]:
    loss = ref(x, labels=x, use_cache=False).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], MAX_NORM)
    opt.step()
    opt.zero_grad()
    return loss.item(), norm.item()


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def zero_equivalence(family: str, schedule: str, params: dict | None, zero: int, reduce: str = "step",
                     variant: str = "tied", recompute: str | None = None, steps: int = 3) -> dict:
    """`steps` pipelined AdamW steps with clipping against the unsplit model's; this rank's findings."""
    rank = dist.get_rank()
    model = model_for(family, variant)
    ref = copy.deepcopy(model)
    ref_params = dict(ref.named_parameters())
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    pipe = _pipeline(model, schedule, params, zero, reduce, recompute)
    names = _hf_names(pipe, model)
    opt = pipe.optimizer(torch.optim.AdamW, lr=LR, eps=EPS, weight_decay=DECAY)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, eps=EPS, weight_decay=DECAY)
    problems: list[str] = []
    loss_err = norm_err = 0.0
    gathered = 0  # ZeRO-3: units still gathered once the step's backward is over (frozen ones included)
    for step in range(steps):
        x = _batch(step)
        loss = pipe.step(x, shift_labels(x))
        gathered = max(gathered, sum(u.gathered for z in opt.zero.values() for u in z.units if z.stage == 3))
        norm = pipe.clip_grad_norm_(MAX_NORM).item()
        opt.step()
        opt.zero_grad()
        want, want_norm = _reference_step(ref, ref_opt, x)
        loss_err, norm_err = max(loss_err, _rel(loss, want)), max(norm_err, _rel(norm, want_norm))
        if _rel(loss, want) > LOSS_RTOL:
            problems.append(f"rank {rank} step {step}: loss {loss!r} != one process {want!r}")
        if _rel(norm, want_norm) > NORM_RTOL or not want_norm > MAX_NORM:
            problems.append(f"rank {rank} step {step}: norm {norm!r} != one process {want_norm!r} (clip {MAX_NORM})")
    values = opt.stage_parameters()  # collective over dp for ZeRO-3
    param_err, ties = 0.0, {}
    for s, named in values.items():
        for name, v in named.items():
            hf = names[s][name]
            err = (v - ref_params[hf].detach()).abs().max().item()
            param_err = max(param_err, err)
            if err > PARAM_ATOL:
                problems.append(f"rank {rank} stage {s} {hf}: max |pipeline - one process| = {err:.3g}")
            if hf in frozen and not torch.equal(v, frozen[hf]):
                problems.append(f"rank {rank} stage {s} {hf}: a frozen parameter changed")
            if "embed_tokens" in hf or "wte" in hf:
                ties[(s, name)] = v
    moved = max((p.detach() - q).abs().max().item() for p, q in zip(ref.parameters(), model_for(family, variant)
                                                                      .parameters()) if p.requires_grad)
    pipe.close()
    return {"problems": problems, "loss_err": loss_err, "norm_err": norm_err, "param_err": param_err,
            "moved": moved, "ties": ties, "tie_names": pipe.ties.names, "frozen": len(frozen), "gathered": gathered,
            "checked": sorted({names[s][n] for s, named in values.items() for n in named}),
            "all": sorted(ref_params)}


# ----------------------------------------------------------------------------------- checkpoints


def checkpoint_run(directory: str, dp: int, zero: int, schedule: str, *, save_at: int = 0, resume: bool = False,
                   steps: int = 4) -> dict:
    """Train the LoRA model (tied trainable embedding, frozen base) to `steps`, saving after step `save_at` or
    resuming from the latest checkpoint; {step: loss} and this rank's parameters by HF name."""
    torch.manual_seed(0)
    model = model_for("llama", "lora")
    pipe = _pipeline(model, schedule, None, zero, "step", None, dp=dp)
    names = _hf_names(pipe, model)
    opt = pipe.optimizer(torch.optim.AdamW, lr=LR, eps=EPS, weight_decay=DECAY)
    start, losses = 0, {}
    if resume:
        start = checkpoint.load(pipe, directory, opt).step
    for step in range(start + 1, steps + 1):
        x = _batch(step)  # the global batch: dp2 splits it over its replicas, dp1 trains on all of it
        losses[step] = pipe.step(x, shift_labels(x))
        pipe.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
        if step == save_at:
            checkpoint.save(pipe, directory, step, opt)
    values = {names[s][n]: v for s, named in opt.stage_parameters().items() for n, v in named.items()}
    pipe.close()
    return {"losses": losses, "params": values if pipe.mesh.coords.dp == 0 else {}}


def checkpoint_dp2(directory: str) -> dict:
    """dp2 × pp2, ZeRO-2, 1F1B: the uninterrupted run saving at step 2, then resumes from it under the same
    layout (slices restored as they are), under ZeRO-3 with ZB-H1 (other units: resharded)."""
    path = Path(directory)
    full = checkpoint_run(str(path / "a"), DP, 2, "1f1b", save_at=2)
    same = checkpoint_run(str(path / "a"), DP, 2, "1f1b", resume=True)
    other = checkpoint_run(str(path / "a"), DP, 3, "zb-h1", resume=True)
    return {"full": full, "same": same, "zero3": other}


def checkpoint_dp1(directory: str) -> dict:
    """dp1 × pp2 without ZeRO (plain AdamW) resumes the dp2 ZeRO-2 checkpoint: every slice reassembled."""
    return {"dp1": checkpoint_run(str(Path(directory) / "a"), 1, 0, "1f1b", resume=True)}


def one_process_losses(steps: int = 4) -> dict[int, float]:
    """The checkpoint runs' reference: the unsplit LoRA model, the same steps."""
    torch.manual_seed(0)
    ref = model_for("llama", "lora")
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, eps=EPS, weight_decay=DECAY)
    return {step: _reference_step(ref, opt, _batch(step))[0] for step in range(1, steps + 1)}


def shared_module_refusal() -> str:
    """Under ZB-V rank 0 holds the first and the last stage of tie_cases' model, which share the embedding
    *module*: ZeRO refuses, on every rank, at construction."""
    import tie_cases

    from pipedsl.errors import PipeRuntimeError

    mesh = ParallelMesh(ParallelConfig(dp=DP, pp=PP, zero=1))
    try:
        pipedsl.Pipeline(tie_cases.tied_model(4), "zb-v", microbatches=M, loss_fn=tie_cases.loss_fn, parallel=mesh)
    except PipeRuntimeError as err:
        return err.message
    return "no error"
