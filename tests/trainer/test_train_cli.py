"""`pipedsl train`: the demo trains on local processes and writes the measured timeline."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from cli_here import pipedsl_here

import pipedsl


@pytest.mark.slow
def test_train_command_writes_a_measured_timeline(tmp_path) -> None:
    out = tmp_path / "train"
    proc = subprocess.run([sys.executable, "-m", "pipedsl.cli", "train", "--schedule", "1f1b", "-P", "2", "-M", "2",
                           "--steps", "3", "--seq", "8", "--embd", "16", "--split", "blocks", "-o", str(out)],
                          capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    progress = [line for line in lines if line.startswith("step ")]
    assert len(progress) == 3 and all("loss" in p and "samples/s" in p for p in progress), proc.stdout
    assert "training a 4-block GPT" in proc.stdout  # --split blocks: 2 blocks a stage by default
    timeline = pipedsl.Timeline.from_json((out / "timeline.json").read_text())
    program = pipedsl.load("1f1b").compile(P=2, M=2)
    assert timeline.kind == "measured"
    assert [[e.instr for e in events] for events in timeline.ranks] == [list(s) for s in program.ranks]
    assert timeline.peak_activations == pipedsl.simulate(program).peak_activations


def _train(tmp_path, name: str, *args: str) -> dict[str, float]:
    out = tmp_path / name
    proc = pipedsl_here("train", "-P", "2", "-M", "2", "--seq", "8", "--embd", "16", "-o", str(out), *args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads((out / "losses.json").read_text())["losses"]


@pytest.mark.slow
def test_train_with_data_parallel_zero_resumes_exactly(tmp_path) -> None:
    """dp=2 x pp=2 with ZeRO-1, fp16 parameters with fp32 main parameters (sharded), clipping and a warmup +
    cosine lr schedule: a run resumed from its step-2 checkpoint (under GPipe: same partition) gives the losses
    of the run that went on, bit for bit (main parameters, the loss scale, its growth counter and the schedule
    are restored)."""
    ckpt = tmp_path / "ckpt"
    llm = ["--precision", "fp16", "--param-dtype", "fp16", "--clip-grad", "0.5", "--lr-schedule", "cosine",
           "--warmup-steps", "1"]
    whole = _train(tmp_path, "whole", "--schedule", "1f1b", "--dp", "2", "--zero", "1", "--steps", "4",
                   "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", *llm)
    assert sorted(whole) == ["1", "2", "3", "4"] and len(set(whole.values())) == 4
    resumed = _train(tmp_path, "resumed", "--schedule", "gpipe", "--dp", "2", "--zero", "1", "--steps", "4",
                     "--checkpoint-dir", str(tmp_path / "other"), "--resume", str(ckpt / "step-00000002"), *llm)
    assert resumed == whole  # steps 1-2 from the checkpoint's record, 3-4 run again bit for bit


@pytest.mark.slow
def test_train_gpt_tensor_sequence_parallel_equals_one_process(tmp_path) -> None:
    """--tp 2 --sequence-parallel (Megatron's 1-D split of the GPT: heads, MLP, vocabulary-parallel embedding, head
    and loss; norms on half the sequence) on two pipeline ranks with selective recomputation and clipping: every
    step's loss equals one process."""
    common = ["--steps", "3", "--layers", "2", "--clip-grad", "0.5", "--recompute", "selective"]
    one = _train(tmp_path, "one", "-P", "1", *common)
    tp = _train(tmp_path, "tp", "--tp", "2", "--sequence-parallel", *common)
    assert one.keys() == tp.keys() == {"1", "2", "3"}
    for step, loss in one.items():
        assert tp[step] == pytest.approx(loss, rel=1e-5), step


def test_train_cosine_warmup_must_end_before_the_last_step(capsys) -> None:
    from pipedsl.cli import main

    assert main(["train", "-P", "2", "--steps", "3", "--lr-schedule", "cosine", "--warmup-steps", "3"]) == 2
    assert "--warmup-steps 3 must be less than --steps 3" in capsys.readouterr().err


def test_train_split_by_blocks_needs_a_block_per_stage(capsys) -> None:
    from pipedsl.cli import main

    assert main(["train", "-P", "4", "--split", "blocks", "--layers", "3"]) == 2
    assert "--layers 3 --split blocks: every one of the program's 4 stages needs a block" in capsys.readouterr().err


