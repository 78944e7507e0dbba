"""Hugging Face causal language models cut into pipeline stages.

    stages = causal_lm_stages(model, program.num_stages)          # embedding … layers … norm + head
    pipe = pipedsl.Pipeline(stages, program=program, loss_fn=causal_lm_loss)
    loss = pipe.step(input_ids, shift_labels(labels))              # = model(input_ids, labels=labels).loss
    # with padding: causal_lm_stages(..., attention_mask=True); pipe.step((input_ids, attention_mask), …)

Any causal decoder in transformers' standard layout is supported, found by structure, not by
name (`_Parts`): embedding → decoder layers → final norm → head, the model's own rotary module,
per-layer full/sliding attention, and the config's embedding/logit multipliers and logit
soft-capping.  Tested equal to the unsplit model's forward (tests/models/test_hf_families.py):
Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 (`gemma3_text`), Granite, Phi-3, OLMo 2, GPT-2,
Cohere, GPT-NeoX, Falcon (rotary), StarCoder2; transformers 5.x.  `causal_lm_stages` checks any other model
itself (`check_architecture`: a shallow random copy must give the model's own logits) and refuses
what it cannot reproduce by name: ALiBi, an MoE router's auxiliary loss (`output_router_logits`).  The
stages hold the model's own modules (no copies), so a tied `lm_head.weight` *is* the embedding
weight in the first and the last stage's module and `Pipeline` finds the tie (ties.py).  Units
are the embedding, each decoder layer and the head; `by=` / `points=` spread them as `split.py`
does.

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

import copy
import functools
import inspect
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from pipedsl.errors import PipeRuntimeError
from pipedsl.models.hf.common import (
    IGNORE_INDEX,
    MAX_CHECK_BYTES,
    causal_lm_loss,
    check_on_shallow_copy,
    compare_with_model,
    no_cache,
    require_transformers,
)
from pipedsl.models.split import ModelNamed, _bounds
from pipedsl.parallel.moe_tp import routes_every_token

LAYER_NAMES = ("layers", "h")  # the decoder layers: model.model.layers (Llama and most), transformer.h (GPT-2)
NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm")  # the final norm before the head (last: GPT-NeoX)
# a dropout module on the embedding's output (GPT-2, GPT-NeoX, Phi)
DROPOUT_NAMES = ("drop", "emb_dropout", "embed_dropout")
# … or a bare probability the model's forward applies with F.dropout instead of a module (StarCoder2)
DROPOUT_PROBABILITIES = ("embedding_dropout",)
# arguments a decoder layer may require that the model's forward sets to None when the config turns them off
NONE_WHEN_OFF = {"alibi": "alibi"}  # Falcon: `alibi` is None unless config.alibi
LAYER_ARGUMENTS = {"hidden_states", "attention_mask", "position_ids", "position_embeddings", "use_cache", "cache",
                   "past_key_values", "layer_past", "kwargs", "args"}  # what CausalLMStage passes or leaves to defaults
MASK_KINDS = ("full_attention", "sliding_attention")  # the layer types whose masks the stages make
# where a model keeps the factor of its router's auxiliary loss: most families, then JetMoE
ROUTER_LOSS_COEFFICIENTS = ("router_aux_loss_coef", "aux_loss_coef")


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The targets of a causal LM, [B, T] → [B, T]: position t gets label t+1, the last `ignore_index`.

    This is transformers' own shift (`ForCausalLMLoss` pads the labels by one `ignore_index` and
    drops the first): done once on the batch, the targets count exactly the tokens HF's loss
    averages over, which `Pipeline(loss_reduction="token")` counts.
    """
    return F.pad(labels[:, 1:], (0, 1), value=ignore_index)


def adapt_model(model: nn.Module) -> None:
    """`model`'s modules behind the interfaces pipedsl's parallelism uses where its family differs, in place, its
    parameters and their names unchanged: JetMoE's experts behind parallel/expert.py's, its attention able to split
    itself over tp (`tensor_parallel`, models/hf/parallelize.py) — models/hf/jetmoe.py."""
    from pipedsl.models.hf.jetmoe import adapt_attention, adapt_experts

    adapt_experts(model)
    adapt_attention(model)


