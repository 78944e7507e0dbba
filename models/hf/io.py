"""Hugging Face model directories in and out of pipedsl.

In: `inspect_model_dir(DIR)` reads and checks a local model directory *before any rank
starts* (the config transformers builds, what it builds but cannot run — heads, rope type:
config_checks.py —, weights present or not, positions, vocabulary);
`LocalStages(...)` then makes on each rank only the stages it holds — from the directory's
safetensors weights when it has them, from a seeded random initialisation when it has only
`config.json` — and `build_model(...)` the whole model where that cannot be done exactly.
Nothing is downloaded (`local_files_only=True`).

Out: `export_hf(CHECKPOINT, OUT)` turns a pipedsl checkpoint of any dp × pp × tp layout and ZeRO
stage into a `save_pretrained` directory (safetensors, config, tokenizer) that
`AutoModelForCausalLM.from_pretrained(OUT)` (`AutoModelForSeq2SeqLM` for an encoder-decoder)
loads.  The trainer stores what this needs in each checkpoint's `extra["hf"]`: the model
config, how the model was cut into stages, and the tokenizer's files.  Names are mapped by
identity, not by rules: the model is rebuilt on the meta device from the saved config and cut
the same way, so every stage tensor *is* one of the HF model's tensors and takes its name (a
tied head takes the embedding's).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipedsl.errors import PipeRuntimeError, one_line
from pipedsl.models import hf
from pipedsl.models.hf import CONFIG, ModelDirError, StageCut, read_config_file
from pipedsl.models.hf.common import require_transformers
from pipedsl.models.hf.config_checks import check_config

WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
# what travels with a checkpoint to the export: every file a tokenizer is read from, and their companions
TOKENIZER_FILES = (*hf.TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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

    @property
    def seq2seq(self) -> bool:
        """An encoder-decoder (`seq2seq_stages`), not a causal decoder (`causal_lm_stages`)."""
        return _is_seq2seq(self.config)

    def describe(self) -> str:
        c = self.config
        layers = getattr(c, "num_hidden_layers", None) or getattr(c, "n_layer", "?")
        if self.seq2seq:
            layers = "+".join(str(n) for n in seq2seq_layers(c)) + " encoder+decoder"
        hidden = getattr(c, "hidden_size", None) or getattr(c, "n_embd", "?")
        init = "weights from safetensors" if self.weights else "random init (no weights in the directory)"
        return f"{self.kind} from {self.path} ({layers} layers, hidden {hidden}, vocab {self.vocab_size}; {init})"


def inspect_model_dir(path: str | os.PathLike) -> ModelDir:
    """The directory's config, checked; one `ModelDirError` line for anything wrong."""
    raw = read_config_file(path)
    tf = require_transformers()
    p = Path(path)
    cfg_file = p / CONFIG
    check_config(raw, cfg_file)  # heads, key/value heads, rope type: what transformers accepts but cannot run
    try:
        config = tf.AutoConfig.from_pretrained(str(p), local_files_only=True)
    except Exception as err:  # noqa: BLE001 - whatever transformers refuses, said in one line
        raise ModelDirError(f"{cfg_file}: transformers cannot build this config: {one_line(err)}") from None
    if type(config) not in tf.MODEL_FOR_CAUSAL_LM_MAPPING and not _is_seq2seq(config):
        raise ModelDirError(f"{cfg_file}: model_type {raw['model_type']!r} has neither a causal language model nor "
                            f"a sequence-to-sequence (encoder-decoder) one in transformers {tf.__version__}")
    weights = any((p / w).is_file() for w in WEIGHTS)
    if not weights and any(p.glob("*.bin")):
        raise ModelDirError(f"--model {path}: weights only as pytorch_model*.bin; pipedsl loads safetensors "
                            f"(convert them with transformers' save_pretrained(safe_serialization=True))")
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return ModelDir(p, config, weights, int(config.vocab_size), int(positions) if positions else None)


