"""What a rank of `pipedsl train` imports on first use, imported instead by the fork server it is forked from.

Every rank is a fresh process, so each imported these itself: 0.12 s of CPU a rank (found by comparing
`sys.modules` before and after a rank's run; 8 ranks on 2 cores pay it 8 times over, and the test suite once a
command).  `pipedsl train` (trainer/cli.py) and the test suite (tests/conftest.py) preload this module last, after
`pipedsl.trainer.train` and transformers: the Hugging Face part only where the server imported transformers.  A
module missing from the list costs its rank the import, nothing more.
"""

from __future__ import annotations

import importlib
import sys

# (the pipeline itself is preloaded for every server's ranks: runtime/preload.py)
EVERY_RANK = ("pipedsl.plan", "pipedsl.runtime.optim", "pipedsl.trainer.data", "pipedsl.trainer.metrics",
              "pipedsl.output", "numpy.ma")
HF_RANK = ("pipedsl.trainer.hf_setup", "pipedsl.models.hf.io", "pipedsl.models.hf.stages", "pipedsl.models.hf.jetmoe",
           "pipedsl.models.split")


def rank_modules(loaded: set[str] | dict[str, object]) -> tuple[str, ...]:
    """The modules to import, given what the process imported already (`loaded`: module names)."""
    return (*EVERY_RANK, *(HF_RANK if "transformers.modeling_utils" in loaded else ()))


for _name in rank_modules(sys.modules):
    importlib.import_module(_name)
