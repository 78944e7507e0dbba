"""The README's first command: compile a schedule, check it, and predict its timeline.

Until the runtime lands this stops at the prediction; then it trains a small model.
"""

from __future__ import annotations

import sys

import pipedsl
from pipedsl.cli import format_summary


def main(name: str = "1f1b", P: int = 4, M: int = 8) -> None:
    schedule = pipedsl.load(name)
    program = schedule.compile(P=P, M=M)
    print(f"{schedule.name}: {schedule.doc}")
    print(f"compiled and validated {program.num_instructions()} instructions on {P} ranks\n")
    for r, order in enumerate(program.compute_orders()):
        print(f"rank {r}: {' '.join(order)}")
    print()
    print(format_summary(pipedsl.simulate(program, pipedsl.Cost(F=1, B=2))))


if __name__ == "__main__":
    main(*sys.argv[1:2])
