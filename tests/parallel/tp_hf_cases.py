"""Worker side of test_tp_hf.py: tiny HF Llama / Qwen3 (GQA) at tp × pp (× dp) against one dense process.

Every rank builds the same seeded dense model (tests/models/hf_cases.py's `tiny_model`), keeps a
deep copy as the one-process reference, tensor-parallelises its stages with `tp_hf_stages` and
trains `steps` SGD steps through `Pipeline(..., parallel=mesh)`.  Each step compares the loss,
every local parameter's gradient (DTensor shards gathered with `full_tensor()`, in the same order
on every tp rank) and the global gradient norm with the dense model's; at the end the parameters.
Returns the largest differences, for the test to report and check.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import pipedsl
from pipedsl.models.hf.parallelize import tp_hf_loss, tp_hf_stages
from pipedsl.models.hf.stages import causal_lm_loss, causal_lm_stages, shift_labels
from pipedsl.parallel import ParallelConfig, ParallelMesh
from pipedsl.runtime.precision import MixedPrecision


def _hf_cases():
    """tests/models/hf_cases.py, loaded by path (tests/ must not go on sys.path: tests/pipedsl shadows the package)."""
    path = Path(__file__).resolve().parents[1] / "models" / "hf_cases.py"
    spec = importlib.util.spec_from_file_location("_pipedsl_hf_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _attention(module: torch.nn.Module) -> bool:
    """Selective recomputation's modules: the attention (what Megatron recomputes)."""
    return type(module).__name__.endswith("Attention")


