"""The encoder-decoder presets: mT5's sizes as Google released them (the model, `EncDecSpec`, is `plan/model.py`'s)."""

from __future__ import annotations

from pipedsl.errors import PipeDSLError
from pipedsl.plan.model import EncDecSpec

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