def _is_seq2seq(config: Any) -> bool:
    tf = require_transformers()
    seq2seq = tf.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING
    return bool(getattr(config, "is_encoder_decoder", False)) and type(config) in seq2seq


ENCODER_LAYERS = ("encoder_layers", "num_layers", "num_encoder_layers")  # BART's, T5's, ProphetNet's names
DECODER_LAYERS = ("decoder_layers", "num_decoder_layers")


def seq2seq_layers(config: Any) -> tuple[int, int]:
    """(encoder layers, decoder layers) of an encoder-decoder's config (BART's, T5's or ProphetNet's names), or a
    refusal naming the config when it says neither."""
    enc = next((n for n in (getattr(config, a, None) for a in ENCODER_LAYERS) if n is not None), None)
    dec = next((n for n in (getattr(config, a, None) for a in DECODER_LAYERS) if n is not None), enc)
    if not isinstance(enc, int) or not isinstance(dec, int):
        raise PipeRuntimeError(f"{type(config).__name__} names its encoder's layers by none of "
                               f"{', '.join(ENCODER_LAYERS)}: pipedsl cannot tell how many it has")
    return enc, dec


def auto_class(config: Any) -> Any:
    """transformers' Auto class for the model's language-model head: seq2seq for encoder-decoders, else causal."""
    tf = require_transformers()
    return tf.AutoModelForSeq2SeqLM if _is_seq2seq(config) else tf.AutoModelForCausalLM


def model_stages(model: nn.Module, num_stages: int, split: StageCut, **kwargs: Any) -> list[nn.Module]:
    """`model` cut into stages as its kind is cut: `seq2seq_stages` or `causal_lm_stages`, with `split`'s keywords."""
    if _is_seq2seq(model.config):
        from pipedsl.models.hf.seq2seq import seq2seq_stages

        return seq2seq_stages(model, num_stages, **split.keywords(), **kwargs)
    from pipedsl.models.hf.stages import causal_lm_stages

    return causal_lm_stages(model, num_stages, **split.keywords(), **kwargs)


def build_model(model_dir: str | os.PathLike, *, seed: int = 0, attn: str = "sdpa") -> nn.Module:
    """The language model (causal or seq2seq) of a checked directory, in fp32 on the CPU: its weights, or a seeded
    random init."""
    tf = require_transformers()
    path = str(model_dir)
    kwargs = {"attn_implementation": attn}
    config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    auto = auto_class(config)
    if any(os.path.isfile(os.path.join(path, w)) for w in WEIGHTS):
        model = auto.from_pretrained(path, local_files_only=True, dtype=torch.float32, **kwargs)
    else:
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=torch.float32, **kwargs)
    return model.float().train()


