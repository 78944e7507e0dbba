"""Split backward's memory and time: what a stage holds between I and W, and what dropping the rest costs.

1. *Held bytes* (one process): a stage of 2 layers, B = 4, T = 256, hidden 256, fp32.  Every storage
   its forward saved is tracked by `StorageWeakRef` (runtime-independent), plus the gradients I
   captured for W.  Reported after F, and after I with everything kept (the yardstick, the runtime
   before 2026-11-26) and with only W's part kept (runtime/stage.py; docs/runtime.md, "Split
   backward's memory").  GPT blocks (SDPA) and Llama layers (eager attention, SDPA).
2. *Step time* (gloo, P = 2, one thread a rank): ZB-H1 on the small GPT, the runtime as it is against
   the same pipeline with I keeping everything, alternating steps in the same processes; the
   paired median ratio.

    python benchmarks/split_backward.py
    python benchmarks/split_backward.py --quick   # structure only (the GPT alone)
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "runtime"))  # saved_storages: what a graph holds, by weak reference

import _bench  # noqa: E402
from saved_storages import saved_storages  # noqa: E402

MiB = 2**20


def held_bytes(make: Any, x: Any, release: bool, zero: int = 0) -> dict[str, float]:
    """MiB a middle stage holds after F and after I (saved tensors alive + the gradients captured for W); `zero`:
    its parameters in ZeRO-`zero`'s flat buffers (a one-rank group)."""
    import torch
    import torch.distributed as dist

    from pipedsl.parallel.zero import ZeroOptimizer
    from pipedsl.runtime.stage import ActivationCounter, Stage, StageOptions

    module = make()
    if zero:
        ZeroOptimizer(module, torch.optim.SGD, group=dist.group.WORLD, stage=zero, lr=0.0)
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    stage = Stage(module, 1, 3, None, 1, ActivationCounter(), options=StageOptions(release=release))
    act, outs = stage.forward([x])
    saved = saved_storages(outs, weights)

    def alive() -> float:
        return sum(n for ref, n in saved.values() if not ref.expired()) / MiB

    after_f = alive()
    grads = [torch.randn_like(outs[0])]
    del outs
    stage.backward_input(act, grads)
    captured = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                for _, gs, _, _ in act.boundary for g in gs if isinstance(g, torch.Tensor)}
    row = {"after_F": after_f, "after_I_saved": alive(), "after_I_grads": sum(captured.values()) / MiB}
    stage.backward_weight(act)
    return row


def stages(quick: bool) -> dict[str, tuple[Any, tuple[int, ...]]]:
    from torch import nn

    from pipedsl.models.gpt.model import Block, GPTConfig

    B, T, C = (2, 32, 32) if quick else (4, 256, 256)
    gpt = GPTConfig(n_embd=C, n_head=4, block_size=T)
    out: dict[str, tuple[Any, tuple[int, ...]]] = {
        "GPT blocks (SDPA)": (lambda: nn.Sequential(Block(gpt), Block(gpt)), (B, T, C))}
    if quick:  # the GPT alone: Hugging Face's import is most of a quick run
        return out
    try:
        import torch
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    except ImportError:  # the hf extra
        return out
    for impl in ("eager", "sdpa"):
        cfg = LlamaConfig(hidden_size=C, intermediate_size=688, num_attention_heads=4,
                          num_key_value_heads=4, num_hidden_layers=2, attn_implementation=impl)

        class Layers(nn.Module):
            def __init__(self, cfg: Any = cfg) -> None:
                super().__init__()
                self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(2))
                self.rotary = LlamaRotaryEmbedding(cfg)

            def forward(self, h: torch.Tensor) -> torch.Tensor:
                pos = torch.arange(h.shape[1], device=h.device)[None]
                pe = self.rotary(h, pos)
                for layer in self.layers:
                    h = layer(h, position_embeddings=pe, position_ids=pos, attention_mask=None)
                    h = h[0] if isinstance(h, tuple) else h
                return h

        out[f"Llama layers ({impl})"] = (Layers, (B, T, C))
    return out


def _held_rows(rank: int, quick: bool) -> list[dict[str, Any]]:
    """Every stage's held bytes: I keeping everything, I keeping W's part, and the same under ZeRO-1."""
    import torch

    torch.manual_seed(0)
    rows = []
    for name, (make, shape) in stages(quick).items():
        x = torch.randn(shape)
        for release, zero in ((False, 0), (True, 0), (True, 1)):
            rows.append({"stage": name, "release": release, "zero": zero, **held_bytes(make, x, release, zero)})
    return rows