def tp_equivalence(family: str, dp: int, pp: int, tp: int, sp: bool, steps: int = 2, M: int = 2,
                   schedule: str = "1f1b", lr: float = 0.5, layers: int = 2, clip: float | None = None,
                   zero: int = 0, recompute: str | None = None, params: dict | None = None,
                   precision: str | None = None, tie: bool | None = None, padded: bool = False,
                   optimizer: str = "sgd", device: str | None = None) -> dict:
    """`steps` optimizer steps of the tensor-parallel pipeline against the dense model; the max differences.

    `precision="bf16-params"`: bf16 parameters with fp32 main parameters (Megatron's); the reference
    then runs under autocast on its fp32 main values rounded to bf16 before every step.  With ZeRO or
    main parameters the gradients live in flat buffers: the parameters are compared after every step
    instead (`opt.stage_parameters`, fp32 main values where there are some).  `device`: the pipeline's and the
    reference's (benchmarks/gpu_check.py; default the pipeline's own choice and the CPU)."""
    hf = _hf_cases()
    mesh = ParallelMesh(ParallelConfig(dp=dp, pp=pp, tp=tp, zero=zero))
    main = precision == "bf16-params"
    flat = zero > 0 or main
    if main:
        precision = MixedPrecision("bf16", params="bf16")
    program = pipedsl.load(schedule).compile(P=pp, M=M, **(params or {}))
    model = hf.tiny_model(family, layers=layers, tie=tie)
    ref = copy.deepcopy(model).to(device or "cpu")
    ref_params = dict(ref.named_parameters())
    x = torch.randint(hf.VOCAB, (2 * M * dp, hf.T), generator=torch.Generator().manual_seed(3))
    labels = x.clone()
    labels[:, : hf.T // 4] = -100  # a prompt: ignored targets must count for nothing
    mask = None
    if padded:  # left- and right-padded rows (hf_cases' batch), the padding mask travelling with every stage
        assert dp == 1, "hf_cases.batch makes one replica's rows"
        x, mask, labels = hf.batch(M, True)
    stages = tp_hf_stages(causal_lm_stages(model, program.num_stages, attention_mask=padded), mesh,
                          sequence_parallel=sp)
    names = {id(p): n for n, p in model.named_parameters()}  # after: the DTensor parameters replaced the dense ones
    hf_name = {(s, n): names[id(p)] for s, st in enumerate(stages) for n, p in st.named_parameters()}
    sent: list[tuple[int, ...]] = []  # what a stage gives the next one (after tp_hf's own hook: local tensors)
    for st in stages:
        if st.head is None:
            st.register_forward_hook(lambda _m, _a, o: sent.append((type(o[0] if isinstance(o, tuple) else o).__name__,
                                                                    *(o[0] if isinstance(o, tuple) else o).shape)))
    # padded rows: microbatches hold different token counts, so the mean is over the global batch's tokens
    pipe = pipedsl.Pipeline(stages, program=program, loss_fn=tp_hf_loss(mesh, "sum" if padded else "mean"),
                            loss_reduction="token" if padded else "microbatch", parallel=mesh,
                            recompute=recompute, precision=precision, device=device,
                            recompute_filter=_attention if recompute == "selective" else None)
    make = torch.optim.SGD if optimizer == "sgd" else functools.partial(torch.optim.AdamW, weight_decay=0.1, eps=1e-4)
    opt = pipe.optimizer(make, lr=lr)
    ref_main = [p.detach().clone() for p in ref.parameters()] if main else list(ref.parameters())
    ref_opt = make(ref_main, lr=lr)
    # by HF name, in the same order on every rank (full_tensor() is a collective over tp)
    local = sorted((names[id(p)], p) for m in pipe.local_stages().values() for p in m.parameters()
                   if id(p) in names)
    out = {"loss_err": 0.0, "grad_err": 0.0, "param_err": 0.0, "norm_err": 0.0, "losses": [], "checked": []}
    for _ in range(steps):
        loss = pipe.step((x, mask) if padded else x, shift_labels(labels))
        if main:  # the model's bf16 values: the main parameters rounded
            with torch.no_grad():
                for p, m in zip(ref.parameters(), ref_main):
                    p.copy_(m.to(torch.bfloat16))
        on = next(ref.parameters()).device
        with torch.autocast(on.type, torch.bfloat16, enabled=precision is not None):
            want = ref(x.to(on), attention_mask=None if mask is None else mask.to(on), labels=labels.to(on),
                       use_cache=False).loss
        want.backward()
        out["losses"].append(float(loss))
        out["loss_err"] = max(out["loss_err"], abs(float(loss) - want.item()) / abs(want.item()))
        for name, p in local if not flat else ():
            q = ref_params[name].grad
            err = ((_whole(p.grad).to(q.device) - q).abs().max() / q.abs().max().clamp_min(1e-12)).item()
            out["grad_err"] = max(out["grad_err"], err)
        ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
        if clip is None:
            norm = pipe.grad_norm().item()
        else:
            norm = pipe.clip_grad_norm_(clip).item()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        out["norm_err"] = max(out["norm_err"], abs(norm - ref_norm) / ref_norm)
        if main:
            for p, m in zip(ref.parameters(), ref_main):
                m.grad, p.grad = p.grad, None
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        if flat:  # every step: the gradients are not on the modules to compare
            held = opt.measured_bytes()  # between steps: ZeRO-3 holds its slices of the shards only
            local = sorted((hf_name[(s, n)], v) for s, got in opt.stage_parameters(main=main).items()
                           for n, v in got.items())
            out["bytes"] = {"params": held.params, "padded": held.padded_numel,
                            "shards": sum(v.to_local().numel() if isinstance(v, DTensor) else v.numel()
                                          for _, v in local), "whole": sum(v.numel() for _, v in local)}
            _param_err(out, local, dict(zip((n for n, _ in ref.named_parameters()), ref_main)))
    if not flat:
        _param_err(out, local, {n: p.detach() for n, p in ref_params.items()})
    out["checked"] = [n for n, _ in local]
    out["dtensors"] = sum(isinstance(p, DTensor) for _, p in local)
    out["sent"] = sorted(set(sent))
    out["rank"] = dist.get_rank()
    return out


def _param_err(out: dict, local: list, want: dict) -> None:
    for name, p in local:
        q = want[name].detach()
        out["param_err"] = max(out["param_err"], ((_whole(p.detach()).to(q.device) - q).abs().max()
                                                  / q.abs().max().clamp_min(1e-12)).item())


def refusals() -> dict[str, str]:
    """The one-line errors for head counts tp does not divide and for a model outside the Llama layout."""
    from pipedsl.parallel import ParallelConfigError

    hf = _hf_cases()
    mesh = ParallelMesh(ParallelConfig(tp=2))
    out = {}
    import transformers as tf

    def llama(**kw):
        common = dict(vocab_size=96, hidden_size=24, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        common.update(kw)
        torch.manual_seed(0)
        return tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**common))

    cases = {"heads": lambda: llama(num_attention_heads=3, num_key_value_heads=3),
             "kv_heads": lambda: llama(num_attention_heads=6, num_key_value_heads=1, hidden_size=24),
             "layout": lambda: hf.tiny_model("phi3", layers=1)}
    for key, make in cases.items():
        try:
            tp_hf_stages(causal_lm_stages(make(), 1), mesh)
            out[key] = "no error"
        except ParallelConfigError as err:
            out[key] = str(err)
    # tensor-parallel stages in a pipeline without the tp dimension: their norm gradients would stay partial
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    stages = tp_hf_stages(causal_lm_stages(hf.tiny_model("llama", layers=1), 1), mesh, sequence_parallel=True)
    try:
        pipedsl.Pipeline(stages, program=pipedsl.load("1f1b").compile(P=1, M=2), loss_fn=tp_hf_loss(mesh),
                         group=alone)
        out["no_mesh"] = "no error"
    except ParallelConfigError as err:
        out["no_mesh"] = str(err)
    return out


def _launched(rank: int, fn_name: str, *args):  # for pipedsl.launch in ad-hoc runs
    return globals()[fn_name](*args)



