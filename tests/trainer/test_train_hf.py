"""`pipedsl train --model DIR --data …` end to end, through the command line: a Hugging Face decoder on
text files equals one process, resumes bit-exactly after SIGTERM, exports to a directory `from_pretrained`
loads with the pipeline's evaluation loss, and refuses bad input in one line before any rank starts."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (the optional `hf` extra)")

import torch  # noqa: E402
from cli_here import pipedsl_here as pipedsl  # noqa: E402

from pipedsl.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
_SENTENCE = ("the pipeline sends activations forward and gradients back while every rank keeps its stages busy "
             "schedules decide the order microbatches flow through stages and how much memory each rank holds")
WORDS = _SENTENCE.split()


def _text(seed: int, words: int) -> str:
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(WORDS), (words,), generator=g).tolist()
    return " ".join(WORDS[i] for i in picks) + ".\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A folder of text files: 12 documents, about 8 k bytes (byte-level tokens)."""
    folder = tmp_path_factory.mktemp("corpus")
    for k in range(12):
        (folder / f"doc{k:02d}.txt").write_text(_text(k, 110))
    return folder


def model_dir(root: Path, family: str, *, weights: bool = False) -> Path:
    """A small random config (byte-level vocabulary: the directory has no tokenizer), optionally with weights."""
    import transformers as tf

    common = dict(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, eos_token_id=256, bos_token_id=None,
                  pad_token_id=None, tie_word_embeddings=True)
    config = {"llama": lambda: tf.LlamaConfig(**common),
              "qwen3": lambda: tf.Qwen3Config(**common, head_dim=8),
              "gemma3": lambda: tf.Gemma3TextConfig(**common, head_dim=8, sliding_window=8,
                                                     sliding_window_pattern=2),
              "mixtral": lambda: tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                                  output_router_logits=True, router_aux_loss_coef=0.5),
              "deepseek_v2": lambda: tf.DeepseekV2Config(**{k: v for k, v in common.items()
                                                             if k != "num_key_value_heads"},
                                                          num_key_value_heads=4, moe_intermediate_size=16,
                                                          n_routed_experts=4, num_experts_per_tok=2,
                                                          n_shared_experts=1, first_k_dense_replace=1,
                                                          q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4,
                                                          v_head_dim=8, qk_nope_head_dim=4),
              "jetmoe": lambda: tf.JetMoeConfig(**{k: v for k, v in common.items() if k != "num_attention_heads"},
                                                kv_channels=8, num_local_experts=4, num_experts_per_tok=2,
                                                output_router_logits=True, aux_loss_coef=0.5)}[family]()
    path = root / f"{family}{'-weights' if weights else ''}"
    if weights:
        torch.manual_seed(123)
        tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    else:
        config.save_pretrained(path)
    return path


def common_flags(model: Path, corpus: Path, out: Path, steps: int = 4) -> list[str]:
    return ["train", "--model", str(model), "--data", str(corpus), "--seq", "32", "--batch", "8", "-M", "2",
            "--steps", str(steps), "--lr", "3e-3", "--clip-grad", "1.0", "--lr-schedule", "cosine",
            "--warmup-steps", "1", "--eval-fraction", "0.1", "--eval-every", "2", "-o", str(out),
            "--cache-dir", str(out.parent / "cache")]


def losses(out: Path) -> dict[int, float]:
    return {int(k): v for k, v in json.loads((out / "losses.json").read_text())["losses"].items()}


