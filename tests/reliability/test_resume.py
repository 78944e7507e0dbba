"""Resume continues exactly: the same losses as a run that never stopped (fresh processes).

Why bit-for-bit: a resumed run executes the same floating-point operations on the same values
as the uninterrupted one — the checkpoint restores parameters, AdamW state (including its step
counters), the data generator and every RNG exactly (torch.save is lossless), each rank runs
one thread, and a stage's forward/backward kernels do not depend on the schedule.  Under
another schedule with the same partition the per-stage arithmetic is the same too, and in the
schedules tested here each stage accumulates its microbatch gradients in microbatch order, so
those are asserted bit-for-bit as well.  Looped BFS runs a stage's backwards in reverse
microbatch order, and Chimera sums the two replicas' gradients at REDUCE_GRAD: both reorder a
floating-point sum, so they are asserted within fp32 rounding only (over many steps such
last-bit differences grow; benchmarks/soak.py shows it happens without any checkpoint too).
With dropout, the RNG stream is consumed in the schedule's op order, so only a same-schedule
resume is exact; it is asserted bit-for-bit and shows the RNG state really is restored.
"""

from __future__ import annotations

import math
import shutil

import pytest
import reliability_cases as cases

import pipedsl
from pipedsl.runtime import checkpoint

BOUNDS = {"timeout": 60.0, "join_timeout": 300.0, "threads": 1}
CFG = cases.CFG


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Uninterrupted runs that checkpoint as they go: 1F1B every 2 steps; 1F1B with dropout at 3;
    interleaved (4 stages, 6 blocks) at 3."""
    root = tmp_path_factory.mktemp("ckpt")
    dirs = {k: str(root / k) for k in ("a", "drop", "four")}
    runs = [("train", cases.program("1f1b"), {**CFG, "checkpoint_dir": dirs["a"], "checkpoint_every": 2}),
            ("train", cases.program("1f1b"), {**CFG, "dropout": 0.2, "checkpoint_dir": dirs["drop"],
                                               "checkpoint_every": 3}),
            ("train", cases.program("interleaved"), {**CFG, "layers": 6, "checkpoint_dir": dirs["four"],
                                                      "checkpoint_every": 3})]
    reports = pipedsl.launch(cases.sequence, 2, runs, **BOUNDS)[0]
    return {k: (d, reports[i]["losses"]) for i, (k, d) in enumerate(dirs.items())}


def resume(directory: str, step: int) -> str:
    return str(checkpoint.step_dir(directory, step))


@pytest.fixture(scope="module")
def resumed(saved, tmp_path_factory):
    """On fresh processes: a run without checkpoints, then resumes under the same and other schedules,
    loads into other partitions, and the API round trip."""
    a, drop, four = saved["a"][0], saved["drop"][0], saved["four"][0]
    api = str(tmp_path_factory.mktemp("api"))
    runs = {
        "plain": ("train", cases.program("1f1b"), CFG),
        "1f1b": ("train", cases.program("1f1b"), {**CFG, "resume": resume(a, 2)}),
        "gpipe": ("train", cases.program("gpipe"), {**CFG, "resume": resume(a, 4)}),
        "zb-h1": ("train", cases.program("zb-h1"), {**CFG, "resume": resume(a, 2)}),
        "chimera": ("train", cases.program("chimera"), {**CFG, "resume": resume(a, 2)}),
        "dropout": ("train", cases.program("1f1b"), {**CFG, "dropout": 0.2, "resume": resume(drop, 3)}),
        "zb-v": ("train", cases.program("zb-v"), {**CFG, "layers": 6, "resume": resume(four, 3)}),
        "hanayo": ("train", cases.program("hanayo"), {**CFG, "layers": 6, "resume": resume(four, 3)}),
        "looped-bfs": ("train", cases.program("looped-bfs"), {**CFG, "layers": 6, "resume": resume(four, 3)}),
        "stage_count": ("error", cases.program("interleaved"), {**CFG, "layers": 6, "resume": a}),  # more blocks
        "shapes": ("error", cases.program("1f1b"), {**CFG, "layers": 3, "resume": a}),  # 2 stages, fewer blocks
        "api": ("api", api, {}),
    }
    results = pipedsl.launch(cases.sequence, 2, list(runs.values()), **BOUNDS)
    return {name: [r[i] for r in results] for i, name in enumerate(runs)}  # name -> [rank 0's, rank 1's]


def tail(losses: dict[int, float], after: int) -> dict[int, float]:
    return {k: v for k, v in losses.items() if k > after}


@pytest.mark.slow
def test_saving_checkpoints_does_not_change_training(saved, resumed) -> None:
    assert resumed["plain"][0]["losses"] == saved["a"][1]
    assert list(saved["a"][1]) == [1, 2, 3, 4, 5, 6]
    assert [c.step for c in checkpoint.checkpoints(saved["a"][0])] == [2, 4, 6]


@pytest.mark.slow
def test_resume_on_the_same_schedule_is_bit_exact(saved, resumed) -> None:
    """1F1B resumed from step 2 on fresh processes: every loss of steps 1-6 equals the run that never stopped, bit for
    bit."""
    assert resumed["1f1b"][0]["losses"] == saved["a"][1]  # steps 1-2 from the checkpoint's record, 3-6 run again


@pytest.mark.slow
def test_resume_with_dropout_restores_the_rng_exactly(saved, resumed) -> None:
    losses = resumed["dropout"][0]["losses"]
    assert losses == saved["drop"][1]
    assert tail(losses, 3) != tail(resumed["plain"][0]["losses"], 3), "dropout must change the losses, or this proves nothing"


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "after"), [("gpipe", 4), ("zb-h1", 2)])
def test_resume_under_another_schedule_with_the_same_partition(saved, resumed, schedule, after) -> None:
    """GPipe resumed from 1F1B's step-4 checkpoint and ZB-H1 from its step 2 (the same partition): every loss equals the
    1F1B run that never stopped, bit for bit."""
    assert resumed[schedule][0]["losses"] == saved["a"][1], schedule  # those up to `after` from the checkpoint
    assert after < max(saved["a"][1])


def _assert_close(got: dict, want: dict) -> None:
    """The same steps, each loss within fp32 rounding (rel 1e-6) of the uninterrupted run's."""
    assert list(got) == list(want)
    assert all(math.isclose(got[k], want[k], rel_tol=1e-6) for k in want), (got, want)


