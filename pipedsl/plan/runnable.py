"""What pipedsl's runtime can run: the rules a layout must meet for the model it is given.

The planner recommends only layouts the runtime runs, so every rule the runtime enforces at
setup is mirrored here, each with the module that enforces it; a layout that breaks one is
rejected with a reason beginning "runtime:" (listed by `pipedsl plan --rejected N`).  The shape
rules every layout meets (batch split, tp divides the sizes, layers split over stages) are in
`search._check_shape`.

Hugging Face decoders (`ModelSpec.layout == "hf"`, `models/hf/parallelize.py` `check_stages` and its docstring):
- 1-D tensor parallelism only (no 3-D);
- heads, key/value heads, vocabulary and intermediate size divisible by tp;
- sequence parallelism needs the sequence divisible by tp (`parallel/tp_hf.py`'s `sequence_divides` pre-hook).
ZeRO 1-3 and bf16 parameters over fp32 main parameters take the DTensor shards (`tp_hf.py`,
`parallel/zero.py`): no rule.

Mixtures of experts: an MoE decoder — a Hugging Face one or the built-in GPT — runs tp × ep, the
attention tensor-parallel, each MoE block whole on its tp rank's share of the tokens, the experts
over ep (`parallel/moe_tp.py`), under 1-D tensor parallelism only (`moe_refusal`; the trainer has
no other mode).  Without sequence parallelism a microbatch's tokens must divide among the tp ranks
(`moe_tokens_refusal`, which `pipedsl train` applies too: trainer/config.py for the GPT,
trainer/hf_setup.py for a Hugging Face model).

The built-in GPT (`ModelSpec.layout == "gpt"`, `models/gpt/tp.py`, `parallel/tp1d.py`,
`parallel/config.py` `check_model`):
- 1-D or 3-D tensor parallelism (3-D: tp = q³, sizes divisible by q or q², microbatch by q²);
- sequence parallelism with 1-D only, the sequence divisible by tp (`tp1d.py`).
"""

from __future__ import annotations

from pipedsl.errors import PipeDSLError
from pipedsl.plan.config import Layout
from pipedsl.plan.model import ModelSpec


class NotRunnableError(PipeDSLError):
    """A layout the runtime refuses for this model; the message names the rule and the module enforcing it."""


def moe_refusal(moe: bool, tp: int, tp_mode: str = "1d") -> str | None:
    """Why the runtime refuses tensor parallelism `tp` for a model (`moe`: it has routed experts), or None.  An MoE
    block runs whole on each tp rank's share of the tokens (parallel/moe_tp.py), under 1-D tensor parallelism."""
    if moe and tp > 1 and tp_mode != "1d":
        return f"an MoE model takes 1-D tensor parallelism only, not {tp_mode} (tp {tp})"
    return None


def moe_tokens_refusal(rows: int, seq: int, tp: int, sequence_parallel: bool) -> str | None:
    """Why an MoE model's microbatch of `rows` sequences of `seq` tokens cannot be shared by `tp` ranks, or None: the
    rule the planner and `pipedsl train` both apply.  Without sequence parallelism each tp rank's MoE blocks take
    1/tp of the microbatch's tokens (parallel/moe_tp.py); with it, its sequence shard (seq % tp is SP's own rule)."""
    if tp > 1 and not sequence_parallel and (rows * seq) % tp:
        return (f"a microbatch's {rows}·{seq} tokens do not divide among tp={tp} ranks, each of which runs the MoE "
                f"blocks on its share")
    return None


def check_runnable(model: ModelSpec, layout: Layout) -> None:
    """Raise `NotRunnableError` if pipedsl's runtime would refuse `layout` for `model`."""
    t = layout.tp
    why = moe_refusal(model.moe, t, layout.tp_mode) or (
        moe_tokens_refusal(layout.microbatch, model.seq, t, layout.sequence_parallel) if model.moe else None)
    if why is not None:
        raise NotRunnableError(f"runtime: {why} (parallel/moe_tp.py)")
    if layout.sequence_parallel and t > 1:
        if layout.tp_mode != "1d":
            raise NotRunnableError("runtime: sequence parallelism needs 1-D tensor parallelism "
                                   "(models/gpt/parallelize.py)")
        if model.seq % t:
            raise NotRunnableError(f"runtime: sequence parallelism needs the sequence {model.seq} divisible by tp {t} "
                              f"({'parallel/tp_hf.py' if model.hf else 'parallel/tp1d.py'})")
    if not model.hf or t == 1:
        return
    if layout.tp_mode != "1d":
        raise NotRunnableError("runtime: Hugging Face stages support 1-D tensor parallelism only "
                               "(models/hf/parallelize.py)")
    for what, n in (("heads", model.heads), ("kv heads", model.kv_heads or model.heads), ("vocab", model.vocab),
                    ("ffn", model.ffn_size)):
        if n % t:
            raise NotRunnableError(f"runtime: {what} {n} is not divisible by tp {t} (parallel/tp_hf.py)")

