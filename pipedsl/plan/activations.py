"""Bytes one transformer layer keeps for its backward, per microbatch and GPU, for every memory mode.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022,
arXiv 2205.05198), Table 2, for Megatron's GPT layer (16-bit values, 1-byte dropout masks),
s sequence, b microbatch, h hidden, a heads, t tensor-parallel size:

    mode                                       bytes per layer
    no parallelism                             s·b·h·(34 + 5·a·s/h)
    tensor parallel (tp)                       s·b·h·(10 + 24/t + 5·a·s/(h·t))
    tp + sequence parallel (SP)                s·b·h/t·(34 + 5·a·s/h)
    tp + selective recomputation               s·b·h·(10 + 24/t)
    tp + SP + selective recomputation          s·b·h·34/t
    full recomputation                         2·s·b·h (the layer's input; /t with SP)

The 34 is 11 for attention's non-s² tensors (QKV input 2, Q and K 4, V 2, projection input 2,
dropout mask 1), 19 for the MLP (input 2, GeLU input 8 and output 8, mask 1) and 4 for the two
LayerNorm inputs; 5·a·s/h is the softmax output (2), its dropout mask (1) and dropout output (2).
Without SP the 10 (LayerNorm inputs, the first linears' inputs, two masks) is replicated over tp;
SP shards it.  Selective recomputation drops the 5·a·s/h (it recomputes QKᵀ, softmax, dropout and
attention over V).  A fused attention kernel (FlashAttention) stores no s² tensor either: the
5·a·s/h term vanishes without any recomputation.

Hugging Face Llama layers as pipedsl runs them (`layout="hf"`: SwiGLU MLP of width f, RMSNorm,
rotary positions, no dropout, grouped-query K/V of width h_kv; `parallel/tp_hf.py`) keep, counted
the same way from what autograd saves (v bytes a value; the norms compute in fp32):

    each RMSNorm            its input and normalised tensor in fp32, its output: (8 + v)·h + 4
    attention, eager        Q, K and V repeated to every head, output: 4·v·h; softmax (fp32) and
                            its v-byte copy (one tensor when v = 4): a·s·(4 + v, or 4)
    attention, fused (SDPA) Q: v·h, K and V unrepeated: 2·v·h_kv, output: v·h, log-sum-exp: 4·a
    MLP                     gate output (SiLU's input), SiLU's output, up output, their product: 4·v·f

per token, all over t except the norms.  torch's sequence parallelism (`SequenceParallel`
norms, `PrepareModuleInput` gathers) runs the norms on 1/t of the sequence, but the linears
keep their all-gathered input whole (2·v·h, where Megatron keeps the shard and gathers again in
the backward) and the norms' output shards are not kept: (8·h + 4)/t a norm.  pipedsl's
selective recomputation recomputes the whole attention module (its `recompute_filter` selects
attention modules): only the module's input stays — the norm's output, or with SP its
all-gathered copy (the gather is the module's input hook, outside the recomputed forward).
Full recomputation is modelled per layer (a region per layer: `recompute="selective"` with a
filter selecting the decoder layers; pipedsl's `recompute="full"` makes the whole stage one
region, which keeps only the stage's input but needs the whole stage's activations at once in
its backward).  tests/plan/test_activation_bytes.py checks these against the bytes pipedsl's
`Pipeline(activation_bytes=True)` counts.

A split backward's pending W (from I to W) holds less: each linear's input and the gradient of its
output (`layer_w_held_bytes`; the rest is dropped at I, runtime/stage.py).  For Megatron's GPT layer
that is the zero-bubble paper's 32 of the 34 (Qi et al. 2024, arXiv 2401.10241: QKV, projection,
fc1 and fc2 inputs 2 + 2 + 2 + 8, their output gradients 6 + 2 + 8 + 2); over tp the QKV and fc1
inputs and the projection and fc2 output gradients are whole on every rank (8 + 24/t), with SP
all of it is sharded (32/t), as Table 2 counts.  For the Hugging Face Llama layer the runtime holds,
per token, v·(4h + (2h + 2·h_kv + 3f)/t) with or without SP: the two norms' normalised tensors and
the linears' whole inputs (4h), the attention output and its projection's gradient, Q's, K's and
V's output gradients, the MLP's product and its gate and up gradients (measured at tp1, tp2 and
tp2 + SP, several widths; an MoE MLP's share taken as a dense MLP's, 3 of its 4·v·f).  Under
recomputation a region is held whole until W: the share is 1.
"""

