"""Probe every Mixture-of-Experts causal LM that the installed transformers ships: does pipedsl's
Hugging Face splitting (`causal_lm_stages`) train it exactly like the unsplit model, or refuse it by name?

A model that is accepted and then trained wrong is the one bug never to ship: a refusal costs the user
a minute, a silently wrong loss or gradient costs them a training run and they may never learn why.
MoE decoders are where that risk concentrates — a router's auxiliary loss that the model's forward adds
between the layers, dense and sparse layers mixed, shared experts, grouped routing, hybrid attention —
and transformers adds new ones every release, so this probe finds them itself instead of listing them.

For each model type in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` whose default config declares routed experts
(> 1), plus the families whose config has an expert count that the default turns off (dense by default),
it builds a tiny random fp32 model from the config class's defaults (hidden 32, 2 layers — one more per
kind of layer the defaults mix, so no layer type hides —, 4 experts, top-2 (top-1 families stay top-1),
vocabulary 128, windows of 4 tokens in a sequence of 8, `output_router_logits=True`, every dropout and
jitter 0, eager attention; the rules go by field name, and `DEFAULT_GAPS` adds what two families' default
configs lack for transformers to build them at all) and compares, on the CPU:

- reference: `model(input_ids=ids, labels=ids)` (the model's own training loss, the router's auxiliary
  loss included where transformers adds it), backward: the loss and every parameter's gradient;
- pipedsl: `causal_lm_stages(model, 2)` (its own architecture check included), the stages run in
  sequence, `causal_lm_loss(…, shift_labels(ids))`, backward: the loss and every parameter's gradient,
  matched to the reference by identity (the stages hold the model's own modules).

Verdicts: "exact" (loss within 1e-4, every gradient within 1e-3, relative), "refused: <pipedsl's message>",
"ACCEPTED AND WRONG: …" (the bug), "accepted, stages fail: …" (loud, but a bug too), "skipped: …" and
"probe could not build a tiny model: …" (the probe's limit, not pipedsl's).  The last column counts the
experts modules `pipedsl.parallel.expert.is_experts` finds (0: `--ep` cannot shard the model).  The detail
says which layers the tiny model has, and when pipedsl's own check would run no MoE layer on the family's
default (full-size) config: its shallow copy keeps the first layers, which may all be dense.

    python benchmarks/moe_probe.py                     # every MoE type; ~15 s on 2 cores
    python benchmarks/moe_probe.py --only mixtral,jetmoe
    python benchmarks/moe_probe.py --self-test         # pipedsl's router loss broken on purpose: must be caught

Writes results/moe_probe.md and results/moe_probe.json; exit status 1 when any model is ACCEPTED AND WRONG.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
LOSS_TOLERANCE = 1e-4  # relative, on the loss
GRAD_TOLERANCE = 1e-3  # relative to the reference gradient's largest magnitude
BATCH, SEQ = 2, 8

# the config fields the probe shrinks, by the names the families use
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
HIDDEN = ("hidden_size", "d_model", "n_embd")
LAYER_COUNTS = ("num_hidden_layers", "n_layers", "n_layer", "num_layers")
TOP_K = ("num_experts_per_tok", "top_k", "moe_topk", "moe_k", "moe_top_k", "num_experts_per_token", "top_k_experts")
GROUPS = ("n_group", "topk_group", "num_expert_group")
POSITIONS = ("max_position_embeddings", "max_seq_len", "model_max_length", "n_positions")
# attention heads and their key/value heads, pair by pair
HEADS = ("num_attention_heads", "n_heads", "swa_num_attention_heads", "linear_num_value_heads", "indexer_n_heads",
         "n_head", "index_n_heads", "linear_num_heads")
KV_HEADS = ("num_key_value_heads", "kv_n_heads", "swa_num_key_value_heads", "linear_num_key_heads",
            "indexer_kv_heads")
LORA_RANKS = ("q_lora_rank", "kv_lora_rank", "o_lora_rank")
DERIVED = ("qk_head_dim",)  # computed from other fields: left to the config
WINDOWS = ("sliding_window", "sliding_window_size", "attention_chunk_size")  # < SEQ, so the window shows
NOISE = ("router_jitter_noise", "input_jitter_noise", "jitter_noise")
SWITCHES_ON = ("is_moe", "enable_moe_block")  # families whose MoE is a switch (Doge, Gemma 4)
SHARED_EXPERTS = ("n_shared_experts", "num_shared_experts")
# fields a default config leaves unset (None) that the model cannot be built without: the tiny value
WHEN_UNSET = {"moe_intermediate_size": 64, "head_dim": 8, "indexer_head_dim": 8, "indexer_budget": 4,
              "indexer_compress_ratio": 2}
# what a family's *default* config lacks for transformers to build it at all (real checkpoints' config.json
# set these): the probe adds them, so the verdict is about pipedsl, not about a default transformers never runs
DEFAULT_GAPS: dict[str, dict[str, Any]] = {
    # DbrxAttention reads attn_config.rope_theta, and clamps by clip_qkv even when it is None (DBRX's own: 8)
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # the model indexes layer_types; default None
}


@dataclasses.dataclass
class Probe:
    """One model type's row of the table."""

    model_type: str
    causal_lm: str
    verdict: str = ""
    experts_found: int | None = None
    detail: str = ""
    layers: str = ""  # the tiny model's layers: type/MoE or dense, one each
    seconds: float = 0.0
    note: str = ""
    check_sees_moe: bool | None = None  # whether pipedsl's own check, on the default config, runs an MoE layer

    @property
    def kind(self) -> str:
        """The verdict's category: exact, refused, WRONG, fails, skipped, no-build."""
        for prefix, kind in (("exact", "exact"), ("refused", "refused"), ("ACCEPTED AND WRONG", "WRONG"),
                             ("accepted, stages fail", "fails"), ("skipped", "skipped")):
            if self.verdict.startswith(prefix):
                return kind
        return "no-build"


