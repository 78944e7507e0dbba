"""Hugging Face encoder-decoders (T5, mT5, UMT5, BART, mBART, Marian, Pegasus, M2M100 …) cut into stages.

    stages = seq2seq_stages(model, program.num_stages)      # encoder … decoder … head, any cut
    pipe = pipedsl.Pipeline(stages, program=program, loss_fn=seq2seq_loss)
    loss = pipe.step((input_ids, attention_mask, decoder_input_ids), labels)
    # = model(input_ids, attention_mask=…, decoder_input_ids=…, labels=labels).loss

The model is found by structure, in transformers' standard layout: `get_encoder()` and
`get_decoder()` stacks, each with its token embedding and a `ModuleList` of layers (`block` in
T5's families, `layers` in BART's), and `get_output_embeddings()` as the head.  The units
[encoder input, encoder layers…, decoder input, decoder layers…, head] are spread over the
stages like `split_sequential` spreads layers, so the encoder/decoder boundary may fall inside a
stage.  What each unit runs:

- a stack's *input* (its token embedding, scaling, positions, embedding norm, dropout) is the
  stack's own `forward` up to its first layer, stopped there: whatever the family does before
  its layers, done by its own code;
- the decoder-input unit first finishes the encoder (its final norm and dropout: the encoder's
  output is final there);
- the head is the decoder's final norm [+ dropout], T5's `scale_decoder_outputs`, the output
  projection and BART's `final_logits_bias`.

What crosses a stage boundary, always a tuple of tensors:

- in the encoder: (hidden [mb, S, C], attention_mask [mb, S], decoder_input_ids [mb, T]
  [, decoder_attention_mask [mb, T]]);
- in the decoder: (hidden [mb, T, C], encoder output [mb, S, C], attention_mask
  [, decoder_attention_mask]).

The encoder output is relayed by every decoder stage to the next: each uses it in its
cross-attention and passes it on, so its gradient arriving back at the encoder's last stage is
autograd's exact sum over every decoder layer (one more [mb, S, C] each way a decoder stage,
priced by the simulator like every message).  The attention masks are made on each stage by
transformers' own `create_bidirectional_mask` / `create_causal_mask` from the 2-D masks.
T5's relative position bias is computed by the first layer of each stack and handed to the
others; a stage without that layer computes it from the same embedding, which is then a
weight shared between stages (`ties.py`: its gradient is summed over them).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pipedsl.errors import PipeRuntimeError
from pipedsl.models.hf.common import (
    IGNORE_INDEX,
    causal_lm_loss,
    check_on_shallow_copy,
    compare_with_model,
    no_cache,
    require_transformers,
)
from pipedsl.models.split import ModelNamed, _bounds

LAYER_NAMES = ("block", "layers")  # a stack's layers: T5's families, BART's
FINAL_NORM_NAMES = ("final_layer_norm", "layer_norm")  # a stack's norm after its layers (T5; mBART, Pegasus)


def seq2seq_loss(logits: torch.Tensor, labels: torch.Tensor, *, reduction: str = "mean",
                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The token-mean cross-entropy of `logits` [mb, T, V] over `labels` [mb, T] ≠ -100: HF's seq2seq loss.

    Labels are the decoder's targets as they are (no shift: `decoder_input_ids` are the shifted
    ones, from `model.prepare_decoder_input_ids_from_labels(labels)`).  `reduction="sum"` is for
    `Pipeline(loss_reduction="token")`.  Logits are upcast to fp32.
    """
    return causal_lm_loss(logits, labels, reduction=reduction, ignore_index=ignore_index)


class _Stop(Exception):  # noqa: N818 - carries a stack's input out of its forward, at its first layer
    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


