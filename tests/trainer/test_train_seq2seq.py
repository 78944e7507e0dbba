"""`pipedsl train --model DIR` on encoder-decoders, end to end through the command line: T5 pretrains with span
corruption and BART fine-tunes on (source, target) pairs, equal to one process under dp × pp with ZeRO-3; a run
resumes bit-exactly from a checkpoint and exports to a directory `AutoModelForSeq2SeqLM` loads with the
pipeline's evaluation loss; what cannot work is one line before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers", reason="transformers is not installed (the optional `hf` extra)")

import torch  # noqa: E402
from cli_here import pipedsl_here as pipedsl  # noqa: E402
from test_train_hf import _refused, evals, losses, model_dir  # noqa: E402

from pipedsl import errors as pipedsl_errors  # noqa: E402
from pipedsl.trainer import seq2seq_data  # noqa: E402

WORDS = ["the", "pipeline", "sends", "activations", "forward", "and", "gradients", "back", "while", "every", "rank", "keeps", "its", "stages", "busy", "schedules", "decide", "the", "order"]
SENTINELS = 20


def _text(g: torch.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in torch.randint(len(WORDS), (n,), generator=g).tolist())


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A text corpus, a JSONL of (src, tgt) pairs (the target: the source's first six words reversed), and T5 and
    BART directories with a word-level tokenizer that has T5's sentinels."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("seq2seq")
    g = torch.Generator().manual_seed(0)
    (root / "corpus").mkdir()
    for k in range(12):
        (root / "corpus" / f"d{k:02d}.txt").write_text(_text(g, 120) + " .\n")
    with open(root / "pairs.jsonl", "w") as f:
        for _ in range(40):
            src = _text(g, 12)
            f.write(json.dumps({"src": src, "tgt": " ".join(reversed(src.split()[:6]))}) + "\n")
    words = Tokenizer(models.WordLevel(unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    sentinels = [f"<extra_id_{k}>" for k in range(SENTINELS)]
    words.train_from_iterator([" ".join(WORDS) + " ."],
                              trainers.WordLevelTrainer(special_tokens=["<pad>", "</s>", "<unk>", *sentinels]))
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="</s>",
                                           pad_token="<pad>", additional_special_tokens=sentinels)
    V = len(tokenizer)
    tf.T5Config(vocab_size=V, d_model=32, d_ff=64, num_layers=3, num_decoder_layers=3, num_heads=4, d_kv=8,
                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                relative_attention_num_buckets=8).save_pretrained(root / "t5")
    tf.BartConfig(vocab_size=V, d_model=32, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0,
                  activation_dropout=0.0, max_position_embeddings=64, pad_token_id=0, bos_token_id=None, eos_token_id=1,
                  decoder_start_token_id=1, forced_eos_token_id=None).save_pretrained(root / "bart")
    for name in ("t5", "bart"):
        tokenizer.save_pretrained(root / name)
    return root


def _flags(root: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--batch", "8", "-M", "2", "--steps", "4", "--lr", "3e-3", "--eval-every", "2",
            "--eval-fraction", "0.2", "-o", str(out), "--cache-dir", str(root / "cache"), *extra]


def _ok(proc) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]


ZERO3 = ["-P", "2", "--dp", "2", "--zero", "3", "--schedule", "zb-h1"]


@pytest.mark.slow
def test_t5_span_corruption_zero3_equals_one_process_resumes_and_exports(root, tmp_path):
    """T5 pretraining as the mT5 work did (span corruption, ZeRO-3), on dp2 × pp2 with ZB-H1: every loss and the
    held-out losses equal one process (fp32), it learns; resuming the step-2 checkpoint gives steps 3 and 4 bit for
    bit; the export loads with AutoModelForSeq2SeqLM and gives the pipeline's last evaluation loss."""
    t5 = ["--model", str(root / "t5"), "--data", str(root / "corpus"), "--seq", "24",
          "--noise-density", "0.2", "--mean-noise-span", "2"]  # not the defaults: both runs mask alike
    ckpt = tmp_path / "ckpt"
    _ok(pipedsl(*_flags(root, tmp_path / "one", *t5), "-P", "1"))
    _ok(pipedsl(*_flags(root, tmp_path / "par", *t5), *ZERO3, "--checkpoint-dir", str(ckpt), "--checkpoint-every",
                "2"))
    want, got = losses(tmp_path / "one"), losses(tmp_path / "par")
    assert want.keys() == got.keys() == {1, 2, 3, 4}
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=2e-5), step
    assert want[4] < want[1]
    assert evals(tmp_path / "par").keys() == {2, 4}
    for step, loss in evals(tmp_path / "one").items():
        assert evals(tmp_path / "par")[step] == pytest.approx(loss, rel=2e-5)

    resumed = pipedsl(*_flags(root, tmp_path / "again", *t5), *ZERO3, "--resume", str(ckpt / "step-00000002"))
    _ok(resumed)
    assert {s: losses(tmp_path / "again")[s] for s in (3, 4)} == {s: got[s] for s in (3, 4)}

    exported = pipedsl("export", str(ckpt), "--hf", str(tmp_path / "hf"))
    _ok(exported)
    assert "exported step 4" in exported.stdout
    assert _exported_eval_loss(root, tmp_path / "hf") == pytest.approx(evals(tmp_path / "par")[4], rel=1e-5)