def test_train_batch_must_split_over_dp_and_microbatches(capsys) -> None:
    from pipedsl.cli import main

    assert main(["train", "-P", "2", "-M", "2", "--dp", "2", "--batch", "6"]) == 2
    assert "--batch 6 does not split into dp*M = 2*2 = 4 equal microbatches" in capsys.readouterr().err


def test_train_param_and_grad_dtypes_must_fit_the_precision(capsys) -> None:
    from pipedsl.cli import main

    assert main(["train", "-P", "2", "--param-dtype", "bf16"]) == 2
    assert "--param-dtype bf16 needs --precision bf16" in capsys.readouterr().err
    assert main(["train", "-P", "2", "--precision", "bf16", "--grad-dtype", "bf16"]) == 2
    assert "--grad-dtype bf16: gradients accumulate in fp32 or in the parameters' dtype" in capsys.readouterr().err


@pytest.mark.slow
def test_train_gpt_experts_sharded_over_ep_equals_one_process_and_resumes_exactly(tmp_path) -> None:
    """--experts 4 --ep 2 on dp2 x pp2 under ZeRO-1 and capacity 1.5: every step's loss equals one process running
    the same four microbatches (the router's loss is per microbatch); a run resumed from its step-2 checkpoint
    (under ZeRO-3 keeping each layer gathered through the step: the expert shards re-cut) continues it."""
    moe = ["--experts", "4", "--top-k", "2", "--capacity-factor", "1.5", "--steps", "4", "--layers", "2"]
    one = _train(tmp_path, "one", "-P", "1", "-M", "4", *moe)
    ckpt = tmp_path / "ckpt"
    ep = _train(tmp_path, "ep", "--dp", "2", "--ep", "2", "--zero", "1", "--checkpoint-dir", str(ckpt),
                "--checkpoint-every", "2", *moe)
    assert one.keys() == ep.keys() == {"1", "2", "3", "4"}
    for step, loss in one.items():
        assert ep[step] == pytest.approx(loss, rel=1e-5), step
    resumed = _train(tmp_path, "resumed", "--dp", "2", "--ep", "2", "--zero", "3", "--zero-reshard", "step",
                     "--checkpoint-dir",
                     str(tmp_path / "other"), "--resume", str(ckpt / "step-00000002"), *moe)
    assert resumed.keys() == {"1", "2", "3", "4"}  # every step's loss: those before the resume from the checkpoint
    for step, loss in resumed.items():
        assert loss == pytest.approx(ep[step], rel=1e-5), step


@pytest.mark.slow
def test_train_gpt_experts_under_tensor_and_expert_parallelism_equal_one_process(tmp_path) -> None:
    """--experts 4 --tp 2 --ep 2 --sequence-parallel on dp2 × pp2 × tp2 (8 ranks) under ZeRO-1: each MoE block whole
    on its tp rank's sequence shard (parallel/moe_tp.py), the router's losses from the microbatch's statistics
    summed over tp — every step's loss equals one process running the same four microbatches."""
    moe = ["--experts", "4", "--top-k", "2", "--steps", "3", "--layers", "2"]
    one = _train(tmp_path, "one", "-P", "1", "-M", "4", *moe)
    par = _train(tmp_path, "tp-ep", "--dp", "2", "--tp", "2", "--ep", "2", "--sequence-parallel", "--zero", "1", *moe)
    assert one.keys() == par.keys() == {"1", "2", "3"}
    for step, loss in one.items():
        assert par[step] == pytest.approx(loss, rel=1e-5), step


@pytest.mark.parametrize("args,said", [
    (["--dp", "2", "--ep", "2"], "--ep 2 shards experts, and the GPT has none: give --experts N"),
    (["--dp", "3", "--ep", "2", "--experts", "4"], "--ep 2 must divide --dp 3"),
    (["--dp", "2", "--ep", "2", "--experts", "3"], "--experts 3 cannot be shared evenly by --ep 2 ranks"),
    (["--experts", "2", "--top-k", "3"], "--top-k 3 is more than the 2 experts"),
    (["--experts", "4", "--capacity-factor", "1.5", "--tp", "2"],
     "--capacity-factor 1.5 with --tp 2: each tp rank routes its share of the tokens"),
    (["--experts", "4", "--tp", "2", "-M", "2", "--batch", "2", "--seq", "7"],
     "--experts with --tp 2: a microbatch's 1·7 tokens do not divide among tp=2 ranks"),
])
def test_train_expert_options_are_checked_before_any_rank(capsys, args, said) -> None:
    from pipedsl.cli import main

    assert main(["train", "-P", "2", *args]) == 2
    assert said in capsys.readouterr().err


