"""Run by test_torchrun.py as `python -m torch.distributed.run --standalone --nproc-per-node 2 THIS`.

The same `pipedsl.launch(fn, nprocs)` call that spawns processes locally runs `fn` for this
process only under torchrun.  Prints one OK line per rank, or the problems and exits 1.
"""

from __future__ import annotations

import sys

import runtime_cases as cases
import torch

import pipedsl


def main(rank: int) -> list[str]:
    torch.set_num_threads(1)
    program = pipedsl.load("1f1b").compile(P=torch.distributed.get_world_size(), M=4)
    return cases.equivalence(rank, program.to_json(), steps=2)["problems"]


if __name__ == "__main__":
    [problems] = pipedsl.launch(main, 2, timeout=60)
    import os

    rank = os.environ["RANK"]
    if problems:
        print(f"rank {rank} problems: {problems}")
        sys.exit(1)
    print(f"rank {rank} OK under torchrun")