class _StackInput(nn.Module):
    """A stack's forward up to its first layer: what the family does to the token ids before the layers.

    Only the modules that part uses are registered here (the stack's children other than its layers and its
    final norm), so a stage holding the input holds nothing of the layers; the stack is called, not owned.
    """

    def __init__(self, stack: nn.Module, first_layer: nn.Module, final_norm: nn.Module | None) -> None:
        super().__init__()
        for n, m in stack.named_children():
            if not isinstance(m, nn.ModuleList) and m is not final_norm:
                self.add_module(n, m)
        object.__setattr__(self, "_stack", stack)  # not a submodule: its layers belong to their stages
        object.__setattr__(self, "_first_layer", first_layer)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:  # [mb, T] → [mb, T, C]
        def stop(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            raise _Stop(args[0] if args else kwargs["hidden_states"])

        handle = self._first_layer.register_forward_pre_hook(stop, with_kwargs=True)
        try:
            self._stack(input_ids=ids, attention_mask=mask, use_cache=False)
        except _Stop as got:
            return got.hidden
        finally:
            handle.remove()
        raise PipeRuntimeError(f"seq2seq_stages: {type(self._stack).__name__}.forward never reached its first layer")


class _SharedPositionBias(nn.Module):
    """T5's relative position bias [1, H, Tq, Tk]: the stack's first layer computes it and hands it to the others
    (T5Stack.forward); every stage computes it with that layer's own `compute_bias` from the same weight.

    The embedding module is a new one around the layer's Parameter: a tie of the Parameter, not of the module,
    which ZeRO needs when two stages that hold it are on one rank (ties.py)."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        table = attention.relative_attention_bias
        self.relative_attention_bias = nn.Embedding(table.num_embeddings, table.embedding_dim, device="meta")
        self.relative_attention_bias.weight = table.weight  # the same Parameter
        self.is_decoder = attention.is_decoder
        self.relative_attention_num_buckets = attention.relative_attention_num_buckets
        self.relative_attention_max_distance = attention.relative_attention_max_distance
        self._relative_position_bucket = attention._relative_position_bucket
        self._compute = type(attention).compute_bias

    def forward(self, length: int, device: torch.device) -> torch.Tensor:
        return self._compute(self, length, length, device=device)


class _Stack:
    """One stack (encoder or decoder) of an encoder-decoder, found by structure."""

    def __init__(self, stack: nn.Module, role: str, model: str) -> None:
        self.module, self.role, self.config = stack, role, stack.config
        found = next((getattr(stack, n) for n in LAYER_NAMES if isinstance(getattr(stack, n, None), nn.ModuleList)),
                     None)
        if found is None or not len(found):
            raise PipeRuntimeError(f"seq2seq_stages: {model}'s {role} has no layers (looked for "
                                   f"{', '.join(f'{type(stack).__name__}.{n}' for n in LAYER_NAMES)})")
        self.layers = list(found)
        self.t5_blocks = found is getattr(stack, "block", None)
        norm = next((getattr(stack, n) for n in FINAL_NORM_NAMES if isinstance(getattr(stack, n, None), nn.Module)),
                    None)
        self.input = _StackInput(stack, self.layers[0], norm)
        drop = stack.dropout if self.t5_blocks and isinstance(getattr(stack, "dropout", None), nn.Module) else None
        self.output = _StackOutput(norm, drop)
        self.position_bias: nn.Module | None = None  # T5: one bias for the stack, from its first layer
        biased = [_relative_bias_attention(layer) for layer in self.layers]
        if biased[0] is not None and not any(b is not None for b in biased[1:]):
            self.position_bias = _SharedPositionBias(biased[0])


def _relative_bias_attention(layer: nn.Module) -> nn.Module | None:
    """The self-attention in `layer` that holds a relative position bias (T5), if any."""
    for m in layer.modules():
        if getattr(m, "has_relative_attention_bias", False) and not getattr(m, "is_cross_attention", False) \
                and isinstance(getattr(m, "relative_attention_bias", None), nn.Module):
            return m
    return None


class _StackOutput(nn.Module):
    """A stack's final norm and, in T5's families, its dropout after it."""

    def __init__(self, norm: nn.Module | None, drop: nn.Module | None) -> None:
        super().__init__()
        self.norm, self.drop = norm, drop

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            h = self.norm(h)
        return self.drop(h) if self.drop is not None else h


class _Head(nn.Module):
    """Decoder output → logits: [× d_model^-0.5 (T5 with tied embeddings)], the projection, [+ final_logits_bias]."""

    def __init__(self, decoder_output: nn.Module, lm_head: nn.Module, scale: float, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.decoder_output, self.lm_head, self.scale = decoder_output, lm_head, scale
        self.final_logits_bias = bias  # a buffer of the model, shared (not a parameter: nothing to tie)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [mb, T, C] → [mb, T, V]
        h = self.decoder_output(h)
        if self.scale != 1.0:
            h = h * self.scale
        logits = self.lm_head(h)
        return logits + self.final_logits_bias if self.final_logits_bias is not None else logits


class _Parts:
    """An HF encoder-decoder's pieces: the two stacks and the head."""

    def __init__(self, model: nn.Module) -> None:
        config = getattr(model, "config", None)
        self.name = name = type(model).__name__
        if config is None or not hasattr(model, "get_output_embeddings"):
            raise PipeRuntimeError(f"seq2seq_stages: {name} is not a Hugging Face model (no config)")
        if not getattr(config, "is_encoder_decoder", False):
            raise PipeRuntimeError(f"seq2seq_stages: {name} is not an encoder-decoder (config.is_encoder_decoder is "
                                   f"not set); a decoder-only model splits with causal_lm_stages")
        if getattr(config, "output_router_logits", False):
            raise PipeRuntimeError(f"seq2seq_stages: {name} has output_router_logits=True: its router's auxiliary "
                                   f"loss is not reproduced by pipedsl's stages yet")
        get_encoder, get_decoder = getattr(model, "get_encoder", None), getattr(model, "get_decoder", None)
        if not callable(get_encoder) or not callable(get_decoder):
            raise PipeRuntimeError(f"seq2seq_stages: {name} has no get_encoder() / get_decoder()")
        self.model, self.config = model, config
        self.encoder = _Stack(get_encoder(), "encoder", name)
        self.decoder = _Stack(get_decoder(), "decoder", name)
        head = model.get_output_embeddings()
        if head is None:
            raise PipeRuntimeError(f"seq2seq_stages: {name} has no output embeddings (lm_head): it is not a "
                                   f"conditional generation model")
        scale = float(config.d_model) ** -0.5 if getattr(config, "scale_decoder_outputs", False) else 1.0
        self.head = _Head(self.decoder.output, head, scale, getattr(model, "final_logits_bias", None))


class Seq2SeqStage(ModelNamed, nn.Module):
    """One pipeline stage of an HF encoder-decoder: units `first` … `last - 1` of
    [encoder input, encoder layers…, decoder input, decoder layers…, head] (see the module docstring)."""

    def __init__(self, parts: _Parts, first: int, last: int, decoder_mask: bool) -> None:
        super().__init__()
        enc, dec = parts.encoder, parts.decoder
        ne, nd = len(enc.layers), len(dec.layers)
        self.first, self.last, self.num_encoder_layers = first, last, ne
        self.decoder_mask = decoder_mask
        self.encoder_config, self.decoder_config = enc.config, dec.config
        self.encoder_input = enc.input if first == 0 else None
        self.encoder_layers = nn.ModuleList(enc.layers[max(first - 1, 0): min(last - 1, ne)])
        self.decoder_input = dec.input if first <= ne + 1 < last else None
        self.encoder_output = enc.output if self.decoder_input is not None else None
        self.decoder_layers = nn.ModuleList(dec.layers[max(first - ne - 2, 0): max(min(last - ne - 2, nd), 0)])
        self.head = parts.head if last == ne + nd + 3 else None
        self.t5_blocks = enc.t5_blocks
        self.encoder_bias = enc.position_bias if len(self.encoder_layers) else None
        self.decoder_bias = dec.position_bias if len(self.decoder_layers) else None
        self.name_after(parts.model)

    @property
    def in_decoder(self) -> bool:
        """Whether this stage's input is already the decoder's (it starts after the decoder input unit)."""
        return self.first > self.num_encoder_layers + 1

    @property
    def extras(self) -> tuple[str, ...]:
        return ("attention_mask", "decoder_input_ids", *(("decoder_attention_mask",) if self.decoder_mask else ()))

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        names = ["hidden", "encoder output", "attention_mask"] if self.in_decoder else ["the first", *self.extras[:2]]
        names += ["decoder_attention_mask"] if self.decoder_mask else []
        if 1 + len(rest) != len(names):
            raise TypeError(f"this stage takes {len(names)} tensors ({', '.join(names)}), got {1 + len(rest)}")
        dec_mask = rest[-1] if self.decoder_mask else None
        if self.in_decoder:
            h, enc_out, mask = x, rest[0], rest[1]
            dec_ids = None
        else:
            mask, dec_ids = rest[0], rest[1]
            h = self.encoder_input(x, mask) if self.encoder_input is not None else x  # [mb, S, C]
            h = self._encoder_layers(h, mask)
            if self.decoder_input is None:  # the stage ends inside the encoder
                return (h, mask.clone(), dec_ids.clone(), *((dec_mask.clone(),) if self.decoder_mask else ()))
            enc_out = self.encoder_output(h)
            h = self.decoder_input(dec_ids, dec_mask)  # [mb, T, C]
        h = self._decoder_layers(h, enc_out, mask, dec_mask)
        if self.head is not None:
            return self.head(h)  # [mb, T, V]
        # cloned: a received buffer is reused once this microbatch's backward is done, maybe before its send is
        return (h, enc_out.clone(), mask.clone(), *((dec_mask.clone(),) if self.decoder_mask else ()))

    def _encoder_layers(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if not len(self.encoder_layers):
            return h
        from transformers.masking_utils import create_bidirectional_mask

        attention = create_bidirectional_mask(config=self.encoder_config, inputs_embeds=h, attention_mask=mask)
        extra = {"position_bias": self.encoder_bias(h.shape[1], h.device)} if self.encoder_bias is not None else {}
        for layer in self.encoder_layers:
            h = _first(layer(h, attention_mask=attention, **extra))
        return h

    def _decoder_layers(self, h: torch.Tensor, enc_out: torch.Tensor, mask: torch.Tensor,
                        dec_mask: torch.Tensor | None) -> torch.Tensor:
        if not len(self.decoder_layers):
            return h
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        causal = create_causal_mask(config=self.decoder_config, inputs_embeds=h, attention_mask=dec_mask,
                                    **no_cache(create_causal_mask))
        cross = create_bidirectional_mask(config=self.decoder_config, inputs_embeds=h, attention_mask=mask,
                                          encoder_hidden_states=enc_out)
        extra = {"position_bias": self.decoder_bias(h.shape[1], h.device)} if self.decoder_bias is not None else {}
        for layer in self.decoder_layers:
            h = _first(layer(h, attention_mask=causal, encoder_hidden_states=enc_out, encoder_attention_mask=cross,
                             use_cache=False, **extra) if not self.t5_blocks else
                       layer(h, attention_mask=causal, encoder_hidden_states=enc_out, encoder_attention_mask=cross,
                             **extra))
        return h


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def seq2seq_stages(model: nn.Module, num_stages: int, *, by: str = "count", points: Sequence[int] | None = None,
                   decoder_attention_mask: bool = False, check: bool = True) -> list[Seq2SeqStage]:
    """`model` (an HF encoder-decoder) as `num_stages` pipeline stages, for `Pipeline(stages, …)`.

    Units [encoder input, encoder layer 0 … Le−1, decoder input, decoder layer 0 … Ld−1, head]
    are spread like `split_sequential` does (`by="count"`, `"params"`, or `points`: where stages
    1 … n−1 begin, in units).  Stage 0 takes (input_ids, attention_mask, decoder_input_ids
    [, decoder_attention_mask]); pair with `seq2seq_loss` and the labels.  `check=True` first
    verifies the architecture on a shallow random copy (`check_seq2seq_architecture`).
    """
    require_transformers()
    parts = _Parts(model)
    units = [parts.encoder.input, *parts.encoder.layers, parts.decoder.input, *parts.decoder.layers, parts.head]
    if points is None and num_stages > len(units):
        raise PipeRuntimeError(f"seq2seq_stages: cannot cut {parts.name} ({len(parts.encoder.layers)} encoder and "
                               f"{len(parts.decoder.layers)} decoder layers, {len(units)} units) into {num_stages} "
                               f"stages")
    bounds = _bounds(units, num_stages, by, points)
    if check:
        check_seq2seq_architecture(model, decoder_attention_mask=decoder_attention_mask)
    return [Seq2SeqStage(parts, a, b, decoder_attention_mask) for a, b in zip(bounds, bounds[1:])]


def check_seq2seq_split(model: nn.Module, stages: Sequence[nn.Module], seq_len: int = 8,
                        tolerance: float = 1e-4) -> float:
    """Run `stages` in sequence on a random padded batch and compare the logits and the loss (`seq2seq_loss`
    against the model's own given labels) with `model`'s own forward; the largest difference relative to their
    scale.  Raises `PipeRuntimeError` above `tolerance`."""
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab, (2, seq_len), generator=g)
    dec_ids = torch.randint(vocab, (2, seq_len - 2), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # padding: the encoder's and the cross-attention's masks matter
    dec_mask = torch.ones_like(dec_ids)
    dec_mask[1, -2:] = 0
    with_dec_mask = getattr(stages[0], "decoder_mask", False)
    labels = dec_ids.masked_fill(dec_mask == 0, IGNORE_INDEX)
    model_inputs = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec_ids,
                    "decoder_attention_mask": dec_mask if with_dec_mask else None, "labels": labels}
    stage_inputs = (ids, mask, dec_ids, *((dec_mask,) if with_dec_mask else ()))
    return compare_with_model(model, stages, stage_inputs, model_inputs, tolerance, "seq2seq_stages",
                              "its stacks' pieces", loss=(seq2seq_loss, labels))


def shallow_seq2seq_config(config: Any) -> Any:
    """`config` with at most two layers a stack and at most 1024 tokens: the same modules, a small cost."""
    config = copy.deepcopy(config)
    for name in ("num_layers", "num_encoder_layers", "num_decoder_layers", "encoder_layers", "decoder_layers"):
        if isinstance(getattr(config, name, None), int):
            setattr(config, name, min(2, getattr(config, name)))
    config.vocab_size = min(int(config.vocab_size), 1024)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "forced_eos_token_id",
                 "forced_bos_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= config.vocab_size:
            setattr(config, name, 0 if name in ("pad_token_id", "decoder_start_token_id") else None)
    return config


def check_seq2seq_architecture(model: nn.Module, *, decoder_attention_mask: bool = False,
                               attn: str | None = None) -> float | None:
    """`seq2seq_stages` reproduces `model`'s architecture: a shallow random copy (`shallow_seq2seq_config`), cut
    inside each stack and at the encoder/decoder boundary, must compute the copy's own logits; None when too
    large to check (`check_on_shallow_copy`)."""
    def cut_and_check(shallow: nn.Module) -> float:
        ne = len(_Parts(shallow).encoder.layers)
        # [enc input, enc layer 0] | [enc layers 1…, dec input, dec layer 0] | [dec layers 1…, head]: a cut in
        # each stack (the second stage of each computes T5's shared bias) and the boundary inside a stage
        stages = seq2seq_stages(shallow, 3, points=[2, ne + 3], decoder_attention_mask=decoder_attention_mask,
                                check=False)
        return check_seq2seq_split(shallow, stages)

    return check_on_shallow_copy(model, shallow_seq2seq_config, cut_and_check, "seq2seq_stages", attn)
