"""How a Hugging Face decoder's stages are parallelized: torchtitan's tensor (and sequence) parallel plan for
Llama, then the MoE layers' experts sharded over ep.

    mesh = ParallelMesh(ParallelConfig(dp=2, pp=2, tp=2, ep=2))
    stages = causal_lm_stages(model, program.num_stages)            # same seeded dense model on every rank
    parallelize_hf(stages, mesh, sequence_parallel=True)            # in place: tp over mesh's tp dimension, experts
    pipe = Pipeline(stages, program=program, loss_fn=tp_hf_loss(mesh), parallel=mesh)   # over its ep groups

`parallelize_hf` is everything layout-specific: `tp_hf_stages` when tp > 1, `shard_experts_over` (parallel/expert.py)
when ep > 1 — each MoE layer's experts module (the model's own, or its view: models/hf/jetmoe.py) cut to this rank's
share.  Encoder-decoders take neither (the trainer refuses --tp and --ep for them, trainer/hf_setup.py).

`tp_hf_stages` applies the plan with torch's `parallelize_module` on the stages' own modules (so parameter
names and ties stay those of the HF model):

    embed_tokens   RowwiseParallel: vocabulary-split table [V/t, C], partial lookups summed
    q/k/v_proj     ColwiseParallel: heads split; GQA works because query and key/value heads are
                   split in the same proportion (head i's kv head i // groups stays on its rank)
    q_norm/k_norm  (Qwen3, per head) replicated weights on the local heads, gradient summed over tp
    o_proj         RowwiseParallel
    gate/up_proj   ColwiseParallel;  down_proj RowwiseParallel
    lm_head        ColwiseParallel → logits [mb, T, V/t] as a local tensor, never gathered;
                   `tp_hf_loss` is the vocabulary-parallel cross-entropy (tp1d's explicit one)

Without sequence parallelism the hidden states are plain tensors [mb, T, C], the same on every
tp rank; norms are plain modules whose weights are copies over tp (`mark_replicated`), and the
row-parallel outputs are all-reduced.  With `sequence_parallel=True` the hidden states between
the blocks are DTensors sharded on the sequence, [mb, T/t, C] per rank: the norms run under
`SequenceParallel` on the shard, the attention and MLP inputs are all-gathered
(`PrepareModuleInput` Shard(1) → Replicate) and the row-parallel outputs reduce-scattered back
to the shard (Korthikanti et al. 2022).  Rotary embeddings and masks need the whole sequence:
the stage computes them from the DTensor's global shape and the position ids, which every rank
has whole, and attention runs on the gathered sequence.  The norms' gradients are summed over tp
once per step (`sum_grads_later`); the DTensor mechanics — gradient placements, plain tensors at
stage boundaries, ZeRO on the shards — are parallel/tp_hf.py's.

Mixtures of experts: a layer whose `mlp` (or `block_sparse_moe`) is an MoE block — a router and
experts rather than gate/up/down_proj — keeps the block whole and runs it on this rank's share of
the tokens (parallel/moe_tp.py: a sequence shard with SP, 1/t of the rows without), so its
experts may be sharded over ep as well (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE,
GraniteMoE, DeepSeek-V2/V3).  DeepSeek's multi-head latent attention keeps its down-projections and
their norms whole and splits its up-projections to the heads by column (with SP: on the gathered sequence).

An attention module that splits itself (a `tensor_parallel(tp_mesh, sequence_parallel)` method its model family
gives it: JetMoE's mixture of attention heads, models/hf/jetmoe.py) is left to it, beside an MoE block.

Supported: decoders whose layers are `self_attn` (q/k/v/o_proj, optional per-head q/k norms) or an attention
that splits itself, `mlp` (gate/up/down_proj, or an MoE block), `input_layernorm`, `post_attention_layernorm` —
Llama, Mistral, Qwen2, Qwen3, JetMoE and the MoE families above.  Tied embeddings stay one parameter
(embedding and head hold the same row block).  Others are refused by name (`check_stages`).  Checkpoints hold
each rank's shards and load under any tp and ZeRO stage, and `pipedsl export` puts the shards back
together (runtime/checkpoint/state.py: `_retp`, `read_model`).  Not yet: dropout, 3-D tp, encoder-decoders.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from pipedsl.parallel.comm import copy_to_group
from pipedsl.parallel.config import ParallelConfig, ParallelConfigError
from pipedsl.parallel.expert import shard_experts_over
from pipedsl.parallel.mesh import ParallelMesh
from pipedsl.parallel.moe_tp import TokenShare, split_tokens
from pipedsl.parallel.replicated import mark_replicated, sum_grads_later
from pipedsl.parallel.tp1d import vocab_parallel_cross_entropy
from pipedsl.parallel.tp_hf import hook_grads, local_output, sequence_divides, shard_input

ATTN = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP = {"gate_proj", "up_proj", "down_proj"}
NORMS = {"input_layernorm", "post_attention_layernorm"}
LAYER = {"self_attn", "mlp", *NORMS}
MOE_NAMES = ("mlp", "block_sparse_moe")  # where a layer keeps its MoE block (GraniteMoE: block_sparse_moe)
# DeepSeek's multi-head latent attention: the low-rank down-projections and their norms stay whole on every rank
# (replicated, their inputs and gradients the same on each), the up-projections to the heads column-parallel
MLA_REPLICATED = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")
MLA = {"q_proj", "q_b_proj", "kv_b_proj", "o_proj", *MLA_REPLICATED}


def parallelize_hf(stages: Sequence[nn.Module], mesh: ParallelMesh, *,
                   sequence_parallel: bool = False) -> list[nn.Module]:
    """This rank's `causal_lm_stages` parallelized in place for `mesh`: tensor-parallel when tp > 1, each experts
    module this rank's share over ep when ep > 1; returns them.  Collective over the tp group (slicing)."""
    stages = list(stages)
    if mesh.config.tp > 1:
        tp_hf_stages(stages, mesh, sequence_parallel=sequence_parallel)
    elif sequence_parallel:
        raise ParallelConfigError("sequence parallelism needs tensor parallelism (tp > 1)")
    shard_experts_over(stages, mesh)
    return stages