@pytest.mark.slow
def test_train_schedule_auto_profiles_searches_switches_and_equals_one_process(tmp_path) -> None:
    """--schedule auto: three steps under ZB-H1 on a lopsided cut (the embedding alone on stage 0), then the units
    re-cut from their measured times and ZB-auto searched from the costs of the new cut, the run carried over
    through a checkpoint of step 3 (weights, AdamW's state, the data position; loaded by tensor name into the new
    partition): every step's loss equals one process, and the report names the cut and the searched program."""
    common = ["--steps", "6", "--layers", "3", "-M", "4"]
    one = _train(tmp_path, "one", "-P", "1", *common)
    out = tmp_path / "auto"
    proc = pipedsl_here("train", "-P", "2", "--seq", "8", "--embd", "16", "-o", str(out), "--schedule", "auto",
                        "-p", "mem=3", "--split", "1", *common)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    auto = json.loads((out / "losses.json").read_text())["losses"]
    assert one.keys() == auto.keys() == {str(k) for k in range(1, 7)}
    for step, loss in one.items():
        assert auto[step] == pytest.approx(loss, rel=1e-5), step
    report = json.loads((out / "losses.json").read_text())
    assert report["schedule"] == "ZB-auto" and report["params"]["mem"] == 3
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    [switch] = [r for r in rows if r["kind"] == "schedule"]
    assert switch["step"] == 3 and switch["program"] == "ZB-auto" and switch["predicted_ms"] > 0, switch
    assert switch["split"] in ([2], [3]) and switch["predicted_ms"] < switch["kept_split_ms"], switch
    assert switch["cost"]["F"] > 0 and switch["cost"]["W"] > 0
    assert switch["op_time_spread"] >= 0  # how noisy the profile was, said with the prediction
    assert switch["wmem_measured"] > 0  # what a pending W held of its activation after I, said
    assert not (out / "auto-switch").exists()  # the hand-over checkpoint is gone
    # each rank's peak saved bytes under the new cut, predicted from the units' bytes measured on the old one and a
    # pending W's share (the most any rank measured, Cost.wmem: one share for every stage): at or above what the last
    # step counted (the stdout's KiB, rounded to 0.1), and within 1 %
    assert switch["cost"]["wmem"] == switch["wmem_measured"]  # the search counted a pending W as measured
    measured = json.loads(re.search(r"saved-activation KiB per rank (\[[^]]*\])", proc.stdout).group(1))
    for got, predicted in zip(measured, (b / 1024 for b in switch["predicted_peak_bytes"]), strict=True):
        assert got <= predicted + 0.051 and got == pytest.approx(predicted, rel=0.01), switch

    # without -p mem the cap is what the device holds: --auto-memory of 1 KB fits no activation, so ZB-auto runs
    # with its least cap, 1 a rank (measured; a pending W holds 0.96 of an activation here, so one activation and
    # its W fit 1), and still every loss equals one process
    small = tmp_path / "small"
    proc = pipedsl_here("train", "-P", "2", "--seq", "8", "--embd", "16", "-o", str(small), "--schedule", "auto",
                        "--auto-memory", "0.000001", *common)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in (small / "metrics.jsonl").read_text().splitlines()]
    [switch] = [r for r in rows if r["kind"] == "schedule"]
    assert switch["wmem_measured"] <= 1 and switch["params"]["mem"] == 1 and switch["activations_that_fit"] == 0
    assert "peak activations per rank [1, 1]" in proc.stdout
    capped = json.loads((small / "losses.json").read_text())["losses"]
    for step, loss in one.items():
        assert capped[step] == pytest.approx(loss, rel=1e-5), step