@pytest.mark.slow
def test_resume_under_chimera_loads_both_replicas_from_one_copy(saved, resumed) -> None:
    _assert_close(resumed["chimera"][0]["losses"], saved["a"][1])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb-v", "hanayo"])
def test_resume_with_another_placement_loads_stages_from_other_ranks_parts(saved, resumed, schedule) -> None:
    # interleaved holds stages {0, 2} | {1, 3}; zb-v and hanayo hold {0, 3} | {1, 2}
    assert resumed[schedule][0]["losses"] == saved["four"][1], schedule


@pytest.mark.slow
def test_resume_under_looped_bfs_is_within_fp32_rounding(saved, resumed) -> None:
    # looped BFS runs each stage's backwards in reverse microbatch order: its gradient sums round differently
    _assert_close(resumed["looped-bfs"][0]["losses"], saved["four"][1])


@pytest.mark.slow
def test_a_different_model_is_one_clear_error_on_every_rank(resumed) -> None:
    """Another partition of the same model loads (tests/reliability/test_checkpoint_repartition.py); another model
    (more blocks, fewer blocks) is refused in one line naming a tensor one side lacks, the same on every rank."""
    count, shapes = resumed["stage_count"][0], resumed["shapes"][0]
    assert resumed["stage_count"][1] == count and resumed["shapes"][1] == shapes, "every rank raises the same error"
    for message in (count, shapes):
        assert message.startswith("checkpoint error: ") and "\n" not in message
        assert "a different model than the checkpoint's" in message and "'" in message, message


@pytest.mark.slow
def test_api_round_trip_restores_parameters_optimizer_rng_extra_and_shards(resumed) -> None:
    for rank, found in enumerate(resumed["api"]):
        assert found["params"] and found["optimizer"] and found["rng"], found
        assert found["lrs"] == [1e-2, 3e-3], "param-group hyperparameters come back"
        assert found["step"] == found["pipe_steps"] == 2
        assert found["extra_rank"] == rank and found["extra_t"] == [0, 1, 2]
        assert found["shards"] == [float(rank)] * 2


@pytest.mark.slow
def test_incomplete_or_damaged_checkpoints_do_not_count(saved, tmp_path) -> None:
    d = tmp_path / "ck"
    shutil.copytree(saved["a"][0], d)
    assert checkpoint.latest(d).step == 6
    (d / "step-00000006" / "manifest.json").unlink()  # a save that never finished
    assert checkpoint.latest(d).step == 4
    with pytest.raises(checkpoint.CheckpointError, match="incomplete"):
        checkpoint.check(d / "step-00000006")
    part = d / "step-00000004" / "rank-00001.pt"
    part.write_bytes(part.read_bytes()[:-10])  # truncated
    assert checkpoint.latest(d).step == 2
    part = d / "step-00000002" / "rank-00000.pt"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one bit pattern changed
    part.write_bytes(bytes(data))
    assert checkpoint.latest(d).step == 2, "sizes match: discovery is cheap"
    with pytest.raises(checkpoint.CheckpointError, match="corrupt"):
        checkpoint.check(d / "step-00000002", verify=True)
    (d / "step-00000002" / "rank-00001.pt").unlink()
    assert checkpoint.latest(d) is None
    with pytest.raises(checkpoint.CheckpointError, match="no complete checkpoint"):
        checkpoint.resolve(d)

