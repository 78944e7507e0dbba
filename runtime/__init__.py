"""pipedsl.runtime: execute compiled programs on real processes (torch.distributed).

- `Pipeline` (pipeline.py): the per-rank API — stages, `step(inputs, targets)`, timelines; built by
  assembly.py, its options typed in options.py (`PipelineOptions`: `ScheduleOptions`, `MixedPrecision`,
  `RecomputeOptions`, `LossOptions`);
- `TrainingSteps` (post_validate.py): a whole training step — clipping, the optimizer — synchronous or
  post-validated (consecutive steps overlap, the global checks read a step later);
- underneath: `Executor` (executor.py) interprets one rank's instruction stream, `Stage`
  (stage.py) runs forward / backward / split backward, `Channels` (p2p.py, socket_p2p.py) moves
  tensors, the data-parallel strategy (data_parallel.py) owns where gradients live and how they
  are reduced over dp, finalize.py the step end's reductions in order (replicas, dp, tp sums,
  ties), `Tracer` (tracer.py) records a Timeline;
- launch/: processes — `launch`, the fork server, signals, failures across ranks, a worker pool;
- checkpoint/: save and restore a training state, resharded to another layout.

Models (`pipedsl.models`) and the trainer (`pipedsl.trainer`) build on this package; it imports neither.
Names are imported on first use, so `import pipedsl.runtime` does not import torch.
"""

from __future__ import annotations

from pipedsl.registry import lazy_attributes

_EXPORTS = {
    "LossOptions": "options",
    "MixedPrecision": "precision",
    "Pipeline": "pipeline",
    "PipelineOptions": "options",
    "PipelineOptimizer": "optim",
    "RecomputeOptions": "options",
    "ScheduleOptions": "options",
    "StepReport": "post_validate",
    "TrainingSteps": "post_validate",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS)
