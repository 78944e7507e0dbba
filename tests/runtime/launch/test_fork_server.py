"""How ranks start (runtime/launch/fork_server.py): forked from the fork server or spawned, a rank sees the same
things — the launcher's environment *now* (not when the server started), its working directory, its
sys.path, its name — and a bad PIPEDSL_START_METHOD is one error before anything starts."""

from __future__ import annotations

import pytest
from launch_cases import where_am_i

import pipedsl
from pipedsl.errors import PipeDSLError


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_rank_sees_the_launchers_environment_directory_and_path(method, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PIPEDSL_START_METHOD", method)
    for probe in ("first", "second"):  # the second launch reuses the running server: the value must still follow
        monkeypatch.setenv("PIPEDSL_PROBE", probe)
        monkeypatch.chdir(tmp_path)
        got = pipedsl.launch(where_am_i, 2, timeout=60)
        assert [r["rank"] for r in got] == [0, 1]
        assert all(r["probe"] == probe and r["cwd"] == str(tmp_path) and r["path_has_tests"] for r in got), got
        assert [r["name"] for r in got] == ["pipedsl-rank0", "pipedsl-rank1"]


def test_an_unknown_start_method_is_one_error(monkeypatch) -> None:
    monkeypatch.setenv("PIPEDSL_START_METHOD", "fork")
    with pytest.raises(PipeDSLError) as info:
        pipedsl.launch(where_am_i, 2, timeout=60)
    assert info.value.message == "PIPEDSL_START_METHOD='fork': expected one of forkserver, spawn", str(info.value)
