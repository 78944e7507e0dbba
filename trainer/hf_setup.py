"""`pipedsl train --model DIR --data …`: everything about a Hugging Face run checked in the launcher.

The model directory, its tokenizer against its vocabulary, the data (tokenized into the cache
here, once), the sequence length against the model's positions, the dataset against one global
batch, the held-out set against an evaluation batch and the memory the ranks will need: each a
one-line error with exit status 2 before any rank starts.  What the ranks need is returned as
an `HFModelConfig`, the `hf` of the run's `TrainConfig` (trainer/train.py's `HFSource` reads it).
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipedsl.errors import PipeDSLError
from pipedsl.models.hf import StageCut
from pipedsl.plan.memory import model_states
from pipedsl.plan.runnable import moe_tokens_refusal
from pipedsl.runtime.launch.capacity import total_memory
from pipedsl.trainer.config import HFModelConfig, TrainConfig, check_points, split_points


def hf_config(cfg: TrainConfig, program: Any, out: Path) -> HFModelConfig:
    """The model directory, its tokenizer and the data checked, the data tokenized into the cache (once, here):
    what the ranks need to know about the model, so that none of them looks again."""
    from pipedsl.models.hf import io as hf_io
    from pipedsl.trainer import data

    d, batch, dp = cfg.data, cfg.training.batch, cfg.parallel.dp
    md = hf_io.inspect_model_dir(cfg.model.model)
    if md.seq2seq:
        return _seq2seq_config(cfg, program, out, md)
    if d.source_field is not None:
        raise PipeDSLError(f"--source-field: {md.path} is a causal decoder ({md.kind}); (source, target) pairs train "
                           f"encoder-decoders such as T5 or BART")
    router_loss = bool(getattr(md.config, "output_router_logits", False))
    if router_loss and cfg.training.loss_reduction == "token":
        raise PipeDSLError(f"--loss-reduction token: {md.path} adds its router's auxiliary loss to each "
                           f"microbatch's mean loss (output_router_logits), as transformers does; use the default "
                           f"(microbatch) or set output_router_logits false in its config.json")
    ep, experts = cfg.parallel.ep, num_experts(md.config)
    if ep > 1 and not experts:
        raise PipeDSLError(f"--ep {ep} shards experts, and {md.path} ({md.kind}) has none")
    if experts % ep:
        raise PipeDSLError(f"--ep {ep}: the {experts} experts of {md.path} cannot be shared evenly by {ep} ranks")
    M = program.num_microbatches
    tokens = moe_tokens_refusal((batch or 4 * M * dp) // (M * dp), d.seq, cfg.parallel.tp,
                                cfg.parallel.sequence_parallel) if experts else None
    if tokens is not None:
        raise PipeDSLError(f"--tp {cfg.parallel.tp}: {md.path} is a mixture of experts, and {tokens}; change --batch "
                           f"or --seq, or add --sequence-parallel")
    S = program.num_stages
    layers = int(getattr(md.config, "num_hidden_layers", None) or getattr(md.config, "n_layer", 0))
    if S > layers + 2:
        raise PipeDSLError(f"{md.path}: an embedding, {layers} decoder layers and a head make {layers + 2} pieces, "
                           f"fewer than the program's {S} stages")
    if md.max_positions and d.seq > md.max_positions:
        raise PipeDSLError(f"--seq {d.seq} is longer than the model's {md.max_positions} positions "
                           f"(max_position_embeddings in {md.path / hf_io.CONFIG})")
    split = replace(_split(cfg.model.split, layers, S, md), attention_mask=d.packing == "pad", position_ids=d.doc_mask)
    tokenizer = data.load_tokenizer(cfg.model.model)
    if tokenizer.vocab_size > md.vocab_size:
        raise PipeDSLError(f"the tokenizer of {md.path} has {tokenizer.vocab_size} tokens, more than the model's "
                           f"vocab_size {md.vocab_size}: ids past {md.vocab_size - 1} have no embedding")
    cache_dir = d.cache_dir or out / "token-cache"
    cache = data.build_token_cache(list(d.data or ()), tokenizer, cache_dir, text_field=d.text_field,
                                   model_vocab=md.vocab_size, model_where=str(md.path / hf_io.CONFIG))
    samples = data.PackedSequences(cache, d.seq, d.packing, d.doc_mask)
    train, heldout = samples.split(d.heldout_fraction)
    eval_cache = None
    if d.eval_data:  # a held-out set of its own: all of it evaluates, all of --data trains
        eval_cache = data.build_token_cache(list(d.eval_data), tokenizer, cache_dir, text_field=d.text_field,
                                            model_vocab=md.vocab_size, model_where=str(md.path / hf_io.CONFIG))
        heldout = data.PackedSequences(eval_cache, d.seq, d.packing, d.doc_mask)
    data.BatchLoader(train, batch, dp_size=dp)  # fewer samples than one global batch: its DataError, now
    eval_at_end, notes = _held_out_fits(cfg, train, heldout, own_set=eval_cache is not None)
    attn = cfg.model.attn or _attention(md)
    meta = _meta_model(md.config)  # shapes only: counted for memory, named for the weights files
    hf_io.check_weights(md, meta)
    _check_memory(cfg, md, meta)
    local = _check_architecture(md, split, attn, meta)
    experts_seen = _check_experts(cfg, md, meta)
    _check_tensor_parallel(cfg, md, meta, split, S)
    described = f"{train.describe()} for training, {len(heldout)} " + ("from --eval-data" if eval_cache else "held out")
    return HFModelConfig(path=str(md.path.resolve()), local=local, attn=attn, split=split, cache=str(cache.path),
                         eval_cache=str(eval_cache.path) if eval_cache is not None else None, eval_at_end=eval_at_end,
                         export=hf_io.export_metadata(md, S, split, hf_io.tokenizer_files(md.path)),
                         describe=md.describe(), data_describe="; ".join([described, *notes]), router_loss=router_loss,
                         experts_seen=experts_seen)


def _held_out_fits(cfg: TrainConfig, train: Any, heldout: Any, own_set: bool) -> tuple[bool, list[str]]:
    """(evaluate at the end?, notes): whether the held-out samples make one global batch.  When they must (an
    --eval-data set, or --eval-every) and do not, a refusal that says what to set — the --eval-fraction that holds
    one batch out of --data's samples while one is left to train on, or that no fraction can."""
    from pipedsl.trainer import data

    batch, d = cfg.training.batch, cfg.data
    if not (d.heldout_fraction or own_set) or len(heldout) >= batch:
        return bool(d.heldout_fraction or own_set), []
    if own_set:
        data.eval_batches(heldout, batch, 0, cfg.parallel.dp)  # raises, naming the sizes
    if not cfg.eval.eval_every:
        return False, [f"no evaluation: {len(heldout)} held-out samples, fewer than one batch of {batch}"]
    n = len(train) + len(heldout)
    if n < 2 * batch:
        raise PipeDSLError(f"--eval-every {cfg.eval.eval_every}: the data makes {n} samples of {d.seq} tokens, "
                           f"too few for a training batch and a held-out batch of {batch} each; lower --batch, give "
                           f"--eval-data, or drop --eval-every")
    fraction = math.ceil(batch / n * 1000) / 1000  # ceil(fraction · n) >= batch, to three decimals
    raise PipeDSLError(f"--eval-fraction {d.heldout_fraction:g} holds out {len(heldout)} of the data's {n} samples, "
                       f"fewer than one evaluation batch of {batch}: --eval-fraction {fraction:g} holds out one (or "
                       f"give --eval-data, or drop --eval-every)")