def _exported_eval_loss(root: Path, exported: Path) -> float:
    """The exported model's loss on the run's held-out batches, as the pipeline evaluates them (token mean)."""
    import transformers as tf

    from pipedsl.trainer import data

    model = tf.AutoModelForSeq2SeqLM.from_pretrained(exported)
    [cache] = [data.TokenCache.open(p) for p in (root / "cache").iterdir() if p.is_dir()
               and data.TokenCache.open(p).num_documents == 12]
    sentinels = seq2seq_data.sentinel_ids(data.load_tokenizer(root / "t5"), "t5")
    samples = seq2seq_data.SpanCorruption(cache, 24, sentinels=sentinels, pad_id=0, start_id=0, noise_density=0.2,
                                          mean_noise_span=2)  # the run's --noise-density and --mean-noise-span
    _, heldout = samples.split(0.2)
    total = count = 0.0
    with torch.no_grad():
        for (ids, mask, dec), y in data.eval_batches(heldout, 8):
            logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits.float()
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                       reduction="sum").item()
            count += (y != -100).sum().item()
    return total / count


@pytest.mark.slow
def test_bart_on_pairs_interleaved_equals_one_process(root, tmp_path):
    """BART fine-tunes on (source, target) pairs from JSONL fields under the interleaved schedule (4 chunks on 2
    ranks: the encoder/decoder boundary inside a chunk), equal to one process; the per-token loss over the
    targets' real tokens, as HF computes it."""
    bart = ["--model", str(root / "bart"), "--data", str(root / "pairs.jsonl"), "--source-field", "src",
            "--target-field", "tgt", "--seq", "16", "--target-seq", "8", "--loss-reduction", "token"]
    _ok(pipedsl(*_flags(root, tmp_path / "one", *bart), "-P", "1"))
    _ok(pipedsl(*_flags(root, tmp_path / "par", *bart), "-P", "2", "--schedule", "interleaved", "-p", "V=2"))
    want, got = losses(tmp_path / "one"), losses(tmp_path / "par")
    assert want.keys() == got.keys() == {1, 2, 3, 4}
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=2e-5), step


def test_span_corruption_is_t5s():
    """T5's lengths (568 raw tokens → 512 inputs and 114 targets at 15 % / 3) and its format: the input keeps the
    window's tokens with each noise span replaced by one sentinel, the target lists each sentinel then its span;
    both end with eos, and the decoder's input is the target shifted right."""
    assert seq2seq_data.span_lengths(568, 0.15, 3.0) == (85, 28, 512, 114)

    class Stream:  # a token cache of one long document
        path, fingerprint, eos_id, num_documents = "stream", "f", 1, 1
        tokens = np.arange(100, 700, dtype=np.uint32)
        num_tokens = len(tokens)

    spans = seq2seq_data.SpanCorruption(Stream(), 64, sentinels=list(range(99, 79, -1)), pad_id=0, start_id=0,
                                        seed=7)
    b = spans.batch([0, 3])
    for row, i in enumerate((0, 3)):
        window = np.asarray(Stream.tokens[i * spans.raw_length:(i + 1) * spans.raw_length])
        noise = spans.noise_mask(i)
        assert noise.sum() == spans.noise and not noise[0]
        inp = b["input_ids"][row].numpy()[b["attention_mask"][row].numpy() == 1]
        tgt = b["targets"][row].numpy()[b["targets"][row].numpy() != -100]
        rebuilt, k, j = [], 0, 0  # undo the corruption from the input and the target
        for tok in inp[:-1]:
            if tok >= 100:
                rebuilt.append(tok)
                continue
            assert tok == 99 - k and tgt[j] == tok
            j += 1
            while j < len(tgt) - 1 and tgt[j] >= 100:
                rebuilt.append(tgt[j])
                j += 1
            k += 1
        assert rebuilt == window.tolist() and inp[-1] == tgt[-1] == 1 and k == spans.spans
        assert b["decoder_input_ids"][row, 0] == 0
        assert b["decoder_input_ids"][row, 1:len(tgt)].tolist() == tgt[:-1].tolist()
    assert torch.equal(spans.batch([3])["input_ids"][0], b["input_ids"][1])  # the same noise every time