def one_line(text: Any, limit: int = 240) -> str:
    """`text` (an exception or a message) as one line of at most `limit` characters."""
    s = " ".join(str(text).split()) or type(text).__name__
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _expert_count(config: Any) -> int | None:
    """The number of routed experts `config` declares, None when it declares none."""
    for name in EXPERT_COUNTS:
        value = _get(config, name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    ffn = getattr(config, "ffn_config", None)  # DBRX
    value = ffn.get("moe_num_experts") if isinstance(ffn, dict) else getattr(ffn, "moe_num_experts", None)
    return value if isinstance(value, int) else None


def _has_expert_field(config_class: type) -> bool:
    """Whether the config class has an expert-count field at all (whatever its default)."""
    names = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
    names |= set(getattr(config_class, "attribute_map", {}) or {})
    return bool(names & set(EXPERT_COUNTS))


def moe_types(only: set[str] | None) -> tuple[list[tuple[str, str, type, str]], list[Probe]]:
    """The MoE causal-LM types to probe, as (model type, CausalLM class name, config class to build, note), and
    the rows of the types skipped with a reason."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    todo: list[tuple[str, str, type, str]] = []
    skipped: list[Probe] = []
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if only is not None and model_type not in only:
            continue
        if isinstance(class_name, (tuple, list)):
            class_name = class_name[0]
        config_class = transformers.CONFIG_MAPPING[model_type]
        try:
            with _quiet():
                default = config_class()
        except Exception as err:  # noqa: BLE001 - a config class without usable defaults: look at its fields
            default = None
            why = one_line(err, 160)
        experts = _expert_count(default) if default is not None else None
        text = _get(default, "text_config")
        text_experts = _expert_count(text) if text is not None and not isinstance(text, dict) else None
        note = ""
        if experts is None or experts <= 1:
            if text_experts is not None and text_experts > 1:  # a multimodal config around an MoE text model
                model_class = getattr(transformers, class_name, None)
                text_class = getattr(model_class, "config_class", None)
                if text_class is None or text_class is config_class or text_class is not type(text):
                    skipped.append(Probe(model_type, class_name, "skipped: not a text-only causal LM"))
                    continue
                config_class, note = text_class, f"built from its text config ({text_class.__name__})"
            elif default is None:
                if _has_expert_field(config_class):
                    skipped.append(Probe(model_type, class_name,
                                         f"probe could not build a tiny model: its default config fails ({why})"))
                continue
            elif _has_expert_field(config_class):
                note = "the default config is dense; MoE turned on for the probe"
            else:
                continue
        todo.append((model_type, class_name, config_class, note))
    return todo, skipped


@contextlib.contextmanager
def _quiet() -> Any:
    """transformers' warnings and log lines about the odd configs the probe builds, silenced."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


# ---------------------------------------------------------------------------------------------------------------
# the tiny config


def _fields(config_class: type) -> list[str]:
    """The config class's own field names (transformers 5 declares configs as dataclasses)."""
    if dataclasses.is_dataclass(config_class):
        return [f.name for f in dataclasses.fields(config_class) if f.init]
    return list(config_class().to_dict())


def _get(config: Any, name: str) -> Any:
    """`config.name`, None when absent; a per-layer field that a heterogeneous config will not read globally
    (Dots3, Gemma 4 raise on it) gives its class default."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError, a RuntimeError
        field = {f.name: f for f in dataclasses.fields(type(config))}.get(name) if dataclasses.is_dataclass(
            config) else None
        if field is None:
            return None
        if field.default is not dataclasses.MISSING:
            return field.default
        return field.default_factory() if field.default_factory is not dataclasses.MISSING else None


def _is_index_list(value: list) -> bool:
    """A list of layer numbers (Llama 4's `moe_layers`, Qwen's `mlp_only_layers`), not one value per layer."""
    return all(isinstance(v, int) and not isinstance(v, bool) for v in value) and all(
        a < b for a, b in zip(value, value[1:]))


def _sparse_layers(default: Any, L: int, per_layer: dict[str, list]) -> list[bool]:
    """Which of the default config's L layers are MoE, by whichever rule the family uses."""
    sparse = [True] * L
    kinds = per_layer.get("mlp_layer_types")
    if kinds is not None:
        sparse = [str(k) not in ("dense", "mlp") for k in kinds]
    blocks = per_layer.get("layers_block_type")  # Nemotron-H: one kind of block per layer
    if blocks is not None:
        sparse = [str(k) == "moe" for k in blocks]
    for name in ("first_k_dense_replace", "num_dense_layers"):
        k = _get(default, name)
        if isinstance(k, int):
            sparse = [s and i >= k for i, s in enumerate(sparse)]
    only = _get(default, "mlp_only_layers")
    if isinstance(only, list):
        sparse = [s and i not in only for i, s in enumerate(sparse)]
    step = _get(default, "decoder_sparse_step")
    if isinstance(step, int) and step > 0:
        sparse = [s and (i + 1) % step == 0 for i, s in enumerate(sparse)]
    moe = _get(default, "moe_layers")
    if isinstance(moe, list):
        sparse = [s and i in moe for i, s in enumerate(sparse)]
    start, end = _get(default, "moe_layer_start_index"), _get(default, "moe_layer_end_index")
    if isinstance(start, int):
        every = _get(default, "moe_layer_interval") or 1
        end = end if isinstance(end, int) and end >= 0 else L - 1
        sparse = [s and start <= i <= end and (i - start) % every == 0 for i, s in enumerate(sparse)]
    period, offset = _get(default, "expert_layer_period"), _get(default, "expert_layer_offset")
    if isinstance(period, int) and isinstance(offset, int):
        sparse = [s and i % period == offset for i, s in enumerate(sparse)]
    return sparse


def _periodic(default: Any, L: int) -> dict[str, list[bool]]:
    """Per-layer flags of the `X_layer_period` / `X_layer_offset` pairs (Jamba's attention and expert layers)."""
    flags = {}
    for name in _fields(type(default)):
        if name.endswith("_layer_period"):
            stem = name[: -len("_period")]
            period, offset = _get(default, name), _get(default, stem + "_offset")
            if isinstance(period, int) and period > 0 and isinstance(offset, int):
                flags[stem] = [i % period == offset for i in range(L)]
    return flags


def _keep(features: list[tuple], sparse: list[bool]) -> list[int]:
    """The layers to keep: at least one MoE layer and one layer of every kind the defaults mix, at least 2."""
    L = len(sparse)
    wanted = {(j, f) for row in features for j, f in enumerate(row)}
    covered: set = set()
    keep: list[int] = []
    first_sparse = next((i for i, s in enumerate(sparse) if s), None)
    if first_sparse is not None:
        keep.append(first_sparse)
        covered |= set(enumerate(features[first_sparse]))
    while covered < wanted:
        best = max(range(L), key=lambda i: (len(set(enumerate(features[i])) - covered), -i))
        keep.append(best)
        covered |= set(enumerate(features[best]))
    for i in range(L):
        if len(keep) >= 2:
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)


