"""Output files are replaced whole or not at all (pipedsl/output.py)."""

from __future__ import annotations

import pytest

from pipedsl.output import replacing, write_text


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path) -> None:
    out = tmp_path / "timeline.svg"
    out.write_text("previous")
    with pytest.raises(KeyboardInterrupt), replacing(out) as tmp:
        assert tmp.suffix == ".svg" and tmp.parent == tmp_path  # the writer may pick the format by suffix
        tmp.write_text("half of the new one")
        raise KeyboardInterrupt  # a signal mid-write
    assert out.read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timeline.svg"]


def test_a_complete_write_replaces_the_file(tmp_path) -> None:
    out = tmp_path / "losses.json"
    out.write_text("previous")
    write_text(out, "new")
    assert out.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["losses.json"]


@pytest.mark.parametrize("name", ["", ".", "/"])
def test_a_path_without_a_file_name_is_an_os_error_like_the_plain_write(name) -> None:
    """Found by the CLI fuzzer: `-o ''` raised ValueError from Path.with_name; callers report OSErrors."""
    with pytest.raises(IsADirectoryError):
        write_text(name, "text")
