"""Worker side of test_activation_bytes.py and benchmarks/activation_bytes.py: the bytes a tiny HF
Llama layer keeps for its backward, measured by the runtime (`Pipeline(activation_bytes=True)`).

One stage (pp = 1), GPipe: after M forwards the counter holds M microbatches' saved tensors, and a
backward's recomputation adds one region's on top, so peak(M=2) − peak(M=1) is what one
microbatch keeps; the same with L and L + 1 layers differ by one layer's bytes.  fp32, so 4 bytes
a value.  `tp`/`sp` run through `tp_hf_stages` on a gloo world of `tp` ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import pipedsl
from pipedsl.parallel import ParallelConfig, ParallelMesh

SIZES = {"hidden": 64, "ffn": 160, "heads": 4, "kv_heads": 2, "seq": 64, "vocab": 128, "microbatch": 2}


def tiny_llama(layers: int, attn: str):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=SIZES["vocab"], hidden_size=SIZES["hidden"],
                            intermediate_size=SIZES["ffn"], num_hidden_layers=layers,
                            num_attention_heads=SIZES["heads"], num_key_value_heads=SIZES["kv_heads"],
                            max_position_embeddings=SIZES["seq"], bos_token_id=0, eos_token_id=0,
                            attn_implementation=attn)
    return tf.AutoModelForCausalLM.from_config(config)


def _attention(module: torch.nn.Module) -> bool:
    """pipedsl train's selective recomputation: the attention modules."""
    return type(module).__name__.endswith("Attention")


def _layer(module: torch.nn.Module) -> bool:
    """Full recomputation a layer at a time (Megatron's): every decoder layer a region."""
    return type(module).__name__.endswith("DecoderLayer")


def _stored(layers: int, M: int, tp: int, sp: bool, recompute: str | None, attn: str) -> int:
    from pipedsl.models.hf.parallelize import tp_hf_loss, tp_hf_stages
    from pipedsl.models.hf.stages import causal_lm_loss, causal_lm_stages, shift_labels

    program = pipedsl.load("gpipe").compile(P=1, M=M)
    stages = causal_lm_stages(tiny_llama(layers, attn), 1)
    mesh = None
    loss = causal_lm_loss
    if tp > 1:
        mesh = ParallelMesh(ParallelConfig(tp=tp))
        stages = tp_hf_stages(stages, mesh, sequence_parallel=sp)
        loss = tp_hf_loss(mesh)
    regions = {"selective": _attention, "layer": _layer}.get(recompute or "")
    pipe = pipedsl.Pipeline(stages, program=program, loss_fn=loss, parallel=mesh, activation_bytes=True,
                            recompute="selective" if regions else recompute, recompute_filter=regions)
    x = torch.randint(SIZES["vocab"], (M * SIZES["microbatch"], SIZES["seq"]),
                      generator=torch.Generator().manual_seed(1))
    pipe.step(x, shift_labels(x))  # the first step also learns the shapes
    pipe.counter.reset()
    pipe.step(x, shift_labels(x))
    out = pipe.counter.peak_bytes
    pipe.close()
    return out


def layer_bytes(tp: int, sp: bool, recompute: str | None, attn: str = "eager") -> dict:
    """Bytes one layer keeps per microbatch on this rank (see the module docstring), and the raw peaks.
    `recompute`: None, "selective" (the attention modules), "layer" (each decoder layer: the planner's
    "full") or "full" (pipedsl's: the whole stage one region, so a layer keeps nothing)."""
    peaks = {(L, M): _stored(L, M, tp, sp, recompute, attn) for L in (1, 2) for M in (1, 2)}
    per_microbatch = {L: peaks[(L, 2)] - peaks[(L, 1)] for L in (1, 2)}
    return {"layer": per_microbatch[2] - per_microbatch[1], "rank": dist.get_rank() if dist.is_initialized() else 0,
            "peaks": {f"L{L} M{M}": v for (L, M), v in peaks.items()}}


def layer_bytes_each(tp: int, sp: bool, variants: list[tuple[str | None, str]]) -> list[dict]:
    """`layer_bytes` for each (recompute, attention) variant, in one job: one gloo world for all (suite time)."""
    return [layer_bytes(tp, sp, recompute, attn) for recompute, attn in variants]


def w_held_layer(tp: int, sp: bool, kv_heads: int) -> dict:
    """Bytes one layer's pending W holds after I, and its stored activation, per microbatch on this rank: stage 1
    of two (the layers and the head: stage 0, the embedding, has no input gradient, so its I is empty) under
    ZB-H1, one microbatch; the counter's share after I (`w_shares`) times the forward's bytes (`largest_bytes`),
    with 2 layers less with 1.  Run on 2·tp ranks (pp2 × tp)."""
    from pipedsl.models.hf.parallelize import tp_hf_loss, tp_hf_stages
    from pipedsl.models.hf.stages import causal_lm_loss, causal_lm_stages, shift_labels

    def one(layers: int) -> tuple[float, float]:
        mesh = ParallelMesh(ParallelConfig(pp=2, tp=tp))
        stages = causal_lm_stages(tiny_llama(layers, "sdpa"), 2, points=[1])
        loss = causal_lm_loss
        if tp > 1:
            stages, loss = tp_hf_stages(stages, mesh, sequence_parallel=sp), tp_hf_loss(mesh)
        pipe = pipedsl.Pipeline(stages, program=pipedsl.load("zb-h1").compile(P=2, M=1), loss_fn=loss,
                                parallel=mesh, activation_bytes=True)
        pipe.counter.measure_w_shares = True
        x = torch.randint(SIZES["vocab"], (SIZES["microbatch"], SIZES["seq"]),
                          generator=torch.Generator().manual_seed(1))
        pipe.step(x, shift_labels(x))  # the first step also learns the shapes
        pipe.counter.reset()
        pipe.counter.w_shares.clear()
        pipe.step(x, shift_labels(x))
        counted = float(pipe.counter.largest_bytes)
        shares = list(pipe.counter.w_shares)
        pipe.close()
        return counted, (shares[-1] * counted if shares else 0.0)

    SIZES["kv_heads"], kept = kv_heads, SIZES["kv_heads"]
    try:
        (stored1, held1), (stored2, held2) = one(1), one(2)
    finally:
        SIZES["kv_heads"] = kept
    return {"stored": stored2 - stored1, "held": held2 - held1, "rank": dist.get_rank()}
