"""Transformer models as the planner sees them: sizes, parameters, FLOPs and activation bytes.

Formulas (GPT with a 4h MLP; `gated`/`kv_heads`/`ffn` generalise them to LLaMA):
- parameters: 12·l·h² + 13·l·h + (V + s)·h (Narayanan et al., SC'21, §5.1);
- FLOPs per iteration: 72·B·s·l·h²·(1 + s/6h + V/12lh) without recomputation and
  96·B·s·l·h²·(1 + s/6h + V/16lh) with it (SC'21 eq. 3: one more forward of every layer);
- activation bytes per layer and sample: s·h·(10 + 24/t + 5·a·s/(h·t)) with t-way tensor
  parallelism, s·h·(34 + 5as/h) at t = 1 (Korthikanti et al., "Reducing Activation
  Recomputation", 2022, eq. 2); with full recomputation only the layer input, 2·s·h.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipedsl.errors import PipeDSLError
from pipedsl.limits import MAX_PLAN_SIZE, shorten

BYTES_FP16 = 2


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

    def __post_init__(self) -> None:
        for field_name in ("layers", "hidden", "heads", "seq", "vocab", "global_batch"):
            if getattr(self, field_name) < 1:
                raise PipeDSLError(f"model {self.name}: {field_name} must be at least 1")
        for field_name in ("layers", "hidden", "heads", "seq", "vocab", "global_batch", "ffn", "kv_heads"):
            if getattr(self, field_name) > MAX_PLAN_SIZE:
                raise PipeDSLError(f"model {self.name}: {field_name}={shorten(getattr(self, field_name))} is over "
                                   f"the limit of {MAX_PLAN_SIZE:,} (MAX_PLAN_SIZE)")
        if self.hidden % self.heads:
            raise PipeDSLError(f"model {self.name}: hidden {self.hidden} is not divisible by heads {self.heads}")

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv_size(self) -> int:
        """Width of K (and of V): hidden for multi-head attention, less with grouped queries."""
        return self.hidden * (self.kv_heads or self.heads) // self.heads

    # ------------------------------------------------------------ parameters

    @property
    def layer_params(self) -> int:
        """One block: QKV + output projection, the MLP, two LayerNorms, biases."""
        h, f, kv = self.hidden, self.ffn_size, self.kv_size
        attention = h * (h + 2 * kv) + (h + 2 * kv) + h * h + h
        mlp = (3 if self.gated else 2) * h * f + f + h
        return attention + mlp + 4 * h

    @property
    def embedding_params(self) -> int:
        """Token and position embeddings (the output layer shares the token table, as in Megatron)."""
        return (self.vocab + self.seq) * self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params + 2 * self.hidden  # + final LayerNorm

    # ------------------------------------------------------------ FLOPs

    def layer_flops(self, samples: int = 1) -> float:
        """Forward FLOPs of one block on `samples` sequences: GEMMs 2·s·(weights) + attention 4·s²·h."""
        s, h, f, kv = self.seq, self.hidden, self.ffn_size, self.kv_size
        gemm = 2 * s * (h * (h + 2 * kv) + h * h + (3 if self.gated else 2) * h * f)
        return samples * (gemm + 4 * s * s * h)

    def logit_flops(self, samples: int = 1) -> float:
        """Forward FLOPs of the output layer (h × V) on `samples` sequences."""
        return samples * 2 * self.seq * self.hidden * self.vocab

    def iteration_flops(self, recompute: bool) -> float:
        """FLOPs of one iteration of the global batch: forward + 2× backward (+ 1 more forward of
        every block when recomputing), as SC'21 counts them."""
        layer_passes = 4 if recompute else 3
        return self.global_batch * (layer_passes * self.layers * self.layer_flops() + 3 * self.logit_flops())

    # ------------------------------------------------------------ activations

    def layer_activation_bytes(self, samples: int, tp: int, recompute: bool) -> float:
        """Bytes a block keeps for its backward, per microbatch of `samples` (Korthikanti et al.)."""
        s, h, a = self.seq, self.hidden, self.heads
        if recompute:
            return BYTES_FP16 * s * samples * h  # only the block's input
        return s * samples * h * (10 + 24 / tp + 5 * a * s / (h * tp))

    def with_batch(self, global_batch: int) -> ModelSpec:
        return replace(self, global_batch=global_batch)


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
    # LLaMA 3 (Meta, 2024): SwiGLU, grouped-query attention, 128K vocabulary; batch 4M tokens.
    ModelSpec("llama-8b", 32, 4096, 32, 8192, 128256, 512, ffn=14336, gated=True, kv_heads=8),
    ModelSpec("llama-70b", 80, 8192, 64, 8192, 128256, 512, ffn=28672, gated=True, kv_heads=8),
)}


def model_preset(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise PipeDSLError(f"unknown model {name!r} (presets: {', '.join(MODELS)})") from None