class LocalStages:
    """The model cut into stages with only the stages this rank holds made real: memory for a rank's share
    of the model, not the whole of it on every rank.

    The model is built on the meta device (shapes only) and cut; the held stages are then
    materialised on the CPU and filled module by module: from the directory's safetensors (only
    the tensors these stages own are read), and otherwise by the model's own `_init_weights`
    (transformers' per-module initialisation, which also computes the rotary and embedding-scale
    buffers) under a seed derived from the seed and the module's name, so a module starts from the
    same values whichever rank holds it and however the model is cut.  Every tensor is poisoned
    (NaN) before it is filled and checked after: an architecture whose initialisation leaves a
    tensor unfilled, or a weights file that lacks one, raises `NotLocal` and the caller builds the
    whole model instead (`build_model`).  Parameters shared inside the held stages stay one object;
    ties across stages are found on the meta model (`ties`) and passed to `Pipeline(ties=…)`.
    """

    class NotLocal(Exception):  # noqa: N818 - a reason to build the whole model instead, not an error
        pass

    def __init__(self, model_dir: str | os.PathLike, num_stages: int, split: StageCut, held: set[int], *,
                 seed: int = 0, attn: str = "sdpa") -> None:
        from pipedsl.runtime.ties import find_ties

        tf = require_transformers()
        config = tf.AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        with torch.device("meta"):
            model = auto_class(config).from_config(config, dtype=torch.float32, attn_implementation=attn)
        self.model = model
        self.stages = model_stages(model, num_stages, split, check=False)  # the launcher checked
        self.ties = find_ties(self.stages)
        self.held = set(held)
        prefixes = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        aliases: dict[int, list[str]] = {}  # a meta tensor -> every HF name it has (a tied head: two)
        for n, t in model.state_dict(keep_vars=True).items():
            aliases.setdefault(id(t), []).append(n)
        # a stage's own glue modules may hold a tensor of a model module they do not include (T5's shared position
        # bias around the first layer's Parameter): that module ("home") is made real too, and lends its tensor
        homes = {id(t): (m, attr) for m in model.modules()
                 for attr, t in [*m._parameters.items(), *m._buffers.items()] if t is not None}
        glue = [m for s in sorted(self.held) for m in self.stages[s].modules() if id(m) not in prefixes]
        borrowed = [(m, kind, attr, *homes[id(t)]) for m in glue
                    for kind, table in (("param", m._parameters), ("buffer", m._buffers))
                    for attr, t in table.items() if t is not None and id(t) in homes]
        modules = list({id(m): m for s in sorted(self.held) for m in self.stages[s].modules()
                        if id(m) in prefixes}.values())
        modules += list({id(home): home for _, _, _, home, _ in borrowed if home not in modules}.values())
        slots = [(m, kind, attr, prefixes[id(m)], aliases.get(id(t), [])) for m in modules
                 for kind, table in (("param", m._parameters), ("buffer", m._buffers))
                 for attr, t in table.items() if t is not None]
        if any(not t.is_floating_point() for m, kind, attr, *_ in slots
               for t in [(m._parameters if kind == "param" else m._buffers)[attr]]):
            raise self.NotLocal("a non-float buffer, which cannot be checked for being filled")
        _materialize(modules, slots)
        weights = _weights_reader(model_dir)
        for m, kind, attr, prefix, names in slots:
            t = (m._parameters if kind == "param" else m._buffers)[attr]
            name = f"{prefix}.{attr}" if prefix else attr
            if weights is not None:
                key = next((k for k in (name, *names) if k in weights.keys), None)
                if key is not None:
                    with torch.no_grad():
                        t.copy_(weights.get(key))
                    t._is_hf_initialized = True
                elif kind == "param":
                    raise self.NotLocal(f"{name} is not in the weights file under its own name")
        held_ids = {id(m) for m in modules}
        owners: dict[int, int] = {}
        for m in modules:
            for p in m._parameters.values():
                if p is not None:
                    owners[id(p)] = owners.get(id(p), 0) + 1
        for m, init in _post_order(model, model._init_weights):  # transformers' order: children, then the parent
            if id(m) not in held_ids:
                continue
            torch.manual_seed(_module_seed(seed, prefixes[id(m)]))
            init(m)
            for p in m._parameters.values():  # a weight two modules share (a tied head) is set by the first
                if p is not None and owners[id(p)] > 1:
                    p._is_hf_initialized = True
        for m, kind, attr, prefix, _ in slots:
            t = (m._parameters if kind == "param" else m._buffers)[attr]
            if torch.isnan(t).any():
                raise self.NotLocal(f"{prefix}.{attr} was left unfilled by {type(model).__name__}._init_weights")
        for m, kind, attr, home, home_attr in borrowed:  # the glue modules take their homes' real tensors
            table = home._parameters if kind == "param" else home._buffers
            (m._parameters if kind == "param" else m._buffers)[attr] = table[home_attr]

    def __call__(self, stage: int) -> nn.Module:
        if stage not in self.held:
            raise ModelDirError(f"stage {stage} is not one of the stages this rank was built with "
                                f"({sorted(self.held)})")
        return self.stages[stage]


