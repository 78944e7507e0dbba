"""GPU readiness in one command: every built-in schedule on NCCL against one process, vs_torch on the
same stages, the runtime's CPU per op, and `pipedsl plan --calibrate`, into one JSON file and a table.

The CUDA + NCCL path cannot run on the machine this was written on, so the checks are the code the
CPU tests and benchmarks run, on the device `pipedsl.launch` picks: tests/runtime/runtime_cases.py's
equivalence (loss, every gradient and the parameters after Adam equal one process on the same
device), vs_torch.py's rank function (GPT workload), op_cpu.py.  `--device cpu` runs exactly these
on gloo (the dry run that proves the logic here); with no GPU and no `--device cpu` it says so and
exits 0.  With two GPUs or more, one rank a GPU over NCCL, every visible GPU; `large` then sends
every built-in's messages at `--message-mib` (64 MiB: past NCCL's buffers, so each send waits for its
receive — the rendezvous the NCCL model proves hang-free, docs/runtime.md "NCCL").  With one GPU
visible, the P ranks (default 4) share it over gloo, their messages staged through host memory
(`Channels.wire`); vs_torch, op_cpu and large, which need one GPU a rank, are then left out and say
why, and `one_gpu` measures what one GPU can: a one-rank pipeline's step against a plain PyTorch
loop on a 0.85 B Llama (bf16, SDPA), the ratio and the MFU.  `zero` runs ZeRO 1-3 and bf16 parameters over fp32
main parameters on one rank of the device against the same steps without them.  `layouts` runs what a first
real run of an HF decoder does — dp × pp × tp with sequence parallelism, ZeRO-1/3, bf16 parameters,
recomputation (`LAYOUTS`, by the ranks there are) — against the dense model on the device, and `trainer_auto`
runs `pipedsl train --schedule auto -P 2` against `-P 1`; both need one GPU a rank (with one GPU they say why
they did not run).  Exit status 1 if any check failed.

    python benchmarks/gpu_check.py                       # one process a GPU (>= 2 GPUs), or all on one
    python benchmarks/gpu_check.py --device cpu --tiny   # the same checks on gloo, tiny sizes
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "runtime"))  # runtime_cases: the tests' equivalence check
sys.path.insert(0, str(HERE.parent / "tests" / "models"))  # moe_cases: the MoE GPT and its parameter check
sys.path.insert(0, str(HERE.parent / "tests" / "parallel"))  # tp_hf_cases: an HF decoder's dp × pp × tp check

import _bench  # noqa: E402

CHECKS = ("schedules", "large", "moe", "layouts", "timeline", "trainer_auto", "vs_torch", "op_cpu", "one_gpu", "zero",
          "calibrate")
# dp × pp × tp layouts of a tiny HF Llama (tests/parallel/tp_hf_cases.py) by the ranks there are: (dp, pp, tp, zero,
# precision, recompute); tolerances: fp32's, or bf16's where it computes in bf16 (test_tp_hf.py's, the gradient norm
# within bf16's unit roundoff 2^-8: 1.8e-3 for this Llama on gloo, a rounding difference of the summed squares)
LAYOUTS = {8: [(2, 2, 2, 1, "bf16-params", "full"), (2, 2, 2, 3, None, "selective")],
           4: [(1, 2, 2, 0, "bf16-params", "full"), (2, 2, 1, 3, None, "selective")],
           2: [(1, 1, 2, 0, "bf16-params", "full"), (2, 1, 1, 3, None, None)]}
FP32_TOL = {"loss_err": 1e-5, "grad_err": 1e-5, "param_err": 1e-5, "norm_err": 1e-5}
BF16_TOL = {"loss_err": 1e-3, "grad_err": 6e-2, "param_err": 6e-2, "norm_err": 2 ** -8}
SIZES = {"full": {"steps": 3, "vs_torch": {"gpt_rows": 4, "steps": 10, "reps": 7, "warmup": 2},
                  "op_cpu": {"M": 16, "steps": 1, "reps": 40, "warmup": 2},
                  "large": {"width": 4096, "steps": 1},  # rows from --message-mib
                  "one_gpu": {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "ffn": 5632, "vocab": 32000,
                              "seq": 2048, "rows": 1, "M": 8, "steps": 12, "warmup": 2}},  # a 0.85 B Llama
         "tiny": {"steps": 1, "vs_torch": {"gpt_rows": 1, "steps": 1, "reps": 1, "warmup": 0},
                  "op_cpu": {"M": 4, "steps": 1, "reps": 1, "warmup": 0},
                  "large": {"width": 32, "steps": 1},
                  "one_gpu": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 256,
                              "seq": 32, "rows": 1, "M": 2, "steps": 2, "warmup": 1}}}


def compile_for(name: str, P: int) -> Any:
    """The schedule at P with the first M (2P, P, 4P, 3P) its `require`s accept (as tests/runtime does)."""
    import pipedsl
    from pipedsl.errors import PipeSemanticError

    for M in (2 * P, P, 4 * P, 3 * P):
        try:
            return pipedsl.load(name).compile(P=P, M=M)
        except PipeSemanticError:
            continue
    return None


def _rank_main(rank: int, P: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import op_cpu
    import runtime_cases
    import torch
    import torch.distributed as dist
    import vs_torch

    cuda = dist.get_backend() == "nccl"
    device = cfg["shared_device"] or (str(torch.device("cuda", torch.cuda.current_device())) if cuda else "cpu")
    options = {"device": device} if cfg["shared_device"] else None
    out: dict[str, Any] = {"device": device, "backend": dist.get_backend()}
    if "schedules" in cfg["checks"]:
        out["schedules"] = {}
        for name, program_json in cfg["programs"].items():
            try:
                res = runtime_cases.equivalence(rank, program_json, cfg["steps"], options)
                out["schedules"][name] = {"problems": res["problems"], "peaks": res["peaks"]}
            except Exception as err:  # noqa: BLE001 - reported in the table; the other ranks fail alike or time out
                out["schedules"][name] = {"problems": [f"{type(err).__name__}: {err}"], "peaks": []}
    if "large" in cfg["checks"]:
        out["large"] = {}
        for name, program_json in cfg["programs"].items():
            try:
                res = runtime_cases.equivalence(rank, program_json, cfg["large"]["steps"], options,
                                                width=cfg["large"]["width"], rows=cfg["large"]["rows"])
                out["large"][name] = {"problems": res["problems"]}
            except Exception as err:  # noqa: BLE001 - reported in the table
                out["large"][name] = {"problems": [f"{type(err).__name__}: {err}"]}
    if "moe" in cfg["checks"] and dist.get_world_size() == 4:
        try:
            out["moe"] = _moe(rank, device)
        except Exception as err:  # noqa: BLE001 - reported in the table
            out["moe"] = {"problems": [f"{type(err).__name__}: {err}"]}
    if "layouts" in cfg["checks"]:
        out["layouts"] = _layouts(rank, device, dist.get_world_size())
    if "timeline" in cfg["checks"]:
        try:
            out["timeline"] = _timeline(rank, device)
        except Exception as err:  # noqa: BLE001 - reported in the table
            out["timeline"] = [f"{type(err).__name__}: {err}"]
    if "vs_torch" in cfg["checks"]:
        out["vs_torch"] = {name: vs_torch._rank_main(rank, "gpt", name, P, {**cfg["vs_torch"], "M": 2 * P,
                                                                             "device": device})
                           for name in vs_torch.SCHEDULE_NAMES}
    if "op_cpu" in cfg["checks"]:
        out["op_cpu"] = op_cpu.measure(rank, P, {**cfg["op_cpu"], "device": device})
    return out


def _moe(rank: int, device: str) -> dict[str, Any]:
    """The MoE GPT at dp2 × pp2 with its experts over ep=2 (parallel/expert.py) on the device, as
    tests/models/test_gpt_moe.py checks it: the loss, gradient norm and every weight after two SGD steps against
    one process on the same device (each shard against its rows), DualPipeV with its F&B pairs overlapped
    against the same steps without (bit for bit), and pp2 × tp2, dp2 × tp2+sp × ep2
    against one process (tests/models/test_gpt_moe.py's tensor × expert check)."""
    import moe_cases

    # dense_index (tp_train_equal's): tests/ joins the path only now, once pipedsl is imported, since its folder of
    # tests named pipedsl would shadow an editable install's package
    sys.path.append(str(HERE.parent / "tests"))
    problems = moe_cases.train_equal(rank, "1f1b", 2, 2, 2, 0, device=device)["problems"]
    if not moe_cases.overlap_identical(rank, "dualpipev", 4, device=device)["same"]:
        problems.append("dualpipev with overlapped pairs differs from the same steps without")
    for dp, ep, sp in ((1, 1, False), (2, 2, True)):  # tensor (× expert) parallelism, parallel/moe_tp.py
        layout = f"dp{dp} x pp{4 // (2 * dp)} x tp2{'+sp' if sp else ''} x ep{ep}"
        problems += [f"{layout}: {p}" for p in moe_cases.tp_train_equal(dp, 2, ep, sp, "1f1b", device=device)]
    return {"problems": problems}


def _timeline(rank: int, device: str) -> list[str]:
    """The measured timelines on the device: a ZB-H1 step of the small GPT post-validated, its last step and its
    last two (which overlap) gathered on rank 0 — on a GPU its compute ops timed by CUDA events
    (runtime/device_clock.py), every event of positive length, each rank's in program order, the two steps' in
    order; what rank 0 found (the others: nothing)."""
    import torch

    import pipedsl
    from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch
    from pipedsl.runtime.post_validate import TrainingSteps

    P = torch.distributed.get_world_size()
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2 * P, n_head=2, n_embd=64)
    torch.manual_seed(0)
    pipe = pipedsl.Pipeline(GPT(cfg).stages(P), "zb-h1", microbatches=2 * P, loss_fn=gpt_loss,
                            device=torch.device(device))
    steps = TrainingSteps(pipe, pipe.optimizer(torch.optim.AdamW, lr=1e-3), max_norm=1.0, post_validate=True)
    x, y = synthetic_batch(4 * P, cfg.block_size, cfg.vocab_size, torch.Generator().manual_seed(1))
    for _ in range(3):
        steps.step(x, y)
    steps.settle()
    one, two = pipe.timeline(), pipe.timeline(steps=2)
    pipe.close()
    if one is None or two is None:
        return []
    problems = []
    clocks = {m.get("compute_clock") for m in one.meta["per_rank"]}
    want = "device events" if torch.device(device).type == "cuda" else None
    if clocks != {want}:
        problems.append(f"compute ops timed by {clocks}, expected {want or 'the host clock'}")
    for name, tl in (("last step", one), ("last two steps", two)):
        for r, events in enumerate(tl.ranks):
            if any(e.end < e.start for e in events):
                problems.append(f"{name}: rank {r} has an event that ends before it starts")
            if any(b.start < a.end - 1e-6 for a, b in zip(events, events[1:])):
                problems.append(f"{name}: rank {r}'s events overlap each other (out of program order)")
    if two.meta.get("steps") != 2:
        problems.append(f"the two-step timeline says steps={two.meta.get('steps')}")
    return problems


