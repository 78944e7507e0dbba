"""Tensor (and sequence) parallelism for Hugging Face decoder stages, with torch's DTensor TP API.

    mesh = ParallelMesh(ParallelConfig(pp=2, tp=2))
    stages = causal_lm_stages(model, program.num_stages)            # same seeded dense model on every rank
    tp_hf_stages(stages, mesh, sequence_parallel=True)              # in place, over mesh's tp dimension
    pipe = Pipeline(stages, program=program, loss_fn=tp_hf_loss(mesh), parallel=mesh)

The plan is torchtitan's for Llama, applied with `parallelize_module` on the stages' own modules
(so parameter names and ties stay those of the HF model):

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
has whole, and attention runs on the gathered sequence.

Stage boundaries carry plain tensors (the runtime sends no DTensors): with SP a stage takes and
gives the local sequence shard [mb, T/t, C]; without, the replicated [mb, T, C].  A pre-hook wraps
the received shard with `DTensor.from_local`, a post-hook returns `to_local()`.  Sequence
parallelism needs T % t == 0.

Gradients are given their weight's placements by a hook as they are computed.  Replicated
DTensor weights used on sharded activations (SP norms, Qwen3's q/k norms) receive a `Partial`
gradient from DTensor, which would all-reduce it in every backward; they are marked
`sum_grads_later` instead (parallel/replicated.py), keep each rank's partial sum through the
step's microbatches, and the pipeline sums them over tp once per step
(`SequenceParallelGradSum`, one all-reduce per stage), as Megatron's SP all-reduces the LayerNorm
gradients once.  The vocabulary-split embedding receives a `Replicate` [V, C] gradient (DTensor's
embedding backward), sliced to the rank's rows.  Global norms count a replicated weight once over
the tp group (runtime/clip.py).

ZeRO (1–3, and 0 with bf16 parameters over fp32 main parameters) takes the DTensor parameters
as their local shards, the way FSDP2's `fully_shard` composes with torch's TP: every dp replica
at one tp coordinate has the same shard shapes, so its flat buffers line up over dp; the views it
installs before each forward are wrapped back into DTensors with `DTensor.from_local`, whose
backward gives the gradient the weight's placements exactly as `_grad_like_param` does here
(parallel/zero.py).

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
(embedding and head hold the same row block).  Others are refused by name.  Checkpoints hold each
rank's shards and load under any tp and ZeRO stage, and `pipedsl export` puts the shards back
together (runtime/checkpoint/state.py: `_retp`, `read_model`).  Not yet: dropout, 3-D tp.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from pipedsl.parallel.comm import copy_to_group
from pipedsl.parallel.config import ParallelConfig, ParallelConfigError
from pipedsl.parallel.mesh import ParallelMesh
from pipedsl.parallel.moe_tp import TokenShare, split_tokens
from pipedsl.parallel.replicated import mark_replicated, partial_local, sum_grads_later, sums_grads_later
from pipedsl.parallel.tp1d import vocab_parallel_cross_entropy

ATTN = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP = {"gate_proj", "up_proj", "down_proj"}
NORMS = {"input_layernorm", "post_attention_layernorm"}
LAYER = {"self_attn", "mlp", *NORMS}
MOE_NAMES = ("mlp", "block_sparse_moe")  # where a layer keeps its MoE block (GraniteMoE: block_sparse_moe)
# DeepSeek's multi-head latent attention: the low-rank down-projections and their norms stay whole on every rank
# (replicated, their inputs and gradients the same on each), the up-projections to the heads column-parallel
MLA_REPLICATED = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")
MLA = {"q_proj", "q_b_proj", "kv_b_proj", "o_proj", *MLA_REPLICATED}


def is_mla(attention: nn.Module) -> bool:
    """Whether `attention` is DeepSeek's multi-head latent attention (children within `MLA`, a kv_b_proj)."""
    kids = {n for n, m in attention.named_children() if m is not None}
    return "kv_b_proj" in kids and kids <= MLA


