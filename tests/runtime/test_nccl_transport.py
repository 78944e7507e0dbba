"""NCCL's communicators and semantics on CPU (runtime/rendezvous.py, runtime/comm_record.py; docs/runtime.md,
"NCCL"): every schedule (P = 2; one a family at P = 4) trains equal to one process when each send waits for its
receive on one stream per communicator (dp × pp under ZeRO-3 and ep × pp with DualPipeV's overlapped pairs:
tests/models/test_gpt_moe.py); torch's default layout is caught hanging, naming the communicator and both
instructions; a recorded issue order checks out by rules that are not the validator's."""

from __future__ import annotations

from pathlib import Path

import nccl_cases
import pytest
import runtime_cases as cases
from test_pipeline import SCHEDULES, _name, compile_for

import pipedsl
from pipedsl.nccl_model import edges
from pipedsl.runtime import comm_record

# Every schedule at P = 2, one a family at P = 4 (docs/testing.md): the runtime's rendezvous transport carries every
# program at the smaller size, and each kind of program — plain, interleaved, split backward, V, replicas, two
# pipelines in opposite directions, shared and reduced copies with local hand-over (mixed.pipe) — at the larger.
FAMILIES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev", "chimera", "hanayo"]
NCCL_CASES = [(s, 2) for s in SCHEDULES] + [(s, 4) for s in SCHEDULES if _name(s) in (*FAMILIES, "mixed")]


@pytest.mark.slow
@pytest.mark.parametrize("schedule, P", NCCL_CASES, ids=lambda v: _name(v) if isinstance(v, str) else f"P{v}")
def test_every_schedule_equals_one_process_under_nccls_semantics(schedule: str, P: int, pools) -> None:
    """Loss, every gradient and the parameters after 2 Adam steps equal one process running the unsplit model, with
    every send a rendezvous on its edge's stream."""
    program = compile_for(schedule, P)
    both = pools[P].run(nccl_cases.by_rendezvous, cases.equivalence, program.to_json(), 2)
    problems = [f"rank {r}: {p}" for r, (res, _) in enumerate(both) for p in res["problems"]]
    assert not problems, "\n".join(problems[:20])
    sends = sum(1 for stream in program.ranks for ins in stream if ins.op.name.startswith("SEND"))
    assert sum(sent for _, sent in both) >= 2 * sends, "every message of both steps (and the shapes) by rendezvous"


def test_the_rendezvous_transport_is_the_one_chosen(pool2) -> None:
    assert pool2.run(nccl_cases.ranked, "rendezvous", None, None, nccl_cases.transport_kind) == \
        ["RendezvousTransport"] * 2
    assert pool2.run(nccl_cases.ranked, "nccl", None, None, nccl_cases.transport_kind) == ["DistTransport"] * 2


def _stuck(rank: int) -> None:
    nccl_cases.under("rendezvous", "pair", None, cases.equivalence, rank,
                     pipedsl.load("1f1b").compile(2, 2).to_json(), 1, {"strict_pair_order": True})


@pytest.mark.slow
def test_one_stream_per_pair_in_program_order_is_caught_naming_both_instructions() -> None:
    """The negative control: torch's default layout (one stream per pair, both directions) in strict program
    order deadlocks 1F1B at P = 2 under the rendezvous; each rank fails within the timeout naming the
    communicator, the instruction that waits and the send its stream is stuck at."""
    with pytest.raises(pipedsl.PipeRuntimeError) as caught:
        pipedsl.launch(_stuck, 2, threads=1, timeout=4)
    text = str(caught.value)
    # the first rank to time out names its hang; the other, its stream failed when that rank went, names its own
    assert "under NCCL's semantics (PIPEDSL_P2P=rendezvous) on communicator {0,1}" in text, text
    assert "that stream is stuck at SEND_F1.0>1 to rank 1, waiting for rank 1 to reach its receive" in text, text
    assert "that stream is stuck at SEND_B0.1>0 to rank 0, waiting for rank 0 to reach its receive" in text, text


@pytest.mark.quick
@pytest.mark.parametrize("schedule,P", [("dualpipev", 2), ("interleaved", 4)])
def test_the_nccl_paths_recorded_issue_order_checks_out(schedule: str, P: int, pools, tmp_path: Path) -> None:
    """`PIPEDSL_P2P=nccl` runs NCCL's layout and issue order with gloo carrying the bytes; the record holds one
    communicator per directed edge of the program, each carrying one direction, its sends and receives matched
    one to one (runtime/comm_record.py).  The same program over one stream per pair is flagged."""
    program = compile_for(schedule, P)
    record = str(tmp_path / "edge")
    results = pools[P].run(nccl_cases.ranked, "nccl", None, record, cases.equivalence, program.to_json(), 1)
    assert not [p for res in results for p in res["problems"]]
    records = comm_record.load(record)
    assert sorted(records) == list(range(P)) and comm_record.problems(records) == []
    assert {op["comm"] for ops in records.values() for op in ops} == {f"{a}>{b}" for a, b in edges(program)}
    assert comm_record.main([record]) == 0
    paired = str(tmp_path / "pair")
    pools[P].run(nccl_cases.ranked, "nccl", "pair", paired, cases.equivalence, program.to_json(), 1)
    found = comm_record.problems(comm_record.load(paired))
    assert found and all("carries sends and receives on one stream" in p for p in found), found


def test_a_record_whose_messages_do_not_match_is_refused(tmp_path: Path) -> None:
    """The checker's own teeth: a receive that names another message than its send, or one message too few."""
    send = {"comm": "0>1", "kind": "send", "peer": 1, "at": "SEND_F0.0>1", "shapes": [[2, 6]]}
    recv = {"comm": "0>1", "kind": "recv", "peer": 0, "at": "RECV_F1.1<0", "shapes": [[2, 6]]}
    assert "is sent by SEND_F0.0>1 [[2, 6]] and received by RECV_F1.1<0" in comm_record.problems(
        {0: [send], 1: [recv]})[0]
    assert "rank 0 sent 2 messages to rank 1, which received 1" in comm_record.problems(
        {0: [send, send], 1: [{**recv, "at": "RECV_F0.1<0"}]})[0]
