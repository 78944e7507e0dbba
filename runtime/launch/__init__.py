"""pipedsl.runtime.launch: the processes a pipeline runs on, and what they report.

- launcher.py: `launch(fn, nprocs)` — local processes with a process group, or torchrun's;
- fork_server.py: ranks forked from one server that imported torch once (spawn as the fallback);
- lifecycle.py: signals, the parent-death watchdog, no process left behind;
- capacity.py: how many ranks this machine can hold; rank_results.py: each rank's result or failure;
- errors.py: failures across ranks (which rank and instruction failed first); tracebacks.py: the
  user's part of a rank's traceback;
- pool.py: `LocalPool`, workers that run many short gloo worlds (tests, benchmarks, calibration).

Nothing here knows a schedule or a model; the executor core (runtime/) builds on it.
Names are imported on first use: the CLI reads lifecycle.py without importing torch.
"""

from __future__ import annotations

from pipedsl.registry import lazy_attributes

_EXPORTS = {"launch": "launcher", "LocalPool": "pool"}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS)
