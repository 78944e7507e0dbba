"""Hugging Face causal decoders (stages.py) and encoder-decoders (seq2seq.py) as pipeline stages, what both
share (common.py: the loss, the architecture check against the model's own forward), their files (io.py), and
the config.json mistakes transformers accepts but cannot run (config_checks.py).

This package's own names are torch-free: the trainer's data reader (which runs without torch) reads
`TOKENIZER_FILES` to find a model directory's tokenizer, and the launcher's configuration holds a `StageCut`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pipedsl.errors import PipeDSLError

# the files a tokenizer is read from (tokenizers' or sentencepiece's); an export copies these and io.py's companions
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "vocab.txt", "spiece.model", "sentencepiece.bpe.model")


CONFIG = "config.json"


@dataclass(frozen=True)
class StageCut:
    """How a Hugging Face model is cut into stages and what its stages take besides the tokens: decided once by
    the launcher (trainer/hf_setup.py) for every rank, and recorded in every checkpoint for `pipedsl export` as the
    plain dict of `keywords()` (`from_keywords` reads it back, from checkpoints of any version)."""

    by: str = "count"  # the rule spreading the units over the stages where no `points` are given
    points: tuple[int, ...] | None = None  # where stages 1 … S-1 begin, in units (embedding, layers…, head)
    attention_mask: bool | None = None  # stages take a padding mask (--packing pad); None: no such keyword
    position_ids: bool | None = None  # stages take position ids restarting per document (--doc-mask); None: as above

    def keywords(self) -> dict[str, Any]:
        """`causal_lm_stages`' (or, without the two flags, `seq2seq_stages`') keywords: `points` or `by`, and each
        flag that is set — the dict checkpoints have always recorded."""
        out: dict[str, Any] = {"points": list(self.points)} if self.points is not None else {"by": self.by}
        for name in ("attention_mask", "position_ids"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @classmethod
    def from_keywords(cls, keywords: dict[str, Any]) -> StageCut:
        """The cut a checkpoint recorded (`keywords()`'s dict); a key it does not know is refused, not dropped."""
        unknown = set(keywords) - {f.name for f in fields(cls)}
        if unknown:
            raise ModelDirError(f"the checkpoint's stage cut has keys this pipedsl does not know: {sorted(unknown)} "
                                f"(written by a newer version?)")
        points = keywords.get("points")
        return cls(by=keywords.get("by", "count"), points=None if points is None else tuple(points),
                   attention_mask=keywords.get("attention_mask"), position_ids=keywords.get("position_ids"))


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