def _layouts(rank: int, device: str, world: int) -> dict[str, list[str]]:
    """What a first real run of an HF decoder does (`LAYOUTS` for this many ranks): dp × pp × tp with sequence
    parallelism, ZeRO-1 or -3, bf16 parameters over fp32 main ones, full or selective recomputation — the loss,
    gradient norm and parameters after two SGD steps against the dense model on the same device
    (tests/parallel/tp_hf_cases.py's `tp_equivalence`, as test_tp_hf.py runs it on gloo)."""
    import tp_hf_cases

    out: dict[str, list[str]] = {}
    for dp, pp, tp, zero, precision, recompute in LAYOUTS.get(world, []):
        name = (f"dp{dp} pp{pp} tp{tp}{'+sp' if tp > 1 else ''} zero{zero} {precision or 'fp32'} "
                f"recompute={recompute}")
        tol = BF16_TOL if precision else FP32_TOL
        try:
            r = tp_hf_cases.tp_equivalence("llama", dp, pp, tp, tp > 1, zero=zero, recompute=recompute,
                                           precision=precision, device=device)
            out[name] = [f"{k} {r[k]:.3g} >= {v:g}" for k, v in tol.items() if not r[k] < v]
        except Exception as err:  # noqa: BLE001 - reported in the table; the other ranks fail alike or time out
            out[name] = [f"{type(err).__name__}: {err}"]
    return out


