"""Encoder-decoder transformers (T5 v1.1, mT5) as the planner sees them: two stacks of different cost.

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

from pipedsl.errors import PipeDSLError
from pipedsl.limits import MAX_PLAN_SIZE, shorten

BYTES_BF16 = 2
FP32 = 4
ID_BYTES = 8  # int64 token ids, kept by an embedding for its backward
ENCDEC_RECOMPUTE = ("none", "full")


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

    def iteration_flops(self, recompute: str = "none") -> float:
        """One iteration of the global batch: forward + backward (2× forward), and with full recomputation one
        more forward of every layer."""
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


# T5's span corruption (15 % noise, mean span 3) at 512 input tokens gives 114 target tokens (T5's
# `compute_input_and_target_lengths`); mT5 pre-trained on 1024 sequences a batch (of 1024 tokens, whose targets
# are 229: `--source-len 1024 --target-len 229`).
MT5_SOURCE, MT5_TARGET, MT5_BATCH = 512, 114, 1024


def mt5(name: str, layers: int, d_model: int, heads: int, d_ff: int) -> EncDecSpec:
    """An mT5 size as Google released it (HF configs google/mt5-*: d_kv 64, vocabulary 250,112, untied head)."""
    return EncDecSpec(name, layers, layers, d_model, heads, 64, d_ff, 250112, MT5_SOURCE, MT5_TARGET, MT5_BATCH)


ENCDEC_MODELS: dict[str, EncDecSpec] = {m.name: m for m in (
    mt5("mt5-small", 8, 512, 6, 1024),  # 300M
    mt5("mt5-base", 12, 768, 12, 2048),  # 582M
    mt5("mt5-large", 24, 1024, 16, 2816),  # 1.23B
    mt5("mt5-xl", 24, 2048, 32, 5120),  # 3.74B
    mt5("mt5-xxl", 24, 4096, 64, 10240),  # 12.9B
)}


def encdec_preset(name: str) -> EncDecSpec:
    try:
        return ENCDEC_MODELS[name]
    except KeyError:
        raise PipeDSLError(f"unknown encoder-decoder {name!r} (presets: {', '.join(ENCDEC_MODELS)})") from None
