"""Transformer models as the planner sees them: sizes, parameters, FLOPs and activation bytes.

Two layouts, because the runtime runs two kinds of decoder (and their tensor parallelism differs):
- "gpt": Megatron's GPT, pipedsl's built-in GPT (`models/gpt/model.py`, `models/gpt/tp.py`): 4h GeLU
  MLP, LayerNorms, biases, learned positions, the output layer tied to the word embedding;
- "hf": a Hugging Face decoder in the Llama layout (`parallel/tp_hf.py`): SwiGLU MLP (`ffn`),
  grouped-query attention (`kv_heads`), RMSNorm, rotary positions, no biases, an untied head.

Formulas:
- parameters: 12·l·h² + 13·l·h + (V + s)·h for the GPT (Narayanan et al., SC'21, §5.1);
- FLOPs per iteration: 72·B·s·l·h²·(1 + s/6h + V/12lh) without recomputation and
  96·B·s·l·h²·(1 + s/6h + V/16lh) with full recomputation (SC'21 eq. 3: one more forward of every
  layer); selective recomputation adds what it recomputes (`recomputed_flops`);
- activation bytes per layer: `plan/activations.py` (Korthikanti et al. 2022, Table 2, and the
  Llama layer as pipedsl runs it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipedsl.errors import PipeDSLError
from pipedsl.limits import MAX_PLAN_SIZE, shorten
from pipedsl.plan.activations import LAYOUTS, layer_activation_bytes

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
    layout: str = "gpt"  # "gpt" (built-in/Megatron GPT) or "hf" (a Hugging Face decoder in the Llama layout)

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise PipeDSLError(f"model {self.name}: layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
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
    def hf(self) -> bool:
        return self.layout == "hf"

    @property
    def layer_params(self) -> int:
        """One block: QKV + output projection, the MLP, two norms (GPT: LayerNorms and biases; HF: RMSNorms)."""
        h, f, kv = self.hidden, self.ffn_size, self.kv_size
        mlp = (3 if self.gated else 2) * h * f
        if self.hf:
            return h * (h + 2 * kv) + h * h + mlp + 2 * h
        attention = h * (h + 2 * kv) + (h + 2 * kv) + h * h + h
        return attention + mlp + f + h + 4 * h

    @property
    def embedding_params(self) -> int:
        """Token (and, for the GPT, position) embeddings; the GPT's output layer shares the token table."""
        return (self.vocab + (0 if self.hf else self.seq)) * self.hidden

    @property
    def params(self) -> int:
        head = self.vocab * self.hidden if self.hf else 0  # the HF Llama head is its own matrix
        return self.layers * self.layer_params + self.embedding_params + head + (1 if self.hf else 2) * self.hidden

    # ------------------------------------------------------------ FLOPs

    def layer_flops(self, samples: int = 1) -> float:
        """Forward FLOPs of one block on `samples` sequences: GEMMs 2·s·(weights) + attention 4·s²·h."""
        s, h, f, kv = self.seq, self.hidden, self.ffn_size, self.kv_size
        gemm = 2 * s * (h * (h + 2 * kv) + h * h + (3 if self.gated else 2) * h * f)
        return samples * (gemm + 4 * s * s * h)

    def attention_core_flops(self, samples: int = 1) -> float:
        """Forward FLOPs of one block's QKᵀ and attention over V (2·b·s²·h each): what Megatron's selective
        recomputation recomputes."""
        return samples * 4 * self.seq * self.seq * self.hidden

    def recomputed_flops(self, recompute: str, fused: bool = False, samples: int = 1) -> float:
        """Forward FLOPs one block recomputes in its backward: full, the whole block; selective, Megatron's
        attention core for the GPT (nothing with a fused kernel, which keeps no s² tensor), the whole
        attention module for an HF decoder (pipedsl's `recompute_filter`: the attention modules)."""
        if recompute == "full":
            return self.layer_flops(samples)
        if recompute != "selective":
            return 0.0
        if not self.hf:
            return 0.0 if fused else self.attention_core_flops(samples)
        h, kv, s = self.hidden, self.kv_size, self.seq
        return samples * 2 * s * (h * (h + 2 * kv) + h * h) + self.attention_core_flops(samples)

    def logit_flops(self, samples: int = 1) -> float:
        """Forward FLOPs of the output layer (h × V) on `samples` sequences."""
        return samples * 2 * self.seq * self.hidden * self.vocab

    def iteration_flops(self, recompute: bool | str = "none", fused: bool = False) -> float:
        """FLOPs of one iteration of the global batch: forward + 2× backward (+ what each block recomputes),
        as SC'21 counts them (`True`: full recomputation, `False`: none)."""
        mode = {True: "full", False: "none"}.get(recompute, recompute)  # type: ignore[call-overload]
        layer = 3 * self.layer_flops() + self.recomputed_flops(mode, fused)
        return self.global_batch * (self.layers * layer + 3 * self.logit_flops())

    # ------------------------------------------------------------ activations

    def layer_activation_bytes(self, samples: int, tp: int, recompute: bool | str = "none",
                               sequence_parallel: bool = False, fused: bool = False) -> float:
        """Bytes a block keeps for its backward per microbatch of `samples` on one GPU (`plan/activations.py`)."""
        mode = {True: "full", False: "none"}.get(recompute, recompute)  # type: ignore[call-overload]
        return layer_activation_bytes(self.seq, samples, self.hidden, self.heads, tp, sequence_parallel, mode, fused,
                                      self.layout, self.ffn_size, self.kv_size, BYTES_FP16)

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
    # Llama 3 (Meta, 2024, "The Llama 3 Herd of Models" Table 3): HF Llama layout (SwiGLU, grouped-query
    # attention, RMSNorm, RoPE, untied head), 128K vocabulary, sequence 8192; batch 4M tokens (405B: 16M).
    ModelSpec("llama-8b", 32, 4096, 32, 8192, 128256, 512, ffn=14336, gated=True, kv_heads=8, layout="hf"),
    ModelSpec("llama-70b", 80, 8192, 64, 8192, 128256, 512, ffn=28672, gated=True, kv_heads=8, layout="hf"),
    ModelSpec("llama-405b", 126, 16384, 128, 8192, 128256, 2048, ffn=53248, gated=True, kv_heads=8, layout="hf"),
)}


def model_preset(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise PipeDSLError(f"unknown model {name!r} (presets: {', '.join(MODELS)})") from None
