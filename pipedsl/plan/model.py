"""Transformer models as the planner sees them: sizes, parameters, FLOPs and activation bytes — decoders
(`ModelSpec`) and encoder-decoders (`EncDecSpec`, its units those `seq2seq_stages` spreads over the stages), both
read by the planner through one protocol (`PlannedModel`).

Two layouts, because the runtime runs two kinds of decoder (and their tensor parallelism differs):
- "gpt": Megatron's GPT, pipedsl's built-in GPT (`models/gpt/model.py`, `models/gpt/parallelize.py`): 4h GeLU
  MLP, LayerNorms, biases, learned positions, the output layer tied to the word embedding;
- "hf": a Hugging Face decoder in the Llama layout (`models/hf/parallelize.py`): SwiGLU MLP (`ffn`),
  grouped-query attention (`kv_heads`), RMSNorm, rotary positions, no biases, an untied head.

Formulas:
- parameters: 12·l·h² + 13·l·h + (V + s)·h for the GPT (Narayanan et al., SC'21, §5.1);
- FLOPs per iteration: 72·B·s·l·h²·(1 + s/6h + V/12lh) without recomputation and
  96·B·s·l·h²·(1 + s/6h + V/16lh) with full recomputation (SC'21 eq. 3: one more forward of every
  layer); selective recomputation adds what it recomputes (`recomputed_flops`);
- activation bytes per layer: `plan/activations.py` (Korthikanti et al. 2022, Table 2, and the
  Llama layer as pipedsl runs it).

Mixture-of-Experts decoders (`experts` > 0, HF layout: Mixtral, Qwen3-MoE, DeepSeek-V3; docs/planner.md
"Mixture-of-Experts"): each MoE layer replaces the MLP with E experts of width f_e (k of them per
token, `top_k`), S shared experts of width f_s every token goes through (DeepSeek-style) and a
router (E × h, no bias); the first `dense_layers` layers keep the dense MLP (DeepSeek-V3's
`first_k_dense_replace`).  With m = 3 for a SwiGLU expert (2 without a gate):

    MoE layer, total    P_attn + E·m·h·f_e + S·m·h·f_s + E·h + 2h
    MoE layer, active   P_attn + k·m·h·f_e + S·m·h·f_s + E·h + 2h   (what one token uses)
    P_attn              h·(q + 2·kv) + q·h (+ 2·head_dim for Qwen3's q/k norms), q = heads·head_dim;
                        DeepSeek's multi-head latent attention: `MLA`'s docstring

Model states count the total (every expert is held; `ep` shards them, `plan/cost.py`); FLOPs
count the active: per token and layer, forward 2·(active matmul weights) + 4·s·q for the scores
and the attention over V, i.e. 6·N_active + 12·l·s·q per token and iteration (forward and
backward), N_active the active matmul weights (embedding lookups and norms excluded, the
output layer included) — the dense model's count with N_active for N.

Encoder-decoders (T5 v1.1, mT5; `EncDecSpec`): two stacks of different cost.

An encoder of Le layers runs over the source (S tokens); a decoder of Ld layers over the target
(T tokens), each layer with causal self-attention *and* cross-attention to the encoder output
(queries from the T target tokens, keys and values from the S encoder outputs).  The layout is
Hugging Face's `MT5ForConditionalGeneration` / T5 v1.1, as `models/hf/seq2seq.py` cuts it:
d = d_model, a heads of width d_kv, n = a·d_kv (the attention's inner width, 384 ≠ 512 for
mT5-Small), f = d_ff, V the vocabulary, B = 32 relative-position buckets, no biases, RMS norms
(weight only), a gated-GELU FFN (wi_0, wi_1: d×f, wo: f×d), one token embedding shared by both
stacks, an untied output layer (mT5; `tied_head=True`: T5 v1.0), relative position bias tables
(B×a) in the first layer of each stack.

Parameters:

    encoder layer   4·d·n + 3·d·f + 2·d            (q, k, v, o; wi_0, wi_1, wo; 2 norms)
    decoder layer   8·d·n + 3·d·f + 3·d            (self q, k, v, o; cross q, k, v, o; FFN; 3 norms)
    first layer     + B·a                           (its stack's relative position bias, each stack)
    embedding       V·d                             (shared by the encoder's and the decoder's input)
    head            V·d + d                         (lm_head, untied; the decoder's final norm)
    encoder's final norm  d
    total           V·d·(1 + untied) + Le·(4dn + 3df + 2d) + Ld·(8dn + 3df + 3d) + 2d + 2·B·a

mT5-Base (d 768, n 768, f 2048, 12/12 layers, V 250,112): 582.4M; tests/plan/test_encoder_decoder.py
checks all five sizes against transformers' own modules built on the meta device.

Forward FLOPs per sample, 2 per multiply-accumulate, every matmul counted (the attention's score
and value products included, the causal mask not exploited, as eager attention computes them):

    encoder layer   2·S·(4·d·n + 3·d·f) + 4·S²·n
    decoder layer   2·T·(6·d·n + 3·d·f) + 4·S·d·n + 4·T²·n + 4·T·S·n
                    (self q, k, v, o and cross q, o over T tokens; cross k, v over the S encoder
                    outputs; self scores and values T×T, cross scores and values T×S)
    head            2·T·d·V
    embeddings, norms, softmax: no matmul (timed by the bytes they move, `plan/cost.py`)

Training = forward + 2× forward (backward); full recomputation adds one more forward of each layer.
At T = S a decoder layer costs more than an encoder layer (cross-attention: 8·S·d·n + 4·S²·n
more); at T5's span-corruption lengths (S 512, T 114) it costs less, and the head over a 250k
vocabulary costs more than either — why each stage is priced by its own units.

Activation bytes per sample kept for the backward (v bytes a value, 2 in bf16; HF's eager
attention and NewGELU, dropout 0 as in T5 v1.1/mT5 pre-training; counted from what autograd
saves, every tensor once — tests/plan/test_encoder_decoder.py counts them on transformers' own
`MT5Block` with saved-tensor hooks, to the byte):

    RMS norm, per token       (4 + 3v)·d + 4   its fp32 copy (4d), rsqrt (4), its input, the
                                               normalised value and its output (v·d each)
    encoder layer             S·[2·norm + 4v·n + 7v·f] + v·a·S²
                              (q, k, v, the attention output; the softmax; the gated GELU:
                              wi_0 out, tanh, x/2, 1 + tanh, GELU out, wi_1 out, product)
    decoder layer             T·[3·norm + 6v·n + 7v·f] + 2v·n·S + v·a·(T² + T·S)
                              (self q, k, v, out; cross q, out over T; cross k, v over S)
    encoder output            v·d·S, once per stage holding decoder layers (every cross-attention's
                              k and v linears keep the same tensor)
    encoder input unit        8·S (the token ids, int64, for the embedding's backward)
    decoder input unit        8·T + S·[(4 + 2v)·d + 4] (ids; the encoder's final norm, whose
                              output is the encoder output above)
    head                      T·norm + 4·T·V (the final norm; fp32 log-probabilities of the loss)
    full recomputation        a layer keeps its input: v·d·S (encoder), v·d·T (decoder)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol

from pipedsl.errors import PipeDSLError
from pipedsl.limits import MAX_PLAN_SIZE, shorten
from pipedsl.plan.activations import LAYOUTS, RECOMPUTE_MODES, layer_activation_bytes, layer_w_held_bytes

BYTES_FP16 = 2
BYTES_BF16 = 2
FP32 = 4
ID_BYTES = 8  # int64 token ids, kept by an embedding for its backward
ENCDEC_RECOMPUTE = ("none", "full")  # what the runtime recomputes in an encoder-decoder: whole layers or none


class PlannedModel(Protocol):
    """A model as the planner reads it, whatever its kind (`ModelSpec`: decoders, dense and MoE; `EncDecSpec`:
    encoder-decoders): one search (`plan/search.py`), one printer (`plan/report.py`) and one CLI take either through
    these names; what differs between the kinds is data here (`kind`, `space`, `comm_kinds`), not a type test."""

    name: str
    global_batch: int  # samples per iteration
    kind: ClassVar[str]  # "decoder" or "encoder-decoder": how its stages are costed (search) and printed (report)
    space: ClassVar[dict[str, Any]]  # `search.layouts`' defaults for the options not given
    comm_kinds: ClassVar[tuple[str, ...]]  # the communication an estimate reports, per iteration on rank 0

    @property
    def layers(self) -> int: ...

    @property
    def moe(self) -> bool: ...

    @property
    def experts(self) -> int: ...

    @property
    def params(self) -> int: ...

    def with_batch(self, global_batch: int) -> PlannedModel: ...

    def describe(self) -> str: ...

    def iteration_flops(self, recompute: str = "none", fused: bool = False) -> float: ...


@dataclass(frozen=True)
class MLA:
    """DeepSeek's multi-head latent attention (DeepSeek-V2/V3): Q through a rank-`q_lora` bottleneck, K and V
    from a shared rank-`kv_lora` latent plus one rotary key of `rope_dim` shared by the heads; a head's
    query/key is `nope_dim + rope_dim` wide, its value `v_dim`.  Weights:
    h·r_q + r_q·a·(d_n + d_r) + h·(r_kv + d_r) + r_kv·a·(d_n + d_v) + a·d_v·h, and two norms r_q + r_kv."""

    q_lora: int
    kv_lora: int
    nope_dim: int
    rope_dim: int
    v_dim: int


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer and its global batch (samples per iteration)."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    global_batch: int
    ffn: int = 0  # 0: 4·hidden
    gated: bool = False  # SwiGLU MLP: three ffn×hidden matrices instead of two
    kv_heads: int = 0  # 0: = heads (no grouped-query attention)
    layout: str = "gpt"  # "gpt" (built-in/Megatron GPT) or "hf" (a Hugging Face decoder in the Llama layout)
    head_dim: int = 0  # 0: hidden / heads (Qwen3: 128 with hidden 2048 and 32 heads)
    qk_norm: bool = False  # RMSNorm over each head's Q and K (Qwen3): 2·head_dim parameters a layer
    # Mixture-of-Experts (0 experts: dense)
    experts: int = 0  # E routed experts in each MoE layer
    top_k: int = 0  # k experts per token
    expert_ffn: int = 0  # f_e, one expert's MLP width
    shared_experts: int = 0  # S experts every token goes through (DeepSeek)
    shared_ffn: int = 0  # f_s, one shared expert's width (0: f_e)
    dense_layers: int = 0  # the first layers keep the dense MLP of width `ffn` (DeepSeek-V3: 3)
    mla: MLA | None = None  # multi-head latent attention instead of Q/K/V projections (DeepSeek-V3)
    kind: ClassVar[str] = "decoder"
    # every option the runtime runs a decoder with (tp: every divisor of the GPUs up to a node; attention: the
    # cluster's kernel; schedules: every built-in but the searched ones, which need the stage costs to compile)
    space: ClassVar[dict[str, Any]] = {"recompute": RECOMPUTE_MODES, "tp_modes": ("1d", "3d"),
                                       "sequence_parallel": (False, True), "splits": ("even", "balanced")}
    # what the planner reports a layout's rank 0 communicates: tensor and expert parallelism besides the pipeline's
    comm_kinds: ClassVar[tuple[str, ...]] = ("tp", "pp", "dp", "zero3", "ep")

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise PipeDSLError(f"model {self.name}: layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        for field_name in ("layers", "hidden", "heads", "seq", "vocab", "global_batch"):
            if getattr(self, field_name) < 1:
                raise PipeDSLError(f"model {self.name}: {field_name} must be at least 1")
        for field_name in ("layers", "hidden", "heads", "seq", "vocab", "global_batch", "ffn", "kv_heads", "head_dim",
                           "experts", "top_k", "expert_ffn", "shared_experts", "shared_ffn", "dense_layers"):
            if getattr(self, field_name) < 0:
                raise PipeDSLError(f"model {self.name}: {field_name} must not be negative")
            if getattr(self, field_name) > MAX_PLAN_SIZE:
                raise PipeDSLError(f"model {self.name}: {field_name}={shorten(getattr(self, field_name))} is over "
                                   f"the limit of {MAX_PLAN_SIZE:,} (MAX_PLAN_SIZE)")
        if self.hidden % self.heads and not self.head_dim:
            raise PipeDSLError(f"model {self.name}: hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.experts:
            if not self.hf:
                raise PipeDSLError(f"model {self.name}: Mixture-of-Experts models are described in the hf layout")
            if not 1 <= self.top_k <= self.experts:
                raise PipeDSLError(f"model {self.name}: top_k must be in 1..experts ({self.experts}), got {self.top_k}")
            if not self.expert_ffn:
                raise PipeDSLError(f"model {self.name}: an MoE model needs expert_ffn")
            if self.dense_layers >= self.layers:
                raise PipeDSLError(f"model {self.name}: dense_layers {self.dense_layers} leaves no MoE layer of "
                                   f"{self.layers}")
        elif self.top_k or self.expert_ffn or self.shared_experts or self.dense_layers:
            raise PipeDSLError(f"model {self.name}: top_k, expert_ffn, shared_experts and dense_layers need experts")

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_size(self) -> int:
        """Width of Q (and of the attention output): hidden unless `head_dim` says otherwise."""
        return self.heads * self.head_size

    @property
    def kv_size(self) -> int:
        """Width of K (and of V): hidden for multi-head attention, less with grouped queries."""
        return (self.kv_heads or self.heads) * self.head_size

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.moe else 0

    def is_moe_layer(self, index: int) -> bool:
        """Whether block `index` (0-based) is an MoE layer: all but the first `dense_layers`."""
        return self.moe and index >= self.dense_layers

    def moe_layers_in(self, first: int, count: int) -> int:
        """MoE layers among blocks first … first + count − 1 (every block from `dense_layers` on is one)."""
        return max(0, first + count - max(first, self.dense_layers)) if self.moe else 0

    # ------------------------------------------------------------ parameters

    @property
    def hf(self) -> bool:
        return self.layout == "hf"

    @property
    def attention_matmul_params(self) -> int:
        """QKV and output projections' weights: h·(q + 2·kv) + q·h (MLA: its docstring's)."""
        h, q, kv = self.hidden, self.q_size, self.kv_size
        if self.mla:
            m, a = self.mla, self.heads
            return (h * m.q_lora + m.q_lora * a * (m.nope_dim + m.rope_dim) + h * (m.kv_lora + m.rope_dim)
                    + m.kv_lora * a * (m.nope_dim + m.v_dim) + a * m.v_dim * h)
        return h * (q + 2 * kv) + q * h

    @property
    def attention_width(self) -> int:
        """Σ over heads of the query/key and value widths, halved: the 4·s²·(this) of the scores and the attention
        over V (q for ordinary attention; MLA: a·(d_n + d_r + d_v)/2)."""
        if self.mla:
            return self.heads * (self.mla.nope_dim + self.mla.rope_dim + self.mla.v_dim) // 2
        return self.q_size

    @property
    def layer_params(self) -> int:
        """One dense block: QKV + output projection, the MLP, two norms (GPT: LayerNorms and biases; HF: RMSNorms)."""
        h, f, kv = self.hidden, self.ffn_size, self.kv_size
        mlp = (3 if self.gated else 2) * h * f
        if self.hf:
            norms = 2 * h + (2 * self.head_size if self.qk_norm else 0)
            if self.mla:  # the latent norms
                norms += self.mla.q_lora + self.mla.kv_lora
            return self.attention_matmul_params + mlp + norms
        attention = h * (h + 2 * kv) + (h + 2 * kv) + h * h + h
        return attention + mlp + f + h + 4 * h

    @property
    def expert_params(self) -> int:
        """One routed expert: m·h·f_e (m = 3 for SwiGLU)."""
        return (3 if self.gated else 2) * self.hidden * self.expert_ffn

    @property
    def shared_expert_params(self) -> int:
        """One shared expert: m·h·f_s."""
        return (3 if self.gated else 2) * self.hidden * (self.shared_ffn or self.expert_ffn)

    @property
    def router_params(self) -> int:
        return self.experts * self.hidden

    @property
    def moe_layer_expert_params(self) -> int:
        """The routed experts of one MoE layer, E·m·h·f_e: what expert parallelism shards."""
        return self.experts * self.expert_params

    @property
    def moe_mlp_params(self) -> int:
        """One MoE block's MLP part — routed and shared experts and the router: what tensor parallelism keeps whole
        on each tp rank (each runs it on its share of the tokens, parallel/moe_tp.py)."""
        return self.moe_layer_expert_params + self.shared_experts * self.shared_expert_params + self.router_params

    def moe_block_params_per_gpu(self, tp: int, ep: int) -> float:
        """One MoE block's parameters on one GPU: the attention and norms over tp (but `tp_whole_params`), the MLP
        part whole but the routed experts over ep."""
        whole = self.tp_whole_params
        return (self.moe_layer_params - self.moe_mlp_params - whole) / tp + whole + self.moe_mlp_params_per_gpu(ep)

    def moe_mlp_params_per_gpu(self, ep: int) -> float:
        """One MoE block's MLP part on one GPU, whole on every tp rank but the routed experts over ep: the
        parameters whose gradient each tp rank holds its tokens' part of (summed over tp once a step)."""
        routed = self.moe_layer_expert_params
        return self.moe_mlp_params - routed + routed / ep

    def layer_params_per_gpu(self, tp: int) -> float:
        """One dense block's parameters on one GPU: over tp, but `tp_whole_params`."""
        whole = self.tp_whole_params
        return (self.layer_params - whole) / tp + whole

    @property
    def tp_whole_weights(self) -> int:
        """The matrices tensor parallelism keeps whole on every rank: latent attention's down-projections,
        h·r_q + h·(r_kv + d_r) (parallel/tp_hf.py; with SP they also run on the whole sequence)."""
        return self.hidden * (self.mla.q_lora + self.mla.kv_lora + self.mla.rope_dim) if self.mla else 0

    @property
    def tp_whole_params(self) -> int:
        """A block's parameters tensor parallelism keeps whole on every rank beside the norms the planner prices
        over tp: `tp_whole_weights` and the latent norms after them, r_q + r_kv."""
        return self.tp_whole_weights + (self.mla.q_lora + self.mla.kv_lora if self.mla else 0)

    def tp_whole_flops(self, samples: int = 1) -> float:
        """Forward FLOPs of `tp_whole_weights`, which every tp rank multiplies whole: 2·s·(those weights)."""
        return samples * 2 * self.seq * self.tp_whole_weights

    @property
    def moe_layer_params(self) -> int:
        """One MoE block, total: P_attn + E·m·h·f_e + S·m·h·f_s + E·h + 2h (+ q/k norms)."""
        dense_mlp = (3 if self.gated else 2) * self.hidden * self.ffn_size
        return (self.layer_params - dense_mlp + self.moe_layer_expert_params
                + self.shared_experts * self.shared_expert_params + self.router_params)

    def block_params(self, moe: bool = False) -> int:
        return self.moe_layer_params if moe else self.layer_params

    @property
    def embedding_params(self) -> int:
        """Token (and, for the GPT, position) embeddings; the GPT's output layer shares the token table."""
        return (self.vocab + (0 if self.hf else self.seq)) * self.hidden

    @property
    def params(self) -> int:
        """All parameters (an MoE model: every expert, the total)."""
        head = self.vocab * self.hidden if self.hf else 0  # the HF Llama head is its own matrix
        blocks = (self.layers - self.moe_layers) * self.layer_params + self.moe_layers * self.moe_layer_params
        return blocks + self.embedding_params + head + (1 if self.hf else 2) * self.hidden

    @property
    def active_params(self) -> int:
        """Parameters one token uses: the total less the E − k routed experts it skips in each MoE layer."""
        return self.params - self.moe_layers * (self.experts - self.top_k) * self.expert_params

    @property
    def active_matmul_params(self) -> int:
        """N_active of the 6·N·tokens rule: the active weights that multiply (the HF layout's blocks and output
        layer; embedding lookups and norms excluded)."""
        h, m = self.hidden, 3 if self.gated else 2
        dense = self.attention_matmul_params + m * h * self.ffn_size
        moe = self.attention_matmul_params + (self.top_k * self.expert_params
                                              + self.shared_experts * self.shared_expert_params + self.router_params)
        return (self.layers - self.moe_layers) * dense + self.moe_layers * moe + self.vocab * h

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward, no recomputation): 6·N_active + 12·l·s·q, q the
        attention width; equals `iteration_flops()` / (global batch · s)."""
        return 6 * self.active_matmul_params + 12 * self.layers * self.seq * self.attention_width

    # ------------------------------------------------------------ FLOPs

    def layer_flops(self, samples: int = 1, moe: bool = False) -> float:
        """Forward FLOPs of one block on `samples` sequences: GEMMs 2·s·(weights) + attention 4·s²·q.  An MoE
        block (`moe`) multiplies its active weights: 2·s·(P_attn + k·m·h·f_e + S·m·h·f_s + E·h) + 4·s²·q."""
        s, h, f, q = self.seq, self.hidden, self.ffn_size, self.attention_width
        if moe:
            mlp = self.top_k * self.expert_params + self.shared_experts * self.shared_expert_params + self.router_params
        else:
            mlp = (3 if self.gated else 2) * h * f
        gemm = 2 * s * (self.attention_matmul_params + mlp)
        return samples * (gemm + 4 * s * s * q)

    def attention_core_flops(self, samples: int = 1) -> float:
        """Forward FLOPs of one block's QKᵀ and attention over V (2·b·s²·q each): what Megatron's selective
        recomputation recomputes."""
        return samples * 4 * self.seq * self.seq * self.attention_width

    def recomputed_flops(self, recompute: str, fused: bool = False, samples: int = 1, moe: bool = False) -> float:
        """Forward FLOPs one block recomputes in its backward: full, the whole block; selective, Megatron's
        attention core for the GPT (nothing with a fused kernel, which keeps no s² tensor), the whole
        attention module for an HF decoder (pipedsl's `recompute_filter`: the attention modules)."""
        if recompute == "full":
            return self.layer_flops(samples, moe)
        if recompute != "selective":
            return 0.0
        if not self.hf:
            return 0.0 if fused else self.attention_core_flops(samples)
        return samples * 2 * self.seq * self.attention_matmul_params + self.attention_core_flops(samples)

    def logit_flops(self, samples: int = 1) -> float:
        """Forward FLOPs of the output layer (h × V) on `samples` sequences."""
        return samples * 2 * self.seq * self.hidden * self.vocab

    def iteration_flops(self, recompute: bool | str = "none", fused: bool = False) -> float:
        """FLOPs of one iteration of the global batch: forward + 2× backward (+ what each block recomputes),
        as SC'21 counts them (`True`: full recomputation, `False`: none)."""
        mode = {True: "full", False: "none"}.get(recompute, recompute)  # type: ignore[call-overload]
        layer = 3 * self.layer_flops() + self.recomputed_flops(mode, fused)
        blocks = (self.layers - self.moe_layers) * layer
        if self.moe_layers:
            blocks += self.moe_layers * (3 * self.layer_flops(moe=True) + self.recomputed_flops(mode, fused, moe=True))
        return self.global_batch * (blocks + 3 * self.logit_flops())

    # ------------------------------------------------------------ activations

    def moe_mlp_bytes(self, value_bytes: int = BYTES_FP16) -> float:
        """Bytes per token an MoE layer's MLP keeps (in place of the dense 4·v·f): each of the token's k routed
        copies keeps its dispatched input and its expert output (2·v·h) and its expert's SwiGLU tensors
        (4·v·f_e); each shared expert 4·v·f_s; the router its fp32 probabilities (4·E)."""
        v, h = value_bytes, self.hidden
        return (self.top_k * (2 * v * h + 4 * v * self.expert_ffn)
                + self.shared_experts * 4 * v * (self.shared_ffn or self.expert_ffn) + 4 * self.experts)

    def layer_activation_bytes(self, samples: int, tp: int, recompute: bool | str = "none",
                               sequence_parallel: bool = False, fused: bool = False, moe: bool = False) -> float:
        """Bytes a block keeps for its backward per microbatch of `samples` on one GPU (`plan/activations.py`);
        an MoE block (`moe`) keeps `moe_mlp_bytes` per token for its MLP."""
        mode = {True: "full", False: "none"}.get(recompute, recompute)  # type: ignore[call-overload]
        return layer_activation_bytes(self.seq, samples, self.hidden, self.heads, tp,
                                      sequence_parallel, mode, fused, self.layout, self.ffn_size, self.kv_size,
                                      BYTES_FP16, mlp=self.moe_mlp_bytes() if moe else None)

    def layer_w_held_bytes(self, samples: int, tp: int, recompute: bool | str = "none",
                           sequence_parallel: bool = False, fused: bool = False, moe: bool = False) -> float:
        """Bytes a block's pending W holds from its I to its W, per microbatch of `samples` on one GPU
        (`plan/activations.py`)."""
        mode = {True: "full", False: "none"}.get(recompute, recompute)  # type: ignore[call-overload]
        return layer_w_held_bytes(self.seq, samples, self.hidden, self.heads, tp,
                                  sequence_parallel, mode, fused, self.layout, self.ffn_size, self.kv_size,
                                  BYTES_FP16, mlp=self.moe_mlp_bytes() if moe else None)

    def with_batch(self, global_batch: int) -> ModelSpec:
        return replace(self, global_batch=global_batch)

    def describe(self) -> str:
        return f"{self.layers} layers, h={self.hidden}, a={self.heads}, s={self.seq}, V={self.vocab}"


@dataclass(frozen=True)
class Unit:
    """One unit of `seq2seq_stages`' split: [encoder input, encoder layers…, decoder input, decoder layers…, head].

    Per sample: `flops` forward (of which `core`: attention scores and values), `stored` bytes kept for
    the backward without recomputation, `kept` with full recomputation (a layer keeps its input)."""

    kind: str  # "encoder input", "encoder layer", "decoder input", "decoder layer", "head"
    label: str  # "emb", "E0" … "E23", "dec-emb", "D0" …, "head"
    params: int
    flops: float
    core: float
    stored: float
    kept: float

    @property
    def layer(self) -> bool:
        return self.kind.endswith("layer")

    @property
    def decoder_layer(self) -> bool:
        return self.kind == "decoder layer"

    @property
    def embedding(self) -> bool:
        """Holds the shared token embedding (a weight tied between the stages that hold it)."""
        return self.kind in ("encoder input", "decoder input")


@dataclass(frozen=True)
class EncDecSpec:
    """An encoder-decoder transformer, its sequence lengths (`source` S, `target` T) and its global batch
    (samples, i.e. source-target pairs, per iteration)."""

    name: str
    encoder_layers: int
    decoder_layers: int
    d_model: int
    heads: int
    d_kv: int
    d_ff: int
    vocab: int
    source: int
    target: int
    global_batch: int
    tied_head: bool = False  # mT5 and T5 v1.1: an untied lm_head; T5 v1.0 ties it to the embedding
    buckets: int = 32  # relative position buckets (a B×a table in each stack's first layer)
    value_bytes: int = BYTES_BF16
    kind: ClassVar[str] = "encoder-decoder"
    # What the runtime runs for a Hugging Face encoder-decoder, where a decoder's space is wider: tp 1
    # (`parallel/tp_hf.py` splits Llama-layout decoders only), eager attention (T5's relative position bias is added
    # to the stored scores), recomputation none or full (per layer), every built-in schedule (the searched ones
    # too, `searched`), recomputation only among its defaults (`recompute_only`); its units are split by
    # `search(split=…)`.
    space: ClassVar[dict[str, Any]] = {"tp": (1,), "tp_modes": ("1d",), "sequence_parallel": (False,),
                                       "attention": ("eager",), "splits": ("even",), "recompute": ENCDEC_RECOMPUTE,
                                       "recompute_only": True, "searched": True}
    comm_kinds: ClassVar[tuple[str, ...]] = ("pp", "dp", "zero3")  # tp 1, no experts: the pipeline's and dp's only

    def __post_init__(self) -> None:
        for field_name in ("encoder_layers", "decoder_layers", "d_model", "heads", "d_kv", "d_ff", "vocab", "source",
                           "target", "global_batch", "buckets"):
            value = getattr(self, field_name)
            if not 1 <= value <= MAX_PLAN_SIZE:
                raise PipeDSLError(f"model {self.name}: {field_name}={shorten(value)} is not in 1..{MAX_PLAN_SIZE:,} "
                                   f"(MAX_PLAN_SIZE)")
        if self.value_bytes not in (2, 4):
            raise PipeDSLError(f"model {self.name}: value_bytes is 2 (bf16) or 4 (fp32), got {self.value_bytes}")

    @property
    def inner(self) -> int:
        """n = heads · d_kv: the width of q, k, v and the attention output."""
        return self.heads * self.d_kv

    @property
    def layers(self) -> int:
        return self.encoder_layers + self.decoder_layers

    @property
    def moe(self) -> bool:
        """No Mixture-of-Experts layers: the search's expert-parallel degree is 1."""
        return False

    @property
    def experts(self) -> int:
        return 0

    # ------------------------------------------------------------ parameters

    @property
    def encoder_layer_params(self) -> int:
        d, n, f = self.d_model, self.inner, self.d_ff
        return 4 * d * n + 3 * d * f + 2 * d

    @property
    def decoder_layer_params(self) -> int:
        d, n, f = self.d_model, self.inner, self.d_ff
        return 8 * d * n + 3 * d * f + 3 * d

    @property
    def position_bias_params(self) -> int:
        """One stack's relative position bias table (B × a), in its first layer."""
        return self.buckets * self.heads

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.d_model

    @property
    def head_params(self) -> int:
        """The decoder's final norm and, untied, the output layer."""
        return (0 if self.tied_head else self.vocab * self.d_model) + self.d_model

    @property
    def params(self) -> int:
        return (self.embedding_params + self.head_params + self.d_model
                + self.encoder_layers * self.encoder_layer_params + self.decoder_layers * self.decoder_layer_params
                + 2 * self.position_bias_params)

    # ------------------------------------------------------------ FLOPs (forward, per sample)

    def encoder_layer_flops(self, samples: float = 1) -> float:
        S, d, n, f = self.source, self.d_model, self.inner, self.d_ff
        return samples * (2 * S * (4 * d * n + 3 * d * f) + 4 * S * S * n)

    def decoder_layer_flops(self, samples: float = 1) -> float:
        S, T, d, n, f = self.source, self.target, self.d_model, self.inner, self.d_ff
        return samples * (2 * T * (6 * d * n + 3 * d * f) + 4 * S * d * n + 4 * T * T * n + 4 * T * S * n)

    def encoder_core_flops(self, samples: float = 1) -> float:
        """Of an encoder layer: QKᵀ and the product with V (2·S²·n each)."""
        return samples * 4 * self.source ** 2 * self.inner

    def decoder_core_flops(self, samples: float = 1) -> float:
        """Of a decoder layer: self-attention's scores and values (T×T) and cross-attention's (T×S)."""
        T, S = self.target, self.source
        return samples * 4 * T * (T + S) * self.inner

    def head_flops(self, samples: float = 1) -> float:
        return samples * 2 * self.target * self.d_model * self.vocab

    def forward_flops(self, samples: float = 1) -> float:
        """One forward of the whole model."""
        return (self.encoder_layers * self.encoder_layer_flops(samples)
                + self.decoder_layers * self.decoder_layer_flops(samples) + self.head_flops(samples))

    def iteration_flops(self, recompute: str = "none", fused: bool = False) -> float:
        """One iteration of the global batch: forward + backward (2× forward), and with full recomputation one
        more forward of every layer (`fused` as a decoder's takes it: encoder-decoders run eager attention)."""
        B = self.global_batch
        layers = self.encoder_layers * self.encoder_layer_flops(B) + self.decoder_layers * self.decoder_layer_flops(B)
        return 3 * self.forward_flops(B) + (layers if recompute == "full" else 0.0)

    # ------------------------------------------------------------ activations (bytes per sample)

    def norm_bytes(self, tokens: int) -> float:
        """An RMS norm (HF's T5LayerNorm, computed in fp32) on `tokens` tokens, its output included."""
        v, d = self.value_bytes, self.d_model
        return tokens * ((FP32 + 3 * v) * d + FP32)

    def encoder_layer_bytes(self, recompute: str = "none") -> float:
        S, v, n, f, a = self.source, self.value_bytes, self.inner, self.d_ff, self.heads
        if recompute == "full":
            return v * self.d_model * S
        return 2 * self.norm_bytes(S) + S * (4 * v * n + 7 * v * f) + v * a * S * S

    def decoder_layer_bytes(self, recompute: str = "none") -> float:
        """Without the encoder output its cross-attention reads (`encoder_output_bytes`, once per stage)."""
        S, T, v, n, f, a = self.source, self.target, self.value_bytes, self.inner, self.d_ff, self.heads
        if recompute == "full":
            return v * self.d_model * T
        return 3 * self.norm_bytes(T) + T * (6 * v * n + 7 * v * f) + 2 * v * n * S + v * a * T * (T + S)

    @property
    def encoder_output_bytes(self) -> float:
        """The encoder output [S, d] a stage holding decoder layers keeps (and relays)."""
        return self.value_bytes * self.d_model * self.source

    # ------------------------------------------------------------ the units seq2seq_stages spreads

    def units(self) -> tuple[Unit, ...]:
        """[encoder input, encoder layers…, decoder input, decoder layers…, head]: `seq2seq_stages`' units."""
        S, T, v, d, V = self.source, self.target, self.value_bytes, self.d_model, self.vocab
        bias = self.position_bias_params
        enc_f, dec_f = self.encoder_layer_flops(), self.decoder_layer_flops()
        enc_b, dec_b = self.encoder_layer_bytes(), self.decoder_layer_bytes()
        out = [Unit("encoder input", "emb", self.embedding_params, 0.0, 0.0, ID_BYTES * S, ID_BYTES * S)]
        out += [Unit("encoder layer", f"E{i}", self.encoder_layer_params + (bias if i == 0 else 0), enc_f,
                     self.encoder_core_flops(), enc_b, self.encoder_layer_bytes("full"))
                for i in range(self.encoder_layers)]
        dec_in = ID_BYTES * T + S * ((FP32 + 2 * v) * d + FP32)
        out.append(Unit("decoder input", "dec-emb", self.embedding_params + d, 0.0, 0.0, dec_in, dec_in))
        out += [Unit("decoder layer", f"D{i}", self.decoder_layer_params + (bias if i == 0 else 0), dec_f,
                     self.decoder_core_flops(), dec_b, self.decoder_layer_bytes("full"))
                for i in range(self.decoder_layers)]
        head = self.norm_bytes(T) + FP32 * T * V
        out.append(Unit("head", "head", self.head_params + (self.embedding_params if self.tied_head else 0),
                        self.head_flops(), 0.0, head, head))
        return tuple(out)

    def boundary_bytes(self, cut: int, b: int) -> float:
        """Bytes crossing the boundary before unit `cut`, per microbatch of `b` samples: inside the encoder part
        hidden [b, S, d], the mask [b, S] and the decoder ids [b, T] (int64); inside the decoder part hidden
        [b, T, d] + the encoder output [b, S, d] + the mask — every decoder stage relays the encoder output."""
        S, T, v, d = self.source, self.target, self.value_bytes, self.d_model
        in_decoder = cut > self.encoder_layers + 1  # after the decoder input unit
        ids = ID_BYTES * b * S + (0 if in_decoder else ID_BYTES * b * T)  # the mask [b, S]; the decoder ids [b, T]
        hidden = v * b * d * ((T + S) if in_decoder else S)
        return hidden + ids

    def with_lengths(self, source: int | None = None, target: int | None = None) -> EncDecSpec:
        return replace(self, source=source or self.source, target=target or self.target)

    def with_batch(self, global_batch: int) -> EncDecSpec:
        return replace(self, global_batch=global_batch)

    def describe(self) -> str:
        return (f"{self.encoder_layers}+{self.decoder_layers} layers, d={self.d_model}, a={self.heads}×{self.d_kv}, "
                f"f={self.d_ff}, V={self.vocab}, S={self.source}, T={self.target}")


def gpt(name: str, layers: int, hidden: int, heads: int, batch: int, seq: int = 2048,
        vocab: int = 51200) -> ModelSpec:
    return ModelSpec(name, layers, hidden, heads, seq, vocab, batch)


# Megatron-LM SC'21 Table 1 (seq 2048, vocabulary 51,200; batch as published) and GPT-3 175B.
MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    gpt("gpt-1.7b", 24, 2304, 24, 512),
    gpt("gpt-3.6b", 30, 3072, 32, 512),
    gpt("gpt-7.5b", 36, 4096, 32, 512),
    gpt("gpt-18b", 40, 6144, 48, 1024),
    gpt("gpt-39b", 48, 8192, 64, 1536),
    gpt("gpt-76b", 60, 10240, 80, 1792),
    gpt("gpt-145b", 80, 12288, 96, 2304),
    gpt("gpt-175b", 96, 12288, 96, 1536),
    gpt("gpt-310b", 96, 16384, 128, 2160),
    gpt("gpt-530b", 105, 20480, 128, 2520),
    gpt("gpt-1t", 128, 25600, 160, 3072),
    # Llama 3 (Meta, 2024, "The Llama 3 Herd of Models" Table 3): HF Llama layout (SwiGLU, grouped-query
    # attention, RMSNorm, RoPE, untied head), 128K vocabulary, sequence 8192; batch 4M tokens (405B: 16M).
    ModelSpec("llama-8b", 32, 4096, 32, 8192, 128256, 512, ffn=14336, gated=True, kv_heads=8, layout="hf"),
    ModelSpec("llama-70b", 80, 8192, 64, 8192, 128256, 512, ffn=28672, gated=True, kv_heads=8, layout="hf"),
    ModelSpec("llama-405b", 126, 16384, 128, 8192, 128256, 2048, ffn=53248, gated=True, kv_heads=8, layout="hf"),
    # Mixture-of-Experts (docs/planner.md "Mixture-of-Experts"; sequence 4096, batch 512 = 2M tokens):
    # Mixtral 8x7B (Jiang et al. 2024: 46.7B total, 12.9B active), every layer 8 experts top-2;
    ModelSpec("mixtral-8x7b", 32, 4096, 32, 4096, 32000, 512, ffn=14336, gated=True, kv_heads=8, layout="hf",
              experts=8, top_k=2, expert_ffn=14336),
    # Qwen3-30B-A3B (Qwen3 technical report, 2025: 30.5B total, 3.3B active), 128 experts top-8, q/k norms.
    ModelSpec("qwen3-30b-a3b", 48, 2048, 32, 4096, 151936, 512, ffn=6144, gated=True, kv_heads=4, layout="hf",
              head_dim=128, qk_norm=True, experts=128, top_k=8, expert_ffn=768),
    # DeepSeek-V3 (DeepSeek-AI 2024: 671B total, 37B active, the multi-token-prediction module's 14B apart):
    # multi-head latent attention, 3 dense layers then 256 experts top-8 and one shared expert; batch 15360
    # sequences of 4096 as its pre-training ran.
    ModelSpec("deepseek-v3", 61, 7168, 128, 4096, 129280, 15360, ffn=18432, gated=True, layout="hf",
              experts=256, top_k=8, expert_ffn=2048, shared_experts=1, dense_layers=3,
              mla=MLA(q_lora=1536, kv_lora=512, nope_dim=128, rope_dim=64, v_dim=128)),
)}


def model_preset(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise PipeDSLError(f"unknown model {name!r} (presets: {', '.join(MODELS)})") from None