def test_encoder_decoder_refusals_are_one_line(root, tmp_path):
    base = ["--seq", "16", "--batch", "8", "-M", "2", "-P", "2", "-o", str(tmp_path / "o"), "--cache-dir",
            str(tmp_path / "cache")]
    t5 = ["train", "--model", str(root / "t5"), *base]
    assert "--tp 2: tensor parallelism of encoder-decoders" in _refused(*t5, "--data", str(root / "corpus"), "--tp",
                                                                          "2", "-P", "1")
    assert "come together" in _refused(*t5, "--data", str(root / "pairs.jsonl"), "--source-field", "src")
    llama = model_dir(tmp_path, "llama")
    assert "is a causal decoder" in _refused("train", "--model", str(llama), *base, "--data",
                                             str(root / "pairs.jsonl"), "--source-field", "src", "--target-field",
                                             "tgt")
    assert "no field 'tgt2'" in _refused(*t5, "--data", str(root / "pairs.jsonl"), "--source-field", "src",
                                         "--target-field", "tgt2")
    assert "make 9 pieces, fewer than the program's 10 stages" in _refused(
        *t5, "--data", str(root / "corpus"), "-P", "5", "--schedule", "zb-v", "-M", "10", "--batch", "10")


def test_an_encoder_decoder_pipedsl_cannot_split_is_refused_in_one_line(root, tmp_path):
    """ProphetNet names its layer counts num_encoder_layers / num_decoder_layers: reading them gave a Python
    traceback (int(None)), exit 1.  Now its layers are counted, and the architecture check refuses it by name."""
    import transformers as tf

    from pipedsl.models.hf.io import seq2seq_layers

    tf.ProphetNetConfig(vocab_size=260, hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64, num_encoder_layers=2,
                        num_decoder_layers=3, num_encoder_attention_heads=2, num_decoder_attention_heads=2,
                        max_position_embeddings=64).save_pretrained(tmp_path / "prophetnet")
    assert seq2seq_layers(tf.AutoConfig.from_pretrained(tmp_path / "prophetnet")) == (2, 3)
    said = _refused("train", "--model", str(tmp_path / "prophetnet"), "--data", str(root / "pairs.jsonl"),
                    "--source-field", "src", "--target-field", "tgt", "--seq", "16", "--batch", "8", "-M", "2",
                    "-P", "2", "-o", str(tmp_path / "o"), "--cache-dir", str(tmp_path / "cache"))
    assert "ProphetNetForConditionalGeneration" in said, said
    with pytest.raises(pipedsl_errors.PipeRuntimeError, match="names its encoder's layers by none of"):
        seq2seq_layers(tf.PretrainedConfig())


def test_the_data_line_counts_only_the_training_pairs_tokens():
    """"760 pairs … (9343 + 5343 tokens) for training" counted the held-out pairs' tokens too: each split now
    counts its own, and the two add up to the whole."""
    from pipedsl.trainer.data import TokenCache

    lengths = [3, 5, 2, 7, 4]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    meta = {"fingerprint": "f", "eos_id": 1, "bos_id": None, "tokenizer_vocab": 64, "max_token_id": 63}
    source = TokenCache("src", meta, np.arange(offsets[-1]), offsets)
    target = TokenCache("tgt", meta, np.arange(2 * offsets[-1]), 2 * offsets)
    pairs = seq2seq_data.Seq2SeqPairs(source, target, 8, 16, pad_id=0, start_id=0)
    train, held = pairs.split(0.4)
    assert (len(train), len(held)) == (3, 2)
    assert "3 pairs" in train.describe() and "(10 + 20 tokens)" in train.describe(), train.describe()
    assert "2 pairs" in held.describe() and "(11 + 22 tokens)" in held.describe(), held.describe()


def test_a_held_out_set_too_small_says_which_fraction_holds_one_batch(root, tmp_path):
    """Span corruption of one small text file: the held-out check failed until --eval-fraction was guessed.  The
    refusal names the fraction that holds out one batch, and that fraction runs."""
    import re

    flags = ["train", "--model", str(root / "t5"), "--data", str(root / "corpus" / "d00.txt"), "--seq", "16",
             "-M", "2", "-P", "2", "--steps", "1", "--eval-every", "1", "--cache-dir", str(tmp_path / "cache")]
    said = _refused(*flags, "--batch", "4", "--eval-fraction", "0.01", "-o", str(tmp_path / "no"))
    assert "too few for a training batch and a held-out batch of 4 each; lower --batch" in said, said
    flags += ["--batch", "2"]
    said = _refused(*flags, "--eval-fraction", "0.01", "-o", str(tmp_path / "no"))
    found = re.search(r"--eval-fraction ([0-9.]+) holds out one", said)
    assert found and "fewer than one evaluation batch of 2" in said, said
    ok = pipedsl(*flags, "--eval-fraction", found.group(1), "-o", str(tmp_path / "yes"))
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert evals(tmp_path / "yes").keys() == {1}