def _period_for(flags: list[bool]) -> tuple[int, int] | None:
    """A (period, offset) whose rule `i % period == offset` gives `flags`, None when none does."""
    for period in range(1, len(flags) + 1):
        for offset in range(period):
            if [i % period == offset for i in range(len(flags))] == flags:
                return period, offset
    return None


def _shrink_scalar(name: str, value: Any, experts: int) -> Any:
    """The tiny value of one scalar config field, or `value` itself when the field is not one the probe shrinks."""
    if isinstance(value, bool):
        return True if name in SWITCHES_ON or name == "output_router_logits" else value
    if value is None:  # unset in the defaults: set where the model needs it (a dense-by-default family's experts)
        if name in EXPERT_COUNTS:
            return experts
        if name in TOP_K:
            return 2
        if name in SHARED_EXPERTS:  # Dots1 multiplies by it
            return 1
        if name in HEADS:
            return 4
        if name in KV_HEADS and name != "num_key_value_heads":  # that one means "= heads" when unset
            return 1  # Qwen4-Exp's indexer takes one
        return WHEN_UNSET.get(name)
    if isinstance(value, float):
        if "dropout" in name or name.endswith("pdrop") or name in NOISE:
            return 0.0
        return value
    if not isinstance(value, int):
        return value
    if name in HIDDEN:
        return 32
    if name.endswith("intermediate_size") or name.endswith("ffn_hidden_size") or name == "intermediate_size_mlp":
        return 64 if value > 0 else value
    if name == "router_hidden_size":
        return 16
    if name in EXPERT_COUNTS:
        return experts
    if name == "zero_expert_num":  # LongCat's identity experts
        return 2 if value > 0 else value
    if name in TOP_K:
        return min(value, 2) if value >= 1 else 2  # a top-1 family stays top-1 (Llama 4, ZAYA)
    if name in GROUPS:
        return 1
    if name in POSITIONS:
        return 64
    if name in HEADS:
        return 4
    if name in KV_HEADS:
        return min(value, 2)  # multi-head families (kv = heads) are set back to 4 by tiny_overrides
    if name in LORA_RANKS:
        return 16
    if name in WINDOWS:
        return 4 if value > 0 else value
    if name in DERIVED:
        return value
    if name.endswith("head_dim") or name in ("kv_channels", "d_head", "dim_head"):
        return 8
    if name in ("mamba_n_heads", "mamba_num_heads"):
        return 8
    if name in ("ssm_state_size", "mamba_d_state", "state_size"):
        return 8
    if name in ("mamba_dt_rank",):
        return 4
    if name in ("mamba_chunk_size", "chunk_size"):
        return 8
    if name in ("index_topk",):
        return 4
    if name.startswith("vocab_size"):  # Gemma 4's per-layer input table too (262,144 rows by default)
        return 128
    if name == "hidden_size_per_layer_input":
        return 8
    return value


