"""Hugging Face causal decoders (stages.py) and encoder-decoders (seq2seq.py) as pipeline stages, what both
share (common.py: the loss, the architecture check against the model's own forward), their files (io.py), and
the config.json mistakes transformers accepts but cannot run (config_checks.py).

This package's own names are torch-free: the trainer's data reader (which runs without torch) reads
`TOKENIZER_FILES` to find a model directory's tokenizer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pipedsl.errors import PipeDSLError

# the files a tokenizer is read from (tokenizers' or sentencepiece's); an export copies these and io.py's companions
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt", "spiece.model", "sentencepiece.bpe.model")


CONFIG = "config.json"


class ModelDirError(PipeDSLError):
    """A model directory that cannot be used, or a checkpoint that cannot be exported."""

    kind = "model error"


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """A model directory's config.json as JSON, checked without transformers or torch (a wrong --model fails in a
    moment, before the heavy imports): the directory, the file, valid JSON with a `model_type`."""
    p = Path(path)
    if not os.path.isdir(p):
        raise ModelDirError(f"--model {path}: no such directory (a local Hugging Face model directory with {CONFIG})")
    cfg_file = p / CONFIG
    if not cfg_file.is_file():
        raise ModelDirError(f"--model {path}: no {CONFIG} in the directory")
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ModelDirError(f"{cfg_file}: not valid JSON: {err}") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ModelDirError(f"{cfg_file}: no 'model_type' (transformers cannot tell which model it is)")
    return raw
