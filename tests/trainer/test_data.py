"""trainer/data.py: input formats and their errors, tokenizers, the token cache, packing, resumable batches."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pipedsl.trainer.data import (
    HELDOUT_BLOCK,
    IGNORE_INDEX,
    BatchLoader,
    ByteTokenizer,
    DataError,
    Document,
    HFTokenizer,
    PackedSequences,
    TokenCache,
    build_token_cache,
    check_vocab,
    document_positions,
    eval_batches,
    load_tokenizer,
    read_documents,
)

pytest.importorskip("transformers", reason="transformers is not installed (the optional `examples` extra)")

CORPUS = ["hello world", "the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs",
          "héllo wörld ✓ — ünïcode"]
EOS, BOS = "<|endoftext|>", "<s>"


def _write(path, content: str | bytes) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(content.encode() if isinstance(content, str) else content)
    return str(path)


def _jsonl(path, records) -> str:
    return _write(path, "".join(json.dumps(r) + "\n" for r in records))


def _bpe():
    """A byte-level BPE trained offline on CORPUS (no hub): ids 0 and 1 are EOS and BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[EOS, BOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 10, trainer=trainer)
    return tok


def _save_hf(directory, **special) -> str:
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=_bpe(), **special).save_pretrained(str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> str:
    return _save_hf(tmp_path_factory.mktemp("bpe"), eos_token=EOS, bos_token=BOS)


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory) -> str:
    """The same BPE prepending BOS to every text (Llama's convention)."""
    return _save_hf(tmp_path_factory.mktemp("bpe_bos"), eos_token=EOS, bos_token=BOS, add_bos_token=True)


def _corpus(tmp_path, texts=CORPUS) -> str:
    return _jsonl(tmp_path / "corpus.jsonl", [{"text": t} for t in texts])


# ---------------------------------------------------------------- formats


def test_text_file_is_one_document_bom_stripped(tmp_path):
    path = _write(tmp_path / "a.md", "\ufeffline one\nline two\n")
    assert list(read_documents([path])) == [Document(path, "line one\nline two\n")]
    assert list(read_documents(path)) == [Document(path, "line one\nline two\n")]  # one path as a string


def test_jsonl_one_document_per_line_with_line_numbers(tmp_path):
    path = _write(tmp_path / "d.jsonl", '{"body": "first", "n": 1}\n\n{"body": "sécond"}\n')
    assert list(read_documents([path], text_field="body")) == [Document(f"{path}:1", "first"),
                                                                 Document(f"{path}:3", "sécond")]


def test_parquet_rows_across_row_groups(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "t.parquet")
    texts = [f"row {i}" for i in range(5)]
    pq.write_table(pa.table({"n": list(range(5)), "text": texts}), path, row_group_size=2)
    assert pq.ParquetFile(path).num_row_groups == 3
    assert list(read_documents([path])) == [Document(f"{path}[{i}]", t) for i, t in enumerate(texts)]


def test_saved_dataset_and_dataset_dict_train_split(tmp_path):
    import datasets

    data = datasets.Dataset.from_dict({"text": ["a", "b", "c"], "n": [1, 2, 3]})
    data.select([2, 0]).save_to_disk(str(tmp_path / "one"))  # a selection: saved with its rows in that order
    datasets.DatasetDict({"test": data.select([1]), "train": data}).save_to_disk(str(tmp_path / "dd"))
    one, dd = str(tmp_path / "one"), str(tmp_path / "dd")
    assert list(read_documents([one])) == [Document(f"{one}[0]", "c"), Document(f"{one}[1]", "a")]
    train = os.path.join(dd, "train")
    assert list(read_documents([dd])) == [Document(f"{train}[{i}]", t) for i, t in enumerate("abc")]


