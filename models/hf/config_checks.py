"""A config.json's architecture checked as the model will read it: the mistakes transformers accepts but
cannot run, refused before it builds anything.

    num_attention_heads 3 does not divide hidden_size 32      (no head_dim: each head is hidden/heads wide)
    num_key_value_heads 3 does not divide num_attention_heads 4
    rope_scaling rope_type 'bogus' is not one of transformers' default, dynamic, linear, …

transformers builds such a config, and sometimes its model: an attention whose heads do not tile the hidden
size runs on a narrower projection than the user wrote, a key/value head count that does not divide the
heads fails only in the forward, an unknown rope type is a KeyError while the model is built.  Each is a
`ModelDirError` here, one line naming config.json, the field and the values.  The values are read from the
file as written (the names the user edits; `n_head` for GPT-2) and, for a field it leaves out, from the
config class's default, which is what transformers would fill in — said in the message.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

from pipedsl.models.hf import ModelDirError

# a head size of its own, so the hidden size need not split into the heads: an explicit head_dim, T5's d_kv,
# the latent attention of DeepSeek-V2/V3 (kv_lora_rank, qk_nope_head_dim), CPM-Ant's dim_head, Reformer's
OWN_HEAD_SIZE = ("head_dim", "d_kv", "kv_lora_rank", "qk_nope_head_dim", "dim_head", "attention_head_size")
ROPE_FIELDS = ("rope_scaling", "rope_parameters")


def check_config(raw: dict[str, Any], cfg_file: Path) -> None:
    """Refuse, in one line, a config.json (`raw`, as read) whose heads, key/value heads or rope type the model
    cannot run with; a `model_type` transformers does not know is left to its own refusal."""
    import transformers as tf

    try:
        cls = tf.CONFIG_MAPPING[raw["model_type"]]
    except (KeyError, TypeError):
        cls = None
    if cls is not None:
        _check_heads(_Fields(raw, cls), cfg_file)
    _check_rope(raw, cfg_file)


class _Fields:
    """A config's fields as its class reads them: the file's value under the class's own name or its alias
    (`n_head` / `num_attention_heads`), else the class's default."""

    def __init__(self, raw: dict[str, Any], cls: type) -> None:
        self.raw, self.cls = raw, cls
        self.aliases: dict[str, str] = dict(getattr(cls, "attribute_map", {}) or {})
        self.defaults = _defaults(cls)

    def name(self, field: str) -> str:
        """The name config.json uses for `field` (the one it holds, else the class's own)."""
        own = self.aliases.get(field, field)
        return field if field in self.raw and own not in self.raw else own

    def value(self, field: str) -> Any:
        own = self.aliases.get(field, field)
        for key in (own, field):
            if key in self.raw:
                return self.raw[key]
        return self.defaults.get(own, self.defaults.get(field))

    def floors_heads(self) -> bool:
        """The family's own default hidden size does not split into its default heads (GLM-4-MoE: 4096 and 96):
        its attention takes hidden // heads as the head size, and a config that does not divide is its normal."""
        heads, hidden = (self.defaults.get(self.aliases.get(k, k)) for k in ("num_attention_heads", "hidden_size"))
        return _positive_int(heads) and _positive_int(hidden) and bool(hidden % heads)

    def shown(self, field: str) -> str:
        """`num_key_value_heads 2`, or `num_key_value_heads 2 (starcoder2's default)` for a field the file omits."""
        given = self.aliases.get(field, field) in self.raw or field in self.raw
        default = "" if given else f" ({getattr(self.cls, 'model_type', None) or self.cls.__name__}'s default)"
        return f"{self.name(field)} {self.value(field)}{default}"


def _defaults(cls: type) -> dict[str, Any]:
    """The class's field defaults: transformers 5 declares configs as dataclasses; older ones by __init__."""
    if dataclasses.is_dataclass(cls):
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    try:
        params = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_heads(f: _Fields, cfg_file: Path) -> None:
    heads, hidden, kv = f.value("num_attention_heads"), f.value("hidden_size"), f.value("num_key_value_heads")
    own_size = any(f.value(name) is not None for name in OWN_HEAD_SIZE) or f.floors_heads()
    if _positive_int(heads) and _positive_int(hidden) and not own_size and hidden % heads:
        raise ModelDirError(f"{cfg_file}: {f.shown('num_attention_heads')} does not divide {f.shown('hidden_size')} "
                            f"(without a head_dim, each head is {f.name('hidden_size')} / "
                            f"{f.name('num_attention_heads')} wide)")
    if _positive_int(heads) and _positive_int(kv) and heads % kv:
        raise ModelDirError(f"{cfg_file}: {f.shown('num_key_value_heads')} does not divide "
                            f"{f.shown('num_attention_heads')} (each key/value head serves an equal group of "
                            f"attention heads)")


def _check_rope(raw: dict[str, Any], cfg_file: Path) -> None:
    """`rope_scaling` / `rope_parameters`: one dict, or one per layer type (Gemma 3's), each with a `rope_type`
    (or the older `type`) that transformers has an init function for."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    known = ("default", *sorted(ROPE_INIT_FUNCTIONS))
    for field in ROPE_FIELDS:
        value = raw.get(field)
        if not isinstance(value, dict):
            continue
        nested = value and all(isinstance(v, dict) for v in value.values())
        for where, params in (((f"{field}.{k}", v) for k, v in value.items()) if nested else [(field, value)]):
            key = "rope_type" if "rope_type" in params else "type"
            rope_type = params.get(key)
            if rope_type is not None and rope_type not in known:
                raise ModelDirError(f"{cfg_file}: {where} {key} {rope_type!r} is not one of transformers' "
                                    f"{', '.join(known)}")