@pytest.mark.slow
def test_a_run_owns_its_checkpoints_and_metrics(tmp_path) -> None:
    """Issue 39: a new run into a directory holding another run's checkpoints is refused before any rank (its
    latest would be exported or resumed as this run's) unless --overwrite removes them; a resume under another
    model configuration names the fields; a resume into another stage partition continues the run; metrics.jsonl
    is the run's own, and a resume replaces the steps it repeats."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    gpt = ["--seq", "8", "--embd", "16", "-o", str(out), "--checkpoint-dir", str(ckpt), "--layers", "4", "--batch", "8"]
    first = pipedsl_here("train", "-P", "2", "--steps", "4", "--checkpoint-every", "2", *gpt)
    assert first.returncode == 0, first.stderr[-2000:]
    whole = json.loads((out / "losses.json").read_text())["losses"]
    again = pipedsl_here("train", "-P", "2", "--steps", "2", *gpt)
    assert again.returncode == 2 and "holds another run's checkpoints (the latest: step 4" in again.stderr
    assert "--resume" in again.stderr and "--overwrite" in again.stderr
    other = pipedsl_here("train", "-P", "2", "--steps", "4", "--resume", *gpt, "--embd", "32")
    assert other.returncode == 2 and "of another model than this run's: n_embd: 16 there, 32 here\n" in other.stderr
    # resumed into another stage partition: 2 stages cut by count saved, 4 cut by FLOPs now (loaded by tensor name,
    # Adam's moments with them): the losses of the run that went on, to fp32 rounding
    resumed = pipedsl_here("train", "-P", "4", "-M", "4", "--split", "flops", "--schedule", "zb-h1", "--steps", "6",
                           "--resume", str(ckpt / "step-00000002"), *gpt)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "cut into 2 stages otherwise; its tensors load by name" in resumed.stdout
    again = json.loads((out / "losses.json").read_text())["losses"]
    assert all(abs(again[k] - whole[k]) <= 1e-5 * abs(whole[k]) for k in ("3", "4")), (again, whole)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps == [1, 2, 3, 4, 5, 6]  # 3 and 4 once: the resumed run's
    fresh = pipedsl_here("train", "-P", "2", "--steps", "2", "--overwrite", *gpt)
    assert fresh.returncode == 0 and "removed 3 checkpoint(s) of another run" in fresh.stdout, fresh.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps == [1, 2]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-00000002"]


@pytest.mark.slow
def test_max_time_stops_with_a_checkpoint_keeps_the_newest_and_logs_every_n(tmp_path) -> None:
    """--max-time: every rank stops after the same step, before the limit, with a checkpoint that --resume continues;
    --keep-checkpoints 2 leaves the newest two; --log-every 5 records steps 1, 5, 10, … and the last."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "run"
    gpt = ["-P", "2", "--seq", "8", "--embd", "16", "--layers", "2", "-o", str(out), "--checkpoint-dir", str(ckpt)]
    proc = pipedsl_here("train", *gpt, "--steps", "100000", "--max-time", "3", "--checkpoint-every", "2",
                        "--keep-checkpoints", "2", "--log-every", "5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    done = json.loads((out / "losses.json").read_text())["losses"]
    last = max(map(int, done))
    assert 3 < last < 100000
    saved = sorted(p.name for p in ckpt.iterdir())
    assert len(saved) == 2 and saved[-1] == f"step-{last:08d}", saved
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps == sorted({1, *range(5, last + 1, 5)}), steps
    resumed = pipedsl_here("train", *gpt, "--steps", str(last + 2), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    again = json.loads((out / "losses.json").read_text())["losses"]  # every step's, the stopped run's from its checkpoint
    assert sorted(map(int, again)) == list(range(1, last + 3))
    assert all(again[k] == v for k, v in done.items()), "the steps before the resume are the stopped run's own"


def _saved_tensors(directory) -> dict[str, object]:
    """Every tensor of a checkpoint's rank files by path, the random generators' states left out."""
    import torch

    out: dict[str, object] = {}

    def walk(x, path: str) -> None:
        if isinstance(x, torch.Tensor):
            out[path] = x
        elif isinstance(x, dict):
            for k, v in x.items():
                if k != "rng":
                    walk(v, f"{path}/{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{path}/{i}")

    for f in sorted(directory.glob("rank-*.pt")):
        walk(torch.load(f, weights_only=False), f.name)
    return out


@pytest.mark.slow
def test_train_post_validated_equals_synchronous_and_resumes(tmp_path) -> None:
    """--post-validate (runtime/post_validate.py) at dp2 × pp2 with ZeRO-1, bf16 parameters over fp32 main ones and
    clipping that triggers: every step's loss and the last checkpoint's every tensor (parameters, main parameters,
    optimizer state) equal the synchronous run's, and a post-validated run resumed from its step-3 checkpoint
    gives the same losses."""
    import torch

    common = ["--schedule", "zb-h1", "--dp", "2", "--zero", "1", "--steps", "6", "--checkpoint-every", "3",
              "--precision", "bf16", "--param-dtype", "bf16", "--clip-grad", "0.6"]
    sync = _train(tmp_path, "sync", *common, "--checkpoint-dir", str(tmp_path / "sync-ckpt"))
    post = _train(tmp_path, "post", *common, "--post-validate", "--checkpoint-dir", str(tmp_path / "post-ckpt"))
    assert sorted(post, key=int) == [str(s) for s in range(1, 7)] and post == sync
    metrics = [json.loads(line) for line in (tmp_path / "post" / "metrics.jsonl").read_text().splitlines()]
    redone = [m["step"] for m in metrics if m.get("redone")]
    assert 0 < len(redone) < 6, f"clipping must trigger on some steps, not all: redone {redone}"
    # the measured timeline is of the last two steps, which overlap, as is the prediction beside it
    program = pipedsl.load("zb-h1").compile(P=2, M=2)
    for name in ("timeline.json", "predicted.json"):
        drawn = pipedsl.Timeline.from_json((tmp_path / "post" / name).read_text())
        assert drawn.meta["steps"] == 2, name
        assert [len(events) for events in drawn.ranks] == [2 * len(stream) for stream in program.ranks], name
    a, b = _saved_tensors(tmp_path / "sync-ckpt" / "step-00000006"), _saved_tensors(tmp_path / "post-ckpt" /
                                                                                 "step-00000006")
    assert a.keys() == b.keys() and len(a) > 10
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    resumed = _train(tmp_path, "resumed", *common, "--post-validate", "--checkpoint-dir", str(tmp_path / "other"),
                     "--resume", str(tmp_path / "post-ckpt" / "step-00000003"))
    assert resumed == post


@pytest.mark.slow
def test_train_post_validated_moe_counts_each_step_once(tmp_path) -> None:
    """An MoE GPT at dp2 × pp2 × ep2 under DualPipeV's overlapped pairs, clipping on some steps: --post-validate
    gives the synchronous losses and the same tokens per expert for every step (an undone pass's routings are
    not counted; each step's counts are logged with its own report, which comes a step late)."""
    common = ["--schedule", "dualpipev", "-M", "4", "--dp", "2", "--ep", "2", "--experts", "4", "--steps", "4",
              "--clip-grad", "0.56"]
    sync = _train(tmp_path, "sync", *common)
    post = _train(tmp_path, "post", *common, "--post-validate")
    assert post == sync

    def experts(name: str) -> dict[int, list[int]]:
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return {m["step"]: m["tokens_per_expert"] for m in map(json.loads, lines) if "tokens_per_expert" in m}

    metrics = [json.loads(line) for line in (tmp_path / "post" / "metrics.jsonl").read_text().splitlines()]
    assert any(m.get("redone") for m in metrics) and not all(m.get("redone") for m in metrics if "step" in m)
    assert experts("post") == experts("sync") and sorted(experts("sync")) == [1, 2, 3, 4]


@pytest.mark.slow
def test_train_schedule_auto_post_validated_searches_the_period(tmp_path) -> None:
    """--schedule auto --post-validate: ZB-auto is searched with post=1 (the period of overlapped steps, what
    post-validated steps run) and the switched run's losses equal one process."""
    common = ["--steps", "6", "--layers", "3", "-M", "4", "--clip-grad", "5.0"]
    one = _train(tmp_path, "one", "-P", "1", *common)
    auto = _train(tmp_path, "auto", "--schedule", "auto", "-p", "mem=3", "--post-validate", *common)
    assert one.keys() == auto.keys() == {str(k) for k in range(1, 7)}
    for step, loss in one.items():
        assert auto[step] == pytest.approx(loss, rel=1e-5), step
    rows = [json.loads(line) for line in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    [switch] = [r for r in rows if r["kind"] == "schedule"]
    assert switch["program"] == "ZB-auto" and switch["params"]["post"] == 1, switch