def test_folder_recursive_sorted_hidden_skipped_datasets_inside(tmp_path):
    import datasets

    root = tmp_path / "data"
    _write(root / "b.txt", "bee")
    _write(root / "a" / "z.txt", "zed")
    _write(root / "a.txt", "ay")
    _jsonl(root / "c" / "r.jsonl", [{"text": "r1"}, {"text": "r2"}])
    _write(root / ".hidden.txt", "no")
    _write(root / ".git" / "config", "no")
    _write(root / "a" / ".cache" / "x.txt", "no")
    datasets.Dataset.from_dict({"text": ["row"]}).save_to_disk(str(root / "d" / "saved"))
    docs = list(read_documents([str(root)]))
    r, saved = str(root / "c" / "r.jsonl"), str(root / "d" / "saved")
    assert docs == [Document(str(root / "a.txt"), "ay"), Document(str(root / "a" / "z.txt"), "zed"),
                    Document(str(root / "b.txt"), "bee"), Document(f"{r}:1", "r1"), Document(f"{r}:2", "r2"),
                    Document(f"{saved}[0]", "row")]


def test_pictures_in_a_folder_are_passed_over_but_refused_when_named(tmp_path):
    """A docs folder with its images trains on the text; a picture named on the command line is an error."""
    root = tmp_path / "docs"
    _write(root / "guide.md", "words")
    (root / "img").mkdir()
    (root / "img" / "plot.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    assert list(read_documents([str(root)])) == [Document(str(root / "guide.md"), "words")]
    with pytest.raises(DataError, match=r"plot\.png: a binary file"):
        list(read_documents([str(root / "img" / "plot.png")]))


# ---------------------------------------------------------------- bad input: one DataError line naming the file


def _pq(path, **columns) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), str(path))
    return str(path)


def _saved(path, columns: dict, split: str | None = None) -> str:
    import datasets

    data = datasets.Dataset.from_dict(columns)
    (datasets.DatasetDict({split: data}) if split else data).save_to_disk(str(path))
    return str(path)


