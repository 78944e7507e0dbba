"""Local ranks meet on one TCPStore master that the launching process keeps, each launch or pool world under a
prefix of its own (runtime/launch/world_store.py): a master made per launch made one launch in fifteen wait 5 s."""

from __future__ import annotations

import launch_cases as cases
import pytest

import pipedsl
from pipedsl.errors import PipeRuntimeError
from pipedsl.runtime.launch import world_store

BOUNDS = {"timeout": 60.0, "join_timeout": 240.0, "threads": 1}


def test_worlds_share_one_master_and_keep_their_keys_apart() -> None:
    """Two worlds: the same master's port, their own prefixes; a key a rank sets is its world's only; a process
    joins every world through its one client of the master."""
    port, prefix, launcher_view = world_store.new_world(30.0)
    other_port, other_prefix, other_view = world_store.new_world(30.0)
    assert port == other_port and prefix != other_prefix
    rank_view = world_store.joined(port, prefix, 30.0)
    other_rank_view = world_store.joined(port, other_prefix, 30.0)
    client = world_store._clients[port]
    rank_view.set("failures", "1")
    assert launcher_view.get("failures") == b"1"
    assert not other_view.check(["failures"]) and not other_rank_view.check(["failures"])
    assert world_store._clients[port] is client


@pytest.mark.slow
def test_launches_meet_on_the_kept_master_and_a_failure_stays_in_its_launch() -> None:
    """Three launches from this process: the same store port for each; the second's rank 1 fails (named by the
    launcher); the third launch's ranks find no failure recorded in their world."""
    first = pipedsl.launch(cases.store_port_and_failures, 2, False, **BOUNDS)
    with pytest.raises(PipeRuntimeError, match="rank 1 fails on purpose"):
        pipedsl.launch(cases.store_port_and_failures, 2, True, **BOUNDS)
    third = pipedsl.launch(cases.store_port_and_failures, 2, False, **BOUNDS)
    assert {port for port, _ in first + third} == {first[0][0]}
    assert [failure for _, failure in third] == [None, None]
