"""The training configuration: one typed, frozen `TrainConfig` from flags and TOML to the ranks (trainer/config.py)."""

from __future__ import annotations

import dataclasses
import pickle
import tomllib
from pathlib import Path

import pytest

import pipedsl
from pipedsl.cli import build_parser
from pipedsl.models.hf import StageCut
from pipedsl.trainer.config import (
    COMMAND_DEFAULTS,
    GPT_ONLY,
    HF_ONLY,
    SECTION_OF,
    SECTION_TYPES,
    SECTIONS,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    HFModelConfig,
    ModelConfig,
    ParallelismConfig,
    RunConfig,
    ScheduleConfig,
    TrainConfig,
    TrainingConfig,
    from_args,
    option_names,
    render,
)

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = TrainConfig()

# the sections and keys TOML files were written against before `TrainConfig` (less `log_every`, which no flag
# took then; --log-every has since): every one must still be read, into a field of its section
OLD_SECTIONS = {
    "model": ("model", "attn", "layers", "embd", "split", "dropout", "seed"),
    "data": ("data", "eval_data", "text_field", "seq", "packing", "doc_mask", "eval_fraction", "cache_dir",
             "pad_fraction"),
    "schedule": ("schedule", "ranks", "microbatches", "param"),
    "parallel": ("dp", "zero", "tp", "sequence_parallel"),
    "training": ("steps", "batch", "lr", "weight_decay", "precision", "param_dtype", "grad_dtype", "clip_grad",
                 "lr_schedule", "warmup_steps", "min_lr", "decay_steps", "recompute", "loss_reduction", "threads"),
    "eval": ("eval_every", "eval_batches"),
    "checkpoint": ("checkpoint_dir", "checkpoint_every", "resume", "overwrite", "keep_checkpoints"),
    "logging": ("out", "tensorboard", "wandb", "peak_tflops", "log_every"),
    "run": ("timeout", "checkpoint_timeout", "join_timeout", "allow_oversubscribe", "max_time"),
}


def parse(*argv: str):
    return build_parser(list(argv)).parse_args(list(argv))


def config_of(*argv: str) -> TrainConfig:
    return from_args(parse(*argv))


def options_of(command: str) -> dict:
    argv = [command, "--program", "p.json"] if command == "run" else [command]
    parser = parse(*argv)._parser
    return {a.dest: a for a in parser._actions if a.dest in option_names(parser)}


@pytest.mark.parametrize("command", ["train", "run"])
def test_every_option_is_a_field_and_its_default_lives_in_the_dataclass(command) -> None:
    """No default written twice: a flag's argparse default is None (not given) and the dataclass supplies it."""
    actions = options_of(command)
    assert set(actions) <= set(SECTION_OF), set(actions) - set(SECTION_OF)
    for dest, action in actions.items():
        assert action.default is None, f"--{dest}: default {action.default!r} beside the dataclass's"
    cfg = config_of(*(["run", "--program", "p.json"] if command == "run" else ["train"]))
    for dest in actions:
        expected = COMMAND_DEFAULTS[command].get(dest, getattr(getattr(DEFAULTS, SECTION_OF[dest]), dest))
        if dest != "program":
            assert getattr(getattr(cfg, SECTION_OF[dest]), dest) == expected, dest


def test_every_toml_key_is_a_field_of_its_section() -> None:
    for section, keys in OLD_SECTIONS.items():
        names = {f.name for f in dataclasses.fields(SECTION_TYPES[section])}
        assert set(keys) <= names, (section, set(keys) - names)
        assert set(keys) <= set(SECTIONS[section])
    assert {f.name for f in dataclasses.fields(TrainConfig)} >= set(SECTIONS)
    assert SECTION_OF["log_every"] == "logging"  # back, with its flag (--log-every)
    assert "live" not in SECTION_OF  # a key no flag defined: gone, not silently accepted