BAD = {  # name -> (make the input under tmp, the fragments its message must contain, with {p} the path)
    "missing_path": (lambda t: str(t / "nope.txt"), ["{p}: no such file or folder"]),
    "empty_file": (lambda t: _write(t / "e.txt", b""), ["{p}: empty file (0 bytes)"]),
    "whitespace_file": (lambda t: _write(t / "w.txt", " \n\t\n"), ["{p}: empty file (only whitespace)"]),
    "empty_jsonl": (lambda t: _write(t / "e.jsonl", b""), ["{p}: empty file (0 bytes)"]),
    "blank_jsonl": (lambda t: _write(t / "b.jsonl", "\n\n  \n"), ["{p}: empty file (only whitespace)"]),
    "nul_byte": (lambda t: _write(t / "n.txt", b"abc\0def"), ["{p}: a binary file (NUL byte at offset 3)"]),
    "invalid_utf8": (lambda t: _write(t / "u.txt", b"ok \xff\xfe"), ["{p}: a binary file", "0xff at offset 3"]),
    "invalid_utf8_late": (lambda t: _write(t / "l.txt", b"x" * 9000 + b"\xc3("),
                          ["{p}: not UTF-8 text", "at offset 9000"]),
    "binary_jsonl": (lambda t: _write(t / "b.jsonl", b'{"text": "a"}\n\0\0'), ["{p}: a binary file", "offset 14"]),
    "jsonl_not_json": (lambda t: _write(t / "j.jsonl", '{"text": "ok"}\n{"text": oops}\n'), ["{p}:2: not JSON"]),
    "jsonl_not_object": (lambda t: _write(t / "j.jsonl", '["text"]\n'), ["{p}:1: a JSON array, not an object"]),
    "jsonl_no_field": (lambda t: _jsonl(t / "j.jsonl", [{"text": "a"}, {"body": "b", "id": 2}]),
                       ["{p}:2: no field 'text' (fields: body, id)"]),
    "jsonl_field_not_string": (lambda t: _jsonl(t / "j.jsonl", [{"text": 3}]),
                               ["{p}:1: field 'text' is a JSON number, not a string"]),
    "parquet_no_column": (lambda t: _pq(t / "p.parquet", body=["a"], n=[1]),
                          ["{p}: no column 'text' (columns: body, n)"]),
    "parquet_not_strings": (lambda t: _pq(t / "p.parquet", text=[1, 2]), ["{p}: column 'text' holds int64"]),
    "parquet_null": (lambda t: _pq(t / "p.parquet", text=["a", None]), ["{p}[1]: 'text' is null"]),
    "not_parquet": (lambda t: _write(t / "p.parquet", b"PAR1 not really"), ["{p}: not a Parquet file"]),
    "dataset_no_column": (lambda t: _saved(t / "ds", {"body": ["a"]}), ["{p}: no column 'text' (columns: body)"]),
    "dataset_dict_no_train": (lambda t: _saved(t / "dd", {"text": ["a"]}, split="test"),
                              ["{p}/dataset_dict.json: a DatasetDict without a 'train' split (splits: test)"]),
    "empty_folder": (lambda t: str((t / "empty").mkdir() or t / "empty"), ["{p}: a folder with no readable file"]),
    "only_hidden_files": (lambda t: os.path.dirname(_write(t / "h" / ".x.txt", "hidden")),
                          ["{p}: a folder with no readable file"]),
    "binary_file_in_folder": (lambda t: os.path.dirname(_write(t / "f" / "notes.txt", b"\x89PNG\r\n\x1a\n\0\0")),
                              ["{p}/notes.txt: a binary file (NUL byte at offset 8)"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_naming_the_file(tmp_path, case):
    make, fragments = BAD[case]
    path = make(tmp_path)
    with pytest.raises(DataError) as info:
        list(read_documents([path]))
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment.format(p=path) in message


def test_bad_input_is_reported_by_the_cache_builder_too(tmp_path):
    path = _write(tmp_path / "j.jsonl", '{"text": "ok"}\n{"text": 1}\n')
    with pytest.raises(DataError, match=rf"^data error: {re.escape(path)}:2: field 'text'"):
        build_token_cache([path], ByteTokenizer(), str(tmp_path / "cache"))
    (key,) = os.listdir(tmp_path / "cache")
    assert os.listdir(tmp_path / "cache" / key) == []  # no partial files left behind


def test_a_file_where_the_cache_directory_goes_is_a_data_error(tmp_path):
    path = _write(tmp_path / "a.txt", "some text\n")
    occupied = _write(tmp_path / "cache.json", "{}")
    with pytest.raises(DataError, match=rf"cannot create the token cache {re.escape(occupied)}/\w+: Not a directory"):
        build_token_cache([path], ByteTokenizer(), occupied)


# ---------------------------------------------------------------- tokenizers


def test_model_tokenizer_round_trips(bpe_dir):
    tok = load_tokenizer(bpe_dir)
    assert isinstance(tok, HFTokenizer)
    assert (tok.eos_id, tok.bos_id, tok.vocab_size) == (0, None, len(tok.tokenizer)) and tok.vocab_size == 320
    for text in CORPUS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert 0 not in ids and 1 not in ids  # no special tokens of its own: the cache adds eos
        assert len(ids) < len(text.encode())  # BPE merges, not bytes
    assert [list(x) for x in tok.encode_batch(CORPUS)] == [tok.encode(t) for t in CORPUS]


def test_tokenizer_that_prepends_bos(bos_dir, tmp_path):
    tok = load_tokenizer(bos_dir)
    assert tok.bos_id == 1 and tok.encode("hello")[0] == 1 and tok.encode("hello").count(1) == 1
    cache = build_token_cache([_corpus(tmp_path)], tok, str(tmp_path / "cache"))
    for i in range(cache.num_documents):
        doc = cache.document(i)
        assert doc[0] == 1 and doc[-1] == 0 and list(doc[:-1]) == tok.encode(CORPUS[i])


def test_tokenizer_fingerprint_is_stable_and_saved_tokenizer_loads_back(bpe_dir, bos_dir, tmp_path):
    tok = load_tokenizer(bpe_dir)
    copy = shutil.copytree(bpe_dir, tmp_path / "elsewhere")
    assert load_tokenizer(bpe_dir).fingerprint == load_tokenizer(str(copy)).fingerprint == tok.fingerprint
    assert load_tokenizer(bos_dir).fingerprint != tok.fingerprint
    saved = tok.save(str(tmp_path / "export"))
    assert saved and all(os.path.isfile(f) for f in saved)
    assert load_tokenizer(str(tmp_path / "export")).fingerprint == tok.fingerprint
    code = f"from pipedsl.trainer.data import load_tokenizer; print(load_tokenizer({bpe_dir!r}).fingerprint)"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "1234"})
    assert other.stdout.strip() == tok.fingerprint  # another process, other hash seed


def test_byte_tokenizer_without_tokenizer_files(tmp_path):
    _write(tmp_path / "model" / "config.json", "{}")
    for tok in (load_tokenizer(None), load_tokenizer(str(tmp_path / "model"))):
        assert isinstance(tok, ByteTokenizer)
        assert (tok.eos_id, tok.vocab_size, tok.bos_id) == (256, 257, None)
        assert tok.encode("é!") == [0xC3, 0xA9, 0x21] and tok.decode(tok.encode(CORPUS[3])) == CORPUS[3]
        assert tok.save(str(tmp_path / "export")) == []


def test_tokenizer_without_eos_is_refused(tmp_path):
    directory = _save_hf(tmp_path / "noeos")
    with pytest.raises(DataError, match=rf"{re.escape(directory)}: the tokenizer has no eos_token"):
        load_tokenizer(directory)


def test_broken_tokenizer_folder_is_refused(tmp_path):
    directory = os.path.dirname(_write(tmp_path / "broken" / "tokenizer.json", "{not json"))
    with pytest.raises(DataError, match=rf"^data error: {re.escape(directory)}: cannot load its tokenizer"):
        load_tokenizer(directory)


# ---------------------------------------------------------------- the token cache


def test_cache_holds_each_document_then_eos(tmp_path, bpe_dir):
    tok = load_tokenizer(bpe_dir)
    cache = build_token_cache([_corpus(tmp_path)], tok, str(tmp_path / "cache"))
    expected = [i for t in CORPUS for i in [*tok.encode(t), tok.eos_id]]
    assert cache.tokens.tolist() == expected and cache.num_tokens == len(expected)
    assert cache.num_documents == len(CORPUS) and cache.doc_offsets[0] == 0
    assert np.diff(cache.doc_offsets).tolist() == [len(tok.encode(t)) + 1 for t in CORPUS]
    assert sorted(os.listdir(cache.path)) == ["doc_offsets.npy", "meta.json", "tokens.npy"]  # no temp files
    assert np.load(os.path.join(cache.path, "tokens.npy")).dtype == np.uint32
    with pytest.raises(ValueError):
        cache.tokens[0] = 1  # ranks map it read-only
    reopened = TokenCache.open(cache.path)
    assert reopened.fingerprint == cache.fingerprint and reopened.tokens.tolist() == expected


def test_cache_is_reused_without_tokenizing(tmp_path, monkeypatch):
    data = _corpus(tmp_path)
    first = build_token_cache([data], ByteTokenizer(), str(tmp_path / "cache"))

    def refuse(*args):
        raise AssertionError("tokenized again")
    monkeypatch.setattr(ByteTokenizer, "encode", refuse)
    monkeypatch.setattr(ByteTokenizer, "encode_batch", refuse)
    again = build_token_cache([data], ByteTokenizer(), str(tmp_path / "cache"))
    assert (again.path, again.fingerprint) == (first.path, first.fingerprint)
    assert again.tokens.tolist() == first.tokens.tolist()


def test_cache_rebuilt_when_input_field_or_tokenizer_changes(tmp_path, bpe_dir):
    data = _corpus(tmp_path)
    base = build_token_cache([data], ByteTokenizer(), str(tmp_path / "cache"))
    assert build_token_cache([data], load_tokenizer(bpe_dir), str(tmp_path / "cache")).path != base.path
    _jsonl(tmp_path / "corpus.jsonl", [{"text": t, "body": t.upper()} for t in CORPUS])
    os.utime(data, ns=(1, 1))  # even with an old mtime: the size changed
    changed = build_token_cache([data], ByteTokenizer(), str(tmp_path / "cache"))
    assert changed.path != base.path and changed.fingerprint == base.fingerprint  # same tokens: same data
    upper = build_token_cache([data], ByteTokenizer(), str(tmp_path / "cache"), text_field="body")
    assert upper.path != changed.path and upper.fingerprint != base.fingerprint
    assert bytes(upper.document(0)[:-1].tolist()) == CORPUS[0].upper().encode()


def test_fingerprint_follows_content_not_location(tmp_path):
    a = _corpus(tmp_path / "a")
    b = _corpus(tmp_path / "b")
    c = _corpus(tmp_path / "c", CORPUS[::-1])
    built = [build_token_cache([p], ByteTokenizer(), str(tmp_path / "cache")) for p in (a, b, c)]
    assert len({x.path for x in built}) == 3
    assert built[0].fingerprint == built[1].fingerprint != built[2].fingerprint


def test_partial_cache_is_rebuilt(tmp_path):
    data = _corpus(tmp_path)
    cache = build_token_cache([data], ByteTokenizer(), str(tmp_path / "cache"))
    os.remove(os.path.join(cache.path, "meta.json"))  # a build that died before its last rename
    with pytest.raises(DataError, match="not a complete token cache"):
        TokenCache.open(cache.path)
    assert build_token_cache([data], ByteTokenizer(), str(tmp_path / "cache")).tokens.tolist() == cache.tokens.tolist()


def test_max_tokens_is_enforced_on_build_and_reuse(tmp_path):
    data = _corpus(tmp_path)
    with pytest.raises(DataError, match=rf"{re.escape(data)}:2: the data has more than max_tokens=20 tokens"):
        build_token_cache([data], ByteTokenizer(), str(tmp_path / "cache"), max_tokens=20)
    total = build_token_cache([data], ByteTokenizer(), str(tmp_path / "cache")).num_tokens
    with pytest.raises(DataError, match=rf"has {total} tokens, more than max_tokens={total - 1}"):
        build_token_cache([data], ByteTokenizer(), str(tmp_path / "cache"), max_tokens=total - 1)
    assert build_token_cache([data], ByteTokenizer(), str(tmp_path / "cache"), max_tokens=total).num_tokens == total


def test_token_ids_beyond_the_model_vocabulary(tmp_path, bpe_dir):
    data = _corpus(tmp_path)
    with pytest.raises(DataError, match=r"^data error: m/config.json: the model's vocabulary has 100 tokens but the "
                                        r"data's tokenizer has 320"):
        build_token_cache([data], load_tokenizer(bpe_dir), str(tmp_path / "c"), model_vocab=100,
                          model_where="m/config.json")
    cache = build_token_cache([data], ByteTokenizer(), str(tmp_path / "c"), model_vocab=257)
    check_vocab(cache, 300, "m")
    with pytest.raises(DataError, match="vocabulary has 256 tokens but the data's tokenizer has 257"):
        check_vocab(cache, 256, "m")


def test_opening_something_that_is_not_a_cache(tmp_path):
    with pytest.raises(DataError, match=rf"{re.escape(str(tmp_path))}: not a complete token cache"):
        TokenCache.open(tmp_path)


# ---------------------------------------------------------------- samples


@pytest.fixture(scope="module")
def bytes_cache(tmp_path_factory) -> TokenCache:
    """Byte tokens of 40 short documents of varied lengths (some empty, so eos follows eos)."""
    tmp = tmp_path_factory.mktemp("bytes")
    texts = [f"doc {i} " * (i % 5) for i in range(40)]
    return build_token_cache([_corpus(tmp, texts)], ByteTokenizer(), str(tmp / "cache"))


def test_pack_windows_overlap_by_one_token_and_rebuild_the_stream(bytes_cache):
    T = 7
    samples = PackedSequences(bytes_cache, T)
    stream = bytes_cache.tokens.tolist()
    assert len(samples) == (len(stream) - 1) // T
    rebuilt = []
    for i in range(len(samples)):
        s = samples.sample(i)
        assert s["input_ids"].dtype == s["targets"].dtype == torch.int64 and s["input_ids"].shape == (T,)
        assert s["targets"][:-1].tolist() == s["input_ids"][1:].tolist()
        if i + 1 < len(samples):
            assert s["targets"][-1] == samples.sample(i + 1)["input_ids"][0]
        rebuilt += s["input_ids"].tolist()
    assert rebuilt + [samples.sample(len(samples) - 1)["targets"][-1].item()] == stream[:len(samples) * T + 1]


def test_doc_mask_positions_restart_after_every_eos(bytes_cache):
    eos = bytes_cache.eos_id
    assert document_positions(np.array([[5, 6, eos, 7, eos, eos, 8, 9]]), eos).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    samples = PackedSequences(bytes_cache, 16, doc_mask=True)
    assert len(samples) > 5
    for i in range(len(samples)):
        ids, pos = samples.sample(i)["input_ids"].tolist(), samples.sample(i)["position_ids"].tolist()
        for j in range(16):
            assert pos[j] == (0 if j == 0 or ids[j - 1] == eos else pos[j - 1] + 1)


def test_hf_masks_apart_the_documents_doc_mask_marks(bytes_cache):
    """The positions are the packing signal transformers' masks read (models/hf/stages.py passes them on)."""
    from transformers.masking_utils import find_packed_sequence_indices

    eos = bytes_cache.eos_id
    batch = PackedSequences(bytes_cache, 16, doc_mask=True).batch(range(8))
    found = find_packed_sequence_indices(batch["position_ids"])
    after_eos = torch.nn.functional.pad((batch["input_ids"] == eos)[:, :-1], (1, 0)).cumsum(1)
    assert torch.equal(found, after_eos) and found.max() > 0


def test_pad_mode_one_document_a_sample(bytes_cache):
    T = 12
    samples = PackedSequences(bytes_cache, T, mode="pad")
    docs = [bytes_cache.document(i).tolist() for i in range(bytes_cache.num_documents)]
    kept = [d for d in docs if len(d) >= 2]  # an empty text is just eos: nothing to predict
    assert len(samples) == len(kept) < len(docs)
    for i, doc in enumerate(kept):
        s = samples.sample(i)
        n = min(len(doc), T + 1) - 1
        assert s["attention_mask"].tolist() == [1] * n + [0] * (T - n)
        assert s["input_ids"][:n].tolist() == doc[:n]
        assert s["targets"].tolist() == doc[1:n + 1] + [IGNORE_INDEX] * (T - n)
    assert any(len(d) > T + 1 for d in kept)  # some were truncated


def test_split_holds_out_blocks_spread_over_the_whole_stream(bytes_cache):
    """ceil(f·n) samples in blocks of HELDOUT_BLOCK spread from the start to the end (not the last file's samples),
    disjoint from the training samples and together all of them; exact counts at the edges."""
    samples = PackedSequences(bytes_cache, 5)
    n = len(samples)
    assert n >= 6 * HELDOUT_BLOCK
    train, held = samples.split(0.3)
    assert len(held) == -(-3 * n // 10) > 2 * HELDOUT_BLOCK and len(train) + len(held) == n
    held_rows, train_rows = held._rows.tolist(), train._rows.tolist()  # which of the samples each holds, in order
    for part, rows in ((held, held_rows), (train, train_rows)):
        assert rows == sorted(rows)
        assert torch.equal(part.batch(range(len(part)))["input_ids"], samples.batch(rows)["input_ids"])
    assert set(held_rows).isdisjoint(train_rows) and set(held_rows) | set(train_rows) == set(range(n))
    runs = 1 + sum(b != a + 1 for a, b in zip(held_rows, held_rows[1:]))
    assert runs == -(-len(held) // HELDOUT_BLOCK)  # whole blocks, few cuts
    assert held_rows[0] < n // 4 and held_rows[-1] > 3 * n // 4  # spread over the stream
    assert train.sample(0)["input_ids"].tolist() == samples.sample(train_rows[0])["input_ids"].tolist()
    with pytest.raises(IndexError):
        train.sample(len(train))
    assert train.fingerprint != held.fingerprint != samples.fingerprint
    assert samples.split(0.3)[1].fingerprint == held.fingerprint  # deterministic
    ten = samples.split(0)[0].subset(0, 10)
    assert len(ten.split(0.7)[1]) == 7  # 0.7 * 10 = 7.000000000000001 in floating point
    assert len(ten.split(0.01)[1]) == 1 and len(ten.split(0)[1]) == 0
    for fraction in (0.5, 0.9, 0.97):  # touching blocks still hold out exactly ceil(f·n)
        assert len(samples.split(fraction)[1]) == -(-int(fraction * n * 1000) // 1000)
    with pytest.raises(DataError, match="leaves none to train on"):
        ten.subset(0, 1).split(0.5)
    sub = held.subset(2, 5)  # a subset of a sampled split indexes its samples
    assert sub.sample(0)["input_ids"].tolist() == held.sample(2)["input_ids"].tolist() and len(sub) == 3


# ---------------------------------------------------------------- batches


@pytest.fixture(scope="module")
def samples(bytes_cache) -> PackedSequences:
    return PackedSequences(bytes_cache, 4)  # 10x the batches below: several epochs in a few steps


def test_every_epoch_is_a_permutation_and_seeds_repeat(samples):
    n, B = len(samples), 6
    a, b, c = (BatchLoader(samples, B, seed=s) for s in (3, 3, 4))
    stream = np.concatenate([a.indices(s) for s in range(3 * n // B + 1)])
    for e in range(3):
        assert sorted(stream[e * n:(e + 1) * n].tolist()) == list(range(n))
    assert stream[:n].tolist() != list(range(n)) and stream[:n].tolist() != stream[n:2 * n].tolist()
    assert all(np.array_equal(a.indices(s), b.indices(s)) for s in range(20))
    assert not np.array_equal(np.concatenate([a.indices(s) for s in range(5)]),
                              np.concatenate([c.indices(s) for s in range(5)]))
    ordered = BatchLoader(samples, B, shuffle=False)
    assert np.concatenate([ordered.indices(s) for s in range(3)]).tolist() == [p % n for p in range(3 * B)]


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_shards_are_the_rows_of_the_global_batch(samples, dp):
    doc_mask = PackedSequences(samples.cache, 4, doc_mask=True)
    for source in (samples, doc_mask):
        reference = BatchLoader(source, 8, seed=1)
        loaders = [BatchLoader(source, 8, seed=1, dp_rank=d, dp_size=dp) for d in range(dp)]
        for step in range(6):
            whole = reference.global_batch_at(step)
            parts = [next(loader) for loader in loaders]
            assert parts[0][1].shape == (8 // dp, 4)
            assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])
            if source.doc_mask:
                assert all(torch.equal(torch.cat([p[0][k] for p in parts]), whole[0][k]) for k in range(2))
            else:
                assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])


@given(before=st.integers(0, 30), after=st.integers(1, 8), seed=st.integers(0, 2**32 - 1),
       dp_then=st.sampled_from([1, 2, 4]), dp_now=st.sampled_from([1, 2, 4]))
def test_resume_gives_the_batches_of_an_uninterrupted_run(samples, before, after, seed, dp_then, dp_now):
    uninterrupted = BatchLoader(samples, 8, seed=seed)
    expected = [uninterrupted.global_batch_at(s)[1] for s in range(before, before + after)]
    first = BatchLoader(samples, 8, seed=seed, dp_size=dp_then)
    for _ in range(before):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    resumed = [BatchLoader(samples, 8, seed=seed, dp_rank=d, dp_size=dp_now) for d in range(dp_now)]
    for loader in resumed:
        loader.load_state_dict(state)
    assert resumed[0].step == before and resumed[0].epoch == before * 8 // len(samples)
    for want in expected:
        assert torch.equal(torch.cat([next(loader)[1] for loader in resumed]), want)


def test_resume_refuses_other_data_batch_or_order(samples, bytes_cache, tmp_path):
    state = BatchLoader(samples, 8, seed=5).state_dict()
    edited = [f"doc {i} " * (i % 5) for i in range(40)]
    edited[7] = edited[7].replace("doc", "dog")  # the same number of tokens: only the fingerprint tells
    other = build_token_cache([_corpus(tmp_path, edited)], ByteTokenizer(), str(tmp_path / "cache"))
    assert other.num_tokens == bytes_cache.num_tokens
    cases = [(BatchLoader(samples, 16, seed=5), "global batch of 8, this run 16"),
             (BatchLoader(PackedSequences(bytes_cache, 5), 8, seed=5), "the data, seq_len or eval fraction changed"),
             (BatchLoader(PackedSequences(other, 4), 8, seed=5), "the data changed since the checkpoint"),
             (BatchLoader(samples, 8, seed=6), "seed 5 (shuffle True), this run seed 6")]
    for loader, fragment in cases:
        with pytest.raises(DataError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            loader.load_state_dict(state)
    with pytest.raises(DataError, match="not a data loader state"):
        BatchLoader(samples, 8).load_state_dict({"step": 3})


def test_fewer_samples_than_a_global_batch(bytes_cache):
    few = PackedSequences(bytes_cache, 4).subset(0, 3)
    with pytest.raises(DataError, match=r"the dataset has 3 samples of 4 tokens \(packed from \d+ tokens in 40 "
                                        r"documents\), fewer than one global batch of 8"):
        BatchLoader(few, 8)
    with pytest.raises(DataError, match="global batch of 6 does not split over dp=4"):
        BatchLoader(PackedSequences(bytes_cache, 4), 6, dp_size=4)


def test_batch_shapes_per_mode(bytes_cache):
    pack = BatchLoader(PackedSequences(bytes_cache, 4), 4)
    x, y = next(pack)
    assert x.shape == y.shape == (4, 4) and x.dtype == y.dtype == torch.int64
    assert pack.tokens_per_step == 16 and pack.epoch == 0 and pack.state_dict()["step"] == 1
    (ids, pos), y = next(BatchLoader(PackedSequences(bytes_cache, 4, doc_mask=True), 4))
    assert ids.shape == pos.shape == (4, 4) and (pos[:, 0] == 0).all()
    (ids, mask), y = next(BatchLoader(PackedSequences(bytes_cache, 9, mode="pad"), 4))
    assert ids.shape == mask.shape == y.shape == (4, 9) and torch.equal(y == IGNORE_INDEX, mask == 0)


def test_eval_batches_in_order_incomplete_last_dropped(samples):
    B = 8
    samples = samples.subset(0, 3 * B + 5)
    n = len(samples)
    for dp in (1, 2):
        shards = [eval_batches(samples, B, d, dp) for d in range(dp)]
        assert len(shards[0]) == n // B == 3
        for k in range(n // B):
            rows = torch.cat([shards[d][k][0] for d in range(dp)])
            assert torch.equal(rows, samples.batch(range(k * B, (k + 1) * B))["input_ids"])
    spread = eval_batches(samples, B, max_batches=2)  # the 1st and 3rd of 3 batches: over the set, not its start
    assert [torch.equal(x, samples.batch(range(k * B, (k + 1) * B))["input_ids"]) for (x, _), k in zip(spread, (0, 2))] \
        == [True, True]
    with pytest.raises(DataError, match="the held-out set has 0 samples"):
        eval_batches(samples.split(0)[1], B)