def checkpoint_resume(directory: str, dp: int = 1, zero: int = 0, other_zero: int | None = None) -> dict:
    """Save a dp × pp2 × tp2 + SP pipeline (DTensor parameters or ZeRO's slices of their shards, Adam state) after
    one step, load it into one built from another seed, and take two more steps with each: the losses and the
    parameters must be the same.  `other_zero`: also load it into a pipeline at that ZeRO stage ("resharded":
    the slices reassembled into this tp rank's shards and cut again)."""
    from pipedsl.runtime import checkpoint

    hf = _hf_cases()
    program = pipedsl.load("1f1b").compile(P=2, M=2)

    def build(seed: int, zero: int):
        mesh = ParallelMesh(ParallelConfig(dp=dp, pp=2, tp=2, zero=zero))
        model = hf.tiny_model("qwen3", layers=2, seed=seed)
        stages = tp_hf_stages(causal_lm_stages(model, 2), mesh, sequence_parallel=True)
        pipe = pipedsl.Pipeline(stages, program=program, loss_fn=tp_hf_loss(mesh), parallel=mesh)
        return pipe, pipe.optimizer(torch.optim.Adam, lr=1e-2)

    x = torch.randint(hf.VOCAB, (4 * dp, hf.T), generator=torch.Generator().manual_seed(3))
    pipe, opt = build(0, zero)
    pipe.step(x, shift_labels(x))
    opt.step()
    opt.zero_grad()
    checkpoint.save(pipe, directory, 1, opt)
    runs = {"saved": (pipe, opt), "loaded": build(5, zero)}
    if other_zero is not None:
        runs["resharded"] = build(5, other_zero)
    for key, (p, o) in runs.items():
        if key != "saved":
            checkpoint.load(p, directory, o)
    losses: dict[str, list[float]] = {key: [] for key in runs}
    for _ in range(2):
        for key, (p, o) in runs.items():
            losses[key].append(float(p.step(x, shift_labels(x))))
            o.step()
            o.zero_grad()
    other_opt = runs["loaded"][1]
    same = [torch.equal(_whole(a), _whole(b)) for (s, got), want in zip(opt.stage_parameters().items(),
                                                                        other_opt.stage_parameters().values())
            for (_, a), b in zip(sorted(got.items()), (v for _, v in sorted(want.items())))]
    return {**losses, "same_params": all(same) and bool(same)}


def _tp_pipeline(seed: int, dp: int, tp: int, zero: int):
    """A dp × pp2 × tp (SP when tp > 1) Qwen3 pipeline with Adam, from the dense model of `seed`."""
    hf = _hf_cases()
    mesh = ParallelMesh(ParallelConfig(dp=dp, pp=2, tp=tp, zero=zero))
    stages = causal_lm_stages(hf.tiny_model("qwen3", layers=2, seed=seed), 2)
    if tp > 1:
        stages = tp_hf_stages(stages, mesh, sequence_parallel=True)
    pipe = pipedsl.Pipeline(stages, program=pipedsl.load("1f1b").compile(P=2, M=2),
                            loss_fn=tp_hf_loss(mesh) if tp > 1 else causal_lm_loss, parallel=mesh)
    return pipe, pipe.optimizer(torch.optim.Adam, lr=1e-2)


def _steps(pipe, opt, n: int) -> list[float]:
    hf = _hf_cases()
    x = torch.randint(hf.VOCAB, (8, hf.T), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(n):
        losses.append(float(pipe.step(x, shift_labels(x))))
        opt.step()
        opt.zero_grad()
    return losses


def retp_save(directory: str, dp: int, tp: int, zero: int) -> list[float]:
    """One step, a checkpoint, then the two steps a resumed run must repeat (their losses)."""
    from pipedsl.runtime import checkpoint

    pipe, opt = _tp_pipeline(0, dp, tp, zero)
    _steps(pipe, opt, 1)
    checkpoint.save(pipe, directory, 1, opt)
    return _steps(pipe, opt, 2)


def retp_load(directory: str, dp: int, tp: int, zero: int) -> list[float]:
    """The checkpoint loaded under another tp size (and dp, ZeRO) into a model of another seed: two steps."""
    from pipedsl.runtime import checkpoint

    pipe, opt = _tp_pipeline(5, dp, tp, zero)
    checkpoint.load(pipe, directory, opt)
    return _steps(pipe, opt, 2)


def norm_grad_all_reduces(family: str, zero: int) -> list[int]:
    """DTensor all-reduces in one step at M = 2 and at M = 4, tp2 + SP (a dispatch mode counts them): the norms'
    partial gradients are summed once per step by the pipeline (a c10d all-reduce), not in every backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.n += func is torch.ops._c10d_functional.all_reduce.default
            return func(*args, **(kwargs or {}))

    hf = _hf_cases()
    counts = []
    for M in (2, 4):
        mesh = ParallelMesh(ParallelConfig(tp=2, zero=zero))
        stages = tp_hf_stages(causal_lm_stages(hf.tiny_model(family, layers=2), 1), mesh, sequence_parallel=True)
        pipe = pipedsl.Pipeline(stages, program=pipedsl.load("1f1b").compile(P=1, M=M), loss_fn=tp_hf_loss(mesh),
                                parallel=mesh)
        pipe.optimizer(torch.optim.SGD, lr=0.1)
        x = torch.randint(hf.VOCAB, (2 * M, hf.T), generator=torch.Generator().manual_seed(3))
        with Count() as count:
            pipe.step(x, shift_labels(x))
        counts.append(count.n)
    return counts