def evals(out: Path, kind: str = "eval") -> dict[int, float]:
    """The losses metrics.jsonl holds (its rows survive a stop and a resume, unlike losses.json's run)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == kind}


ZERO3 = ["-P", "2", "--dp", "2", "--zero", "3", "--schedule", "zb-h1", "--recompute", "full"]


@pytest.mark.slow
def test_qwen3_bf16_main_parameters_dp2_pp2_zero3_auto_recut_equal_one_process(corpus, tmp_path):
    """dp2 x pp2 with ZeRO-3, full recomputation, clipping, cosine LR, packing and evaluation, under `--schedule
    auto` from a lopsided cut (the embedding alone on stage 0): three ZB-H1 steps, then the layers re-cut from
    their measured times and ZB-auto, the ZeRO-3 slices carried into the new partition by tensor name.  Qwen3
    trains bf16 weights over fp32 main parameters (--param-dtype bf16), and every step's loss and the held-out
    loss equal a one-process run of the same command to bf16's tolerance.  The fp32 case of the same layout
    (Gemma 3, --eval-data) is the resume/export test below, which compares with one process too."""
    model = model_dir(tmp_path, "qwen3")
    dtypes = ["--precision", "bf16", "--param-dtype", "bf16"]
    auto = ["-P", "2", "--dp", "2", "--zero", "3", "--schedule", "auto", "--split", "1", "--recompute", "full"]
    runs = [pipedsl(*common_flags(model, corpus, tmp_path / name), *dtypes, *layout)
            for name, layout in (("one", ["-P", "1"]), ("par", auto))]
    for proc in runs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    (want, want_eval), (got, got_eval) = ((losses(tmp_path / name), evals(tmp_path / name)) for name in ("one", "par"))
    assert want.keys() == got.keys() == {1, 2, 3, 4}
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=2e-3), step
    assert got_eval.keys() == want_eval.keys() == {2, 4}
    for step, loss in want_eval.items():
        assert got_eval[step] == pytest.approx(loss, rel=2e-3)
    assert want[4] < want[1]  # it learns
    rows = [json.loads(line) for line in (tmp_path / "par" / "metrics.jsonl").read_text().splitlines()]
    [switch] = [r for r in rows if r["kind"] == "schedule"]
    assert switch["step"] == 3 and switch["split"] is not None and switch["split"][0] > 1, switch


@pytest.mark.slow
def test_fine_tune_starts_from_the_saved_weights(corpus, tmp_path):
    """A directory with safetensors and a BPE tokenizer: the data is tokenized with that tokenizer, step 1's
    loss is the saved model's own loss on the first global batch, and the export carries the tokenizer."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from pipedsl.trainer import data

    model = model_dir(tmp_path, "qwen3", weights=True)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train([str(p) for p in sorted(corpus.iterdir())],
              trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"]))
    tf.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="</s>").save_pretrained(model)
    out = tmp_path / "run"
    proc = pipedsl(*common_flags(model, corpus, out, steps=2), "-P", "2", "--checkpoint-dir", str(tmp_path / "ck"),
                   "--eval-fraction", "0.25")  # BPE packs the corpus into fewer tokens than bytes
    assert proc.returncode == 0, proc.stderr[-3000:]
    [cache] = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    opened = data.TokenCache.open(cache)
    tokenizer = tf.AutoTokenizer.from_pretrained(model)
    assert opened.eos_id == tokenizer.eos_token_id and opened.max_token_id < 200  # the BPE's ids, not bytes
    train, _ = data.PackedSequences(opened, 32).split(0.25)
    x, y = data.BatchLoader(train, 8).global_batch_at(0)
    ref = tf.AutoModelForCausalLM.from_pretrained(model)
    with torch.no_grad():
        logits = ref(x).logits.float()
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
    assert losses(out)[1] == pytest.approx(want, rel=1e-5)
    exported = pipedsl("export", str(tmp_path / "ck"), "--hf", str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr[-3000:]
    again = tf.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert again("stages keep busy").input_ids == tokenizer("stages keep busy").input_ids


@pytest.mark.slow
def test_gemma3_zero3_equals_one_process_resumes_after_sigterm_and_exports(corpus, tmp_path, monkeypatch):
    """Gemma 3 (sliding and full layers, each with its own rotary) on dp2 x pp2, ZeRO-3, ZB-H1, full recomputation,
    clipping, cosine LR, a held-out file of its own (--eval-data) and TensorBoard: every step's loss and the
    held-out loss equal one process (fp32: 2e-5), and it learns; SIGTERM after the step-2 checkpoint (the ranks
    finish step 3 and save it) and --resume to step 4 give the same losses as the run that never stopped, bit for bit (the data position included); `pipedsl
    export` of the last checkpoint loads with `from_pretrained` and gives the pipeline's final evaluation loss.
    (Suite time: this was a Llama run plus a Gemma 3 parameter of the test above with the same layout and the same
    one-process comparison; one Gemma 3 run now asserts both.  Llama under dp2 x pp2 ZeRO-3 ZB-H1 is
    tests/models/test_hf_zero.py's.)"""

    from pipedsl.trainer import data

    model = model_dir(tmp_path, "gemma3")
    (tmp_path / "eval.txt").write_text(_text(99, 400))
    heldout_file = ["--eval-data", str(tmp_path / "eval.txt")]
    one = pipedsl(*common_flags(model, corpus, tmp_path / "one"), "-P", "1", *heldout_file)
    whole = pipedsl(*common_flags(model, corpus, tmp_path / "whole"), *ZERO3, *heldout_file,
                    "--tensorboard", str(tmp_path / "tb"))
    assert one.returncode == 0, one.stderr[-3000:]
    assert whole.returncode == 0, whole.stderr[-3000:]
    want, got = losses(tmp_path / "one"), losses(tmp_path / "whole")
    assert want.keys() == got.keys() == {1, 2, 3, 4}
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=2e-5), step
    assert want[4] < want[1]  # it learns
    assert evals(tmp_path / "whole").keys() == evals(tmp_path / "one").keys() == {2, 4}
    for step, loss in evals(tmp_path / "one").items():
        assert evals(tmp_path / "whole")[step] == pytest.approx(loss, rel=2e-5)
    assert list((tmp_path / "tb" / "whole").glob("events.out.tfevents.*")), "no TensorBoard event file"

    ckpt = tmp_path / "ckpt"
    flags = [*common_flags(model, corpus, tmp_path / "cut"), *ZERO3, *heldout_file, "--checkpoint-dir", str(ckpt),
             "--checkpoint-every", "2"]
    log = open(tmp_path / "cut.log", "w")  # noqa: SIM115 - the child writes it
    gate = tmp_path / "gate"  # rank 0 waits in step 3 until the signal reaches it: step 3 is in flight
    env = {**os.environ, "PIPEDSL_FAULT": "gate:0:3", "PIPEDSL_FAULT_GATE": str(gate)}
    proc = subprocess.Popen([sys.executable, "-m", "pipedsl.cli", *flags], stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT, start_new_session=True, env=env)
    deadline = time.monotonic() + 300
    while not (tmp_path / "gate.reached").exists():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "cut.log").read_text()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    log.close()
    # the ranks finished the step in flight and saved it (trainer/stop.py): the resume starts from step 3
    assert "stopped after step 3 of 4: SIGTERM received" in (tmp_path / "cut.log").read_text()
    resumed = pipedsl(*flags, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {ckpt}" in resumed.stdout
    cut = evals(tmp_path / "cut", "train")  # step 3 from the stopped run, step 4 from the resumed one
    assert {s: cut[s] for s in (3, 4)} == {s: got[s] for s in (3, 4)}  # bit for bit
    assert evals(tmp_path / "cut")[4] == evals(tmp_path / "whole")[4]

    caches = [data.TokenCache.open(p) for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    [heldout] = [c for c in caches if c.num_documents == 1]  # eval.txt's cache (the corpus has 12 documents)
    with monkeypatch.context() as patch:  # a disk that fills during the export: one line, nothing left behind
        import transformers as tf

        def full_disk(self, directory, **_):
            Path(directory).mkdir(parents=True, exist_ok=True)
            (Path(directory) / "model.safetensors").write_bytes(b"half")
            raise RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                               "\"No space left on device\" })")

        patch.setattr(tf.PreTrainedModel, "save_pretrained", full_disk)
        failed = pipedsl("export", str(ckpt), "--hf", str(tmp_path / "hf"))
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr[-2000:]
    [line] = failed.stderr.strip().splitlines()[-1:]
    assert "cannot write the export to" in line and "No space left on device" in line, line
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.partial-*"))
    assert exported_loss(ckpt, tmp_path / "hf", data.PackedSequences(heldout, 32)) == pytest.approx(
        evals(tmp_path / "cut")[4], rel=1e-5)


def exported_loss(ckpt: Path, out: Path, heldout) -> float:
    """`pipedsl export` of the latest checkpoint under `ckpt` to `out`, loaded with `from_pretrained`: its mean
    next-token loss over the held-out samples, batch by batch as the pipeline evaluates them."""
    import transformers as tf

    from pipedsl.trainer import data

    exported = pipedsl("export", str(ckpt), "--hf", str(out))
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "exported step 4" in exported.stdout
    assert "Traceback" not in exported.stderr and "pickling" not in exported.stderr, exported.stderr[-2000:]
    ref = tf.AutoModelForCausalLM.from_pretrained(out)
    total = count = 0.0
    with torch.no_grad():
        for x, y in data.eval_batches(heldout, 8):
            logits = ref(x).logits.float()
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                       reduction="sum").item()
            count += y.numel()
    return total / count