def num_experts(config: Any) -> int:
    """The experts of each MoE layer a transformers config declares (its name differs by family); 0: dense."""
    return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)


def _check_experts(cfg: TrainConfig, md: Any, meta: Any) -> bool:
    """Whether pipedsl sees the MoE model's experts (parallel/expert.py's interface): what `--ep` shards and the
    router statistics count.  A model whose experts it cannot see still trains exactly (its loss was checked),
    but `--ep` is refused and no statistics are logged, each said by name — never zeros nor a layout that shards
    nothing."""
    from pipedsl.models.hf.stages import adapt_model
    from pipedsl.parallel.expert import is_experts, why_no_experts

    if not num_experts(md.config):
        return False
    adapt_model(meta)  # as the stages will be
    if any(is_experts(m) for m in meta.modules()):
        return True
    why = f"{type(meta).__name__} ({md.path}): {why_no_experts(meta)}"
    if cfg.parallel.ep > 1:
        raise PipeDSLError(f"--ep {cfg.parallel.ep}: pipedsl cannot shard the experts of {why}")
    print(f"note: no router statistics (tokens_per_expert): {why}", flush=True)
    return False


def _seq2seq_config(cfg: TrainConfig, program: Any, out: Path, md: Any) -> HFModelConfig:
    """`hf_config` for an encoder-decoder: (source, target) pairs of two fields, or T5's span corruption of the
    text (trainer/seq2seq_data.py); each rank builds only its stages where `LocalStages` can (T5, mT5), else the
    whole model, cut by `seq2seq_stages`."""
    from pipedsl.models.hf import io as hf_io
    from pipedsl.trainer import data, seq2seq_data

    d, batch, S = cfg.data, cfg.training.batch, program.num_stages
    if cfg.parallel.ep > 1:
        raise PipeDSLError(f"--ep {cfg.parallel.ep}: expert parallelism shards decoders' MoE layers; {md.path} is an "
                           f"encoder-decoder ({md.kind})")
    enc, dec = hf_io.seq2seq_layers(md.config)
    if S > enc + dec + 3:
        raise PipeDSLError(f"{md.path}: an encoder input, {enc} encoder layers, a decoder input, {dec} decoder layers "
                           f"and a head make {enc + dec + 3} pieces, fewer than the program's {S} stages")
    if cfg.model.split != "count":
        raise PipeDSLError(f"--split {cfg.model.split}: {md.path} is an encoder-decoder, cut by unit count "
                           f"(--split count)")
    if cfg.parallel.tp > 1:
        raise PipeDSLError(f"--tp {cfg.parallel.tp}: tensor parallelism of encoder-decoders is not supported yet "
                           f"({md.path} is a {md.kind}); use dp and pp")
    if d.packing != "pack" or d.doc_mask:
        raise PipeDSLError(f"--packing / --doc-mask: {md.path} is an encoder-decoder, whose rows are one record or one "
                           f"span-corrupted window each, padded")
    target_seq = d.target_seq or d.seq
    longest = max(md.max_positions or 0, 0)
    if longest and max(d.seq, target_seq) > longest:
        raise PipeDSLError(f"--seq {d.seq} / --target-seq {target_seq}: longer than the model's {longest} positions "
                           f"(max_position_embeddings in {md.path / hf_io.CONFIG})")
    tokenizer = data.load_tokenizer(cfg.model.model)
    if tokenizer.vocab_size > md.vocab_size:
        raise PipeDSLError(f"the tokenizer of {md.path} has {tokenizer.vocab_size} tokens, more than the model's "
                           f"vocab_size {md.vocab_size}: ids past {md.vocab_size - 1} have no embedding")
    config = md.config
    pad = config.pad_token_id if config.pad_token_id is not None else tokenizer.eos_id
    start = config.decoder_start_token_id if config.decoder_start_token_id is not None else pad
    cache_dir = d.cache_dir or out / "token-cache"
    where = str(md.path / hf_io.CONFIG)

    def caches(paths: Any) -> tuple[str, str | None]:  # (the source or text cache, the target cache)
        fields = (d.source_field, d.target_field) if d.source_field else (d.text_field, None)
        return tuple(None if f is None else data.build_token_cache(list(paths), tokenizer, cache_dir, text_field=f,
                                                                    model_vocab=md.vocab_size, model_where=where).path
                     for f in fields)

    if d.source_field:
        objective = seq2seq_data.Seq2SeqObjective("pairs", int(pad), int(start), target_seq=target_seq)
    else:  # (its sentinels checked before any tokenizing)
        objective = seq2seq_data.Seq2SeqObjective(
            "spans", int(pad), int(start), sentinels=tuple(seq2seq_data.sentinel_ids(tokenizer, str(md.path))),
            noise_density=d.noise_density, mean_noise_span=d.mean_noise_span, seed=cfg.model.seed)
    train_caches = caches(d.data)
    objective = replace(objective, target_cache=train_caches[1])
    samples = seq2seq_data.samples(objective, train_caches[0], d.seq)
    train, heldout = samples.split(d.heldout_fraction)
    eval_caches = caches(d.eval_data) if d.eval_data else None
    if eval_caches:
        objective = replace(objective, eval_target_cache=eval_caches[1])
        heldout = seq2seq_data.samples(objective, eval_caches[0], d.seq, held_out=True)
    data.BatchLoader(train, batch, dp_size=cfg.parallel.dp)
    eval_at_end, notes = _held_out_fits(cfg, train, heldout, own_set=bool(eval_caches))
    attn = cfg.model.attn or _attention(md)
    meta = _meta_model(md.config)
    hf_io.check_weights(md, meta)
    _check_memory(cfg, md, meta)
    from pipedsl.models.hf.seq2seq import check_seq2seq_architecture, shallow_seq2seq_config

    try:
        checked = check_seq2seq_architecture(meta, attn=attn)
    except PipeDSLError as err:
        raise PipeDSLError(f"{md.path}: {err.message}") from None
    if checked is None:
        print(f"note: the architecture check is skipped (one layer of {md.path.name} is too large)", flush=True)
        local = _weights_cover(md, meta)
    else:  # the shallow copy cut like the check cuts it: every kind of stage, T5's borrowed bias included
        local = _builds_locally(md, shallow_seq2seq_config(md.config), 3, attn, meta)
    split = StageCut()
    described = f"{train.describe()} for training, {len(heldout)} " + ("from --eval-data" if eval_caches else
                                                                        "held out")
    return HFModelConfig(path=str(md.path.resolve()), local=local, attn=attn, split=split,
                         cache=train_caches[0], eval_cache=eval_caches[0] if eval_caches else None,
                         eval_at_end=eval_at_end, seq2seq=objective,
                         export=hf_io.export_metadata(md, S, split, hf_io.tokenizer_files(md.path)),
                         describe=md.describe(), data_describe="; ".join([described, *notes]))