class _Parts:
    """The pieces of an HF causal decoder in transformers' standard layout, found by structure.

    The layout: `model.base_model` holds the input embedding (`get_input_embeddings()`, and
    learned positions `wpe` when the model has them), the decoder layers (`layers` or `h`),
    the final norm (`norm`, `ln_f` or `final_layernorm`) and the rotary module `rotary_emb`;
    `model.get_output_embeddings()` is the head.  The scalar rules that the models' own
    `forward` applies between those pieces are read from the config, whatever the family:
    `embedding_multiplier` (Granite) on the embedding, `logits_scaling` (Granite, a divisor),
    `logit_scale` (Cohere, a multiplier) and `final_logit_softcapping` (Gemma 2/3) on the logits.
    Scalings that live inside a module (Gemma's scaled embedding, Granite's residual multiplier,
    attention soft-capping) come with the module.  What cannot be split is refused, naming the piece that is missing.
    """

    def __init__(self, model: nn.Module) -> None:
        if hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None)):
            model = model.get_base_model()  # a PEFT wrapper: the adapters sit inside its base model's layers
        config = getattr(model, "config", None)
        name = type(model).__name__
        if config is None or not hasattr(model, "base_model") or not hasattr(model, "get_output_embeddings"):
            raise PipeRuntimeError(f"causal_lm_stages: {name} is not a Hugging Face model (no config / base_model)")
        if getattr(config, "is_encoder_decoder", False):
            raise PipeRuntimeError(f"causal_lm_stages: {name} is an encoder-decoder model; only causal decoders "
                                   f"(embedding → decoder layers → final norm → head) can be split")
        if getattr(config, "use_bidirectional_attention", False):
            raise PipeRuntimeError(f"causal_lm_stages: {name} has use_bidirectional_attention=True; only causal "
                                   f"(left-to-right) attention is supported")
        adapt_model(model)  # before anything reads its modules: one layout, parallel or not
        body = model.base_model
        self.router = RouterLoss.of(model, body, name) if getattr(config, "output_router_logits", False) else None
        self.model, self.name = model, name
        self.config, self.kind = config, getattr(config, "model_type", None)
        self.layers = list(_child_list(body, LAYER_NAMES, name, "decoder layers")[: config.num_hidden_layers])
        norm = _child(body, NORM_NAMES, name, "final norm")
        head = model.get_output_embeddings()
        if head is None:
            raise PipeRuntimeError(f"causal_lm_stages: {name} has no output embeddings (lm_head): it is not a "
                                   f"causal language model")
        embed = body.get_input_embeddings()
        positions = getattr(body, "wpe", None)  # learned absolute positions (GPT-2)
        self.rotary: nn.Module | None = getattr(body, "rotary_emb", None)
        if self.rotary is None and positions is None:
            raise PipeRuntimeError(f"causal_lm_stages: {name} has neither a rotary module (rotary_emb) nor learned "
                                   f"positions (wpe); its position encoding is not one pipedsl can recompute per stage")
        self.rotary_per_type = (self.rotary is not None
                                and "layer_type" in inspect.signature(self.rotary.forward).parameters)
        self.layer_extras = _layer_extras(self.layers[0], config, name) if self.layers else {}
        multiplier = float(getattr(config, "embedding_multiplier", None) or 1.0)
        drop = next((d for d in (getattr(body, n, None) for n in DROPOUT_NAMES) if isinstance(d, nn.Module)), None)
        # a check in eval mode cannot see an embedding dropout left out: looked for here, not left to the check
        drop_p = next((float(p) for p in (getattr(body, n, None) for n in DROPOUT_PROBABILITIES)
                       if isinstance(p, (int, float)) and not isinstance(p, bool)), 0.0) if drop is None else 0.0
        self.embed: nn.Module = _Embedding(embed, positions, drop, multiplier, drop_p)
        self.head: nn.Module = _Head(norm, head, divisor=float(getattr(config, "logits_scaling", None) or 1.0),
                                     scale=float(getattr(config, "logit_scale", None) or 1.0),
                                     softcap=getattr(config, "final_logit_softcapping", None))
        # which mask each layer needs, as the HF model's forward picks it
        types = getattr(config, "layer_types", None)
        if types is not None:
            self.mask_kinds = list(types[: len(self.layers)])
        elif getattr(config, "sliding_window", None) is not None and self.rotary is not None:
            self.mask_kinds = ["sliding_attention"] * len(self.layers)  # Mistral, Phi-3: every layer, when set
        else:
            self.mask_kinds = ["full_attention"] * len(self.layers)
        unknown = sorted(set(self.mask_kinds) - set(MASK_KINDS))
        if unknown:  # linear attention, compressed or indexed attention …: masks (or states) the stages do not make
            raise PipeRuntimeError(f"causal_lm_stages: {name} has layers of type {', '.join(map(repr, unknown))}, "
                                   f"which pipedsl's stages cannot run (supported: {', '.join(MASK_KINDS)})")