def tp_hf_stages(stages: Sequence[nn.Module], mesh: ParallelMesh, *,
                 sequence_parallel: bool = False) -> list[nn.Module]:
    """Tensor-parallelise this rank's `causal_lm_stages` in place over `mesh`'s tp dimension; returns them.

    Every rank must have built the stages from the same seeded dense model: each keeps its slices.
    """
    stages = list(stages)
    if not stages:
        return stages
    t, _ = check_stages(stages, mesh.config, sequence_parallel)
    if t == 1:
        return stages
    tp_mesh: DeviceMesh = mesh.device_mesh["tp"]
    group, sp = mesh.tp_group, sequence_parallel
    share = TokenShare(group, sp)  # the tokens an MoE block runs on this rank
    first = next((st for st in stages if st.embed is not None), None)
    last = next((st for st in stages if st.head is not None), None)
    tied = (first is not None and last is not None
            and first.embed.embed_tokens.weight is last.head.lm_head.weight)
    for stage in stages:
        if getattr(stage, "_pipedsl_tp", None) is not None:
            raise ParallelConfigError("tp_hf_stages: this stage is already tensor-parallel")
        stage._pipedsl_tp = "sp" if sp else "tp"
        if stage.embed is not None:
            parallelize_module(stage.embed, tp_mesh, {"embed_tokens": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate(), use_local_output=not sp)})
        for layer in stage.layers.values():
            if _parallelize_layer(layer, tp_mesh, group, sp, share):
                stage.token_share = share
        if stage.head is not None:
            _parallelize_head(stage.head, tp_mesh, group, sp)
        stage.register_forward_pre_hook(hook_grads)
        if sp:  # stage boundaries carry the plain sequence shard [mb, T/t, C]
            stage.register_forward_pre_hook(sequence_divides(t) if stage.embed is not None else shard_input(tp_mesh))
            stage.register_forward_hook(local_output)
    if tied:  # both are [V/t, C] row blocks of the one weight (vocabulary-parallel): one DTensor parameter again
        last.head.lm_head.weight = first.embed.embed_tokens.weight
    return stages