def trainer_auto(device: str, tiny: bool) -> dict[str, Any]:
    """The trainer's `--schedule auto` as a user runs it (a subprocess: profile steps under ZB-H1, the units re-cut,
    ZB-auto searched and switched to through a checkpoint), against `-P 1` on the same device: every step's loss.
    On GPUs the launcher gives each rank one (NCCL); with `--device cpu`, gloo."""
    import json
    import tempfile

    steps = "4" if tiny else "8"
    common = ["--steps", steps, "--layers", "3", "-M", "4", "--seq", "32", "--embd", "64"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else None  # on GPUs: the user's devices
    losses, problems = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("one", ["-P", "1"]), ("auto", ["-P", "2", "--schedule", "auto", "--split", "1"])):
            out = Path(tmp) / name
            proc = subprocess.run([sys.executable, "-m", "pipedsl.cli", "train", *common, *extra, "-o", str(out)],
                                  capture_output=True, text=True, env=env, timeout=600, check=False)
            if proc.returncode != 0:
                problems.append(f"{name}: exit {proc.returncode}: {(proc.stderr or proc.stdout)[-400:]}")
                continue
            losses[name] = json.loads((out / "losses.json").read_text())["losses"]
    if len(losses) == 2:
        problems += [f"step {k}: {losses['auto'].get(k)} != -P 1's {v}" for k, v in losses["one"].items()
                     if k not in losses["auto"] or abs(losses["auto"][k] - v) > 1e-4 * abs(v)]
    return {"problems": problems, "steps": len(losses.get("auto", {}))}