def _rank_main(rank: int, P: int, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    import pipedsl
    from pipedsl.models.gpt.model import GPT, GPTConfig, gpt_loss, synthetic_batch

    gcfg = GPTConfig(n_layer=cfg["layers"], n_embd=cfg["embd"], block_size=cfg["seq"])
    torch.manual_seed(0)
    model = GPT(gcfg)
    pipes = {name: pipedsl.Pipeline(copy.deepcopy(model).stages(P), "zb-h1", microbatches=cfg["M"],
                                    loss_fn=gpt_loss) for name in ("released", "kept")}
    for stage in pipes["kept"]._stages.values():  # the yardstick: I keeps everything, as before 2026-11-26
        stage.release = False
    x, y = synthetic_batch(cfg["M"] * cfg["rows"], gcfg.block_size, gcfg.vocab_size, torch.Generator().manual_seed(1))

    def step(pipe: Any) -> float:
        dist.barrier(group=pipe.group)
        t0 = time.perf_counter()
        pipe.step(x, y)
        dist.barrier(group=pipe.group)
        for p in pipe.parameters():
            p.grad = None
        return time.perf_counter() - t0

    for _ in range(cfg["warmup"]):
        for pipe in pipes.values():
            step(pipe)
    times: dict[str, list[float]] = {name: [] for name in pipes}
    for k in range(cfg["reps"]):
        for name in (("released", "kept") if k % 2 == 0 else ("kept", "released")):
            times[name].append(step(pipes[name]))
    for pipe in pipes.values():
        pipe.close()
    return times


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (structure only)")
    ap.add_argument("--json", help="output file (default benchmarks/results/split_backward.json)")
    ap.add_argument("--no-append", action="store_true", help="do not add a row to RESULTS.md")
    args = ap.parse_args(argv)
    import torch

    import pipedsl

    rows = pipedsl.launch(_held_rows, 1, args.quick, threads=max(1, torch.get_num_threads()), timeout=600)[0]
    print("| stage | I keeps | after F MiB | after I MiB (saved + gradients for W) |")
    print("|---|---|---:|---:|")
    for r in rows:
        keeps = ("W's part" + (f", ZeRO-{r['zero']}" if r["zero"] else "")) if r["release"] else "everything"
        print(f"| {r['stage']} | {keeps} | {r['after_F']:.1f} | {r['after_I_saved'] + r['after_I_grads']:.1f} "
              f"({r['after_I_saved']:.1f} + {r['after_I_grads']:.1f}) |")
    cfg = ({"layers": 2, "embd": 16, "seq": 16, "M": 4, "rows": 1, "warmup": 1, "reps": 2} if args.quick else
           {"layers": 4, "embd": 64, "seq": 64, "M": 8, "rows": 2, "warmup": 2, "reps": 20})
    times = pipedsl.launch(_rank_main, 2, 2, cfg, threads=1, timeout=600)[0]
    ratio = _bench.paired_median(times["released"], times["kept"])
    print(f"\nZB-H1 P=2 M={cfg['M']}, GPT {cfg['layers']} layers C={cfg['embd']} T={cfg['seq']}: step "
          f"{1e3 * _bench.median(times['released']):.1f} ms with I dropping what W does not read, "
          f"{1e3 * _bench.median(times['kept']):.1f} ms keeping everything; paired median ratio {ratio:.3f}")
    command = "python benchmarks/split_backward.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"benchmark": "split_backward", "command": command.strip(), "machine": _bench.machine(),
              "date": _bench.today(), "held": rows, "step": {"config": cfg, "times": times, "ratio": ratio}}
    _bench.write_json("split_backward", result, args.json)
    if not args.no_append:
        held = "; ".join(f"{r['stage']} after F {r['after_F']:.1f} MiB, after I "
                         f"{r['after_I_saved'] + r['after_I_grads']:.1f}" + (f" (ZeRO-{r['zero']})" * bool(r["zero"]))
                         for r in rows if r["release"])
        _bench.append_results(_bench.results_row(result["command"], f"split backward: {held}; ZB-H1 step, I "
                                                 f"dropping what W does not read over keeping all: {ratio:.3f}"))
    return result


if __name__ == "__main__":
    main()
