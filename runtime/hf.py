"""Hugging Face causal language models cut into pipeline stages.

    stages = causal_lm_stages(model, program.num_stages)          # embedding … layers … norm + head
    pipe = pipedsl.Pipeline(stages, program=program, loss_fn=causal_lm_loss)
    loss = pipe.step(input_ids, shift_labels(labels))              # = model(input_ids, labels=labels).loss
    # with padding: causal_lm_stages(..., attention_mask=True); pipe.step((input_ids, attention_mask), …)

Supported: `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM` (one
decoder shape: `model.model.{embed_tokens, layers, norm, rotary_emb}` and `lm_head`) and
`GPT2LMHeadModel` (`transformer.{wte, wpe, drop, h, ln_f}`), transformers 5.x.  The stages hold
the model's own modules (no copies), so a tied `lm_head.weight` *is* the embedding weight in the
first and the last stage's module and `Pipeline` finds the tie (ties.py).  Units are the
embedding, each decoder layer and the head; `by=` / `points=` spread them as `split.py` does.

What crosses a stage boundary — stages exchange tensors only:

- the hidden states [mb, T, C], carrying the gradient;
- with `attention_mask=True`, the 2-D padding mask [mb, T] (1 = token, 0 = padding), and with
  `position_ids=True`, the position ids [mb, T]: integers, no gradient, T·8 bytes a row beside
  the hidden states' T·C·4.  They enter stage 0 after the input ids, in that order, and every
  stage passes them on.

What each stage recomputes instead of receiving — the HF model computes these once in its
`forward` and hands them to every layer:

- the rotary (cos, sin) [mb, T, head_dim] from the position ids with the model's own
  `rotary_emb` (a few multiplications per token).  Sending them would cost 2·head_dim floats a
  token each way (the pipeline sends a gradient back for every float input) and put a
  float input without a real gradient on every stage; torchtitan likewise keeps its
  `freqs_cis` buffer on every stage;
- the attention masks, with transformers' own `create_causal_mask` /
  `create_sliding_window_causal_mask` from the padding mask and position ids, per layer type
  (Qwen2's `layer_types`, Mistral's `sliding_window`), for the model's attention
  implementation (`eager`: a 4-D additive mask; `sdpa`: none at all when purely causal).

Without `position_ids`, positions are 0 … T−1 as in the HF model's forward.  Position ids that
restart within a row mark packed documents, masked apart as HF's training forward does
(`use_cache=False`; with a KV cache HF does not look for packing).  Dropout is the
modules' own: it follows `.train()` / `.eval()` and draws from each rank's RNG, so with dropout
on, a pipelined step is not bit-equal to the unsplit model's (the draws differ), only alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from pipedsl.errors import PipeRuntimeError

from .split import _bounds

IGNORE_INDEX = -100  # transformers' label for "no loss here" (padding, prompts)
DECODER_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # model.model.{embed_tokens, layers, norm, rotary_emb}
GPT2_TYPES = ("gpt2",)


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The targets of a causal LM, [B, T] → [B, T]: position t gets label t+1, the last `ignore_index`.

    This is transformers' own shift (`ForCausalLMLoss` pads the labels by one `ignore_index` and
    drops the first): done once on the batch, the targets count exactly the tokens HF's loss
    averages over, which `Pipeline(loss_reduction="token")` counts.
    """
    return F.pad(labels[:, 1:], (0, 1), value=ignore_index)


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor, *, reduction: str = "mean",
                   ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """HF's causal-LM cross-entropy of `logits` [mb, T, V] against `shift_labels(labels)` [mb, T].

    `reduction="mean"` (over the targets that are not `ignore_index`) is the loss of
    `model(input_ids, labels=labels)`, for the default per-microbatch mean; `"sum"` is for
    `Pipeline(loss_reduction="token")`, which divides by the global batch's token count
    (`functools.partial(causal_lm_loss, reduction="sum")`).  Logits are upcast to fp32, as HF does.
    """
    logits = logits.float()  # [mb, T, V]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.to(logits.device).reshape(-1),
                           ignore_index=ignore_index, reduction=reduction)


class _Parts:
    """The pieces of one supported HF model, named the same for every family."""

    def __init__(self, model: nn.Module) -> None:
        config = getattr(model, "config", None)
        kind = getattr(config, "model_type", None)
        self.config = config
        self.kind = kind
        if kind in DECODER_TYPES:
            body = model.model
            self.embed: nn.Module = _TokenEmbedding(body.embed_tokens)
            self.layers = list(body.layers[: config.num_hidden_layers])
            self.head: nn.Module = _Head(body.norm, model.lm_head)
            self.rotary: nn.Module | None = body.rotary_emb
        elif kind in GPT2_TYPES:
            body = model.transformer
            self.embed = _GPT2Embedding(body.wte, body.wpe, body.drop)
            self.layers = list(body.h)
            self.head = _Head(body.ln_f, model.lm_head)
            self.rotary = None
        else:
            supported = ", ".join(DECODER_TYPES + GPT2_TYPES)
            raise PipeRuntimeError(f"causal_lm_stages: model type {kind!r} ({type(model).__name__}) is not supported "
                                   f"(supported: {supported})")
        # which mask each layer needs, as the HF model's forward picks it
        types = getattr(config, "layer_types", None)
        if types is not None:
            self.mask_kinds = list(types[: len(self.layers)])
        elif getattr(config, "sliding_window", None) is not None and kind in DECODER_TYPES:
            self.mask_kinds = ["sliding_attention"] * len(self.layers)  # Mistral: every layer, when set
        else:
            self.mask_kinds = ["full_attention"] * len(self.layers)