def _materialize(modules: list[nn.Module], slots: list) -> None:
    """Real, NaN-filled CPU storage for every parameter and buffer of `modules`, keeping shared parameters one
    object (`to_empty` would give each module its own copy)."""
    first: dict[int, tuple[nn.Module, str]] = {}
    for m, kind, attr, *_ in slots:
        if kind == "param":
            first.setdefault(id(m._parameters[attr]), (m, attr))
    shared = {(id(m), attr): first[id(m._parameters[attr])] for m, kind, attr, *_ in slots if kind == "param"}
    for m in modules:
        m.to_empty(device="cpu", recurse=False)
    for m, kind, attr, *_ in slots:
        owner, owner_attr = shared.get((id(m), attr), (m, attr))
        if kind == "param" and (owner is not m or owner_attr != attr):
            m._parameters[attr] = owner._parameters[owner_attr]
    with torch.no_grad():
        for m, kind, attr, *_ in slots:
            (m._parameters if kind == "param" else m._buffers)[attr].fill_(float("nan"))


def _post_order(module: nn.Module, init: Any) -> list[tuple[nn.Module, Any]]:
    """(module, the `_init_weights` that initialises it) children first, as transformers' `smart_apply` runs
    them: a parent may re-initialise its children's weights (GPT-2 scales its residual projections)."""
    out = []
    for child in module.children():
        out += _post_order(child, getattr(child, "_init_weights", init) if hasattr(child, "config") else init)
    out.append((module, init))
    return out


def _module_seed(seed: int, name: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest(), "little") >> 1


class _Weights:
    """The tensors of a directory's safetensors files, read one at a time by name (each file opened once)."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files  # tensor name -> file
        self.keys = set(files)
        self._open: dict[Path, Any] = {}

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path].get_tensor(name).float()


def _weights_reader(model_dir: str | os.PathLike) -> _Weights | None:
    p = Path(model_dir)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        mapping = json.loads(index.read_text())["weight_map"]
        return _Weights({k: p / v for k, v in mapping.items()})
    single = p / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return _Weights(dict.fromkeys(f.keys(), single))
    return None


SAFETENSORS_FLOATS = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
MAX_HEADER = 100 * 2**20  # safetensors' own limit on a header


def safetensors_header(path: Path) -> dict[str, Any]:
    """The header of a safetensors file ({name: {"dtype", "shape", "data_offsets"}}), read without loading a
    tensor; a `ModelDirError` naming the file when it is unreadable or shorter than the tensors it describes."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= min(MAX_HEADER, size - 8):
                raise ModelDirError(f"{path}: not a safetensors file (no readable header; truncated?)")
            header = json.loads(f.read(n))
    except OSError as err:
        raise ModelDirError(f"{path}: cannot read: {err.strerror or err}") from None
    except (ValueError, UnicodeDecodeError):
        raise ModelDirError(f"{path}: not a safetensors file (its header is not JSON; truncated?)") from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"} if isinstance(header, dict) else None
    if tensors is None or not all(isinstance(v, dict) and {"dtype", "shape", "data_offsets"} <= set(v)
                                  for v in tensors.values()):
        raise ModelDirError(f"{path}: not a safetensors file (its header does not describe tensors)")
    need = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    if 8 + n + need > size:
        raise ModelDirError(f"{path}: truncated: its header describes {8 + n + need:,} bytes, the file has "
                            f"{size:,} (copy or download it again)")
    return tensors


