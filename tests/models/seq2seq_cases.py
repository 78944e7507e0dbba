"""Checks of models/hf/seq2seq.py on tiny random encoder-decoders, run on every rank of a pool (see conftest.py).

Each check builds the same model on every rank (same seed), keeps a deep copy as the unsplit
reference, trains both for a few SGD steps — the pipeline on its share of the global batch (dp),
the reference on all of it with `model(input_ids, attention_mask, decoder_input_ids, labels=…)` —
and compares every step's loss and gradient norm, and at the end every parameter this rank holds
(by its HF name, ZeRO's slices gathered).  SGD moves a weight by exactly its gradient, so equal
weights after the steps mean equal gradients at every step.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import pipedsl
from pipedsl.models.hf.seq2seq import seq2seq_loss, seq2seq_stages
from pipedsl.parallel import ParallelConfig, ParallelMesh

VOCAB, S, T = 64, 9, 6  # source and target lengths differ, so a mix-up of the two fails loudly
FAMILIES = ("t5", "mt5", "umt5", "bart", "mbart", "marian", "pegasus")
LR = 0.5
LOSS_RTOL, PARAM_ATOL = 1e-5, 2e-6  # fp32: summation order only
BF16_LOSS_RTOL = 1e-2  # bf16 against autocast: 8 mantissa bits, rounded in other places
BF16_NORM_RTOL = 5e-2  # the gradient norm: every gradient's rounding summed


def tiny_seq2seq(family: str, seed: int = 0, encoder_layers: int = 3, decoder_layers: int = 3) -> nn.Module:
    """A random encoder-decoder of `family` with dropout off; T5's families share one relative position bias per
    stack (UMT5: one per layer), mT5 keeps its encoder, decoder and head embeddings apart, BART's add learned
    positions, an embedding norm and `final_logits_bias` (made non-zero here, so that it counts)."""
    import transformers as tf

    t5 = dict(vocab_size=VOCAB, d_model=16, d_ff=32, num_layers=encoder_layers, num_decoder_layers=decoder_layers,
              num_heads=2, d_kv=8, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
              relative_attention_num_buckets=8)
    bart = dict(vocab_size=VOCAB, d_model=16, encoder_layers=encoder_layers, decoder_layers=decoder_layers,
                encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=64,
                pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    classes = {"t5": (tf.T5Config, tf.T5ForConditionalGeneration, t5),
               "mt5": (tf.MT5Config, tf.MT5ForConditionalGeneration, t5),
               "umt5": (tf.UMT5Config, tf.UMT5ForConditionalGeneration, t5),
               "bart": (tf.BartConfig, tf.BartForConditionalGeneration, bart),
               "mbart": (tf.MBartConfig, tf.MBartForConditionalGeneration, {**bart, "scale_embedding": True}),
               "marian": (tf.MarianConfig, tf.MarianMTModel, {**bart, "decoder_start_token_id": 1}),
               "pegasus": (tf.PegasusConfig, tf.PegasusForConditionalGeneration, {**bart, "scale_embedding": True})}
    config_cls, model_cls, kwargs = classes[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs))
    bias = getattr(model, "final_logits_bias", None)
    if bias is not None:
        bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(seed)))
    return model


def batch(model: nn.Module, rows: int, step: int = 0) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """((input_ids, attention_mask, decoder_input_ids), labels) of `rows` rows: source padding and label padding
    (-100) spread unevenly over the rows; decoder inputs are the model's own shift of the labels."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(3, VOCAB, (rows, S), generator=g)
    mask = torch.ones_like(ids)
    labels = torch.randint(3, VOCAB, (rows, T), generator=g)
    for r in range(rows):
        mask[r, S - r % 4:] = 0
        labels[r, T - r % 3:] = -100
    return (ids, mask, model.prepare_decoder_input_ids_from_labels(labels)), labels


def train_equal(rank: int, family: str, schedule: str, M: int, params: dict | None = None, dp: int = 1,
                zero: int = 0, points: list[int] | None = None, steps: int = 2,
                recompute: str | None = None, precision: str | None = None) -> dict[str, Any]:
    """`steps` SGD steps of the pipeline (per-token loss, as HF's) against the unsplit model; this rank's findings.
    `precision="bf16"`: the reference runs under `torch.autocast(bf16)` and only the first step's loss is compared,
    to bf16's tolerance (the weights then drift apart by rounding)."""
    world = dist.get_world_size()
    pp = world // dp
    model = tiny_seq2seq(family)
    ref = copy.deepcopy(model)
    hf = {id(p): n for n, p in model.named_parameters()}
    ref_params = dict(ref.named_parameters())
    program = pipedsl.load(schedule).compile(P=pp, M=M, **(params or {}))
    stages = seq2seq_stages(model, program.num_stages, points=points)
    mesh = ParallelMesh(ParallelConfig(dp=dp, pp=pp, zero=zero)) if dp > 1 or zero else None
    pipe = pipedsl.Pipeline(stages, program=program, loss_fn=functools.partial(seq2seq_loss, reduction="sum"),
                            loss_reduction="token", parallel=mesh, recompute=recompute, precision=precision)
    names = {s: {n: hf[id(p)] for n, p in m.named_parameters(remove_duplicate=False)}
             for s, m in pipe.local_stages().items()}
    opt = pipe.optimizer(torch.optim.SGD, lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    problems: list[str] = []
    loss_err = 0.0
    for step in range(steps):
        inputs, labels = batch(ref, 2 * M * dp, step)
        loss = pipe.step(inputs, labels)
        norm = pipe.grad_norm().item()
        opt.step()
        opt.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            want = ref(input_ids=inputs[0], attention_mask=inputs[1], decoder_input_ids=inputs[2], labels=labels,
                       use_cache=False).loss
        want.backward()
        want_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
        ref_opt.step()
        ref_opt.zero_grad()
        err = abs(loss - want.item()) / abs(want.item())
        loss_err = max(loss_err, err)
        if precision is not None:  # the first step's loss and gradient norm (bf16 rounds in other places after it)
            if err > BF16_LOSS_RTOL:
                problems.append(f"rank {rank}: bf16 loss {loss!r} != one process under autocast {want.item()!r}")
            if abs(norm - want_norm) > BF16_NORM_RTOL * want_norm:
                problems.append(f"rank {rank}: bf16 gradient norm {norm!r} != one process under autocast "
                                f"{want_norm!r}")
            break
        if err > LOSS_RTOL:
            problems.append(f"rank {rank} step {step}: loss {loss!r} != one process {want.item()!r}")
        if abs(norm - want_norm) > LOSS_RTOL * want_norm:
            problems.append(f"rank {rank} step {step}: gradient norm {norm!r} != one process {want_norm!r}")
    values = opt.stage_parameters() if precision is None else {}  # a collective over dp under ZeRO-3
    param_err, checked = 0.0, set()  # bf16: no parameter compared, none recorded as checked
    for s, named in values.items():
        for name, v in named.items():
            name_hf = names[s][name]
            checked.add(name_hf)
            err = (v - ref_params[name_hf].detach()).abs().max().item()
            param_err = max(param_err, err)
            if err > PARAM_ATOL:
                problems.append(f"rank {rank} stage {s} {name_hf}: max |pipeline - one process| = {err:.3g}")
    moved = max((p.detach() - q).abs().max().item() for p, q in zip(ref.parameters(), tiny_seq2seq(family).parameters()))
    pipe.close()
    return {"problems": problems, "checked": sorted(checked), "all": sorted(ref_params), "loss_err": loss_err,
            "param_err": param_err, "moved": moved, "ties": len(pipe.ties.names)}