def test_the_example_toml_file_still_reads() -> None:
    cfg = config_of("train", "--config", str(ROOT / "examples" / "train-tiny.toml"))
    assert cfg.model.model == "examples/llama-tiny" and cfg.schedule.schedule == "zb-h1"
    assert (cfg.schedule.ranks, cfg.schedule.microbatches, cfg.parallel.dp, cfg.parallel.zero) == (2, 4, 2, 3)
    assert cfg.data.data[1] == "docs/" and cfg.data.eval_fraction == 0.05
    assert (cfg.training.param_dtype, cfg.training.clip_grad, cfg.training.warmup_steps) == ("bf16", 1.0, 5)
    assert (cfg.eval.eval_every, cfg.checkpoint.checkpoint_every, cfg.logging.tensorboard) == (20, 20,
                                                                                                "out/train-tiny/tb")


@pytest.fixture
def inputs(tmp_path, monkeypatch) -> Path:
    """A working directory holding what the configurations below name (--print-config checks the paths as a run
    does): a model directory's config.json, data files and a folder, a compiled program."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "some" / "dir").mkdir(parents=True)
    (tmp_path / "some" / "dir" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "a.txt").write_text("some text\n")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "doc.txt").write_text("more text\n")
    (tmp_path / "c.jsonl").write_text('{"body": "held out"}\n')
    (tmp_path / "prog.json").write_text(pipedsl.load("1f1b").compile(P=2, M=2).to_json())
    return tmp_path


@pytest.mark.parametrize("argv", [
    ["train"],
    ["train", "--schedule", "interleaved", "-P", "2", "-M", "4", "-p", "V=2", "--dp", "2", "--zero", "1", "--steps",
     "7", "--lr", "1e-4", "--clip-grad", "0.5", "--lr-schedule", "cosine", "--warmup-steps", "2", "--seed", "12",
     "--precision", "bf16", "--param-dtype", "bf16", "--recompute", "selective", "--loss-reduction", "token",
     "--checkpoint-dir", "ck", "--checkpoint-every", "3", "--resume", "--checkpoint-timeout", "30",
     "--tensorboard", "tb", "--peak-tflops", "1.5", "--allow-oversubscribe", "-o", 'odd "dir"\\ \n\x7f'],
    ["train", "--model", "some/dir", "--data", "a.txt", "b/", "--eval-data", "c.jsonl", "--text-field", "body",
     "--packing", "pack", "--doc-mask", "--eval-every", "5", "--eval-batches", "2", "--attn", "eager",
     "--cache-dir", "cache", "--tp", "2", "--sequence-parallel", "--seq", "64"],
    ["run", "--program", "prog.json", "-P", "2", "--batch", "8", "--log-every", "3"],
])
def test_print_config_reads_back_as_an_equal_config(inputs, tmp_path, capsys, argv) -> None:
    from pipedsl.cli import main

    cfg = config_of(*argv)
    assert main([*argv, "--print-config"]) == 0
    text = capsys.readouterr().out
    assert text == render(cfg, option_names(parse(*argv)._parser))
    (tmp_path / "run.toml").write_text(text)
    base = [argv[0], *(["--program", "prog.json"] if argv[0] == "run" else [])]
    assert config_of(*base, "--config", str(tmp_path / "run.toml")) == cfg


@pytest.mark.parametrize(("argv", "message"), [
    (["train", "--batch", "7"], "--batch 7 does not split into M=8 equal microbatches"),
    (["train", "-P", "3", "--split", "3,2"], "--split 3,2: cut points must increase"),
    (["train", "--tensorboard", "a.txt"], "--tensorboard a.txt: not a directory"),
    (["train", "--model", "nope", "--data", "a.txt"], "--model nope: no such directory"),
    (["train", "--model", "some/dir", "--data", "missing.txt"], "missing.txt: no such file or folder"),
    (["run", "--program", "missing.json"], "missing.json"),
    (["train", "--auto-memory", "2"], "--auto-memory 2 sizes --schedule auto's memory cap; the schedule is '1f1b'"),
    # the other model source's options, which a run would ignore without a word
    (["train", "--model", "some/dir", "--data", "a.txt", "--layers", "6", "--embd", "32"],
     "--layers, --embd: the built-in GPT's; --model some/dir brings its own"),
    (["train", "--packing", "pad", "--eval-every", "2"], "--packing, --eval-every: options of a Hugging Face model"),
])
def test_print_config_checks_what_it_prints(inputs, capsys, argv, message) -> None:
    """A configuration that would not start is refused as a run refuses it — one line, exit status 2 — and not
    printed (issue 39: --print-config printed whatever it was given)."""
    from pipedsl.cli import main

    assert main([*argv, "--print-config"]) == 2
    said = capsys.readouterr()
    assert said.out == ""
    assert len(said.err.strip().splitlines()) == 1 and message in said.err, said.err


def test_print_config_writes_a_cluster_file_this_machine_could_not_run(inputs, capsys) -> None:
    """What this machine holds is not checked: the file may be for torchrun on many machines (docs/training.md)."""
    from pipedsl.cli import main

    assert main(["train", "-P", "8", "--dp", "16", "--threads", "64", "--print-config"]) == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert printed["parallel"]["dp"] == 16 and printed["training"]["threads"] == 64
    assert main(["train", "-P", "8", "--dp", "16", "--threads", "64"]) == 2  # a run here is refused
    assert "local processes is more than" in capsys.readouterr().err


def _keys(text: str) -> set[str]:
    return {key.replace("-", "_") for section in tomllib.loads(text).values() for key in section}


@pytest.mark.parametrize(("argv", "shown", "other"), [
    (["train", "--layers", "6", "--embd", "32", "--pad-fraction", "0.25"], {"layers", "embd", "pad_fraction"}, HF_ONLY),
    (["train", "--model", "some/dir", "--data", "a.txt", "--attn", "eager", "--eval-every", "2"],
     {"data", "attn", "eval_every"}, GPT_ONLY),
])
def test_print_config_prints_the_keys_of_the_chosen_model_source(inputs, capsys, argv, shown, other) -> None:
    """The GPT's keys (layers, embd, …) are not printed for a Hugging Face model, nor a Hugging Face model's
    (attn, data, packing, [eval], …) for the GPT: the run ignores them (issue 39).  The printed TOML, given back
    with --config, prints the same text."""
    from pipedsl.cli import main

    assert main([*argv, "--print-config"]) == 0
    text = capsys.readouterr().out
    keys = _keys(text)
    assert not keys & set(other), keys & set(other)
    assert shown <= keys
    assert {"seq", "split", "seed", "steps"} <= keys  # what both read
    (inputs / "printed.toml").write_text(text)
    assert main(["train", "--config", "printed.toml", "--print-config"]) == 0
    assert capsys.readouterr().out == text


def test_flags_win_over_the_file_and_the_file_over_the_defaults(tmp_path) -> None:
    (tmp_path / "run.toml").write_text("[training]\nsteps = 7\nlr = 0.01\n[parallel]\ndp = 2\n")
    cfg = config_of("train", "--config", str(tmp_path / "run.toml"), "--steps", "9")
    assert (cfg.training.steps, cfg.training.lr, cfg.parallel.dp) == (9, 0.01, 2)
    assert cfg.training.weight_decay == DEFAULTS.training.weight_decay


@pytest.mark.parametrize(("build", "message"), [
    (lambda: TrainingConfig(steps=0), "--steps 0: must be an integer of at least 1"),
    (lambda: TrainingConfig(lr=float("nan")), "--lr nan: must be a non-negative, finite number"),
    (lambda: TrainingConfig(lr=-1e-3), "--lr -0.001: must be a non-negative, finite number"),
    (lambda: TrainingConfig(precision="fp8"), "--precision 'fp8': is not one of fp32, bf16, fp16"),
    (lambda: TrainingConfig(steps="3"), "--steps '3': must be an integer"),
    (lambda: ParallelismConfig(zero=4), "--zero 4: is not one of 0, 1, 2, 3"),
    (lambda: ParallelismConfig(sequence_parallel=1), "--sequence-parallel 1: must be true or false"),
    (lambda: DataConfig(eval_fraction=1.0), "--eval-fraction 1: must be in [0, 1)"),
    (lambda: DataConfig(data=()), "--data (): must be a list of paths"),
    (lambda: ModelConfig(seed=-1), "--seed -1: must be in [0, 2**63 - 2]"),
    (lambda: ModelConfig(split="halves"), "--split 'halves': is not one of count, blocks"),
    (lambda: ModelConfig(split="3,x"), "--split '3,x': is not one of count, blocks, flops or cut points"),
    (lambda: TrainConfig(model=ModelConfig(split="3,2")).for_program(pipedsl.load("1f1b").compile(P=3, M=3)),
     "--split 3,2: cut points must increase within 1..5"),
    (lambda: TrainConfig(model=ModelConfig(split="3")).for_program(pipedsl.load("1f1b").compile(P=3, M=3)),
     "--split 3: 1 cut points make 2 stages, the program has 3"),
    (lambda: TrainConfig(training=TrainingConfig(lr=0.1, min_lr=0.2)), "--min-lr 0.2 is above --lr 0.1"),
    (lambda: TrainConfig(training=TrainingConfig(decay_steps=3)), "--decay-steps 3 sets the wsd schedule's"),
    (lambda: TrainConfig(training=TrainingConfig(lr_schedule="wsd", steps=10, warmup_steps=4, decay_steps=7)),
     "--decay-steps 7 is more than the 6 steps after the warmup"),
    (lambda: RunConfig(timeout=1e9), "--timeout 1e+09: more than a year"),
    (lambda: RunConfig(checkpoint_timeout=-1.0), "--checkpoint-timeout -1: must be a positive"),
    (lambda: ScheduleConfig(ranks=0), "-P 0: must be an integer of at least 1"),
    (lambda: ScheduleConfig(param=("V",)), "-p 'V': expected NAME=INTEGER"),
    (lambda: ScheduleConfig(param=("V=²",)), "-p 'V=²': expected NAME=INTEGER"),
    (lambda: TrainConfig(checkpoint=CheckpointConfig(checkpoint_every=2)), "--checkpoint-every needs --checkpoint-dir"),
    (lambda: TrainConfig(checkpoint=CheckpointConfig(resume="latest")), "--resume without a checkpoint needs"),
    (lambda: TrainConfig(training=TrainingConfig(grad_dtype="bf16")), "--grad-dtype bf16: gradients accumulate"),
    (lambda: TrainConfig(parallel=ParallelismConfig(sequence_parallel=True)), "--sequence-parallel splits"),
    (lambda: ParallelismConfig(zero_reshard="never"), "--zero-reshard 'never': is not one of auto, unit, step"),
    (lambda: TrainConfig(parallel=ParallelismConfig(zero=2, zero_reshard="step")),
     "--zero-reshard step sets when ZeRO-3 frees gathered parameters: it needs --zero 3"),
    (lambda: TrainConfig(model=ModelConfig(embd=30)), "--embd 30 must be a multiple of 4"),
    (lambda: TrainConfig(model=ModelConfig(model="dir")), "--model needs --data"),
    (lambda: TrainConfig(data=DataConfig(data=("a.txt",))), "--data needs --model"),
    (lambda: TrainConfig(model=ModelConfig(model="d"), data=DataConfig(data=("a",), packing="pad", doc_mask=True)),
     "--doc-mask keeps documents apart"),
    (lambda: TrainConfig(model=ModelConfig(dropout=0.1), parallel=ParallelismConfig(tp=2)), "--tp 2 with --dropout"),
    (lambda: TrainConfig(training=TrainingConfig(lr_schedule="cosine", warmup_steps=20)),
     "--warmup-steps 20 must be less than --steps 20"),
    (lambda: TrainConfig.from_options({"stepz": 3}), "unknown option 'stepz'"),
])
def test_invalid_values_raise_one_config_error_naming_the_key(build, message) -> None:
    with pytest.raises(ConfigError) as err:
        build()
    assert err.value.message.startswith(message), err.value.message
    assert "\n" not in err.value.render() and err.value.render().startswith("error: ")


def test_the_config_is_frozen_and_pickles_as_the_ranks_receive_it() -> None:
    hf = HFModelConfig(path="/m", local=True, attn="sdpa", split=StageCut(attention_mask=False),
                       cache="/c", eval_cache=None, eval_at_end=True, export={"config": {"a": 1}}, describe="m",
                       data_describe="d")
    cfg = TrainConfig(model=ModelConfig(model="/m"), data=DataConfig(data=["x.txt"]), hf=hf, peak_flops=1e12,
                      started_at=1.0)
    assert cfg.data.data == ("x.txt",)  # lists become tuples
    again = pickle.loads(pickle.dumps(cfg))
    assert again == cfg and isinstance(again.hf, HFModelConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.training.steps = 3  # type: ignore[misc]


def test_the_loss_reduction_default_is_decided_in_one_place() -> None:
    assert DEFAULTS.loss_reduction == "microbatch"
    hf = TrainConfig(model=ModelConfig(model="dir"), data=DataConfig(data=("a",)))
    assert hf.loss_reduction == "token"
    chosen = dataclasses.replace(hf, training=TrainingConfig(loss_reduction="microbatch"))
    assert chosen.loss_reduction == "microbatch"
    assert config_of("train").training.loss_reduction is None  # the user's choice (none) stays visible


def test_for_program_makes_sizes_concrete_and_is_idempotent() -> None:
    program = pipedsl.load("1f1b").compile(P=2, M=2)
    cfg = TrainConfig(parallel=ParallelismConfig(dp=2)).for_program(program)
    assert (cfg.training.batch, cfg.model.layers, cfg.schedule.ranks, cfg.schedule.microbatches) == (16, 2, 2, 2)
    assert cfg.for_program(program) == cfg
    with pytest.raises(ConfigError, match="--batch 6 does not split into dp"):
        TrainConfig(training=TrainingConfig(batch=6), parallel=ParallelismConfig(dp=2)).for_program(program)


@pytest.mark.parametrize("recorded", [
    {"by": "count"},  # an encoder-decoder's cut
    {"by": "flops", "attention_mask": False, "position_ids": True},
    {"points": [3, 5], "attention_mask": True, "position_ids": False},
    {"attention_mask": False, "position_ids": False, "points": [2]}])  # a --schedule auto re-cut, written before
def test_the_stage_cut_a_checkpoint_recorded_reads_back_as_it_was_written(recorded):
    """Checkpoints record an HF model's cut as a plain dict (`StageCut.keywords`, what `pipedsl export` reads with
    `from_keywords`): every shape ever written reads back to the same keywords."""
    assert StageCut.from_keywords(recorded).keywords() == recorded


def test_a_stage_cut_with_a_key_this_version_does_not_know_is_refused_not_dropped():
    from pipedsl.models.hf import ModelDirError

    with pytest.raises(ModelDirError, match=r"\['by_memory'\]"):
        StageCut.from_keywords({"by": "count", "by_memory": True})


def test_every_option_is_on_a_help_page() -> None:
    """trainer/cli.py's LAYOUTS places each TrainConfig option under some command's help heading: an option added
    to the config and forgotten there would be a field no flag sets."""
    from pipedsl.trainer import config
    from pipedsl.trainer.cli import FILE_FLAGS, LAYOUTS

    placed = {name for layout in LAYOUTS.values() for _, names in layout for name in names}
    assert [name for name in config.FIELDS if name not in placed] == []
    assert placed - set(config.FIELDS) <= set(FILE_FLAGS)  # the rest are file flags (--config, --print-config)


def test_the_modules_the_fork_server_preloads_for_the_ranks_exist() -> None:
    """trainer/rank_modules.py names modules by string: a renamed one would silently stop being preloaded."""
    import importlib.util

    from pipedsl.trainer.rank_modules import EVERY_RANK, HF_RANK

    assert [name for name in (*EVERY_RANK, *HF_RANK) if importlib.util.find_spec(name) is None] == []
