"""What Hugging Face decoders (stages.py) and encoder-decoders (seq2seq.py) share: transformers itself, the
token cross-entropy both train with, the mask makers' "no cache" argument, and the architecture check — stages
run against the model's own forward on a shallow random copy, logits and loss — by which each refuses a model
it would train wrong."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from pipedsl.errors import PipeRuntimeError, one_line

IGNORE_INDEX = -100  # transformers' label for "no loss here" (padding, prompts)
MAX_CHECK_BYTES = 2 * 2**30  # the architecture check's shallow model: at most this much, or the check is skipped


def require_transformers() -> Any:
    """The transformers module, 5.x (its masking_utils and decoder layers), or one line saying how to get it."""
    try:
        import transformers
    except ImportError:
        raise PipeRuntimeError("Hugging Face models need transformers (pip install 'pipedsl[hf]')") from None
    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise PipeRuntimeError(f"Hugging Face models need transformers 5.x (its masking_utils and decoder layers); "
                               f"found {transformers.__version__}")
    return transformers


def causal_lm_loss(logits: torch.Tensor | tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor, *,
                   reduction: str = "mean", ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """HF's causal-LM cross-entropy of `logits` [mb, T, V] against `shift_labels(labels)` [mb, T].

    `reduction="mean"` (over the targets that are not `ignore_index`) is the loss of
    `model(input_ids, labels=labels)`, for the default per-microbatch mean; `"sum"` is for
    `Pipeline(loss_reduction="token")`, which divides by the global batch's token count
    (`functools.partial(causal_lm_loss, reduction="sum")`).  Logits are upcast to fp32, as HF does.
    """
    aux = None
    if isinstance(logits, tuple):  # (logits, the router's auxiliary loss) from an MoE's last stage (RouterLoss)
        logits, aux = logits
        if reduction != "mean":
            raise PipeRuntimeError("an MoE's auxiliary loss is added to each microbatch's mean loss, as the model "
                                   "adds it to each forward's: use loss_reduction='microbatch' with "
                                   "causal_lm_loss (reduction='mean'), or output_router_logits=False")
    logits = logits.float()  # [mb, T, V]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.to(logits.device).reshape(-1),
                           ignore_index=ignore_index, reduction=reduction)
    return loss + aux.to(loss.device) if aux is not None else loss


@functools.cache
def no_cache(mask_maker: Any) -> dict[str, None]:
    """The mask maker's "no KV cache" argument: `cache` since transformers 5.2x, `past_key_values` before."""
    return {"cache" if "cache" in inspect.signature(mask_maker).parameters else "past_key_values": None}


def compare_with_model(model: nn.Module, stages: Sequence[nn.Module], stage_inputs: tuple, model_inputs: dict,
                       tolerance: float, who: str, pieces: str,
                       loss: tuple[Callable[..., torch.Tensor], torch.Tensor] | None = None) -> float:
    """The stages run in sequence on `stage_inputs` against `model(**model_inputs)`, both in eval mode without
    gradients: the largest difference relative to the scale of the logits and, with `loss` = (the stages' loss
    function, its targets) and labels among `model_inputs`, of the loss against the model's own.  A
    `PipeRuntimeError` names the model above `tolerance` or when a stage fails."""
    name = type(model).__name__
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            device = next(model.parameters()).device
            out = _model_forward(model, model_inputs, device)
            expected = out.logits.float()
            try:
                x = _stage_chain(stages, stage_inputs, device)
            except Exception as err:  # noqa: BLE001 - whatever the layers refuse, said as the model's refusal
                raise PipeRuntimeError(f"{who}: {name}'s layers fail when called as pipedsl's stages call them "
                                       f"({type(err).__name__}: {one_line(err, 200)}): its forward passes them "
                                       f"something the stages do not") from None
            got = (x[0] if isinstance(x, tuple) else x).float()
            own_loss = getattr(out, "loss", None)
            stage_loss = extra = None
            if loss is not None and own_loss is not None:
                fn, targets = loss[0], loss[1].to(device)
                stage_loss = fn(x, targets)
                # what each adds to the cross-entropy of its own logits (an MoE's router loss): compared on its own
                # scale, so that a small coefficient's error is not lost in the loss's rounding
                extra = (float(own_loss) - float(fn(out.logits, targets)), float(stage_loss) - float(fn(got, targets)))
    finally:
        model.train(was_training)
    diff = float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-12))
    if not diff <= tolerance:
        raise PipeRuntimeError(f"{who}: {name} cut into {len(stages)} stages gives logits {diff:.2e} (relative) away "
                               f"from the model's own forward: its forward does something between {pieces} that "
                               f"pipedsl does not reproduce")
    if stage_loss is not None:
        want, have = float(own_loss), float(stage_loss)
        loss_diff = abs(have - want) / max(abs(want), 1e-12)
        model_extra, stage_extra = extra
        extra_off = abs(stage_extra - model_extra) > tolerance * max(abs(model_extra), 0.01 * abs(want))
        if not loss_diff <= tolerance or extra_off:
            raise PipeRuntimeError(f"{who}: {name} cut into {len(stages)} stages gives the model's logits but a loss "
                                   f"of {have:.6f} where its own forward gives {want:.6f} (beyond the cross-entropy: "
                                   f"{stage_extra:.3g} against {model_extra:.3g}): the model adds to its loss "
                                   f"something pipedsl does not reproduce (a router's auxiliary loss under a "
                                   f"coefficient pipedsl does not know?); it cannot be trained exactly")
        diff = max(diff, loss_diff)
    if has_dropout(model):
        diff = max(diff, _compare_in_training(model, stages, stage_inputs, model_inputs, tolerance, who))
    return diff