def tiny_overrides(config_class: type) -> tuple[dict[str, Any], int]:
    """Keyword arguments that turn `config_class`'s defaults into a tiny MoE config, and its number of layers.

    Generic, by the fields' names (the tables above); the only family-specific lines are `DEFAULT_GAPS`."""
    with _quiet():
        default = config_class()
    experts = 4
    names = _fields(config_class)
    L = int(_get(default, "num_hidden_layers") or 0)
    per_layer = {n: list(_get(default, n)) for n in names
                 if isinstance(_get(default, n), list) and len(_get(default, n)) == L
                 and not _is_index_list(_get(default, n))}
    # layers_block_type is an alias on Nemotron-H: its field holds the per-layer kinds
    sparse = _sparse_layers(default, L, per_layer) if L else []
    periodic = _periodic(default, L) if L else {}
    over: dict[str, Any] = {}
    if L:
        features = [tuple(str(v[i]) for v in per_layer.values()) + tuple(f[i] for f in periodic.values())
                    + (sparse[i],) for i in range(L)]
        keep = _keep(features, sparse) if any(sparse) else [0, 1]
        n = len(keep)
        for name, values in per_layer.items():
            over[name] = [values[i] for i in keep]
            if "heads" in name:
                over[name] = [4 for _ in keep]
        kept_sparse = [sparse[i] for i in keep]
        for name in names:
            value = _get(default, name)
            if name in ("first_k_dense_replace", "num_dense_layers") and isinstance(value, int):
                over[name] = next((j for j, s in enumerate(kept_sparse) if s), n)
            elif name in ("mlp_only_layers", "moe_layers") and isinstance(value, list):
                over[name] = [j for j, i in enumerate(keep) if i in value]
            elif name == "decoder_sparse_step" and isinstance(value, int):
                over[name] = 1
                if "mlp_only_layers" in names:
                    over["mlp_only_layers"] = [j for j, s in enumerate(kept_sparse) if not s]
            elif name == "moe_layer_start_index" and isinstance(value, int):
                over[name] = next((j for j, s in enumerate(kept_sparse) if s), n)
            elif name == "moe_layer_end_index" and isinstance(value, int):
                over[name] = n - 1
            elif name == "moe_layer_interval" and isinstance(value, int):
                over[name] = 1
            elif isinstance(value, list) and _is_index_list(value) and value and max(value) >= n and L:
                over[name] = [j for j, i in enumerate(keep) if i in value]
        for stem, flags in periodic.items():
            rule = _period_for([flags[i] for i in keep])
            if rule is not None:
                over[stem + "_period"], over[stem + "_offset"] = rule
        for name in LAYER_COUNTS:
            if name in names:
                over[name] = n
    elif "num_layers" in names:  # LongCat: num_layers pairs of sub-layers
        over["num_layers"] = 1
    for name in names:
        if name in over:
            continue
        value = _get(default, name)
        if dataclasses.is_dataclass(value) and name.endswith("_config") and name != "text_config":  # DBRX's
            over[name] = {k: _shrink_scalar(k, _get(value, k), experts) for k in _fields(type(value))
                          if _shrink_scalar(k, _get(value, k), experts) != _get(value, k)}
        elif isinstance(value, dict) and name.endswith("_config") and name != "text_config":
            over[name] = {k: _shrink_scalar(k, v, experts) for k, v in value.items()}
        else:
            tiny = _shrink_scalar(name, value, experts)
            if tiny is not value and tiny != value:
                over[name] = tiny
    for heads, kv in zip(HEADS, KV_HEADS):  # multi-head attention stays multi-head (DeepSeek's MLA needs it)
        if kv in over and heads in over and _get(default, kv) is not None and _get(default, kv) == _get(default, heads):
            over[kv] = over[heads]
    vocab = over.get("vocab_size", _get(default, "vocab_size") or 128)
    for name in names:
        if name.endswith("token_id"):
            value = over.get(name, _get(default, name))
            if isinstance(value, int) and value >= vocab:
                over[name] = None
            elif isinstance(value, list):
                over[name] = [v for v in value if v < vocab] or None
    for name, value in DEFAULT_GAPS.get(getattr(config_class, "model_type", ""), {}).items():
        over[name] = {**over.get(name, {}), **value} if isinstance(value, dict) else value
    return over, int(over.get("num_hidden_layers", L) or 0)