TP_SP = ["-P", "2", "--dp", "2", "--tp", "2", "--sequence-parallel", "--schedule", "zb-h1", "--recompute", "selective",
         "--lr-schedule", "constant"]


@pytest.mark.slow
def test_llama_dp2_pp2_tp2_sequence_parallel_equals_one_process_resumes_and_exports(corpus, tmp_path):
    """Llama (grouped-query heads, tied embeddings) on dp2 x pp2 x tp2 with sequence parallelism: heads and MLP split
    over tp, vocabulary-parallel embedding, head and loss (parallel/tp_hf.py), ZB-H1, selective recomputation and
    clipping.  Two steps, a checkpoint of tp shards, --resume to step 4 in a second command: every step's loss and
    the held-out losses equal one process that never stopped (fp32: 2e-5); `pipedsl export` puts the shards back
    together into a model `from_pretrained` loads with the pipeline's final held-out loss."""
    from pipedsl.trainer import data

    model = model_dir(tmp_path, "llama")
    ckpt = tmp_path / "ckpt"
    par = [*common_flags(model, corpus, tmp_path / "par"), *TP_SP, "--checkpoint-dir", str(ckpt)]
    one = pipedsl(*common_flags(model, corpus, tmp_path / "one"), "-P", "1", "--lr-schedule", "constant")
    first = pipedsl(*par, "--steps", "2")
    assert one.returncode == 0, one.stderr[-3000:]
    assert first.returncode == 0, first.stderr[-3000:]
    assert "2 x 2 x 2 = 8 processes (dp x pp x tp, zero=0, sequence parallel)" in first.stdout
    resumed = pipedsl(*par, "-o", str(tmp_path / "par2"), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    want, got = losses(tmp_path / "one"), {**losses(tmp_path / "par"), **losses(tmp_path / "par2")}
    assert want.keys() == got.keys() == {1, 2, 3, 4} and losses(tmp_path / "par2") == got  # every step's loss
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=2e-5), step
    assert want[4] < want[1]  # it learns
    got_eval = {**evals(tmp_path / "par"), **evals(tmp_path / "par2")}
    assert got_eval.keys() == evals(tmp_path / "one").keys() == {2, 4}
    for step, loss in evals(tmp_path / "one").items():
        assert got_eval[step] == pytest.approx(loss, rel=2e-5), step

    [cache] = [data.TokenCache.open(p) for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    _, heldout = data.PackedSequences(cache, 32).split(0.1)
    assert exported_loss(ckpt, tmp_path / "hf", heldout) == pytest.approx(got_eval[4], rel=1e-5)


def _refused(*argv: str) -> str:
    """Run the CLI in this process; it must exit 2 with one line on stderr and start no rank."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(list(argv))
    assert code == 2, (code, out.getvalue()[-500:], err.getvalue()[-500:])
    text = err.getvalue().strip()
    assert len(text.splitlines()) == 1 and "Traceback" not in text, text
    assert "training" not in out.getvalue()  # nothing launched
    return text


def test_a_wrong_path_fails_before_the_heavy_imports(tmp_path):
    """A missing model directory or data file is refused before torch or transformers is imported (issue 39: every
    refusal took 13-22 s of imports): a fresh interpreter running the command has imported neither."""
    code = ("import sys\nfrom pipedsl.cli import main\n"
            f"code = main(['train', '--model', {str(tmp_path / 'nope')!r}, '--data', 'x.txt', '-P', '2'])\n"
            "print(code, 'torch' in sys.modules, 'transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["2", "False", "False"], (proc.stdout, proc.stderr[-1000:])
    assert "no such directory" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_bad_input_is_one_line_before_any_rank(corpus, tmp_path):
    good = model_dir(tmp_path, "llama")
    base = ["--seq", "32", "--batch", "8", "-M", "2", "-P", "2", "-o", str(tmp_path / "o"),
            "--cache-dir", str(tmp_path / "cache")]

    def train(model: Path | str, data: Path | str, *extra: str) -> str:
        return _refused("train", "--model", str(model), "--data", str(data), *base, *extra)

    assert "no such directory" in train(tmp_path / "nope", corpus)
    (tmp_path / "empty-model").mkdir()
    assert "no config.json" in train(tmp_path / "empty-model", corpus)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{ not json")
    assert "not valid JSON" in train(broken, corpus)
    (tmp_path / "a-file").write_text("{}")  # found by tests/reliability/test_cli_fuzz.py
    for flag in ("--cache-dir", "--tensorboard", "--checkpoint-dir"):
        assert f"{flag} {tmp_path / 'a-file'}: not a directory" in train(good, corpus, flag, str(tmp_path / "a-file"))
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    assert "transformers cannot build this config" in train(odd, corpus)
    small = tmp_path / "small-vocab"
    small.mkdir()
    cfg = json.loads((good / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "vocab_size": 100}))
    assert "more than the model's vocab_size 100" in train(small, corpus)
    (tmp_path / "empty.txt").write_text("")
    assert "empty.txt" in train(good, tmp_path / "empty.txt")
    (tmp_path / "blob.txt").write_bytes(b"abc\x00\x01\x02")
    assert "blob.txt" in train(good, tmp_path / "blob.txt") and "binary" in train(good, tmp_path / "blob.txt")
    (tmp_path / "rows.jsonl").write_text('{"body": "hello"}\n')
    assert "rows.jsonl:1" in train(good, tmp_path / "rows.jsonl")
    (tmp_path / "tiny.txt").write_text("just a few words\n")
    assert "fewer than one global batch" in train(good, tmp_path / "tiny.txt")
    assert "longer than the model's 128 positions" in train(good, corpus, "--seq", "256")
    assert "held-out set has" in train(good, corpus, "--eval-data", str(tmp_path / "tiny.txt"))
    (tmp_path / "bad.toml").write_text("[training]\nstepz = 3\n")
    assert "unknown key 'stepz' in [training]" in train(good, corpus, "--config", str(tmp_path / "bad.toml"))
    (tmp_path / "type.toml").write_text('[training]\nsteps = "ten"\n')
    assert "[training] steps" in train(good, corpus, "--config", str(tmp_path / "type.toml"))
    assert "--data needs --model" in _refused("train", "--data", str(corpus), "-P", "2")
    assert "needs --tp 2 or more" in train(good, corpus, "--sequence-parallel")
    assert "--seq 30 does not divide by --tp 4" in train(good, corpus, "--tp", "4", "--seq", "30", "--sequence-parallel")
    assert "num_key_value_heads=2 is not divisible by tp=4" in train(good, corpus, "--tp", "4", "-P", "1")
    assert "--tp 3: the GPT's attention heads (4) does not divide by 3" in _refused("train", "--tp", "3", "-P", "1")
    assert "no such checkpoint directory" in _refused("export", str(tmp_path / "nope"), "--hf", str(tmp_path / "x"))


def test_weights_and_data_that_cannot_train_are_one_line_before_any_rank(corpus, tmp_path):
    """Weights files that do not fit config.json's model — truncated, another shape, a shape that would broadcast,
    an index naming a missing file — and data whose records are all empty are refused in the launcher (issue 39:
    they were tracebacks on the ranks, or trained wrong)."""
    import shutil

    from safetensors.torch import load_file, save_file

    good = model_dir(tmp_path, "llama", weights=True)
    base = ["--seq", "32", "--batch", "8", "-M", "2", "-P", "2", "-o", str(tmp_path / "o"),
            "--cache-dir", str(tmp_path / "cache")]

    def train(model: Path, data: Path = corpus) -> str:
        return _refused("train", "--model", str(model), "--data", str(data), *base)

    def variant(name: str, change) -> Path:
        path = tmp_path / name
        shutil.copytree(good, path)
        change(path / "model.safetensors")
        return path

    def truncate(f: Path) -> None:
        f.write_bytes(f.read_bytes()[:-1000])

    def reshape(new_shape, key="model.layers.1.mlp.up_proj.weight"):
        def change(f: Path) -> None:
            tensors = load_file(f)
            tensors[key] = torch.zeros(new_shape)
            save_file(tensors, f, metadata={"format": "pt"})
        return change

    said = train(variant("truncated", truncate))
    assert "truncated" in said and "model.safetensors" in said, said
    said = train(variant("narrow", reshape((64, 16))))
    assert "model.layers.1.mlp.up_proj.weight is F32[64, 16], the model of" in said and "has [64, 32]" in said, said
    said = train(variant("broadcast", reshape((1, 32))))  # would broadcast on copy_: refused, not trained wrong
    assert "F32[1, 32]" in said, said
    indexed = tmp_path / "indexed"
    shutil.copytree(good, indexed)
    keys = list(load_file(indexed / "model.safetensors"))
    (indexed / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "model-00002-of-00002.safetensors" for k in keys}}))
    (indexed / "model.safetensors").unlink()
    assert "model-00002-of-00002.safetensors, which is not in" in train(indexed)
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n' * 20)
    said = train(good, tmp_path / "empty.jsonl")
    assert "empty.jsonl" in said and "documents is empty" in said, said


def test_configs_transformers_accepts_but_cannot_run_are_one_line_before_any_rank(corpus, tmp_path):
    """Heads that do not divide the hidden size (without a head_dim), key/value heads that do not divide the heads,
    an unknown rope type: refused naming config.json, the field and the values (issue 39: tracebacks of 94 and 46
    lines, or a model narrower than the file says)."""
    good = json.loads((model_dir(tmp_path, "llama") / "config.json").read_text())
    base = ["--seq", "32", "--batch", "8", "-M", "2", "-P", "2", "-o", str(tmp_path / "o"),
            "--cache-dir", str(tmp_path / "cache")]

    def variant(name: str, drop: tuple[str, ...] = (), **changes) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({k: v for k, v in {**good, **changes}.items() if k not in drop}))
        return path

    def refused(model: Path) -> str:
        said = _refused("train", "--model", str(model), "--data", str(corpus), *base)
        assert f"{model / 'config.json'}: " in said, said
        return said

    heads = variant("heads", drop=("head_dim",), num_attention_heads=3, num_key_value_heads=3)  # as written by hand
    assert "num_attention_heads 3 does not divide hidden_size 32" in refused(heads)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 260, "n_embd": 32, "n_head": 3,
                                                  "n_layer": 2, "n_positions": 128}))
    assert "n_head 3 does not divide n_embd 32" in refused(gpt2)  # the names the file uses
    assert "num_key_value_heads 3 does not divide num_attention_heads 4" in refused(variant("kv", num_key_value_heads=3))
    starcoder2 = variant("starcoder2", drop=("num_key_value_heads", "head_dim"), model_type="starcoder2",
                         num_attention_heads=3, hidden_size=36)
    said = refused(starcoder2)  # a field the file leaves out: transformers' default, said so
    assert "num_key_value_heads 2 (starcoder2's default) does not divide num_attention_heads 3" in said, said
    for field in ("rope_scaling", "rope_parameters"):
        said = refused(variant(field, **{field: {"rope_type": "bogus", "factor": 2.0, "rope_theta": 10000.0}}))
        assert f"{field} rope_type 'bogus' is not one of transformers' default, " in said and "linear" in said, said

    from pipedsl.models.hf.io import inspect_model_dir

    inspect_model_dir(variant("head-dim", model_type="qwen3", num_attention_heads=3, num_key_value_heads=3,
                              head_dim=8))  # a head size of its own: the heads need not divide the hidden size
    inspect_model_dir(variant("linear", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                          "rope_theta": 10000.0}))


def test_a_config_whose_model_transformers_cannot_build_is_one_line(tmp_path):
    """What config_checks.py does not foresee and transformers only finds while building the model is still one
    line naming config.json, not a traceback (the backstop around every meta-device build in the launcher)."""
    import transformers as tf

    from pipedsl.models.hf import ModelDirError
    from pipedsl.trainer.hf_setup import _meta_model

    path = model_dir(tmp_path, "llama")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "rope_parameters": {"rope_type": "bogus",
                                                                           "rope_theta": 10000.0}}))
    config = tf.AutoConfig.from_pretrained(str(path), local_files_only=True)  # the config builds, its model not
    with pytest.raises(ModelDirError) as err:
        _meta_model(config)
    assert err.value.message.startswith(f"{path / 'config.json'}: transformers cannot build its model: KeyError")


def test_library_warnings_never_precede_a_refusal(corpus, tmp_path, monkeypatch):
    """Warnings printed while the launcher checks a model — transformers' log (a token id outside the
    vocabulary) and a Python FutureWarning — are held back: the refusal is the first line on stderr, and the
    only one (issue 39: 4 lines of library warnings stood above several refusals)."""
    import logging
    import warnings

    from transformers.utils import logging as tf_logging

    from pipedsl.models.hf import io as hf_io

    path = model_dir(tmp_path, "llama")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 5000}))  # transformers logs a warning
    inspect = hf_io.inspect_model_dir

    def warning_inspect(model):
        warnings.warn("a library's deprecation", FutureWarning, stacklevel=1)
        return inspect(model)

    monkeypatch.setattr(hf_io, "inspect_model_dir", warning_inspect)
    err, out = io.StringIO(), io.StringIO()
    tf_logging.get_logger()  # its handler set up, to write where this test reads
    for handler in logging.getLogger("transformers").handlers:
        if isinstance(handler, logging.StreamHandler):
            monkeypatch.setattr(handler, "stream", err)
    monkeypatch.setattr(warnings, "showwarning", lambda message, category, filename, lineno, file=None, line=None:
                        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line)))
    with warnings.catch_warnings(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        warnings.simplefilter("always")
        code = main(["train", "--model", str(path), "--data", str(corpus), "--seq", "256", "--batch", "8", "-M", "2",
                     "-P", "2", "-o", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "cache")])
    lines = err.getvalue().splitlines()
    assert code == 2 and lines[0].startswith("error: --seq 256 is longer than the model's 128 positions"), lines
    assert len(lines) == 1, lines


def test_config_file_and_flags(tmp_path):
    """Flags win over the file, sections and top-level keys both work, --print-config round-trips."""
    (tmp_path / "run.toml").write_text('schedule = "zb-h1"\n[training]\nsteps = 7\nlr = 0.01\nclip-grad = 0.5\n'
                                       '[parallel]\ndp = 2\n[data]\npad_fraction = 0.25\n')
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["train", "--config", str(tmp_path / "run.toml"), "--steps", "9", "--print-config"]) == 0
    text = out.getvalue()
    import tomllib

    resolved = tomllib.loads(text)
    assert resolved["training"]["steps"] == 9  # the flag
    assert resolved["training"]["lr"] == 0.01 and resolved["training"]["clip-grad"] == 0.5
    assert resolved["schedule"]["schedule"] == "zb-h1" and resolved["parallel"]["dp"] == 2
    assert resolved["data"]["pad-fraction"] == 0.25
    (tmp_path / "again.toml").write_text(text)
    again = io.StringIO()
    with contextlib.redirect_stdout(again):
        assert main(["train", "--config", str(tmp_path / "again.toml"), "--print-config"]) == 0
    assert again.getvalue() == text


def _exported(tmp_path: Path, name: str) -> dict[str, torch.Tensor]:
    """`pipedsl export` of step 4 of checkpoint folder `name` ("one": ckpt-one) as a transformers state dict."""
    import transformers as tf

    done = pipedsl("export", str(tmp_path / ("ckpt-one" if name == "one" else name)), "--hf", str(tmp_path / f"hf-{name}"))
    assert done.returncode == 0 and "exported step 4" in done.stdout, done.stderr[-3000:]
    return tf.AutoModelForCausalLM.from_pretrained(tmp_path / f"hf-{name}").state_dict()


@pytest.mark.slow
def test_mixtral_with_its_router_loss_and_expert_parallelism_equals_one_process_resumes_and_exports(corpus, tmp_path):
    """An MoE directory with output_router_logits: the router's auxiliary loss is added per microbatch (the
    default reduction for it), and dp2 × pp2 with the experts sharded over ep=2, ZeRO-1 and ZB-V — two steps, a
    checkpoint of expert shards, --resume to step 4 — equals one process step by step; each step logs the tokens
    every expert received; both runs export, and the exported weights (the shards joined) are the same.  The
    per-token reduction, which would change what the loss means, is refused in one line.  (The auxiliary loss
    depends on how rows are grouped into microbatches, so the one-process run uses the same microbatches.)"""

    model = model_dir(tmp_path, "mixtral")
    constant = ["--lr-schedule", "constant"]  # the same learning rates whether the run stops at step 2 or 4
    one = pipedsl(*common_flags(model, corpus, tmp_path / "one"), *constant, "-P", "1", "-M", "4",  # dp2 × M2's
                  "--checkpoint-dir", str(tmp_path / "ckpt-one"))
    par = [*common_flags(model, corpus, tmp_path / "par"), *constant, "-P", "2", "--dp", "2", "--ep", "2", "--zero",
           "1", "--schedule", "zb-v", "--checkpoint-dir", str(tmp_path / "ckpt")]
    first = pipedsl(*par, "--steps", "2")
    for proc in (one, first):
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "experts over ep=2" in first.stdout
    resumed = pipedsl(*par, "-o", str(tmp_path / "par2"), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    want, got = losses(tmp_path / "one"), {**losses(tmp_path / "par"), **losses(tmp_path / "par2")}
    assert want.keys() == got.keys() == {1, 2, 3, 4}
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=2e-5), step
    assert losses(tmp_path / "par2") == got  # every step's loss, those before the resume from the checkpoint
    rows = [json.loads(line) for line in (tmp_path / "par2" / "metrics.jsonl").read_text().splitlines()]
    load = [r["tokens_per_expert"] for r in rows if r["kind"] == "train"]
    # 8 rows of 32 tokens, top-2 routings, 4 layers: every routing is counted once, over every rank
    assert len(load) == 2 and all(len(t) == 4 and sum(t) == 8 * 32 * 2 * 4 for t in load), load
    exported = {name: _exported(tmp_path, name) for name in ("one", "ckpt")}
    assert exported["one"].keys() == exported["ckpt"].keys()
    for key, value in exported["one"].items():
        assert torch.allclose(exported["ckpt"][key], value, atol=1e-5), key
    assert "adds its router's auxiliary loss" in _refused(*common_flags(model, corpus, tmp_path / "t"),
                                                            "--loss-reduction", "token")


def resumed_equals_one_process(model: Path, corpus: Path, tmp_path: Path, one: list[str], par: list[str],
                               first: list[str]) -> None:
    """Four steps of one process (-P 1 -M 4, flags `one`) against two steps of `par` + `first` with a checkpoint
    in tmp_path/ckpt, then `par` --resume'd to step 4: every run succeeds and every step's loss is equal."""
    constant = ["--lr-schedule", "constant"]
    runs = [pipedsl(*common_flags(model, corpus, tmp_path / "one"), *constant, "-P", "1", "-M", "4", *one)]
    par = [*common_flags(model, corpus, tmp_path / "par"), *constant, *par, "--checkpoint-dir", str(tmp_path / "ckpt")]
    runs.append(pipedsl(*par, *first, "--steps", "2"))
    runs.append(pipedsl(*par, "-o", str(tmp_path / "par2"), "--resume"))
    for proc in runs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    want, got = losses(tmp_path / "one"), {**losses(tmp_path / "par"), **losses(tmp_path / "par2")}
    assert want.keys() == got.keys() == {1, 2, 3, 4}
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=2e-5), step


@pytest.mark.slow
def test_deepseek_latent_attention_under_sequence_parallelism_equals_one_process_and_resumes(corpus, tmp_path):
    """DeepSeek-V2 (latent attention, a dense first layer, shared experts) at dp2 × pp2 × tp2 with sequence
    parallelism and selective recomputation (its attention run again through the tp hooks), experts over ep=2 and
    ZeRO-3, through the command line: two steps and a checkpoint, then --resume without tp or ep to step 4, every
    step's loss and gradient norm equal to one process's (without the rotary key's sum over tp the norm is off; the
    loss hides it: Adam's first steps barely see a gradient's scale)."""
    resumed_equals_one_process(model_dir(tmp_path, "deepseek_v2"), corpus, tmp_path, [],
                               ["-P", "2", "--dp", "2", "--zero", "3"],
                               ["--tp", "2", "--sequence-parallel", "--ep", "2", "--recompute", "selective"])

    def norms(*runs: str) -> list[float]:
        rows = [json.loads(line) for run in runs for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [r["grad_norm"] for r in rows if r["kind"] == "train"]

    assert len(norms("one")) == 4 and norms("par", "par2") == pytest.approx(norms("one"), rel=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "jetmoe"])
def test_moe_tp2_ep2_equals_one_process_resumes_on_another_tp_and_ep_and_exports(corpus, tmp_path, family):
    """An MoE directory at dp2 × pp2 × tp2 with sequence parallelism and the experts over ep=2 (8 ranks: the
    attention tensor-parallel — JetMoE's mixture of attention heads split by heads, models/hf/jetmoe.py — each MoE
    block on its tp rank's share of the tokens, parallel/moe_tp.py), ZeRO-1 and ZB-V: two steps and a checkpoint,
    then --resume at tp1 × ep1 (4 ranks) to step 4, every step's loss equal to one process (the router's auxiliary
    loss included); each step logs every routing once; the export (the tensor-parallel shards and the expert
    shards joined) is one process's model."""

    resumed_equals_one_process(model_dir(tmp_path, family), corpus, tmp_path,
                               ["--checkpoint-dir", str(tmp_path / "ckpt-one")],
                               ["-P", "2", "--dp", "2", "--zero", "1", "--schedule", "zb-v"],
                               ["--tp", "2", "--sequence-parallel", "--ep", "2"])
    rows = [json.loads(line) for line in (tmp_path / "par" / "metrics.jsonl").read_text().splitlines()]
    load = [r["tokens_per_expert"] for r in rows if r["kind"] == "train"]
    # 8 rows of 32 tokens, top-2 routings, 4 layers: every routing counted once though each tp rank routes its share
    assert len(load) == 2 and all(sum(t) == 8 * 32 * 2 * 4 for t in load), load
    exported = {name: _exported(tmp_path, name) for name in ("one", "ckpt")}
    assert exported["one"].keys() == exported["ckpt"].keys()
    # the tp ranks' partial expert gradients are summed in another order, which AdamW's division by √v magnifies
    # where a gradient is tiny: 1.3e-5 measured; a missing or doubled sum would be of the learning rate's order (3e-3)
    bad = {key: (exported["ckpt"][key] - value).abs().max().item() for key, value in exported["one"].items()}
    assert all(v <= 5e-5 for v in bad.values()), {k: v for k, v in bad.items() if v > 5e-5}


