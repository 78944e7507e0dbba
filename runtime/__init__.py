"""pipedsl.runtime: execute compiled programs on real processes (torch.distributed).

- `Pipeline` (pipeline.py): the per-rank API — stages, `step(inputs, targets)`, timelines;
- `launch` (launcher.py): local processes with a process group, or torchrun's;
- `split_sequential`, `split_gpt` (split.py): cut a model into stages; `gpt.py`: a small GPT;
- `causal_lm_stages`, `causal_lm_loss`, `shift_labels` (hf.py): Hugging Face causal LMs as stages;
- underneath: `Executor` (executor.py) interprets one rank's instruction stream, `Stage`
  (stage.py) runs forward / backward / split backward, `Channels` (p2p.py) moves tensors,
  `GradReducer` (reduce.py) reduces replica gradients, `Tracer` (tracer.py) records a Timeline,
  errors.py reports failures across ranks; train_cli.py is `pipedsl train`.

Names are imported on first use, so `pipedsl.runtime.train_cli` (the CLI) does not import torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "Pipeline": "pipeline",
    "causal_lm_loss": "hf",
    "causal_lm_stages": "hf",
    "shift_labels": "hf",
    "launch": "launcher",
    "split_gpt": "split",
    "split_sequential": "split",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pipedsl.runtime' has no attribute {name!r}")
    return getattr(import_module(f"pipedsl.runtime.{_EXPORTS[name]}"), name)
