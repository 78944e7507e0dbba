"""pipedsl.runtime.checkpoint: save and restore a pipelined training state, on any layout.

    from pipedsl.runtime import checkpoint

    checkpoint.save(pipe, "ckpt", step, optimizer)      # every rank
    restored = checkpoint.load(pipe, "ckpt", optimizer) # the latest complete checkpoint in ckpt/

- state.py: what each rank's part holds (parameters, optimizer and ZeRO slices, RNG, training state),
  restoring it under the same or another dp × pp × tp layout or stage partition, and `read_model` (the export
  reader);
- files.py: the files on disk — finding them, atomic writes, the manifest that commits a checkpoint.

Names are imported on first use, so reading a manifest (`check`, `latest`) does not import torch.
"""

from __future__ import annotations

from pipedsl.registry import lazy_attributes

_STATE = ("Restored", "SavedModel", "check_partition", "describe_stage", "describe_stage_tensors", "fingerprint",
          "load", "loads_into", "model_differences", "read_model", "save", "tp_dims")
_FILES = ("FORMAT", "MANIFEST", "READABLE", "VERSION", "CheckpointError", "CheckpointInfo", "check", "checkpoints",
          "fault_point", "latest", "prune", "resolve", "saved_parallel", "schedule_name", "step_dir")
_EXPORTS = {**{name: "state" for name in _STATE}, **{name: "files" for name in _FILES}}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS)