def one_gpu(rank: int, device: str, size: dict[str, Any]) -> dict[str, Any]:
    """What one GPU can show of the runtime's cost (a one-rank world's rank function): a one-rank 1F1B pipeline's
    step against a plain PyTorch loop (the same microbatches, forward and backward each, gradients accumulated,
    AdamW) on copies of one Llama, bf16 parameters, SDPA attention; step times alternate, medians, their ratio,
    the MFU (`pipedsl train`'s: trainer/metrics.py's FLOPs a token and the card's datasheet peak) and how far
    the first losses are apart."""
    import statistics
    import time

    import torch
    import transformers

    import pipedsl
    from pipedsl.models.hf.stages import causal_lm_loss, causal_lm_stages, shift_labels
    from pipedsl.trainer.metrics import GPU_PEAKS, model_flops_per_token

    config = transformers.LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"],
                                      num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                                      num_key_value_heads=size["kv_heads"], intermediate_size=size["ffn"],
                                      max_position_embeddings=size["seq"])
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=dtype).to(device)
    models = [model, copy.deepcopy(model)]
    params = sum(p.numel() for p in models[0].parameters())
    M, rows, seq = size["M"], size["rows"], size["seq"]
    ids = torch.randint(size["vocab"], (M * rows, seq), device=device)
    targets = shift_labels(ids)
    program = pipedsl.load("1f1b").compile(1, M)
    pipe = pipedsl.Pipeline(causal_lm_stages(models[0], 1, check=False), program=program, loss_fn=causal_lm_loss,
                            device=device)
    opt = pipe.optimizer(torch.optim.AdamW, lr=1e-5)
    plain, plain_opt = models[1], torch.optim.AdamW(models[1].parameters(), lr=1e-5)

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize()

    losses: dict[str, list[float]] = {"pipedsl": [], "torch": []}

    def pipelined() -> None:
        losses["pipedsl"].append(pipe.step(ids, targets))
        opt.step()
        opt.zero_grad()

    def loop() -> None:
        total = 0.0
        for x, t in zip(ids.chunk(M), targets.chunk(M)):
            loss = causal_lm_loss(plain(x, use_cache=False).logits, t) / M
            loss.backward()
            total += loss.item()
        losses["torch"].append(total)
        plain_opt.step()
        plain_opt.zero_grad()

    times: dict[str, list[float]] = {"pipedsl": [], "torch": []}
    for i in range(size["warmup"] + size["steps"]):
        for name, fn in (("pipedsl", pipelined), ("torch", loop)):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if i >= size["warmup"]:
                times[name].append(time.perf_counter() - t0)
    pipe.close()
    step = {name: statistics.median(v) for name, v in times.items()}
    paired = sorted(p / t for p, t in zip(times["pipedsl"], times["torch"]))  # step i of each: same GPU state
    card = torch.cuda.get_device_name() if device != "cpu" else ""
    peak = next((v for k, v in GPU_PEAKS.items() if k in card), None)  # the trainer's MFU: its peaks, its FLOPs
    flops = model_flops_per_token(params, model.get_input_embeddings().weight.numel(), size["layers"],
                                  size["hidden"], seq) * M * rows * seq
    first = losses["torch"][0]
    return {"params": params, "tokens": M * rows * seq, "step_s": step,
            "ratio": statistics.median(paired), "ratio_range": [paired[0], paired[-1]],
            "mfu": {n: flops / t / peak for n, t in step.items()} if peak else None, "card": card,
            "dtype": str(dtype).removeprefix("torch."),
            "first_loss_rel_diff": abs(losses["pipedsl"][0] - first) / first}