def build(config_class: type, class_name: str) -> tuple[torch.nn.Module, int]:
    """A tiny random fp32 model of `class_name` from `config_class`'s shrunk defaults, and its number of layers
    as its config says."""
    import transformers

    over, layers = tiny_overrides(config_class)
    with _quiet():
        config = config_class(**over)
        if getattr(config, "output_router_logits", None) is not None:
            config.output_router_logits = True
        model_class = getattr(transformers, class_name)
        torch.manual_seed(0)
        model = model_class._from_config(config, dtype=torch.float32, attn_implementation="eager")
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    layers = int(getattr(model.config, "num_hidden_layers", layers) or layers)
    return model.train(), layers


def check_sees_moe(config_class: type, class_name: str) -> bool | None:
    """Whether `causal_lm_stages`' own architecture check, given the family's *default* (full-size) config, runs
    an MoE layer at all: its shallow copy keeps one layer per `layer_types` value or the first two, and every
    layer through the first MoE one (`first_moe_layer`).  Built on the meta device; None when it cannot be."""
    import transformers

    from pipedsl.models.hf.stages import first_moe_layer, shallow_config

    try:
        with _quiet(), torch.device("meta"):
            cls, config = getattr(transformers, class_name), config_class()
            through = first_moe_layer(cls._from_config(config, dtype=torch.float32))
            model = cls._from_config(shallow_config(config, through=through), dtype=torch.float32)
        return moe_layers(model) > 0
    except Exception:  # noqa: BLE001 - a default config transformers cannot build: unknown
        return None


