"""tests/compared.py's assertion fails when a comparison skipped something (so the suite's uses of it can fail)."""

import pytest
from compared import every_parameter_compared

NAMES = ["a.weight", "experts.fc"]
ROWS = {"experts.fc": 4}


def test_a_full_comparison_passes() -> None:
    every_parameter_compared(["a.weight", "experts.fc[0:2]", "experts.fc[2:4]"], NAMES, ROWS)
    every_parameter_compared(["a.weight", "experts.fc"], NAMES)


@pytest.mark.parametrize("checked, said", [
    (["experts.fc"], "compared on no rank"),
    (["a.weight", "experts.fc", "b"], "does not have"),
    (["a.weight", "experts.fc[0:2]"], "cover rows [0, 2) of 4"),
    (["a.weight", "experts.fc[0:2]", "experts.fc[1:4]"], "do not tile"),
])
def test_a_skipped_parameter_or_shard_fails(checked: list[str], said: str) -> None:
    with pytest.raises(AssertionError, match=said.replace("[", r"\[").replace(")", r"\)").replace("(", r"\(")):
        every_parameter_compared(checked, NAMES, ROWS)