def zero_one_rank(rank: int, device: str, steps: int) -> dict[str, Any]:
    """ZeRO's flat buffers on the device (a one-rank world): the small GPT's one-rank 1F1B pipeline under ZeRO 0-3
    against the same steps without ZeRO (losses bit for bit: the gradients accumulate in place in the flat
    buffer, by post-accumulate hooks on the device's autograd thread), and bf16 parameters over fp32 main
    parameters against bf16 autocast over fp32 parameters (within bf16 rounding)."""
    import torch
    from zero_speed import VARIANTS, layout  # the benchmark's variants and their baselines

    import pipedsl
    from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch
    from pipedsl.runtime.precision import MixedPrecision

    cfg = GPTConfig(n_layer=2, n_embd=64, block_size=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    data = [synthetic_batch(8, cfg.block_size, cfg.vocab_size, torch.Generator().manual_seed(s)) for s in range(steps)]
    losses = {}
    for name, (_, compute, params, _) in VARIANTS.items():
        pipe = pipedsl.Pipeline(copy.deepcopy(model).stages(1), program=pipedsl.load("1f1b").compile(1, 4),
                                loss_fn=gpt_loss, device=device, precision=MixedPrecision(compute, params=params),
                                parallel=layout(name, 1, 1))
        opt = pipe.optimizer(torch.optim.AdamW, lr=1e-3)
        losses[name] = []
        for x, y in data:
            losses[name].append(pipe.step(x, y))
            opt.step()
            opt.zero_grad()
        pipe.close()
    problems = [f"{name}: losses {losses[name]} != without ZeRO {losses[base]}"
                for name, (_, _, _, base) in VARIANTS.items() if base == "fp32" and losses[name] != losses[base]]
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses["bf16-main"], losses["bf16"]))
    if rel > 1e-2:
        problems.append(f"bf16 main parameters: losses {rel:.2g} from bf16 autocast (relative)")
    return {"problems": problems, "losses": losses, "bf16_main_rel_diff": rel}


def calibrate(P: int, device: str) -> dict[str, Any]:
    """`pipedsl plan --calibrate` on P local processes (on the CPU with CUDA hidden in the dry run)."""
    env = dict(os.environ)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-m", "pipedsl.cli", "plan", "--calibrate", "--gpus", str(P)],
                          capture_output=True, text=True, env=env, timeout=1800)
    lines = proc.stdout.splitlines()
    said = next((line for line in lines if line.startswith("calibrated on")), "")
    return {"ok": proc.returncode == 0, "exit": proc.returncode, "calibration": said,
            "stdout": proc.stdout[-4000:], "stderr": proc.stderr[-2000:]}