def own_attention(layer: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, module) of a layer's attention that splits itself over tp (a `tensor_parallel(tp_mesh,
    sequence_parallel)` method a model family provides: JetMoE's mixture of attention heads, models/hf/jetmoe.py);
    None for the q/k/v/o layout this file splits."""
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
            kids = {n for n, _ in layer.named_children()}
            own = own_attention(layer)
            if own is not None:  # it splits itself: the rest of the layer is an MoE block and the two norms
                moe = moe_block(layer)
                if moe is None or kids != {own[0], moe[0], *NORMS}:
                    raise ParallelConfigError(f"tp_hf_stages: layer {i} ({type(layer).__name__}) has an attention "
                                              f"that splits itself but not an MoE block and two norms beside it")
                continue
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
                continue
            head_dim = layer.self_attn.head_dim
            for n in ("q_norm", "k_norm"):
                norm = getattr(layer.self_attn, n, None)
                if norm is not None and any(p.shape != (head_dim,) for p in norm.parameters()):
                    raise ParallelConfigError(f"tp_hf_stages: layer {i}'s {n} is not per head (Qwen3 style)")
    return t, config


_HOOKED = "_pipedsl_grad_like_param"  # on the parameter object; moves away with its old payload under swap_tensors


def _grad_like_param(p: nn.Parameter, later: bool) -> None:
    """Give a DTensor weight's gradient the weight's own placements, as soon as it is computed.

    DTensor does not: a replicated weight used on sharded activations (SP norms, Qwen3's q/k
    norms) gets a `Partial` gradient, and the vocabulary-split embedding a `Replicate` one (sliced
    here).  `later` (the norms, marked `sum_grads_later`): the partial gradient is kept as this
    rank's local part, labelled with the weight's placements without communication, and the
    pipeline sums it over tp once per step; otherwise it is all-reduced at once.  Optimizers,
    clipping and the dp reduction then see each rank's shard, or the whole gradient of a copy.
    """
    placements = tuple(p.placements)

    def hook(g: torch.Tensor) -> torch.Tensor:
        if not isinstance(g, DTensor) or tuple(g.placements) == placements:
            return g
        if later:
            return DTensor.from_local(partial_local(g), g.device_mesh, placements, run_check=False,
                                      shape=g.shape, stride=g.stride())
        return g.redistribute(placements=placements)
    p.register_hook(hook)
    setattr(p, _HOOKED, True)


def _hook_grads(stage: nn.Module, args: tuple) -> None:
    """Pre-hook: (re)install the gradient hooks of the stage's DTensor weights before each forward.

    `module.to(device)` — which `Pipeline` calls — swaps a DTensor parameter's payload
    (`torch.utils.swap_tensors`) and with it the gradient accumulator its hooks hang on, so hooks
    installed once at parallelisation would be lost; a marker attribute travels with the payload.
    """
    for m in stage.modules():
        for p in m.parameters(recurse=False):
            if isinstance(p, DTensor) and not getattr(p, _HOOKED, False):
                _grad_like_param(p, sums_grads_later(m))


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
    group = mesh.tp_group
    sp = sequence_parallel
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
                stage.token_share = share
                split_tokens(moe[1], share, tp_mesh)
            for n in ("q_norm", "k_norm") if own is None else ():
                if getattr(attention, n, None) is not None:
                    parallelize_module(attention, tp_mesh, {n: SequenceParallel(sequence_dim=2,
                                                                                use_local_output=True)})
                    sum_grads_later(getattr(attention, n))
            if sp:
                sum_grads_later(layer.input_layernorm)
                sum_grads_later(layer.post_attention_layernorm)
            else:
                mark_replicated([*layer.input_layernorm.parameters(), *layer.post_attention_layernorm.parameters()],
                                group)
        if stage.head is not None:
            if sp:
                parallelize_module(stage.head, tp_mesh, {
                    "norm": SequenceParallel(),
                    "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                               use_local_output=True)})
                sum_grads_later(stage.head.norm)
            else:
                parallelize_module(stage.head, tp_mesh, {"lm_head": ColwiseParallel(use_local_output=True)})
                mark_replicated(stage.head.norm, group)
        stage.register_forward_pre_hook(_hook_grads)
        if sp:
            stage.register_forward_pre_hook(_shard_input(tp_mesh, t))
            stage.register_forward_hook(_local_output)
    if tied:  # both are [V/t, C] row blocks of the one weight (vocabulary-parallel): one DTensor parameter again
        last.head.lm_head.weight = first.embed.embed_tokens.weight
    return stages


def _shared_rope_key(rank: int, group: Any) -> Callable:
    """Forward hook on latent attention's kv_a_proj_with_mqa: its output is the KV latent [.., rank] and one rotary
    key [.., d_rope] that every head shares.  The latent's gradient comes back whole (kv_b_proj is column-parallel:
    its input gradient is all-reduced), but the shared key's sums this rank's heads only: `copy_to_group` sums it
    over tp (Megatron's f on the rotary key)."""
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return torch.cat([out[..., :rank], copy_to_group(out[..., rank:], group)], dim=-1)
    return hook


def _shard_input(tp_mesh: DeviceMesh, t: int) -> Callable:
    """Pre-hook: a received hidden-state shard [mb, T/t, C] becomes a DTensor sharded on the sequence."""
    def hook(stage: nn.Module, args: tuple) -> tuple | None:
        if stage.embed is not None:
            ids = args[0]
            if ids.shape[1] % t:
                raise ParallelConfigError(f"sequence parallelism needs the sequence length ({ids.shape[1]}) "
                                          f"divisible by tp={t}")
            return None
        h = args[0]
        if isinstance(h, DTensor):
            return None
        return (DTensor.from_local(h, tp_mesh, [Shard(1)], run_check=False), *args[1:])
    return hook


def _local_output(stage: nn.Module, args: tuple, out: Any) -> Any:
    """Post-hook: what leaves a stage is a plain tensor (the runtime sends no DTensors)."""
    if isinstance(out, tuple):
        return tuple(o.to_local() if isinstance(o, DTensor) else o for o in out)
    return out.to_local() if isinstance(out, DTensor) else out


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