def layer_summary(model: torch.nn.Module) -> str:
    """The tiny model's decoder layers, e.g. `full/dense, sliding/MoE`: what the verdict covers."""
    bodies = [b for b in (model.base_model, getattr(model, "model", None), getattr(model, "transformer", None)) if b]
    layers = next((getattr(b, n) for b in bodies for n in ("layers", "h", "blocks")
                   if isinstance(getattr(b, n, None), torch.nn.ModuleList)), None)
    if layers is None:
        return ""
    types = _get(model.config, "layer_types") or []
    out = []
    for i, layer in enumerate(layers):
        kind = str(types[i]).replace("_attention", "") + "/" if i < len(types) else ""
        out.append(kind + ("MoE" if moe_layers(layer) else "dense"))
    return ", ".join(out)


def moe_layers(model: torch.nn.Module) -> int:
    """How many modules of `model` hold routed experts: one named `experts` or of an *Experts class (not a shared
    expert), or an MoE block by its class name (Doge's CDMoE keeps its experts as embeddings)."""
    found = 0
    for name, m in model.named_modules():
        leaf, cls = name.rsplit(".", 1)[-1], type(m).__name__
        if "shared" in leaf:
            continue
        if leaf == "experts" or cls.endswith("Experts") or ("moe" in cls.lower() and "Sparse" in cls) or (
                cls.endswith(("MoE", "Moe")) and not any(c.endswith("Experts") for c in map(
                    lambda c: type(c).__name__, m.children()))):
            found += 1
    return found