from __future__ import annotations

RECOMPUTE_MODES = ("none", "selective", "full")
LAYOUTS = ("gpt", "hf")


def layer_activation_bytes(seq: int, samples: int, hidden: int, heads: int, tp: int = 1,
                           sequence_parallel: bool = False, recompute: str = "none", fused: bool = False,
                           layout: str = "gpt", ffn: int = 0, kv_hidden: int = 0, value_bytes: int = 2,
                           mlp: float | None = None) -> float:
    """Bytes one layer keeps between its forward and backward on one GPU (see the module table).

    `layout` "gpt": Korthikanti's Table 2 (Megatron's GPT, 16-bit values); "hf": a Hugging Face
    Llama layer under pipedsl (`ffn` its MLP width, `kv_hidden` its K/V width, `value_bytes` 2 for
    bf16, 4 for fp32); `mlp`, bytes per token in place of the MLP's 4·v·f (an MoE layer's routed and
    shared experts, `ModelSpec.moe_mlp_bytes`), sharded over t like it."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute is one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout is one of {', '.join(LAYOUTS)}, got {layout!r}")
    s, b, h, a, t = seq, samples, hidden, heads, tp
    sp = sequence_parallel and t > 1
    if recompute == "full":
        return (2 if layout == "gpt" else value_bytes) * s * b * h / (t if sp else 1)
    if layout == "gpt":
        squared = 0.0 if fused or recompute == "selective" else 5 * a * s / h
        if sp:
            return s * b * h / t * (34 + squared)
        return s * b * h * (10 + 24 / t + squared / t)
    v = value_bytes
    f, kv = ffn or 4 * h, kv_hidden or h
    norms = 2 * ((8 + v) * h + 4)
    attention = 2 * v * h + 2 * v * kv + 4 * a if fused else 4 * v * h + a * s * (4 + (v if v != 4 else 0))
    mlp = 4 * v * f if mlp is None else mlp
    if recompute == "selective":
        attention = 0.0
    if not sp:
        return s * b * (norms + (attention + mlp) / t)
    # the norms' output shards are not kept: the linears (or the recomputed attention region) keep the gathered copy
    return s * b * (2 * (8 * h + 4) / t + 2 * v * h + (attention + mlp) / t)


def layer_w_held_bytes(seq: int, samples: int, hidden: int, heads: int, tp: int = 1,
                       sequence_parallel: bool = False, recompute: str = "none", fused: bool = False,
                       layout: str = "gpt", ffn: int = 0, kv_hidden: int = 0, value_bytes: int = 2,
                       mlp: float | None = None) -> float:
    """Bytes one layer's pending W holds from its I to its W on one GPU (see the module docstring); under
    recomputation what the layer keeps (`layer_activation_bytes`: a recomputed region is held whole)."""
    if recompute != "none":
        return layer_activation_bytes(seq, samples, hidden, heads, tp, sequence_parallel, recompute, fused, layout,
                                      ffn, kv_hidden, value_bytes, mlp)
    if layout not in LAYOUTS:
        raise ValueError(f"layout is one of {', '.join(LAYOUTS)}, got {layout!r}")
    s, b, h, t = seq, samples, hidden, tp
    if layout == "gpt":
        return s * b * h * (32 / t if sequence_parallel and t > 1 else 8 + 24 / t)
    v = value_bytes
    f, kv = ffn or 4 * h, kv_hidden or h
    held_mlp = 3 * v * f if mlp is None else 0.75 * mlp
    return s * b * (4 * v * h + (2 * v * h + 2 * v * kv + held_mlp) / t)