@pytest.mark.slow
def test_jetmoe_trains_with_its_router_loss_and_expert_parallelism(corpus, tmp_path):
    """JetMoE calls its router loss's factor aux_loss_coef; it once trained on the cross-entropy alone, logged
    tokens_per_expert [0, 0, 0, 0] and accepted --ep 2 while sharding nothing, and was then refused --ep.  Now its
    MLP experts are sharded (models/hf/jetmoe.py): pp2 and dp2 × pp2 with the experts over ep=2 equal one process
    step by step (the launcher's check compares the model's own loss), and every step logs the tokens each MLP
    expert received, the same with ep as without."""
    model = model_dir(tmp_path, "jetmoe")
    one = pipedsl(*common_flags(model, corpus, tmp_path / "one", steps=2), "-P", "1", "-M", "4")  # dp2 × M2's
    two = pipedsl(*common_flags(model, corpus, tmp_path / "two", steps=2), "-P", "2", "-M", "4")
    ep = pipedsl(*common_flags(model, corpus, tmp_path / "ep", steps=2), "-P", "2", "--dp", "2", "--ep", "2", "--zero",
                 "1")
    for proc in (one, two, ep):
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "no router statistics" not in proc.stdout
    assert "experts over ep=2" in ep.stdout
    want = losses(tmp_path / "one")
    assert want.keys() == losses(tmp_path / "two").keys() == losses(tmp_path / "ep").keys() == {1, 2}
    for run in ("two", "ep"):
        got = losses(tmp_path / run)
        for step in want:
            assert got[step] == pytest.approx(want[step], rel=2e-5), (run, step)
    loads = {}
    for run in ("one", "two", "ep"):
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        loads[run] = [r["tokens_per_expert"] for r in rows if r["kind"] == "train"]
    # 8 rows of 32 tokens, top-2 routings, 4 layers: every MLP routing counted once, over every rank
    assert len(loads["ep"]) == 2 and all(len(t) == 4 and sum(t) == 8 * 32 * 2 * 4 for t in loads["ep"]), loads
    assert loads["one"] == loads["two"] == loads["ep"], loads