def check_weights(model_dir: ModelDir, model: nn.Module) -> None:
    """Every safetensors file of the directory readable and whole, and each tensor the model has by that name of
    exactly its shape (no broadcast) and a float dtype: the model `model` (config.json's, on the meta device)
    would otherwise load them wrong or fail on a rank.  A `ModelDirError` naming the file and the tensor."""
    p = model_dir.path
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted({p / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ModelDirError(f"{index}: not a safetensors index (no weight_map)") from None
    else:
        files = [p / "model.safetensors"] if (p / "model.safetensors").is_file() else []
    shapes = {n: list(t.shape) for n, t in model.state_dict().items()}
    for f in files:
        if not f.is_file():
            raise ModelDirError(f"{index}: names {f.name}, which is not in {p}")
        for name, entry in safetensors_header(f).items():
            want = shapes.get(name)
            if want is None:
                continue
            if list(entry["shape"]) != want:
                raise ModelDirError(f"{f}: {name} is {entry['dtype']}{list(entry['shape'])}, the model of "
                                    f"{p / CONFIG} has {want}: weights of another configuration")
            if entry["dtype"] not in SAFETENSORS_FLOATS:
                raise ModelDirError(f"{f}: {name} is {entry['dtype']}, not a floating-point type")


def tokenizer_files(model_dir: str | os.PathLike) -> dict[str, bytes]:
    """The directory's tokenizer (and generation config) files, to travel with checkpoints."""
    out = {}
    for name in TOKENIZER_FILES:
        f = Path(model_dir) / name
        if f.is_file():
            out[name] = f.read_bytes()
    return out


@dataclass(frozen=True)
class ExportMetadata:
    """What `export_hf` needs, stored in every checkpoint (`extra["hf"]` of rank 0) as `to_dict()`'s plain values,
    which torch.load(weights_only=True) reads back: so the cut is its keywords (`StageCut.keywords`)."""

    config: dict[str, Any]  # the model's config.json, as a dict
    num_stages: int
    split: dict[str, Any]  # StageCut.keywords()
    tokenizer: dict[str, bytes]  # the tokenizer's files, by name
    source: str  # the model directory it was read from

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> ExportMetadata:
        """The metadata of a checkpoint (older ones may lack the tokenizer)."""
        return cls(dict(saved["config"]), int(saved["num_stages"]), dict(saved["split"]),
                   dict(saved.get("tokenizer", {})), str(saved.get("source", "")))


def export_metadata(model_dir: ModelDir, num_stages: int, split: StageCut,
                    tokenizer: dict[str, bytes]) -> ExportMetadata:
    """The export's metadata of a model directory cut into `num_stages` at `split`."""
    return ExportMetadata(model_dir.config.to_dict(), num_stages, split.keywords(), dict(tokenizer),
                          str(model_dir.path))


def export_hf(source: str | os.PathLike, out: str | os.PathLike, dtype: str = "fp32") -> tuple[Path, int]:
    """Write the model of checkpoint `source` (or the latest under it) as a Hugging Face directory `out`;
    returns (the directory, the checkpoint's step)."""
    from pipedsl.runtime import checkpoint

    tf = require_transformers()
    tf.utils.logging.disable_progress_bar()
    saved = checkpoint.read_model(source)
    saved_meta = saved.extra.get("hf") if isinstance(saved.extra, dict) else None
    if saved_meta is None:
        raise ModelDirError(f"{saved.info.path}: not a checkpoint of a Hugging Face model (written by "
                            f"`pipedsl train --model DIR`); nothing says which model its tensors belong to")
    meta = ExportMetadata.from_dict(saved_meta)
    config_dict = dict(meta.config)
    config = tf.AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
    with torch.device("meta"):
        model = auto_class(config).from_config(config, dtype=torch.float32)
    stages = model_stages(model, meta.num_stages, StageCut.from_keywords(meta.split), check=False)
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
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.partial-{os.getpid()}")  # beside it: the move is a rename
    try:
        model.save_pretrained(staging, safe_serialization=True)
        for name, content in meta.tokenizer.items():
            (staging / name).write_bytes(content)
        target.mkdir(exist_ok=True)
        for f in sorted(staging.iterdir()):
            os.replace(f, target / f.name)
    except Exception as err:  # noqa: BLE001 - safetensors' SafetensorError is no OSError: a full disk, a quota
        shutil.rmtree(staging, ignore_errors=True)
        cause = getattr(err, "strerror", None) or one_line(err)
        raise ModelDirError(f"cannot write the export to {target}: {cause} (nothing was written there)") from None
    shutil.rmtree(staging, ignore_errors=True)
    return target, saved.info.step

