"""Fixtures for the visualize tests (the schedule texts live in vis_support)."""

from __future__ import annotations

from pathlib import Path

import pytest
from vis_support import INTERLEAVED, REPLICAS, SPLIT


@pytest.fixture(scope="session")
def pipes(tmp_path_factory) -> dict[str, str]:
    """Paths of the local test schedules by short name: split, interleaved, replicas."""
    folder: Path = tmp_path_factory.mktemp("pipes")
    paths = {}
    for name, text in (("split", SPLIT), ("interleaved", INTERLEAVED), ("replicas", REPLICAS)):
        path = folder / f"{name}.pipe"
        path.write_text(text)
        paths[name] = str(path)
    return paths