def _split(how: str, layers: int, num_stages: int, md: Any) -> StageCut:
    """`--split count`: embedding, layers and head spread as units; `blocks`: every stage the same number of
    decoder layers (±1), the embedding with the first and the head with the last (Megatron's split); `flops`:
    the units balanced by the FLOPs a token costs in each (models/split.py's `matmul_weights`: a large
    vocabulary's head weighs what it costs), read off the model on the meta device."""
    points = split_points(how)
    if points is not None:
        check_points(points, layers + 2, num_stages, str(md.path))
        return StageCut(points=tuple(points))
    if how == "flops":
        from pipedsl.models.hf.stages import _Parts
        from pipedsl.models.split import _bounds

        parts = _Parts(_meta_model(md.config))
        units = [parts.embed, *parts.layers, parts.head]
        if num_stages > len(units):
            raise PipeDSLError(f"--split flops: {md.path} has {len(units)} units (embedding, layers, head), fewer "
                               f"than the program's {num_stages} stages")
        return StageCut(points=tuple(_bounds(units, num_stages, "flops", None)[1:-1]))
    if how != "blocks":
        return StageCut()
    if layers < num_stages:
        raise PipeDSLError(f"--split blocks: {md.path} has {layers} decoder layers, fewer than the program's "
                           f"{num_stages} stages")
    sizes = [layers // num_stages + (k < layers % num_stages) for k in range(num_stages)]
    return StageCut(points=tuple(1 + sum(sizes[:k]) for k in range(1, num_stages)))


def _attention(md: Any) -> str:
    """sdpa where transformers implements it for this model (Gemma 2 has only eager), else eager."""
    import transformers as tf

    mapping = tf.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING if md.seq2seq else tf.MODEL_FOR_CAUSAL_LM_MAPPING
    cls = mapping[type(md.config)]
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def _check_memory(cfg: TrainConfig, md: Any, meta: Any) -> None:
    """Each rank builds only its stages (hf_io.LocalStages): in all, every dp replica holds its share of the
    model states — parameters, gradients, fp32 main parameters and AdamW's moments under the run's precision
    and ZeRO stage, as the planner counts them (`pipedsl.plan.memory.model_states`)."""
    if cfg.run.allow_oversubscribe:
        return
    dp, zero = cfg.parallel.dp, cfg.parallel.zero
    params = sum(p.numel() for p in meta.parameters())
    mode = cfg.training.state_bytes
    need, memory = dp * model_states(params, dp, zero, mode).total, total_memory()
    if memory and need > memory:
        raise PipeDSLError(f"{md.path}: {params / 1e6:.1f} M parameters on {dp} data-parallel replica(s) need "
                           f"about {need / 2**30:.3g} GiB of model states ({mode.total} bytes a parameter before "
                           f"ZeRO {zero} shards them), more than this machine's {memory / 2**30:.3g} GiB "
                           f"(--allow-oversubscribe to run anyway)")


def _check_tensor_parallel(cfg: TrainConfig, md: Any, meta: Any, split: StageCut, S: int) -> None:
    """`--tp`: the model's stages split as models/hf/parallelize.py splits them — its own checks (the Llama layout,
    heads, kv heads, vocabulary and MLP divisible by tp, no dropout, what it composes with), run here on the
    meta-device stages, so that a model it refuses is one line before any rank starts."""
    tp = cfg.parallel.tp
    if tp == 1:
        return
    from pipedsl.models.hf.parallelize import check_stages
    from pipedsl.models.hf.stages import causal_lm_stages
    from pipedsl.parallel import ParallelConfig
    from pipedsl.parallel.config import ParallelConfigError

    try:
        check_stages(causal_lm_stages(meta, S, **split.keywords(), check=False),
                     ParallelConfig(dp=cfg.parallel.dp, pp=S, tp=tp, zero=cfg.parallel.zero),
                     cfg.parallel.sequence_parallel)
    except ParallelConfigError as err:
        raise PipeDSLError(f"--tp {tp}: {md.path}: {err.message.removeprefix('tp_hf_stages: ')}") from None


def _check_architecture(md: Any, split: StageCut, attn: str, meta: Any = None) -> bool:
    """The model's stages reproduce its own forward (`hf.check_split`), tried once here on the shallow copy
    with random weights, so that an architecture pipedsl does not split exactly is refused before any rank
    starts.  Returns whether the ranks can build only their own stages (`hf_io.LocalStages`): every tensor
    filled by the model's own initialisation, and with weights, every parameter in the files under a name."""
    from pipedsl.models.hf.stages import MAX_CHECK_BYTES, check_architecture, shallow_config

    try:
        checked = check_architecture(meta if meta is not None else _meta_model(md.config), attn=attn,
                                     attention_mask=split.attention_mask, position_ids=split.position_ids)
    except PipeDSLError as err:
        raise PipeDSLError(f"{md.path}: {err.message}") from None
    if checked is None:
        print(f"note: the architecture check is skipped (one layer of {md.path.name} is larger than "
              f"{MAX_CHECK_BYTES / 2**30:g} GiB)", flush=True)
        return _weights_cover(md, meta)
    return _builds_locally(md, shallow_config(md.config), 1, attn, meta)


def _builds_locally(md: Any, shallow: Any, num_stages: int, attn: str, meta: Any) -> bool:
    """Whether each rank can build only its stages (`hf_io.LocalStages`), tried on the shallow config with every
    stage held, and with weights, whether every parameter is in the files under a name."""
    import tempfile

    from pipedsl.models.hf.io import LocalStages

    with tempfile.TemporaryDirectory() as tmp:
        shallow.save_pretrained(tmp)
        try:
            LocalStages(tmp, num_stages, StageCut(), set(range(num_stages)), attn=attn)
        except LocalStages.NotLocal as why:
            print(f"note: every rank builds the whole model ({why})", flush=True)
            return False
    return _weights_cover(md, meta)


def _weights_cover(md: Any, model: Any = None) -> bool:
    """Every parameter of the model (`model`: its meta-device copy) is in its safetensors files under one of its
    names (or there are none)."""
    from pipedsl.models.hf.io import _weights_reader

    weights = _weights_reader(md.path)
    if weights is None:
        return True
    model = model if model is not None else _meta_model(md.config)
    names: dict[int, list[str]] = {}
    for n, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(n)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    missing = [ns[0] for ns in names.values() if not any(n in weights.keys for n in ns) and params.intersection(ns)]
    if missing:
        print(f"note: every rank builds the whole model ({missing[0]} is not in the weights files under its own "
              f"name)", flush=True)
    return not missing


def _meta_model(config: Any) -> Any:
    """The language model of `config` on the meta device: its shapes and names, no memory.  A config transformers
    read but cannot build a model of (what models/hf/config_checks.py does not foresee) is one line naming it."""
    import torch

    from pipedsl.errors import one_line
    from pipedsl.models.hf import CONFIG, ModelDirError
    from pipedsl.models.hf.io import auto_class

    try:
        with torch.device("meta"):
            return auto_class(config).from_config(config, dtype=torch.float32)
    except Exception as err:  # noqa: BLE001 - whatever transformers' model code refuses, said in one line
        where = Path(config.name_or_path) / CONFIG if getattr(config, "name_or_path", "") else type(config).__name__
        raise ModelDirError(f"{where}: transformers cannot build its model: {type(err).__name__}: "
                            f"{one_line(err)}") from None


def _count_parameters(config: Any) -> int:
    return sum(p.numel() for p in _meta_model(config).parameters())


def meta_stages(cfg: TrainConfig, num_stages: int) -> tuple[list, str]:
    """The run's stages on the meta device (shapes only), to compare with a checkpoint's partition."""
    import transformers as tf

    from pipedsl.models.hf.io import model_stages

    hfc = cfg.hf
    assert hfc is not None, "meta_stages: a Hugging Face run's configuration (hf_config's)"
    model = _meta_model(tf.AutoConfig.from_pretrained(hfc.path, local_files_only=True))
    stages = model_stages(model, num_stages, hfc.split, check=False)  # checked by hf_config
    return stages, f"{os.path.basename(hfc.path)} cut into {num_stages} stages"