def router_recorder(body: nn.Module) -> Any:
    """transformers' record of where `body` (a model's base) takes its router logits from: an `OutputRecorder`
    (`target_class`, `index`), or None for a model that records none."""
    return (getattr(type(body), "_can_record_outputs", None) or {}).get("router_logits")


class RouterLoss:
    """An MoE decoder's auxiliary load-balancing loss (Switch Transformer's), computed across stages exactly as the
    model's own forward computes it with `output_router_logits=True` (transformers' `load_balancing_loss_func`).

    The loss is E · Σ_e f_e · P_e over all layers at once: f_e the share of (layer, token) routings that pick
    expert e in their top k, P_e the mean router probability of e, both over every layer's tokens (padding left
    out when the stage has the mask).  It is not a sum over layers, so each stage adds its layers' sums to three
    accumulators that travel with the hidden states — the routings per expert [E] (int64), the router
    probabilities per expert [E] (fp32, carrying the gradient back to every stage's routers) and the token rows
    (int64) — in the model's own order of layers, and the last stage computes the loss and returns it beside
    the logits for `causal_lm_loss` to add, × the model's coefficient, to the microbatch's mean loss (HF adds it
    per forward, so per microbatch).  The routers' logits are caught with forward hooks on the module class the
    model records them from (`_can_record_outputs["router_logits"]`).
    """

    def __init__(self, router_class: type, index: int, num_experts: int, top_k: int, coef: float) -> None:
        self.router_class, self.index = router_class, index
        self.num_experts, self.top_k, self.coef = num_experts, top_k, coef

    @classmethod
    def of(cls, model: nn.Module, body: nn.Module, name: str) -> RouterLoss | None:
        """The model's router loss, None when its forward adds none, or a refusal naming what is missing.  A model
        that adds one under a name not in `ROUTER_LOSS_COEFFICIENTS` is refused by the check (`check_split`
        compares the loss), not trained without it."""
        coef = next((c for c in (getattr(model, n, None) for n in ROUTER_LOSS_COEFFICIENTS) if c is not None), None)
        if coef is None:  # router logits only returned (DeepSeek-V3): the loss is the plain one
            return None
        recorder = router_recorder(body)
        experts = getattr(model, "num_experts", None)
        top_k = getattr(model, "num_experts_per_tok", None)
        if getattr(recorder, "target_class", None) is None or experts is None or top_k is None:
            raise PipeRuntimeError(f"causal_lm_stages: {name} has output_router_logits=True but pipedsl cannot find "
                                   f"where its router logits come from (no _can_record_outputs['router_logits'] "
                                   f"target class, num_experts, num_experts_per_tok); set "
                                   f"config.output_router_logits=False to train without the auxiliary loss")
        return cls(recorder.target_class, int(recorder.index or 0), int(experts), int(top_k), float(coef))

    def start(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The accumulators before the first layer: (routings [E] int64, probabilities [E] fp32, rows [1] int64)."""
        E = self.num_experts
        return (torch.zeros(E, dtype=torch.long, device=device), torch.zeros(E, dtype=torch.float32, device=device),
                torch.zeros(1, dtype=torch.long, device=device))

    def add(self, sums: tuple[torch.Tensor, ...], logits: torch.Tensor,
            padding: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """`sums` with one layer's router logits [mb·T, E] added, as `load_balancing_loss_func` adds a layer."""
        counts, probs, rows = sums
        weights = torch.softmax(logits, dim=-1)  # [mb·T, E]
        _, chosen = torch.topk(weights, self.top_k, dim=-1)  # [mb·T, k]
        if padding is None:
            picked, rows = chosen.reshape(-1), rows + weights.shape[0]
            probs = probs + weights.float().sum(dim=0)
        else:
            keep = padding.reshape(-1).to(device=weights.device, dtype=torch.float32)  # [mb·T]
            picked, rows = chosen[keep.bool()].reshape(-1), rows + keep.sum().long()
            probs = probs + (weights.float() * keep.unsqueeze(-1)).sum(dim=0)
        counts = counts + torch.bincount(picked, minlength=self.num_experts)
        return counts, probs, rows

    def loss(self, sums: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """coef · E · Σ_e f_e · P_e from the accumulators of every layer."""
        counts, probs, rows = sums
        total = rows.to(torch.float32)
        aux = torch.sum((counts.to(torch.float32) / total) * (probs / total).unsqueeze(0)) * self.num_experts
        return self.coef * aux


def _layer_extras(layer: nn.Module, config: Any, model: str) -> dict[str, None]:
    """The arguments `layer.forward` requires beyond what `CausalLMStage` passes, each None as the model's forward
    passes it when the config turns it off; any other required argument is refused by name."""
    extras: dict[str, None] = {}
    for p in inspect.signature(layer.forward).parameters.values():
        required = p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        if not required or p.name in LAYER_ARGUMENTS:
            continue
        switch = NONE_WHEN_OFF.get(p.name)
        if switch is not None and not getattr(config, switch, False):
            extras[p.name] = None
            continue
        why = f" (config.{switch}=True)" if switch is not None else ""
        raise PipeRuntimeError(f"causal_lm_stages: {model}'s decoder layers take {p.name!r}{why}, which its forward "
                               f"computes and pipedsl's stages do not: this architecture cannot be split")
    return extras


def _child(body: nn.Module, names: tuple[str, ...], model: str, what: str) -> nn.Module:
    for n in names:
        found = getattr(body, n, None)
        if isinstance(found, nn.Module):
            return found
    raise PipeRuntimeError(f"causal_lm_stages: {model} has no {what} (looked for "
                           f"{', '.join(f'{type(body).__name__}.{n}' for n in names)})")


def _child_list(body: nn.Module, names: tuple[str, ...], model: str, what: str) -> nn.ModuleList:
    found = _child(body, names, model, what)
    if not isinstance(found, nn.ModuleList):
        raise PipeRuntimeError(f"causal_lm_stages: {model}'s {what} are a {type(found).__name__}, not a ModuleList")
    return found


class _Embedding(nn.Module):
    """Token embedding [+ learned positions, dropout] × the config's embedding multiplier.  The dropout is the
    model's module (`drop`) or, where the model keeps only its probability (`drop_p`: StarCoder2), `F.dropout` as
    its forward calls it — the same draw — in the train/eval mode of the model's own embedding module, so that
    the model's `.eval()` (the architecture check's) turns it off as it turns off the model's."""

    def __init__(self, tokens: nn.Module, positions: nn.Module | None, drop: nn.Module | None,
                 multiplier: float, drop_p: float = 0.0) -> None:
        super().__init__()
        self.embed_tokens, self.wpe, self.drop, self.multiplier = tokens, positions, drop, multiplier
        self.drop_p = drop_p

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:  # [mb, T] → [mb, T, C]
        h = self.embed_tokens(input_ids)
        if self.multiplier != 1.0:
            h = h * self.multiplier
        if self.wpe is not None:
            h = h + self.wpe(position_ids)
        if self.drop_p:
            return F.dropout(h, self.drop_p, training=self.embed_tokens.training)
        return self.drop(h) if self.drop is not None else h


class _Head(nn.Module):
    """Final norm, output projection, then the config's logit rules, in the models' order: divide by
    `logits_scaling` (Granite), multiply by `logit_scale` (Cohere), soft-cap (Gemma 2/3)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, *, divisor: float, scale: float,
                 softcap: float | None) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head
        self.divisor, self.scale, self.softcap = divisor, scale, softcap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [mb, T, C] → [mb, T, V]
        logits = self.lm_head(self.norm(hidden))
        if self.divisor != 1.0:
            logits = logits / self.divisor
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class CausalLMStage(ModelNamed, nn.Module):
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
        self._num_layers = n
        self.config = parts.config
        self.extras = extras
        self.embed = parts.embed if first == 0 else None
        self.head = parts.head if last == n + 2 else None
        ids = range(max(first - 1, 0), min(last - 1, n))
        self.layers = nn.ModuleDict({str(i): parts.layers[i] for i in ids})  # keys: the HF layer numbers
        self.mask_kinds = [parts.mask_kinds[i] for i in ids]
        self.rotary_emb = parts.rotary if len(ids) else None  # no parameters: shared, not tied
        self.rotary_per_type = parts.rotary_per_type
        self.layer_extras = parts.layer_extras
        self.router: RouterLoss | None = parts.router  # an MoE's auxiliary loss: accumulators travel (RouterLoss)
        # this forward's router logits in layer order, each with whether its router ran on every token under tp
        self._caught: list[tuple[bool, torch.Tensor]] | None = None
        self.token_share: Any = None  # under tp: the tokens this rank's MoE blocks run (parallel/moe_tp.py)
        if self.router is not None:
            for m in self.layers.modules():
                if isinstance(m, self.router.router_class):
                    m.register_forward_hook(self._catch)
        self.name_after(parts.model)

    def units(self) -> list[tuple[int, nn.Module]]:
        """(index in [embedding, layer 0 … layer L−1, head], module) of this stage's pieces: what a partition
        moves (the rotary module, without parameters, goes with every stage)."""
        out = [(0, self.embed)] if self.embed is not None else []
        out += [(int(i) + 1, layer) for i, layer in self.layers.items()]
        return out + ([(self._num_layers + 1, self.head)] if self.head is not None else [])

    def _catch(self, module: nn.Module, _args: Any, out: Any) -> None:
        if self._caught is not None:
            self._caught.append((routes_every_token(module), out[self.router.index] if isinstance(out, tuple) else out))

    def forward(self, x: torch.Tensor, *extras: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        sums_in = 3 if self.router is not None and self.embed is None else 0  # the router loss's accumulators
        if len(extras) != len(self.extras) + sums_in:
            raise TypeError(f"this stage takes {1 + len(self.extras) + sums_in} tensors (the first, then "
                            f"{', '.join(self.extras) or 'nothing else'}"
                            f"{', then the router loss sums' if sums_in else ''}), got {1 + len(extras)}")
        given = dict(zip(self.extras, extras))
        mask, pos = given.get("attention_mask"), given.get("position_ids")
        T = x.shape[1]
        positions = pos if pos is not None else torch.arange(T, device=x.device).unsqueeze(0)  # [1 or mb, T]
        h = self.embed(x, positions) if self.embed is not None else x  # [mb, T, C]
        sums = tuple(extras[len(self.extras):]) if sums_in else None
        if self.router is not None and sums is None:
            sums = self.router.start(h.device)
        self._caught = [] if self.router is not None else None
        try:
            if len(self.layers):
                h = self._layers(h, mask, positions)
            caught = self._caught
        finally:
            self._caught = None
        if self.router is not None and caught:
            sums = self._router_sums(sums, caught, mask)
        if self.head is not None:
            logits = self.head(h)  # [mb, T, V]
            return (logits, self.router.loss(sums)) if self.router is not None else logits
        passed = extras[:len(self.extras)]
        if not passed and sums is None:
            return h
        # cloned: a received buffer is reused once this microbatch's backward is done, maybe before its send is
        return (h, *(t.clone() for t in passed), *(t.clone() for t in (sums or ())))

    def _router_sums(self, sums: tuple[torch.Tensor, ...], caught: list[tuple[bool, torch.Tensor]],
                     mask: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """`sums` with this stage's layers' router logits added; under tp, where each rank's MoE blocks route only
        its share of the tokens, its layers' sums added over tp in one all-reduce (fp64: the counts stay exact,
        the probabilities keep their gradient).  A router every tp rank runs on every token (JetMoE's attention
        router, `routes_every_token`) is added as it is."""
        assert self.router is not None
        share = self.token_share
        if share is None:
            for _, logits in caught:
                sums = self.router.add(sums, logits, mask)
            return sums
        mine = self.router.start(sums[0].device)
        rows = None if mask is None else share.rows(mask)
        for every_token, logits in caught:
            if every_token:
                sums = self.router.add(sums, logits, mask)
            else:
                mine = self.router.add(mine, logits, rows)
        counts, probs, n = mine
        E = counts.numel()
        whole = share.summed(torch.cat([probs.double(), counts.double(), n.double()]))
        return (sums[0] + whole[E:2 * E].round().long(), sums[1] + whole[:E].to(probs.dtype),
                sums[2] + whole[2 * E:].round().long())

    def _layers(self, h: torch.Tensor, padding: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        masks: dict[str, Any] = {}
        for kind in dict.fromkeys(self.mask_kinds):
            if kind not in makers:
                raise PipeRuntimeError(f"causal_lm_stages: layer type {kind!r} is not supported "
                                       f"(supported: {', '.join(makers)})")
            masks[kind] = makers[kind](config=self.config, inputs_embeds=h, attention_mask=padding,
                                       position_ids=positions, **no_cache(makers[kind]))
        rotary: dict[str, Any] = {}  # (cos, sin) [1 or mb, T, head_dim] per layer type
        if self.rotary_emb is not None and self.rotary_per_type:  # Gemma 3: local and global layers, own RoPE bases
            rotary = {kind: self.rotary_emb(h, positions, kind) for kind in dict.fromkeys(self.mask_kinds)}
        elif self.rotary_emb is not None:
            rotary = dict.fromkeys(self.mask_kinds, self.rotary_emb(h, positions))
        for layer, kind in zip(self.layers.values(), self.mask_kinds):
            extra = {"position_embeddings": rotary[kind]} if rotary else {}
            out = layer(h, attention_mask=masks[kind], position_ids=positions, use_cache=False, **extra,
                        **self.layer_extras)
            h = out[0] if isinstance(out, tuple) else out
        return h


def causal_lm_stages(model: nn.Module, num_stages: int, *, by: str = "count", points: Sequence[int] | None = None,
                     attention_mask: bool = False, position_ids: bool = False,
                     check: bool = True) -> list[CausalLMStage]:
    """`model` (an HF causal LM) as `num_stages` pipeline stages, for `Pipeline(stages, …)`.

    The units [embedding, layer 0 … layer L−1, head] are spread like `split_sequential` does:
    `by="count"` (units per stage), `by="params"`, or `points` (where stages 1 … n−1 begin, in
    units).  With interleaved schedules `num_stages` is `program.num_stages` (P·V).
    `attention_mask=True`: stage 0 takes (input_ids, attention_mask); `position_ids=True`: it
    takes the position ids next; both travel to every stage (see the module docstring).
    Pair with `causal_lm_loss` and the targets `shift_labels(labels)`.
    `check=True` first verifies the architecture (`check_architecture`: a shallow random copy of
    the model, split, must compute the model's own logits) and refuses it by name if not.
    """
    require_transformers()
    parts = _Parts(model)
    if check and check_architecture(parts.model, attention_mask=attention_mask, position_ids=position_ids) is None:
        warnings.warn(f"causal_lm_stages: {parts.name}'s architecture is not verified (one layer of it is larger "
                      f"than {MAX_CHECK_BYTES / 2**30:g} GiB)", RuntimeWarning, stacklevel=2)
    units: list[nn.Module] = [parts.embed, *parts.layers, parts.head]
    if points is None and num_stages > len(units):
        raise PipeRuntimeError(f"causal_lm_stages: cannot cut an embedding, {len(parts.layers)} layers and a head "
                               f"into {num_stages} stages (at most {len(units)})")
    bounds = _bounds(units, num_stages, by, points)
    extras = tuple(name for name, on in (("attention_mask", attention_mask), ("position_ids", position_ids)) if on)
    return [CausalLMStage(parts, a, b, extras) for a, b in zip(bounds, bounds[1:])]


def check_split(model: nn.Module, stages: Sequence[nn.Module], seq_len: int = 8, tolerance: float = 1e-4) -> float:
    """Run `stages` one after another on a random [2, seq_len] batch and compare the logits *and the loss* with
    the unsplit `model`'s own forward given labels; returns the largest difference relative to their scale.

    The loss is transformers' own (`model(input_ids, labels=…).loss`, an MoE's router loss included when its
    config sets `output_router_logits`) against `causal_lm_loss` of the last stage's output: equal logits do not
    prove equal training (JetMoE's router loss was once left out with every logit right).  Raises
    `PipeRuntimeError` when either differs by more than `tolerance`: the model's `forward` does something
    between its pieces, or to its loss, that the stages do not reproduce.  Dropout is off during the check
    (`eval()`), then restored.
    """
    vocab = int(model.config.vocab_size)
    ids = torch.randint(vocab, (2, seq_len), generator=torch.Generator().manual_seed(0))
    extras = getattr(stages[0], "extras", ())
    given = {"attention_mask": torch.ones_like(ids), "position_ids": torch.arange(seq_len).expand(2, -1)}
    return compare_with_model(model, stages, (ids, *(given[e] for e in extras)), {"input_ids": ids, "labels": ids},
                              tolerance, "causal_lm_stages", "the embedding, the layers and the head",
                              loss=(causal_lm_loss, shift_labels(ids)))


def shallow_config(config: Any, through: int = 0) -> Any:
    """A copy of an HF decoder's config with one layer of each type and at most 1024 tokens: the same modules,
    at a cost that does not grow with the model's depth or vocabulary.  `through`: layers 0 … `through` kept as
    they are (the first MoE layer, `first_moe_layer`: DeepSeek's first layers are dense, and a check that runs
    no router checks no router loss)."""
    config = copy.deepcopy(config)
    types = getattr(config, "layer_types", None)
    if types:
        head = list(types[:through + 1]) if through else []
        config.layer_types = head + [t for t in dict.fromkeys(types) if t not in head]
    depth = int(getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or 2)
    layers = len(config.layer_types) if types else min(max(2, through + 1), depth)
    for name in ("num_hidden_layers", "n_layer"):
        if hasattr(config, name):
            setattr(config, name, layers)
    config.vocab_size = min(int(config.vocab_size), 1024)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= config.vocab_size:
            setattr(config, name, None)
    return config


EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")  # a module's experts


def first_moe_layer(model: nn.Module) -> int:
    """The index of the first decoder layer holding routed experts — a module with an expert count above 1, or the
    module the model records router logits from — or 0 (a dense model, or layers not found)."""
    body = getattr(model, "base_model", model)
    router = getattr(router_recorder(body), "target_class", None)
    try:
        layers = _child_list(body, LAYER_NAMES, type(model).__name__, "decoder layers")
    except PipeRuntimeError:
        return 0
    for i, layer in enumerate(layers):
        for m in layer.modules():
            if (router is not None and isinstance(m, router)) or any(
                    isinstance(n, int) and n > 1 for n in (getattr(m, a, None) for a in EXPERT_COUNTS)):
                return i
    return 0


def check_architecture(model: nn.Module, *, attention_mask: bool = False, position_ids: bool = False,
                       attn: str | None = None) -> float | None:
    """Verify that `causal_lm_stages` reproduces `model`'s architecture: a shallow copy (`shallow_config`,
    random fp32 weights, on the CPU) cut into two stages must compute the copy's own logits (`check_split`).
    `model` may be on any device, the meta device included; `attn` overrides its attention implementation.

    Cheap whatever the model's size (one layer of each kind, and every layer up to the first MoE layer); the
    caller's RNG is left as it was.  Returns the
    relative difference, or None (unverified) when one layer alone exceeds `MAX_CHECK_BYTES`.  Raises
    `PipeRuntimeError` naming the model when its forward does something the stages do not.
    """
    def cut_and_check(shallow: nn.Module) -> float:
        layers = int(getattr(shallow.config, "num_hidden_layers", None) or shallow.config.n_layer)
        stages = causal_lm_stages(shallow, min(2, layers + 2), attention_mask=attention_mask,
                                  position_ids=position_ids, check=False)
        return check_split(shallow, stages)

    shallow = functools.partial(shallow_config, through=first_moe_layer(model))
    return check_on_shallow_copy(model, shallow, cut_and_check, "causal_lm_stages", attn)