def _model_forward(model: nn.Module, model_inputs: dict, device: torch.device) -> Any:
    """The model's own training forward (no KV cache) on `model_inputs`."""
    return model(**{k: v.to(device) for k, v in model_inputs.items() if v is not None}, use_cache=False)


def _stage_chain(stages: Sequence[nn.Module], stage_inputs: tuple, device: torch.device) -> Any:
    """The stages called one after another, as the pipeline calls them; the last one's output."""
    x: Any = tuple(t.to(device) for t in stage_inputs)
    for stage in stages:
        x = stage(*x) if isinstance(x, tuple) else stage(x)
    return x


def has_dropout(model: nn.Module) -> bool:
    """Whether training draws any dropout: a dropout module, or a probability its forward applies itself
    (`config.attention_dropout`, StarCoder2's `embedding_dropout`), above zero."""
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    items = config.to_dict().items() if hasattr(config, "to_dict") else ()
    return any(("drop" in key) and isinstance(v, float) and v > 0 for key, v in items)


def _compare_in_training(model: nn.Module, stages: Sequence[nn.Module], stage_inputs: tuple, model_inputs: dict,
                         tolerance: float, who: str) -> float:
    """The same comparison with dropout on: the model and the stages from one seed draw the same masks exactly when
    the stages apply every dropout the model's forward does, in its order.  The eval-mode comparison cannot see a
    dropout left out (StarCoder2's and Phi's embedding dropout once were: accepted, and trained without it)."""
    name = type(model).__name__
    modes = [(m, m.training) for m in (model, *stages)]
    try:
        for m, _ in modes:
            m.train()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            device = next(model.parameters()).device
            torch.manual_seed(0)
            expected = _model_forward(model, model_inputs, device).logits.float()
            torch.manual_seed(0)
            x = _stage_chain(stages, stage_inputs, device)
            got = (x[0] if isinstance(x, tuple) else x).float()
    finally:
        for m, mode in modes:
            m.train(mode)
    diff = float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-12))
    if not diff <= tolerance:
        raise PipeRuntimeError(f"{who}: {name} cut into {len(stages)} stages gives the model's logits without "
                               f"dropout but {diff:.2e} (relative) away with it: its forward applies a dropout the "
                               f"stages do not (or not in its order), so it cannot be trained exactly; set its "
                               f"dropout probabilities to 0 to train it with pipedsl")
    return diff


def check_on_shallow_copy(model: nn.Module, shallow: Callable[[Any], Any], cut_and_check: Callable[[nn.Module], float],
                          who: str, attn: str | None = None) -> float | None:
    """`cut_and_check(copy)` on a random fp32 CPU copy of `model`'s class built from `shallow(model.config)`,
    under a forked RNG; None when the copy would exceed `MAX_CHECK_BYTES`.  Whatever fails is a
    `PipeRuntimeError` naming the model (`who`: the function whose check it is)."""
    name = type(model).__name__
    unverified = "; check=False splits it unverified"
    try:
        config = shallow(model.config)
        build = functools.partial(type(model)._from_config, config, dtype=torch.float32,
                                  **({"attn_implementation": attn} if attn else {}))
        with torch.device("meta"):
            size = 4 * sum(p.numel() for p in build().parameters())
    except Exception as err:  # noqa: BLE001 - a config no shallow copy can be made of: unverifiable
        raise PipeRuntimeError(f"{who}: {name} cannot be verified: a shallow copy of it cannot be built "
                               f"({type(err).__name__}: {one_line(err, 200)}){unverified}") from None
    if size > MAX_CHECK_BYTES:
        return None
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(0)
        try:
            return cut_and_check(build())
        except PipeRuntimeError:
            raise
        except Exception as err:  # noqa: BLE001 - the model's own forward fails on its shallow copy
            raise PipeRuntimeError(f"{who}: {name} cannot be verified: its own forward fails on a shallow copy "
                                   f"({type(err).__name__}: {one_line(err, 200)}){unverified}") from None