def tp_hf_loss(mesh: ParallelMesh, reduction: str = "mean",
               ignore_index: int = -100) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """HF's causal-LM cross-entropy of this rank's logits block [mb, T, V/t] against targets [mb, T].

    The value is the microbatch's loss on every tp rank (no logits gathered: a max, a sum-exp and
    the target logit are all-reduced); `reduction="sum"` is for `Pipeline(loss_reduction="token")`.
    Logits are upcast to fp32, as `causal_lm_loss` does.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    group = mesh.tp_group

    def loss(logits: torch.Tensor | tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        aux = None
        if isinstance(logits, tuple):  # (logits, an MoE's router loss, the same on every tp rank: RouterLoss)
            logits, aux = logits
            if reduction != "mean":
                raise ParallelConfigError("an MoE's auxiliary loss is added to each microbatch's mean loss: use "
                                          "tp_hf_loss(mesh) (reduction='mean') with loss_reduction='microbatch'")
        keep = targets != ignore_index
        safe = targets.masked_fill(~keep, 0)  # an ignored target's id is irrelevant: its loss is zeroed
        per_token = vocab_parallel_cross_entropy(logits.float(), safe, group)  # [mb, T]
        total = per_token.masked_fill(~keep, 0.0).sum()
        out = total if reduction == "sum" else total / keep.sum()
        return out + aux.to(out.device) if aux is not None else out

    return loss


# ------------------------------------------------------------------------------------------ what the plan takes


def is_mla(attention: nn.Module) -> bool:
    """Whether `attention` is DeepSeek's multi-head latent attention (children within `MLA`, a kv_b_proj)."""
    kids = {n for n, m in attention.named_children() if m is not None}
    return "kv_b_proj" in kids and kids <= MLA


