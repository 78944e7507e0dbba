"""Checks of models/hf/stages.py on tiny random Hugging Face models, run on every rank of a pool (see conftest.py).

Each check builds the same model on every rank (same seed), keeps a deep copy as the unsplit
reference, runs one pipelined step and compares the loss with `model(input_ids, labels=…).loss`
and every local parameter's gradient with the reference's, by its HF name.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from torch import nn

import pipedsl
from pipedsl.models.hf.stages import causal_lm_loss, causal_lm_stages, shift_labels

VOCAB, T = 96, 8
MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "jetmoe")  # with output_router_logits: the aux loss across stages
TP_MOE_FAMILIES = ("qwen2_moe", "granitemoe")  # more MoE layouts tensor parallelism takes (parallel/moe_tp.py)
# each MoE family's router weights, by name: JetMoE routes its attention heads too (two routers a layer)
ROUTER_SUFFIXES = {"mixtral": ("mlp.gate.weight",), "qwen3_moe": ("mlp.gate.weight",), "olmoe": ("mlp.gate.weight",),
                   "jetmoe": ("mlp.router.layer.weight", "experts.router.layer.weight")}
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "granite", "phi3", "olmo2", "gpt2", "cohere",
            "gpt_neox", "falcon", "starcoder2")
EAGER_ONLY = ("gemma2",)  # transformers refuses sdpa for Gemma 2 (its attention soft-capping)
# (loss, gradient) relative errors allowed: of the loss, and of each gradient tensor's largest entry.
# Measured on these models: fp32 ≤ 1.4e-7 and ≤ 1.2e-6; bf16 ≤ 2.7e-5 and ≤ 1.9e-2 (8 mantissa bits).
TOLERANCE = {None: (1e-5, 1e-4), "bf16": (1e-3, 6e-2)}
LR = 0.5  # plain SGD, large enough that steps change the weights visibly


def tiny_model(family: str, attn: str = "sdpa", tie: bool | None = None, dropout: float = 0.0, layers: int = 3,
               seed: int = 0) -> nn.Module:
    """A random causal LM of `family` (one of FAMILIES); the sliding windows are shorter than the
    sequence, so the per-layer masks matter, and every multiplier or soft-cap is far from 1."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, attention_dropout=dropout,
                  bos_token_id=0, eos_token_id=0, pad_token_id=None)
    if tie is not None:
        common["tie_word_embeddings"] = tie
    if family == "llama":
        config = tf.LlamaConfig(**common)
    elif family == "qwen2":  # layer 0 full attention, layers 1+ a window of 3
        config = tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=3, max_window_layers=1)
    elif family == "qwen3":
        config = tf.Qwen3Config(**common, head_dim=8)
    elif family == "mistral":
        config = tf.MistralConfig(**common, sliding_window=4)
    elif family == "gemma2":  # alternating sliding / global layers, logit and attention soft-capping, scaled embedding
        config = tf.Gemma2Config(**common, head_dim=8, sliding_window=3, final_logit_softcapping=3.0,
                                 attn_logit_softcapping=5.0)
    elif family == "gemma3":  # local and global layers with their own RoPE bases, q/k norms, scaled embedding
        config = tf.Gemma3TextConfig(**common, head_dim=8, sliding_window=3, sliding_window_pattern=2,
                                     final_logit_softcapping=3.0)
    elif family == "granite":  # embedding, residual, attention multipliers and a logit divisor
        config = tf.GraniteConfig(**common, embedding_multiplier=3.0, logits_scaling=4.0, residual_multiplier=0.5,
                                  attention_multiplier=0.2)
    elif family == "phi3":  # fused qkv and gate_up projections, a sliding window on every layer
        config = tf.Phi3Config(**common, sliding_window=4)
    elif family == "olmo2":  # norms after attention and MLP, q/k norms
        config = tf.Olmo2Config(**common)
    elif family == "cohere":  # Command-R: parallel attention and MLP, a logit multiplier far from 1
        config = tf.CohereConfig(**common, logit_scale=0.25)
    elif family == "gpt_neox":  # Pythia: parallel residual, partial rotary, separate head, final_layer_norm
        config = tf.GPTNeoXConfig(**{k: v for k, v in common.items() if k != "num_key_value_heads"}, rotary_pct=0.25,
                                  use_parallel_residual=True, hidden_dropout=dropout)
    elif family == "falcon":  # rotary Falcon (alibi=False), the new decoder architecture with grouped KV heads
        config = tf.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                 num_kv_heads=2, new_decoder_architecture=True, alibi=False, bos_token_id=0,
                                 eos_token_id=0, attention_dropout=dropout, hidden_dropout=dropout,
                                 **({} if tie is None else {"tie_word_embeddings": tie}))
    elif family == "starcoder2":  # biased LayerNorms and projections, a GELU MLP (c_fc, c_proj), a window on every
        # layer, dropout on the residual branches and on the embedding (a bare probability, not a module)
        config = tf.Starcoder2Config(**common, sliding_window=4, use_bias=True, residual_dropout=dropout,
                                     embedding_dropout=dropout)
    elif family == "deepseek_v3":  # MLA, a dense first layer, shared experts, group-limited routing, no aux loss
        config = tf.DeepseekV3Config(**{k: v for k, v in common.items() if k != "num_key_value_heads"},
                                     num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4,
                                     num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                                     topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, v_head_dim=8,
                                     qk_nope_head_dim=4, norm_topk_prob=True, routed_scaling_factor=2.5)
    elif family == "deepseek_v2":  # MLA (no q down-projection), a dense first layer, shared experts, greedy top-k
        config = tf.DeepseekV2Config(**{k: v for k, v in common.items() if k != "num_key_value_heads"},
                                     num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4,
                                     num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                     q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4, v_head_dim=8,
                                     qk_nope_head_dim=4)
    elif family == "jetmoe":  # experts in the attention and the MLP; its coefficient is called aux_loss_coef
        config = tf.JetMoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                 num_key_value_heads=2, kv_channels=8, max_position_embeddings=64, bos_token_id=0,
                                 eos_token_id=0, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                 aux_loss_coef=0.5, attention_dropout=dropout,
                                 **({} if tie is None else {"tie_word_embeddings": tie}))
    elif family in (*MOE_FAMILIES, *TP_MOE_FAMILIES):  # 4 experts, top 2, the router's aux loss on (far from 0)
        moe = {"mixtral": dict(num_local_experts=4), "qwen3_moe": dict(num_experts=4, moe_intermediate_size=16),
               "olmoe": dict(num_experts=4),
               "granitemoe": dict(num_local_experts=4),
               "qwen2_moe": dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=24)}[family]
        config = tf.AutoConfig.for_model(family, **common, **moe, num_experts_per_tok=2, output_router_logits=True,
                                         router_aux_loss_coef=0.5)
    elif family == "gpt2":
        config = tf.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=layers, n_head=2, bos_token_id=0,
                               eos_token_id=0, attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout,
                               **({} if tie is None else {"tie_word_embeddings": tie}))
    else:
        raise ValueError(family)
    config.loss_type = "ForCausalLM"  # what HF picks anyway, named so that it does not warn
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    if family == "deepseek_v3":  # its routing bias starts at 0: random, so that the choice of experts depends on it
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("e_score_correction_bias"):
                    p.normal_()
    if family == "starcoder2":  # its biases start at 0: random, so that a bias the stages dropped would show; std
        # 0.1, since larger ones shrink its (already tiny) q_proj gradient into rounding: 6e-5 apart pipelined at 0.5
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(std=0.1)
    return model


