"""`pipedsl train --model DIR --data …`: everything about a Hugging Face run checked in the launcher.

The model directory, its tokenizer against its vocabulary, the data (tokenized into the cache
here, once), the sequence length against the model's positions, the dataset against one global
batch, the held-out set against an evaluation batch and the memory the ranks will need: each a
one-line error with exit status 2 before any rank starts.  What the ranks need is returned as
the `cfg["hf"]` section (runtime/trainer.py's `HFSource` reads it).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from pipedsl.errors import PipeDSLError

from .capacity import total_memory


def hf_config(args: argparse.Namespace, program: Any, batch: int, out: Path) -> dict[str, Any]:
    from . import data, hf_io

    md = hf_io.inspect_model_dir(args.model)
    if not args.data:
        raise PipeDSLError("--model needs --data: text files or folders, .jsonl, .parquet or a saved dataset")
    S = program.num_stages
    layers = int(getattr(md.config, "num_hidden_layers", None) or getattr(md.config, "n_layer", 0))
    if S > layers + 2:
        raise PipeDSLError(f"{md.path}: an embedding, {layers} decoder layers and a head make {layers + 2} pieces, "
                           f"fewer than the program's {S} stages")
    if md.max_positions and args.seq > md.max_positions:
        raise PipeDSLError(f"--seq {args.seq} is longer than the model's {md.max_positions} positions "
                           f"(max_position_embeddings in {md.path / hf_io.CONFIG})")
    split = _split(args.split, layers, S, md)
    split.update(attention_mask=args.packing == "pad", position_ids=args.doc_mask)
    if args.doc_mask and args.packing != "pack":
        raise PipeDSLError("--doc-mask keeps documents apart inside packed rows; with --packing pad every row is "
                           "one document already")
    tokenizer = data.load_tokenizer(args.model)
    if tokenizer.vocab_size > md.vocab_size:
        raise PipeDSLError(f"the tokenizer of {md.path} has {tokenizer.vocab_size} tokens, more than the model's "
                           f"vocab_size {md.vocab_size}: ids past {md.vocab_size - 1} have no embedding")
    cache = data.build_token_cache(args.data, tokenizer, args.cache_dir or out / "token-cache",
                                   text_field=args.text_field, model_vocab=md.vocab_size,
                                   model_where=str(md.path / hf_io.CONFIG))
    samples = data.PackedSequences(cache, args.seq, args.packing, args.doc_mask)
    train, heldout = samples.split(args.eval_fraction)
    data.BatchLoader(train, batch, dp_size=args.dp)  # fewer samples than one global batch: its DataError, now
    eval_at_end = bool(args.eval_fraction)
    notes = []
    if args.eval_fraction and len(heldout) < batch:
        if args.eval_every:
            data.eval_batches(heldout, batch, 0, args.dp)  # raises, naming the sizes
        eval_at_end = False
        notes.append(f"no evaluation: {len(heldout)} held-out samples, fewer than one batch of {batch}")
    _check_memory(args, md, program.num_ranks * args.dp)
    described = f"{train.describe()} for training, {len(heldout)} held out"
    return {"model": str(md.path.resolve()), "attn": args.attn or _attention(md), "packing": args.packing,
            "doc_mask": args.doc_mask, "eval_fraction": args.eval_fraction, "eval_every": args.eval_every,
            "eval_batches": args.eval_batches, "eval_at_end": eval_at_end, "cache": cache.path, "split": split,
            "export": hf_io.export_metadata(md, S, split, hf_io.tokenizer_files(md.path)), "layers": layers,
            "describe": md.describe(), "data_describe": "; ".join([described, *notes])}


def _split(how: str, layers: int, num_stages: int, md: Any) -> dict[str, Any]:
    """`--split count`: embedding, layers and head spread as units; `blocks`: every stage the same number of
    decoder layers (±1), the embedding with the first and the head with the last (Megatron's split)."""
    if how != "blocks":
        return {"by": "count"}
    if layers < num_stages:
        raise PipeDSLError(f"--split blocks: {md.path} has {layers} decoder layers, fewer than the program's "
                           f"{num_stages} stages")
    sizes = [layers // num_stages + (k < layers % num_stages) for k in range(num_stages)]
    return {"points": [1 + sum(sizes[:k]) for k in range(1, num_stages)]}


def _attention(md: Any) -> str:
    """sdpa where transformers implements it for this model (Gemma 2 has only eager), else eager."""
    import transformers as tf

    cls = tf.MODEL_FOR_CAUSAL_LM_MAPPING[type(md.config)]
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def _check_memory(args: argparse.Namespace, md: Any, nprocs: int) -> None:
    """Every rank builds the whole model in fp32 before keeping its stages; its stages' gradients and Adam's
    moments come on top (at most the whole model's once more, x3)."""
    if args.allow_oversubscribe:
        return
    params = _count_parameters(md.config)
    need, memory = 4 * params * nprocs + 12 * params, total_memory()
    if memory and need > memory:
        raise PipeDSLError(f"{md.path}: {params / 1e6:.1f} M parameters on {nprocs} processes need about "
                           f"{need / 2**30:.3g} GiB, more than this machine's {memory / 2**30:.3g} GiB "
                           f"(--allow-oversubscribe to run anyway)")


def _count_parameters(config: Any) -> int:
    import torch
    import transformers as tf

    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def meta_stages(cfg: dict[str, Any], num_stages: int) -> tuple[list, str]:
    """The run's stages on the meta device (shapes only), to compare with a checkpoint's partition."""
    import torch
    import transformers as tf

    from .hf import causal_lm_stages

    hfc = cfg["hf"]
    config = tf.AutoConfig.from_pretrained(hfc["model"], local_files_only=True)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return causal_lm_stages(model, num_stages, **hfc["split"]), f"{os.path.basename(hfc['model'])} cut into " \
                                                                 f"{num_stages} stages"