def own_attention(layer: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, module) of a layer's attention that splits itself over tp (a `tensor_parallel(tp_mesh,
    sequence_parallel)` method a model family provides: JetMoE's mixture of attention heads, models/hf/jetmoe.py);
    None for the q/k/v/o layout this plan splits."""
    for name, child in layer.named_children():
        if callable(getattr(child, "tensor_parallel", None)):
            return name, child
    return None


def moe_block(layer: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, module) of the layer's MoE block: its MLP slot holding experts (a module with an int `num_experts`
    or `num_local_experts`) rather than gate/up/down_proj; None for a dense layer."""
    for name in MOE_NAMES:
        block = getattr(layer, name, None)
        if block is None or MLP <= {n for n, _ in block.named_children()}:
            continue
        if any(isinstance(getattr(m, a, None), int) for m in block.modules()
               for a in ("num_experts", "num_local_experts")):
            return name, block
    return None


def check_stages(stages: Sequence[nn.Module], config: ParallelConfig,
                 sequence_parallel: bool = False) -> tuple[int, Any]:
    """The tp size and the model config; refuse what this plan cannot split, with the reason.  Needs only the
    stages' shapes and names (meta-device stages do): `pipedsl train` runs it before any rank starts."""
    if config.tp_mode != "1d":
        raise ParallelConfigError("tp_hf_stages: Hugging Face stages support 1-D tensor parallelism only")
    t = config.tp
    config = stages[0].config
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    for what, n in (("num_attention_heads", heads), ("num_key_value_heads", kv), ("vocab_size", config.vocab_size),
                    ("intermediate_size", config.intermediate_size)):
        if n % t:
            raise ParallelConfigError(f"tp_hf_stages: {what}={n} is not divisible by tp={t}")
    for name in ("attention_dropout", "hidden_dropout", "embd_pdrop"):
        if float(getattr(config, name, 0.0) or 0.0):
            raise ParallelConfigError(f"tp_hf_stages: {name} must be 0 (tensor-parallel dropout needs per-rank RNG)")
    for stage in stages:
        if stage.embed is not None and stage.embed.wpe is not None:
            raise ParallelConfigError("tp_hf_stages: learned position embeddings (wpe) are not supported")
        for i, layer in stage.layers.items():
            _check_layer(i, layer)
    return t, config


def _check_layer(i: int, layer: nn.Module) -> None:
    """Refuse decoder layer `i` unless it is in a layout this plan splits (the module docstring's "Supported")."""
    kids = {n for n, _ in layer.named_children()}
    own = own_attention(layer)
    if own is not None:  # it splits itself: the rest of the layer is an MoE block and the two norms
        moe = moe_block(layer)
        if moe is None or kids != {own[0], moe[0], *NORMS}:
            raise ParallelConfigError(f"tp_hf_stages: layer {i} ({type(layer).__name__}) has an attention "
                                      f"that splits itself but not an MoE block and two norms beside it")
        return
    attn = {n for n, _ in getattr(layer, "self_attn", nn.Module()).named_children()}
    moe = moe_block(layer)
    mlp = {n for n, _ in getattr(layer, "mlp", nn.Module()).named_children()}
    dense = kids == LAYER and MLP <= mlp
    mla = is_mla(getattr(layer, "self_attn", nn.Module()))
    if (not dense and (moe is None or kids != {"self_attn", moe[0], *NORMS})) \
            or not (mla or ATTN <= attn <= ATTN | {"q_norm", "k_norm"}):
        raise ParallelConfigError(f"tp_hf_stages: layer {i} ({type(layer).__name__}) is not in the Llama "
                                  f"layout (self_attn.q/k/v/o_proj or DeepSeek's latent attention, "
                                  f"mlp.gate/up/down_proj or an MoE block, two norms)")
    if mla:
        return
    head_dim = layer.self_attn.head_dim
    for n in ("q_norm", "k_norm"):
        norm = getattr(layer.self_attn, n, None)
        if norm is not None and any(p.shape != (head_dim,) for p in norm.parameters()):
            raise ParallelConfigError(f"tp_hf_stages: layer {i}'s {n} is not per head (Qwen3 style)")


# ------------------------------------------------------------------------------------------ the plan


def _parallelize_layer(layer: nn.Module, tp_mesh: DeviceMesh, group: Any, sp: bool, share: TokenShare) -> bool:
    """One decoder layer split in place by `_layer_plan`, and what the plan leaves to others: an attention that
    splits itself, latent attention's replicated down-projections, an MoE block's token share, the norms' gradient
    sums.  Returns whether the layer has an MoE block."""
    moe = moe_block(layer)
    own = own_attention(layer)
    attention = own[1] if own is not None else layer.self_attn
    mla = attention if own is None and is_mla(attention) else None
    parallelize_module(layer, tp_mesh, _layer_plan(sp, moe is not None, mla, own is not None))
    if own is not None:
        attention.tensor_parallel(tp_mesh, sp)
    if mla is not None:
        mark_replicated([p for n in MLA_REPLICATED if getattr(mla, n, None) is not None
                         for p in getattr(mla, n).parameters()], group)
        mla.kv_a_proj_with_mqa.register_forward_hook(_shared_rope_key(mla.kv_lora_rank, group))
    if moe is not None:
        split_tokens(moe[1], share, tp_mesh)
    for n in ("q_norm", "k_norm") if own is None else ():
        if getattr(attention, n, None) is not None:
            parallelize_module(attention, tp_mesh, {n: SequenceParallel(sequence_dim=2, use_local_output=True)})
            sum_grads_later(getattr(attention, n))
    if sp:
        sum_grads_later(layer.input_layernorm)
        sum_grads_later(layer.post_attention_layernorm)
    else:
        mark_replicated([*layer.input_layernorm.parameters(), *layer.post_attention_layernorm.parameters()], group)
    return moe is not None


def _parallelize_head(head: nn.Module, tp_mesh: DeviceMesh, group: Any, sp: bool) -> None:
    """The final norm (on the sequence shard with SP) and the column-parallel lm_head: logits [mb, T, V/t]."""
    if sp:
        parallelize_module(head, tp_mesh, {
            "norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=True)})
        sum_grads_later(head.norm)
    else:
        parallelize_module(head, tp_mesh, {"lm_head": ColwiseParallel(use_local_output=True)})
        mark_replicated(head.norm, group)


def _layer_plan(sp: bool, moe: bool = False, mla: nn.Module | None = None, own: bool = False) -> dict[str, Any]:
    """The layer's plan; an MoE layer's (`moe`) leaves its block to `split_tokens`; DeepSeek's latent attention
    (`mla`) splits its up-projections to the heads by column and its output by row, its down-projections whole on
    every rank.  With SP the attention's input is gathered as the dense plan's is (a DTensor, so that a module
    called again by recomputation is right), the down-projections take it as a plain tensor (every rank's the
    same, and so their input gradients: the up-projections sum theirs over tp, the shared rotary key is summed by
    `_shared_rope_key`), and the output is reduce-scattered to the sequence shard."""
    plan = _dense_layer_plan(sp)
    if moe:
        plan = {k: v for k, v in plan.items() if not k.startswith("mlp")}
    if own:  # an attention that splits itself (`own_attention`): its entries are its own
        plan = {k: v for k, v in plan.items() if not k.startswith("self_attn")}
    if mla is not None:
        plan = {k: v for k, v in plan.items() if not k.startswith("self_attn.")}
        ups = [n for n in ("q_proj", "q_b_proj", "kv_b_proj") if getattr(mla, n, None) is not None]
        plan.update({f"self_attn.{n}": ColwiseParallel() for n in ups})
        if sp:
            downs = [n for n in ("q_a_proj", "kv_a_proj_with_mqa") if getattr(mla, n, None) is not None]
            plan.update({f"self_attn.{n}": PrepareModuleInput(input_layouts=(Replicate(),),
                                                              desired_input_layouts=(Replicate(),),
                                                              use_local_output=True) for n in downs})
            plan["self_attn.o_proj"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        else:
            plan["self_attn.o_proj"] = RowwiseParallel()
    return plan


def _dense_layer_plan(sp: bool) -> dict[str, Any]:
    """Llama's layer: q/k/v and gate/up column-parallel, o and down row-parallel; with SP the norms on the sequence
    shard, the attention's and MLP's inputs gathered, their outputs reduce-scattered."""
    seq = Shard(1)
    if sp:
        return {
            "input_layernorm": SequenceParallel(),
            # DTensor outputs (use_local_output=False): the hook is then idempotent, so a module called
            # again with the arguments it already converted (recomputation, runtime/recompute.py) is right
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": seq},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=seq, use_local_output=False),
        }
    return {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}


def _shared_rope_key(rank: int, group: Any) -> Callable:
    """Forward hook on latent attention's kv_a_proj_with_mqa: its output is the KV latent [.., rank] and one rotary
    key [.., d_rope] that every head shares.  The latent's gradient comes back whole (kv_b_proj is column-parallel:
    its input gradient is all-reduced), but the shared key's sums this rank's heads only: `copy_to_group` sums it
    over tp (Megatron's f on the rotary key)."""
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return torch.cat([out[..., :rank], copy_to_group(out[..., rank:], group)], dim=-1)
    return hook