def table(result: dict[str, Any]) -> str:
    """The markdown report: one section per check."""
    shared = " (all ranks on this one GPU)" if result["backend"] == "gloo" and result["gpus"] else ""
    out = [f"# gpu_check: {result['device']} ({result['backend']}), P={result['P']}{shared}", "",
           f"{', '.join(result['gpus']) or 'no GPU'}; {result['machine']}; {result['date']}; `{result['command']}`",
           ""]
    skipped = [f"- {check} not run: {why}" for check, why in result.get("skipped", {}).items()]
    out += skipped + [""] * bool(skipped)
    if "schedules" in result:
        out += ["| schedule | M | loss, gradients, Adam vs one process |", "|---|---|---|"]
        for row in result["schedules"]:
            verdict = "equal" if row["ok"] else "; ".join(row["problems"][:3]) or row.get("skipped", "")
            out.append(f"| {row['schedule']} | {row.get('M', '')} | {verdict} |")
        out.append("")
    if "large" in result:
        which = "Every schedule" if result.get("every_schedule", True) else "Each schedule above"
        out += [f"{which} with {result['large_mib']:.0f} MiB messages (rendezvous sends on NCCL), loss, "
                f"gradients and Adam vs one process: " + ("equal" if not result["large"] else
                                                         "; ".join(result["large"][:3])), ""]
    if "one_gpu" in result:
        g = result["one_gpu"]
        mfu = (f"; MFU {g['mfu']['pipedsl']:.1%} against {g['mfu']['torch']:.1%}" if g["mfu"] else "")
        out += [f"One GPU, a {g['params'] / 1e9:.2f} B Llama ({g['dtype']}, SDPA), {g['tokens']} tokens a step: "
                f"pipedsl's one-rank 1F1B {g['step_s']['pipedsl'] * 1e3:.1f} ms against a plain PyTorch loop "
                f"{g['step_s']['torch'] * 1e3:.1f} ms (ratio {g['ratio']:.3f}, paired steps {g['ratio_range'][0]:.3f}-"
                f"{g['ratio_range'][1]:.3f}){mfu}; first losses "
                f"{g['first_loss_rel_diff']:.1e} apart (relative)", ""]
    if "zero" in result:
        z = result["zero"]
        verdict = (f"losses bit-equal to the same steps without ZeRO; bf16 parameters over fp32 main ones "
                   f"{z['bf16_main_rel_diff']:.1e} from bf16 autocast (relative)") if not z["problems"] else \
            "; ".join(z["problems"][:3])
        out += [f"ZeRO 1-3 on one rank (the small GPT, 1F1B, {len(z['losses']['fp32'])} AdamW steps): {verdict}", ""]
    if "moe" in result:
        verdict = "equal" if not result["moe"] else "; ".join(result["moe"][:3])
        out += [f"MoE GPT at dp2 x pp2 x ep2 (1F1B; DualPipeV overlapped vs not), pp2 x tp2, dp2 x tp2+sp x ep2: "
                f"{verdict}", ""]
    if "layouts" in result:
        out += ["| HF Llama layout (1F1B, 2 SGD steps) | vs the dense model on the device |", "|---|---|"]
        for name, problems in result["layouts"].items():
            out.append(f"| {name} | {'equal' if not problems else '; '.join(problems[:3])} |")
        out.append("")
    if "timeline" in result:
        timed = ", compute ops timed by CUDA events" if str(result["device"]).startswith("cuda") else ""
        verdict = f"in order{timed}" if not result["timeline"] else "; ".join(result["timeline"][:3])
        out += [f"Measured timelines (ZB-H1, post-validated; the last step and the last two): {verdict}", ""]
    if "trainer_auto" in result:
        t = result["trainer_auto"]
        verdict = "every loss equal to -P 1's" if not t["problems"] else "; ".join(t["problems"][:3])
        out += [f"`pipedsl train --schedule auto -P 2` ({t['steps']} steps: ZB-H1 profile, re-cut, ZB-auto): "
                f"{verdict}", ""]
    if "vs_torch" in result:
        out += ["| vs_torch (GPT) | pipedsl ms | torch ms | throughput ratio (paired) |", "|---|---|---|---|"]
        for row in result["vs_torch"]:
            out.append(f"| {row['schedule']} | {row['step_s']['pipedsl']['median'] * 1e3:.2f} | "
                       f"{row['step_s']['torch']['median'] * 1e3:.2f} | {row['ratio_paired_median']:.3f} |")
        out.append("")
    if "op_cpu" in result:
        c = result["op_cpu"]
        out += ["| CPU per op beyond compute | pipedsl µs | torch µs | pipedsl / torch |", "|---|---|---|---|",
                f"| 1F1B, Linear(8, 8) | {c['beyond_compute_s_per_op']['pipedsl'] * 1e6:.0f} | "
                f"{c['beyond_compute_s_per_op']['torch'] * 1e6:.0f} | {c['ratio']:.3f} |", ""]
    if "calibrate" in result:
        c = result["calibrate"]
        verdict = "ok" if c["ok"] else f"FAILED, exit {c['exit']}"
        said = c["calibration"] or " ".join(c["stderr"].strip().splitlines()[-1:])
        out += [f"`pipedsl plan --calibrate --gpus {result['P']}`: {verdict}; {said}", ""]
    return "\n".join(out)


def _placement(device: str, ranks: int | None) -> tuple[int, str, str | None] | None:
    """(ranks, backend, the one GPU every rank shares or None) for `--device`; None (said) without a GPU."""
    import torch

    if device != "cuda":
        return ranks or 2, "gloo", None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 1:
        print(f"gpu_check: no GPU to check (no CUDA device visible; torch {torch.__version__}, "
              f"CUDA build {torch.version.cuda}). `--device cpu` runs the same checks on gloo.")
        return None
    if count == 1:
        return ranks or 4, "gloo", "cuda:0"
    return ranks or count, "nccl", None


