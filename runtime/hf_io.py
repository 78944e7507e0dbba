"""Hugging Face model directories in and out of pipedsl.

In: `inspect_model_dir(DIR)` reads and checks a local model directory *before any rank
starts* (the config transformers builds, weights present or not, positions, vocabulary);
`build_model(...)` then makes the model on each rank — fine-tuning from the directory's
safetensors weights when it has them, random initialisation from the config (seeded, the
same on every rank) when it has only `config.json`.  Nothing is downloaded
(`local_files_only=True`).

Out: `export_hf(CHECKPOINT, OUT)` turns a pipedsl checkpoint of any dp × pp layout and ZeRO
stage into a `save_pretrained` directory (safetensors, config, tokenizer) that
`AutoModelForCausalLM.from_pretrained(OUT)` loads.  The trainer stores what this needs in
each checkpoint's `extra["hf"]`: the model config, how the model was cut into stages, and the
tokenizer's files.  Names are mapped by identity, not by rules: the model is rebuilt on the
meta device from the saved config and cut the same way, so every stage tensor *is* one of the
HF model's tensors and takes its name (a tied head takes the embedding's).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipedsl.errors import PipeDSLError

CONFIG = "config.json"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json")
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ModelDirError(PipeDSLError):
    """A model directory that cannot be used, or a checkpoint that cannot be exported."""

    kind = "model error"


@dataclass(frozen=True)
class ModelDir:
    """A checked local model directory."""

    path: Path
    config: Any  # transformers.PretrainedConfig
    weights: bool  # safetensors weights present: fine-tune from them
    vocab_size: int
    max_positions: int | None  # the longest sequence its positions allow (None: no limit known)

    @property
    def kind(self) -> str:
        return str(getattr(self.config, "model_type", "?"))

    def describe(self) -> str:
        c = self.config
        layers = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", "?")
        hidden = getattr(c, "hidden_size", None) or getattr(c, "n_embd", "?")
        init = "weights from safetensors" if self.weights else "random init (no weights in the directory)"
        return f"{self.kind} from {self.path} ({layers} layers, hidden {hidden}, vocab {self.vocab_size}; {init})"


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ModelDirError("--model needs transformers: pip install 'pipedsl[hf]'") from None
    return transformers


def inspect_model_dir(path: str | os.PathLike) -> ModelDir:
    """The directory's config, checked; one `ModelDirError` line for anything wrong."""
    tf = _require_transformers()
    p = Path(path)
    if not os.path.isdir(p):
        raise ModelDirError(f"--model {path}: no such directory (a local Hugging Face model directory with "
                            f"{CONFIG})")
    cfg_file = p / CONFIG
    if not cfg_file.is_file():
        raise ModelDirError(f"--model {path}: no {CONFIG} in the directory")
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ModelDirError(f"{cfg_file}: not valid JSON: {err}") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ModelDirError(f"{cfg_file}: no 'model_type' (transformers cannot tell which model it is)")
    try:
        config = tf.AutoConfig.from_pretrained(str(p), local_files_only=True)
    except Exception as err:  # noqa: BLE001 - whatever transformers refuses, said in one line
        raise ModelDirError(f"{cfg_file}: transformers cannot build this config: {_one_line(err)}") from None
    if type(config) not in tf.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelDirError(f"{cfg_file}: model_type {raw['model_type']!r} has no causal language model in "
                            f"transformers {tf.__version__}")
    weights = any((p / w).is_file() for w in WEIGHTS)
    if not weights and any(p.glob("*.bin")):
        raise ModelDirError(f"--model {path}: weights only as pytorch_model*.bin; pipedsl loads safetensors "
                            f"(convert them with transformers' save_pretrained(safe_serialization=True))")
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return ModelDir(p, config, weights, int(config.vocab_size), int(positions) if positions else None)


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 300 else text[:297] + "..."


def build_model(model_dir: str | os.PathLike, *, seed: int = 0, attn: str = "sdpa") -> nn.Module:
    """The causal LM of a checked directory, in fp32 on the CPU: its weights, or a seeded random init."""
    tf = _require_transformers()
    path = str(model_dir)
    kwargs = {"attn_implementation": attn}
    if any(os.path.isfile(os.path.join(path, w)) for w in WEIGHTS):
        model = tf.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32, **kwargs)
    else:
        config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
    return model.float().train()


def tokenizer_files(model_dir: str | os.PathLike) -> dict[str, bytes]:
    """The directory's tokenizer (and generation config) files, to travel with checkpoints."""
    out = {}
    for name in TOKENIZER_FILES:
        f = Path(model_dir) / name
        if f.is_file():
            out[name] = f.read_bytes()
    return out


def export_metadata(model_dir: ModelDir, num_stages: int, split: dict[str, Any],
                    tokenizer: dict[str, bytes]) -> dict[str, Any]:
    """What `export_hf` needs, stored in every checkpoint (`extra["hf"]` of rank 0)."""
    return {"config": model_dir.config.to_dict(), "num_stages": num_stages, "split": dict(split),
            "tokenizer": dict(tokenizer), "source": str(model_dir.path)}


def export_hf(source: str | os.PathLike, out: str | os.PathLike, dtype: str = "fp32") -> tuple[Path, int]:
    """Write the model of checkpoint `source` (or the latest under it) as a Hugging Face directory `out`;
    returns (the directory, the checkpoint's step)."""
    from . import checkpoint
    from .hf import causal_lm_stages

    tf = _require_transformers()
    tf.utils.logging.disable_progress_bar()
    saved = checkpoint.read_model(source)
    meta = saved.extra.get("hf") if isinstance(saved.extra, dict) else None
    if meta is None:
        raise ModelDirError(f"{saved.info.path}: not a checkpoint of a Hugging Face model (written by "
                            f"`pipedsl train --model DIR`); nothing says which model its tensors belong to")
    config_dict = dict(meta["config"])
    config = tf.AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    stages = causal_lm_stages(model, meta["num_stages"], **meta["split"])
    hf_names: dict[int, list[str]] = {}  # a tied tensor has two names (embedding and head)
    for n, t in model.state_dict(keep_vars=True).items():
        hf_names.setdefault(id(t), []).append(n)
    state: dict[str, torch.Tensor] = {}
    for s, stage in enumerate(stages):
        tensors = saved.stages[s]
        for name, t in stage.state_dict(keep_vars=True).items():
            for hf_name in hf_names.get(id(t), []) if name in tensors else []:
                state.setdefault(hf_name, tensors[name].to(EXPORT_DTYPES[dtype]))
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise ModelDirError(f"{saved.info.path}: the checkpoint has no tensor for {missing[0]!r}")
    model.load_state_dict(state, assign=True, strict=True)
    model.config.dtype = EXPORT_DTYPES[dtype]
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    for name, data in meta.get("tokenizer", {}).items():
        (target / name).write_bytes(data)
    return target, saved.info.step