def test_ep_is_refused_for_an_moe_whose_experts_cannot_be_found(tmp_path):
    """An MoE whose experts module has neither the experts interface nor a view giving it one (as JetMoE's
    JetMoeParallelExperts had before models/hf/jetmoe.py) is refused --ep naming the module and the forward it
    takes; a JetMoE model is not refused."""
    from types import SimpleNamespace

    import transformers as tf

    from pipedsl.errors import PipeDSLError
    from pipedsl.trainer.hf_setup import _check_experts

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = 4
            self.weight = torch.nn.Parameter(torch.zeros(4, 3, 2))

        def forward(self, inputs: torch.Tensor, expert_size: list[int]) -> torch.Tensor:
            return inputs

    md = SimpleNamespace(config=SimpleNamespace(num_local_experts=4), path=tmp_path)
    cfg = SimpleNamespace(parallel=SimpleNamespace(ep=2))
    with pytest.raises(PipeDSLError) as refused:
        _check_experts(cfg, md, torch.nn.Sequential(Experts()))
    assert "--ep 2: pipedsl cannot shard the experts of Sequential" in str(refused.value)
    assert "Experts (0) takes forward(inputs, expert_size)" in str(refused.value)
    with torch.device("meta"):
        jetmoe = tf.JetMoeForCausalLM(tf.JetMoeConfig(vocab_size=32, hidden_size=16, intermediate_size=16,
                                                      num_hidden_layers=1, num_key_value_heads=2, kv_channels=4,
                                                      num_local_experts=4, num_experts_per_tok=2))
    assert _check_experts(cfg, SimpleNamespace(config=jetmoe.config, path=tmp_path), jetmoe)


def test_lr_0_runs_the_steps_and_leaves_the_weights(corpus, tmp_path):
    """--lr 0 (the data's losses under the model as it is, no update) was refused: it runs, and the exported weights
    are the model's own, bit for bit (AdamW's decoupled weight decay is scaled by the learning rate too)."""
    import transformers as tf

    model = model_dir(tmp_path, "llama", weights=True)
    run = pipedsl(*common_flags(model, corpus, tmp_path / "out", steps=2), "-P", "2", "--lr", "0", "--lr-schedule",
                  "constant", "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert losses(tmp_path / "out").keys() == {1, 2}
    done = pipedsl("export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr[-3000:]
    before = tf.AutoModelForCausalLM.from_pretrained(model).state_dict()
    after = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