def batch(M: int, padded: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(input_ids, attention_mask or None, labels) of 2·M rows; padded: right- and left-padded rows
    spread unevenly over the microbatches (labels -100 on padding, as a collator makes them)."""
    x = torch.randint(VOCAB, (2 * M, T), generator=torch.Generator().manual_seed(3))
    if not padded:
        return x, None, x.clone()
    mask = torch.ones_like(x)
    for row in range(2 * M):
        kind, n = row % 4, 1 + row % 5
        if kind == 0:
            mask[row, T - n - 2:] = 0  # right padding
        elif kind == 2:
            mask[row, :n] = 0  # left padding
        elif kind == 3:
            mask[row, T - 1:] = 0
    return x, mask, x.masked_fill(mask == 0, -100)


def equivalence(rank: int, family: str, schedule: str, M: int, params: dict[str, int] | None = None,
                attn: str = "sdpa", tie: bool | None = None, padded: bool = False, token: bool = False,
                precision: str | None = None, recompute: str | None = None, steps: int = 1) -> dict:
    """`steps` pipelined SGD steps against the unsplit model's `model(x, attention_mask, labels=…)`.

    Every step compares the loss, every local parameter's gradient (by its HF name) and the global
    gradient norm (a tie counted once); then both models take the same SGD step, so after several
    steps every copy of a tied weight (embedding on the first stage, head on the last) must still
    equal the one tied weight of the reference.  `precision="bf16"`: the reference runs under
    `torch.autocast(bf16)`, as HF users do, and the tolerance is bf16's.
    """
    P = torch.distributed.get_world_size()
    program = pipedsl.load(schedule).compile(P=P, M=M, **(params or {}))
    model = tiny_model(family, attn, tie)
    ref = copy.deepcopy(model)
    names = {id(p): n for n, p in model.named_parameters()}
    ref_params = dict(ref.named_parameters())
    x, mask, labels = batch(M, padded)
    stages = causal_lm_stages(model, program.num_stages, attention_mask=padded)
    loss_fn = functools.partial(causal_lm_loss, reduction="sum") if token else causal_lm_loss
    pipe = pipedsl.Pipeline(stages, program=program, loss_fn=loss_fn, precision=precision, recompute=recompute,
                            loss_reduction="token" if token else "microbatch")
    loss_tol, grad_tol = TOLERANCE[precision]
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16")
    local = {names[id(p)]: p for m in pipe.local_stages().values() for p in m.parameters()}
    problems: list[str] = []
    loss_err = grad_err = 0.0
    for step in range(steps):
        loss = pipe.step((x, mask) if padded else x, shift_labels(labels))
        with autocast:
            want = ref(x, attention_mask=mask, labels=labels, use_cache=False).loss
        want.backward()
        loss_err = max(loss_err, abs(loss - want.item()) / abs(want.item()))
        if loss_err > loss_tol:
            problems.append(f"rank {rank} step {step}: loss {loss} != the unsplit model's {want.item()}")
        for name, p in local.items():
            q = ref_params[name].grad
            if p.grad is None:
                problems.append(f"rank {rank} step {step}: {name} has no gradient")
                continue
            err = ((p.grad - q).abs().max() / q.abs().max().clamp_min(1e-12)).item()  # relative to the tensor's scale
            grad_err = max(grad_err, err)
            if err > grad_tol:
                problems.append(f"rank {rank} step {step}: {name}.grad differs (max err {err:.3g} of its max)")
        norm, ref_norm = pipe.grad_norm().item(), torch.nn.utils.get_total_norm(
            [p.grad for p in ref.parameters()]).item()
        if abs(norm - ref_norm) > grad_tol * ref_norm:
            problems.append(f"rank {rank} step {step}: gradient norm {norm} != the unsplit model's {ref_norm}")
        with torch.no_grad():
            for p in [*pipe.parameters(), *ref.parameters()]:
                p -= LR * p.grad
                p.grad = None
    if steps > 1:
        for name, p in local.items():
            if not torch.allclose(p, ref_params[name], rtol=grad_tol, atol=grad_tol * 1e-2):
                problems.append(f"rank {rank}: {name} after {steps} steps differs from the unsplit model's")
    return {"problems": problems, "checked": sorted(local), "all": sorted(names.values()), "ties": len(pipe.ties.names),
            "loss_err": loss_err, "grad_err": grad_err}


def stage_chain(rank: int, family: str, attn: str, num_stages: int, dropout: float, padded: bool,
                positions: bool) -> dict[str, Any]:
    """The stages called in sequence in one process reproduce the model's logits — with dropout on
    (train mode, the same seed: the modules draw in the same order), padding and position ids.
    `use_cache=False` is HF's training forward: only without a KV cache does HF mask packed
    documents (position ids that restart) apart, as the stages always do."""
    model = tiny_model(family, attn, dropout=dropout).train()
    x, mask, _ = batch(2, padded)
    pos = torch.arange(T).repeat(x.shape[0], 1) % 5 if positions else None  # two packed documents a row
    torch.manual_seed(11)
    want = model(x, attention_mask=mask, position_ids=pos, use_cache=False).logits
    stages = causal_lm_stages(model, num_stages, attention_mask=padded, position_ids=positions)
    torch.manual_seed(11)
    h: Any = tuple(t for t in (x, mask, pos) if t is not None)
    for st in stages:
        h = st(*h)
        h = h if isinstance(h, tuple) else (h,)
    with torch.no_grad():  # without dropout the same run twice must give the same logits
        torch.manual_seed(12)
        other = model(x, attention_mask=mask, position_ids=pos, use_cache=False).logits
    return {"err": (h[0] - want).abs().max().item(), "dropout_changes": (other - want).abs().max().item(),
            "kinds": [k for st in stages for k in st.mask_kinds], "sizes": [len(st.layers) for st in stages]}


def bad_requests(rank: int) -> dict[str, str]:
    """The errors of an unsupported model and of more stages than units."""
    from pipedsl.errors import PipeRuntimeError

    out = {}
    for key, call in [("unsupported", lambda: causal_lm_stages(nn.Linear(2, 2), 2)),
                      ("too_many", lambda: causal_lm_stages(tiny_model("llama"), 6))]:
        try:
            call()
            out[key] = "no error"
        except PipeRuntimeError as err:
            out[key] = str(err)
    return out


def moe_equivalence(rank: int, family: str, schedule: str, M: int, params: dict[str, int] | None = None,
                    steps: int = 2) -> dict:
    """An MoE decoder with its router's auxiliary loss, pipelined, against the unsplit model trained with gradient
    accumulation over the same microbatches (HF adds the auxiliary loss to each forward's loss): every step's
    loss, every local gradient, and the weights after `steps` SGD steps."""
    P = torch.distributed.get_world_size()
    program = pipedsl.load(schedule).compile(P=P, M=M, **(params or {}))
    model = tiny_model(family)
    ref = copy.deepcopy(model)
    names = {id(p): n for n, p in model.named_parameters()}
    ref_params = dict(ref.named_parameters())
    x, mask, labels = batch(M, True)
    pipe = pipedsl.Pipeline(causal_lm_stages(model, program.num_stages, attention_mask=True), program=program,
                            loss_fn=causal_lm_loss)
    local = {names[id(p)]: p for m in pipe.local_stages().values() for p in m.parameters()}
    problems: list[str] = []
    for step in range(steps):
        loss = pipe.step((x, mask), shift_labels(labels))
        want = 0.0
        for xm, mm, lm in zip(x.chunk(M), mask.chunk(M), labels.chunk(M)):
            out = ref(xm, attention_mask=mm, labels=lm, use_cache=False)
            (out.loss / M).backward()
            want += out.loss.item() / M
        if abs(loss - want) > 1e-5 * abs(want):
            problems.append(f"rank {rank} step {step}: loss {loss} != the unsplit model's {want}")
        for name, p in local.items():
            q = ref_params[name].grad
            if q is None:  # unused in the unsplit model: no gradient here either (zeros from the reduction)
                if p.grad is not None and bool(p.grad.abs().max() > 0):
                    problems.append(f"rank {rank} step {step}: {name} has a gradient the unsplit model has not")
                continue
            if p.grad is None:
                problems.append(f"rank {rank} step {step}: {name} has no gradient; the unsplit model's is not None")
                continue
            err = ((p.grad - q).abs().max() / q.abs().max().clamp_min(1e-12)).item()
            if err > 1e-4:
                problems.append(f"rank {rank} step {step}: {name}.grad differs (max err {err:.3g} of its max)")
        with torch.no_grad():
            for p in [*pipe.parameters(), *ref.parameters()]:
                if p.grad is not None:
                    p -= LR * p.grad
                    p.grad = None
    gate = [n for n in local if n.endswith("mlp.gate.weight")]
    return {"problems": problems, "gates": gate}