class _TokenEmbedding(nn.Module):
    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:  # [mb, T] → [mb, T, C]
        return self.embed_tokens(input_ids)


class _GPT2Embedding(nn.Module):
    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:  # [mb, T] → [mb, T, C]
        return self.drop(self.wte(input_ids) + self.wpe(position_ids))


class _Head(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [mb, T, C] → [mb, T, V]
        return self.lm_head(self.norm(hidden))


class CausalLMStage(nn.Module):
    """One pipeline stage of an HF causal LM: [embedding], decoder layers, [norm + head].

    forward(first input, *extras): the first input is the input ids [mb, T] on the first stage,
    the hidden states [mb, T, C] on the others; `extras` are the padding mask and/or position ids
    [mb, T] (see `extras`).  Returns the logits [mb, T, V] on the last stage, else the hidden
    states followed by the extras (passed on to the next stage).
    """

    def __init__(self, parts: _Parts, first: int, last: int, extras: tuple[str, ...]) -> None:
        """Units `first` … `last - 1` of [embedding, layer 0 … layer L−1, head]."""
        super().__init__()
        n = len(parts.layers)
        self.config = parts.config
        self.extras = extras
        self.embed = parts.embed if first == 0 else None
        self.head = parts.head if last == n + 2 else None
        ids = range(max(first - 1, 0), min(last - 1, n))
        self.layers = nn.ModuleDict({str(i): parts.layers[i] for i in ids})  # keys: the HF layer numbers
        self.mask_kinds = [parts.mask_kinds[i] for i in ids]
        self.rotary_emb = parts.rotary if len(ids) else None  # no parameters: shared, not tied

    def forward(self, x: torch.Tensor, *extras: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if len(extras) != len(self.extras):
            raise TypeError(f"this stage takes {1 + len(self.extras)} tensors (the first, then "
                            f"{', '.join(self.extras) or 'nothing else'}), got {1 + len(extras)}")
        given = dict(zip(self.extras, extras))
        mask, pos = given.get("attention_mask"), given.get("position_ids")
        T = x.shape[1]
        positions = pos if pos is not None else torch.arange(T, device=x.device).unsqueeze(0)  # [1 or mb, T]
        h = self.embed(x, positions) if self.embed is not None else x  # [mb, T, C]
        if len(self.layers):
            h = self._layers(h, mask, positions)
        if self.head is not None:
            return self.head(h)  # [mb, T, V]
        if not extras:
            return h
        # cloned: a received buffer is reused once this microbatch's backward is done, maybe before its send is
        return (h, *(t.clone() for t in extras))

    def _layers(self, h: torch.Tensor, padding: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        masks: dict[str, Any] = {}
        for kind in dict.fromkeys(self.mask_kinds):
            if kind not in makers:
                raise PipeRuntimeError(f"causal_lm_stages: layer type {kind!r} is not supported "
                                       f"(supported: {', '.join(makers)})")
            masks[kind] = makers[kind](config=self.config, inputs_embeds=h, attention_mask=padding,
                                       past_key_values=None, position_ids=positions)
        extra: dict[str, Any] = {}
        if self.rotary_emb is not None:
            extra["position_embeddings"] = self.rotary_emb(h, positions)  # (cos, sin) [1 or mb, T, head_dim]
        for layer, kind in zip(self.layers.values(), self.mask_kinds):
            out = layer(h, attention_mask=masks[kind], position_ids=positions, past_key_values=None,
                        use_cache=False, **extra)
            h = out[0] if isinstance(out, tuple) else out
        return h


def causal_lm_stages(model: nn.Module, num_stages: int, *, by: str = "count", points: Sequence[int] | None = None,
                     attention_mask: bool = False, position_ids: bool = False) -> list[CausalLMStage]:
    """`model` (an HF causal LM) as `num_stages` pipeline stages, for `Pipeline(stages, …)`.

    The units [embedding, layer 0 … layer L−1, head] are spread like `split_sequential` does:
    `by="count"` (units per stage), `by="params"`, or `points` (where stages 1 … n−1 begin, in
    units).  With interleaved schedules `num_stages` is `program.num_stages` (P·V).
    `attention_mask=True`: stage 0 takes (input_ids, attention_mask); `position_ids=True`: it
    takes the position ids next; both travel to every stage (see the module docstring).
    Pair with `causal_lm_loss` and the targets `shift_labels(labels)`.
    """
    _require_transformers()
    parts = _Parts(model)
    units: list[nn.Module] = [parts.embed, *parts.layers, parts.head]
    if points is None and num_stages > len(units):
        raise PipeRuntimeError(f"causal_lm_stages: cannot cut an embedding, {len(parts.layers)} layers and a head "
                               f"into {num_stages} stages (at most {len(units)})")
    bounds = _bounds(units, num_stages, by, points)
    extras = tuple(name for name, on in (("attention_mask", attention_mask), ("position_ids", position_ids)) if on)
    return [CausalLMStage(parts, a, b, extras) for a, b in zip(bounds, bounds[1:])]


def _require_transformers() -> None:
    try:
        import transformers
    except ImportError:
        raise PipeRuntimeError("causal_lm_stages needs transformers (pip install 'pipedsl[examples]')") from None
    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise PipeRuntimeError(f"causal_lm_stages needs transformers 5.x (its masking_utils and decoder layers); "
                               f"found {transformers.__version__}")