def _runnable(checks: list[str], P: int, shared_device: str | None, device: str) -> tuple[list[str], dict[str, str]]:
    """The checks this placement can run, and why each other one cannot."""
    skipped = {}
    if shared_device:  # torch's pipelining sends GPU tensors over gloo, which cannot: these need NCCL
        skipped = {c: f"{P} ranks share one GPU over gloo; torch's runtime needs one GPU a rank (NCCL)"
                   for c in ("vs_torch", "op_cpu") if c in checks}
        if "large" in checks:
            skipped["large"] = (f"{P} ranks share one GPU over gloo, which buffers sends: NCCL's rendezvous of large "
                                f"messages needs two GPUs or more (PIPEDSL_P2P=rendezvous emulates it on CPU)")
        if "layouts" in checks:
            skipped["layouts"] = (f"{P} ranks share one GPU over gloo: tensor parallelism's and ZeRO's collectives "
                                  f"on GPU tensors need NCCL, one GPU a rank (the CPU tests run them on gloo)")
        if "trainer_auto" in checks:
            skipped["trainer_auto"] = ("with one GPU `pipedsl train -P 2` runs its ranks on the CPU (gloo): the "
                                       "trainer's GPU run needs one GPU a rank")
        checks = [c for c in checks if c not in skipped]
    if "one_gpu" in checks and device == "cuda" and not shared_device:
        skipped["one_gpu"] = "run with one GPU visible (CUDA_VISIBLE_DEVICES=0): it measures one GPU alone"
        checks = [c for c in checks if c != "one_gpu"]
    return checks, skipped