# ---------------------------------------------------------------------------------------------------------------
# the verdict


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient (a clone, or None), by name; the gradients then cleared."""
    out = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def _worst_grad(ref: dict[str, torch.Tensor | None], got: dict[str, torch.Tensor | None]) -> tuple[float, str, str]:
    """(worst relative gradient difference, its parameter, how it differs) over every parameter; a gradient on
    one side only is a mismatch (inf)."""
    worst, where, how = 0.0, "", ""
    for name, want in ref.items():
        have = got.get(name)
        if want is None and have is None:
            continue
        if want is None or have is None:
            side = "the stages" if want is None else "the unsplit model"
            return float("inf"), name, f"a gradient only from {side}"
        scale = float(want.abs().max())
        diff = float((have - want).abs().max()) / max(scale, 1e-12)
        if not diff <= worst:  # NaN counts as worst
            worst, where, how = diff, name, f"{diff:.2e} relative (max |grad| {scale:.2e})"
    return worst, where, how


def verdict(model: torch.nn.Module) -> tuple[str, str]:
    """(verdict, detail) of pipedsl's split of `model` against the model's own training step."""
    from pipedsl.errors import PipeDSLError
    from pipedsl.models.hf.stages import causal_lm_loss, causal_lm_stages, shift_labels

    vocab = int(model.config.vocab_size)
    ids = torch.randint(vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    try:
        with _quiet():
            out = model(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
    except Exception as err:  # noqa: BLE001 - the model's own training step fails on the tiny config
        raise _NoBuildError(f"its own forward fails: {type(err).__name__}: {one_line(err, 160)}") from None
    want = float(out.loss.detach())
    aux = getattr(out, "aux_loss", None)
    ref = _grads(model)
    try:
        with _quiet():
            stages = causal_lm_stages(model, 2)
    except PipeDSLError as err:
        return f"refused: {one_line(err.message)}", ""
    torch.manual_seed(0)
    try:
        x: Any = ids
        for stage in stages:
            x = stage(*x) if isinstance(x, tuple) else stage(x)
        loss = causal_lm_loss(x, shift_labels(ids))
        loss.backward()
    except PipeDSLError as err:
        return f"refused: {one_line(err.message)}", "(while running, not by causal_lm_stages)"
    except Exception as err:  # noqa: BLE001 - accepted, then the stages fail: loud, but a bug
        return f"accepted, stages fail: {type(err).__name__}: {one_line(err, 200)}", ""
    got = float(loss.detach())
    worst, where, how = _worst_grad(ref, _grads(model))
    loss_diff = abs(got - want) / max(abs(want), 1e-12)
    aux_text = f"aux {float(aux.detach()):.4g}" if aux is not None else "no aux loss"
    if loss_diff <= LOSS_TOLERANCE and worst <= GRAD_TOLERANCE:
        return "exact", f"loss {want:.6f} ({aux_text}), loss diff {loss_diff:.1e}, worst grad {worst:.1e}"
    grad_text = f"worst gradient {where}: {how}" if where else "gradients equal"
    return (f"ACCEPTED AND WRONG: loss {got:.6f} vs {want:.6f} ({loss_diff:.1e} relative, model's {aux_text}), "
            f"{grad_text}"), ""


class _NoBuildError(Exception):
    """The probe could not build a working tiny model (the probe's limit, not a verdict on pipedsl)."""


def probe(model_type: str, class_name: str, config_class: type, note: str) -> Probe:
    """One model type's row: build the tiny model, run the verdict and count the experts `is_experts` finds."""
    from pipedsl.parallel.expert import is_experts

    row = Probe(model_type, class_name, note=note)
    start = time.perf_counter()
    try:
        try:
            model, _ = build(config_class, class_name)
            row.layers = layer_summary(model)
        except Exception as err:  # noqa: BLE001 - a config or model the probe cannot make tiny
            raise _NoBuildError(f"{type(err).__name__}: {one_line(err, 200)}") from None
        if not moe_layers(model):
            raise _NoBuildError("the tiny model has no experts module (the probe's layer choice found no MoE layer)")
        row.experts_found = sum(1 for m in model.modules() if is_experts(m))
        row.verdict, row.detail = verdict(model)
        row.check_sees_moe = check_sees_moe(config_class, class_name)
    except _NoBuildError as err:
        row.verdict = f"probe could not build a tiny model: {one_line(err)}"
    except Exception as err:  # noqa: BLE001 - the probe's own failure: said, and the next model probed
        row.verdict = f"probe could not build a tiny model: probe error {type(err).__name__}: {one_line(err)}"
    row.seconds = time.perf_counter() - start
    return row


# ---------------------------------------------------------------------------------------------------------------
# the probe's own test: pipedsl broken on purpose must not come out "exact"

SELF_TEST_TYPES = ("mixtral", "qwen2_moe", "jetmoe")


def _sabotages() -> dict[str, Any]:
    """{what is broken: a replacement for `RouterLoss.loss` made from the original}."""
    return {"the router loss dropped": lambda orig: lambda self, sums: 0 * orig(self, sums),
            "the router loss detached (the loss equal, the routers' gradient from it lost)":
                lambda orig: lambda self, sums: orig(self, sums).detach(),
            "the router loss x1.1": lambda orig: lambda self, sums: 1.1 * orig(self, sums)}


def self_test() -> int:
    """Break pipedsl's MoE router loss three ways, in this process only, and probe models with an auxiliary loss:
    each must come out refused or ACCEPTED AND WRONG, never exact.  0 when the probe caught every one."""
    import pipedsl.models.hf.stages as stages

    router_loss = getattr(stages, "RouterLoss", None)
    if router_loss is None or not callable(getattr(router_loss, "loss", None)):
        print("self-test: pipedsl has no RouterLoss.loss to break; nothing tested", file=sys.stderr)
        return 1
    todo, _ = moe_types(set(SELF_TEST_TYPES))
    missed = 0
    original = router_loss.loss
    for what, make in _sabotages().items():
        router_loss.loss = make(original)
        try:
            for model_type, class_name, config_class, note in todo:
                row = probe(model_type, class_name, config_class, note)
                caught = row.kind in ("WRONG", "refused")
                missed += not caught
                print(f"{'caught' if caught else 'MISSED'}  {what:78s} {model_type:10s} {row.verdict[:150]}")
        finally:
            router_loss.loss = original
    print(f"self-test: {'every sabotage caught' if not missed else f'{missed} sabotaged runs came out exact'}")
    return 1 if missed else 0


# ---------------------------------------------------------------------------------------------------------------
# output


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(rows: list[Probe], meta: dict[str, Any]) -> str:
    """The table as markdown, with the run's facts above it."""
    lines = ["# MoE probe: pipedsl's Hugging Face splitting against each MoE model's own training step", "",
             f"transformers {meta['transformers']}, torch {meta['torch']}, {meta['date']}, "
             f"{meta['seconds']:.0f} s on {meta['cpus']} CPU cores. `python benchmarks/moe_probe.py`", "",
             "Counts: " + ", ".join(f"{k} {v}" for k, v in meta["counts"].items()), "",
             "| model type | CausalLM class | verdict | experts found | detail |", "|---|---|---|---|---|"]
    for r in rows:
        experts = "" if r.experts_found is None else str(r.experts_found)
        blind = ("pipedsl's own check, on the default config, runs no MoE layer"
                 if r.check_sees_moe is False and r.kind in ("exact", "WRONG") else "")
        detail = "; ".join(t for t in (r.detail, f"layers: {r.layers}" if r.layers else "", r.note, blind) if t)
        lines.append(f"| {r.model_type} | {r.causal_lm} | {_cell(r.verdict)} | {experts} | {_cell(detail)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Probe the MoE types, print the table, write the results; 1 when any is ACCEPTED AND WRONG."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types (default: every MoE type)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave results/ as it is")
    parser.add_argument("--self-test", action="store_true",
                        help=f"break pipedsl's router loss in-process; {', '.join(SELF_TEST_TYPES)} must not be exact")
    args = parser.parse_args(argv)
    import transformers

    if args.self_test:
        return self_test()

    only = {t.strip() for t in args.only.split(",") if t.strip()} if args.only else None
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
    start = time.perf_counter()
    todo, skipped = moe_types(only)
    unknown = sorted((only or set()) - {t for t, *_ in todo} - {r.model_type for r in skipped})
    if unknown:
        print(f"not MoE causal-LM types of transformers {transformers.__version__}: {', '.join(unknown)}",
              file=sys.stderr)
    print(f"{len(todo)} MoE causal-LM types to probe: {', '.join(t for t, *_ in todo)}", flush=True)
    if skipped:
        print(f"skipped: {', '.join(r.model_type for r in skipped)}", flush=True)
    rows: list[Probe] = []
    done: dict[tuple[str, type], Probe] = {}
    for model_type, class_name, config_class, note in todo:
        same = done.get((class_name, config_class))
        if same is not None:  # a multimodal type whose CausalLM is a text type's: the same probe
            row = dataclasses.replace(same, model_type=model_type, seconds=0.0,
                                      note="; ".join(t for t in (note, f"same class and config as {same.model_type}")
                                                     if t))
        else:
            row = probe(model_type, class_name, config_class, note)
            done[(class_name, config_class)] = row
        rows.append(row)
        print(f"{model_type:22s} {row.seconds:5.1f}s  {row.verdict}" + (f"  [{row.detail}]" if row.detail else ""),
              flush=True)
    rows += skipped
    rows.sort(key=lambda r: r.model_type)
    seconds = time.perf_counter() - start
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.kind] = counts.get(r.kind, 0) + 1
    meta = {"transformers": transformers.__version__, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "seconds": seconds, "cpus": os.cpu_count(),
            "counts": counts, "only": sorted(only) if only else None}
    table = markdown(rows, meta)
    print()
    print(table)
    if not args.no_write:
        RESULTS_DIR.mkdir(exist_ok=True)
        (RESULTS_DIR / "moe_probe.md").write_text(table)
        (RESULTS_DIR / "moe_probe.json").write_text(json.dumps(
            {**meta, "rows": [{**dataclasses.asdict(r), "kind": r.kind} for r in rows]}, indent=1) + "\n")
        print(f"wrote {RESULTS_DIR / 'moe_probe.md'} and {RESULTS_DIR / 'moe_probe.json'}")
    wrong = [r.model_type for r in rows if r.kind == "WRONG"]
    if wrong:
        print(f"ACCEPTED AND WRONG: {', '.join(wrong)}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
