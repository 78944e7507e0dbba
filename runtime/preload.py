"""What every rank needs and would otherwise build for itself, imported once by the fork server
(runtime/launch/fork_server.py): a rank forked from the server inherits what the server holds.

Measured in a 4-rank `pipedsl.launch` of the README's script on 2 cores, each rank spent 3.2 s importing
torch._dynamo (the first optimizer's constructor imports it), 1.0 s building the schedule language's parser and
0.9 s importing the runtime; done here, they are paid once instead of once a rank.
"""

from __future__ import annotations

import torch._dynamo  # noqa: F401 - `torch.optim.Optimizer.__init__` imports it

import pipedsl.runtime.pipeline  # noqa: F401 - `pipedsl.Pipeline`
from pipedsl import parser

parser.grammar()  # built once, here: every rank that loads a schedule by name parses it