def main(argv: list[str] | None = None) -> int:
    import torch

    import pipedsl

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda (default: NCCL, one process a GPU) or cpu (the same checks on gloo: a dry run)")
    ap.add_argument("--P", type=int, help="ranks (default: every visible GPU, 4 sharing one, 2 on cpu)")
    ap.add_argument("--message-mib", type=float, default=64.0,
                    help="the large check's message size (default 64: past NCCL's buffers, so sends rendezvous)")
    ap.add_argument("--tiny", action="store_true", help="one step, one repetition (the smoke test)")
    ap.add_argument("--skip", nargs="+", choices=CHECKS, default=[], help="checks not to run")
    ap.add_argument("--schedules", nargs="+", choices=pipedsl.builtin_names(), metavar="NAME",
                    help="the built-ins that schedules and large run (default: every one)")
    ap.add_argument("--json", help="output file (default benchmarks/results/gpu_check.json; the table beside it, .md)")
    args = ap.parse_args(argv)
    placed = _placement(args.device, args.P)
    if placed is None:
        return 0
    P, backend, shared_device = placed  # shared_device: every rank on this one GPU (NCCL takes one rank a GPU)
    sizes = SIZES["tiny" if args.tiny else "full"]
    checks, skipped = _runnable([c for c in CHECKS if c not in args.skip], P, shared_device, args.device)
    large = dict(sizes["large"])
    large["rows"] = max(1, int(args.message_mib * 2**20 / (4 * large["width"]))) if not args.tiny else 2
    programs, rows = {}, []
    for name in args.schedules or pipedsl.builtin_names():
        program = compile_for(name, P)
        if program is None:
            rows.append({"schedule": name, "ok": True, "problems": [], "skipped": f"no M accepted at P={P}"})
        else:
            programs[name] = program
    cfg = {**sizes, "large": large, "checks": checks, "programs": {n: p.to_json() for n, p in programs.items()},
           "shared_device": shared_device}
    command = "python benchmarks/gpu_check.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    result: dict[str, Any] = {"benchmark": "gpu_check", "command": command, "machine": _bench.machine(),
                              "date": _bench.today(), "P": P, "backend": backend, "skipped": skipped,
                              "every_schedule": not args.schedules}
    ranks = []
    if {"schedules", "large", "moe", "layouts", "timeline", "vs_torch", "op_cpu"} & set(checks):
        ranks = pipedsl.launch(_rank_main, P, P, cfg, backend=backend, threads=1, timeout=600)
    # after the ranks: CUDA initialised here before they fork would leave them unable to use it
    result["gpus"] = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                      if args.device == "cuda" else [])
    result["device"] = ranks[0]["device"] if ranks else args.device
    _collect(result, checks, ranks, programs, rows, args, sizes, large["rows"] * large["width"] * 4 / 2**20)
    result["failed"] = failed = _failures(result)
    path = _bench.write_json("gpu_check", result, args.json)
    md = table(result)
    path.with_suffix(".md").write_text(md + "\n")
    print(md)
    print(f"wrote {path} and {path.with_suffix('.md')}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _collect(result: dict[str, Any], checks: list[str], ranks: list[dict], programs: dict, rows: list[dict],
             args: argparse.Namespace, sizes: dict, mib: float) -> None:
    """Each check's outcome into `result`: from the ranks' reports, or run here (one GPU, ZeRO on one rank, the
    trainer, calibration)."""
    import pipedsl

    P = result["P"]
    if "schedules" in checks:
        for name, program in programs.items():
            problems = [f"rank {r}: {p}" for r, out in enumerate(ranks) for p in out["schedules"][name]["problems"]]
            predicted = pipedsl.simulate(program).peak_activations
            problems += [f"rank {r}: peak activations {out['schedules'][name]['peaks']}, simulated {predicted[r]}"
                         for r, out in enumerate(ranks) if set(out["schedules"][name]["peaks"]) != {predicted[r]}]
            rows.append({"schedule": name, "M": program.num_microbatches, "ok": not problems, "problems": problems})
        result["schedules"] = sorted(rows, key=lambda r: r["schedule"])
    if "vs_torch" in checks:
        import vs_torch

        vs_cfg = {**sizes["vs_torch"], "M": 2 * P}
        result["vs_torch"] = [vs_torch._row("gpt", name, P, vs_cfg, ranks[0]["vs_torch"][name])
                              for name in vs_torch.SCHEDULE_NAMES]
    if "large" in checks:
        result["large"] = [f"{name}: rank {r}: {p}" for name in programs for r, out in enumerate(ranks)
                           for p in out["large"][name]["problems"]]
        result["large_mib"] = mib
    if "moe" in checks and P == 4:
        result["moe"] = [f"rank {r}: {p}" for r, out in enumerate(ranks) for p in out["moe"]["problems"]]
    if "layouts" in checks:
        if P not in LAYOUTS:
            result["skipped"]["layouts"] = f"no layout listed for {P} ranks (LAYOUTS: {', '.join(map(str, LAYOUTS))})"
        else:
            result["layouts"] = {name: [f"rank {r}: {p}" for r, out in enumerate(ranks) for p in out["layouts"][name]]
                                 for name in ranks[0]["layouts"]}
    if "timeline" in checks:
        result["timeline"] = [f"rank {r}: {p}" for r, out in enumerate(ranks) for p in out["timeline"]]
    if "trainer_auto" in checks:
        result["trainer_auto"] = trainer_auto(args.device, args.tiny)
    device = args.device  # "cuda" or "cpu"
    if "one_gpu" in checks:
        result["one_gpu"] = pipedsl.launch(one_gpu, 1, device, sizes["one_gpu"], backend="nccl" if device == "cuda"
                                           else "gloo", threads=None if device == "cuda" else 1, timeout=600)[0]
    if "zero" in checks:
        result["zero"] = pipedsl.launch(zero_one_rank, 1, device, sizes["steps"] + 2,
                                        backend="nccl" if device == "cuda" else "gloo", threads=1, timeout=600)[0]
    if "op_cpu" in checks:
        import op_cpu

        result["op_cpu"] = op_cpu.summarize([r["op_cpu"] for r in ranks])
    if "calibrate" in checks:
        result["calibrate"] = calibrate(P, args.device)


def _failures(result: dict[str, Any]) -> list[str]:
    """The names of the checks that failed."""
    failed = [r["schedule"] for r in result.get("schedules", []) if not r["ok"]]
    failed += ["moe"] if result.get("moe") else []
    failed += [f"layout {name}" for name, problems in result.get("layouts", {}).items() if problems]
    failed += ["trainer --schedule auto"] if result.get("trainer_auto", {}).get("problems") else []
    failed += ["large messages"] if result.get("large") else []
    failed += ["timeline"] if result.get("timeline") else []
    failed += ["zero"] if result.get("zero", {}).get("problems") else []
    failed += ["plan --calibrate"] if "calibrate" in result and not result["calibrate"]["ok"] else []
    return failed

if __name__ == "__main__":
    raise SystemExit(main())
