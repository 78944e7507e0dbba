"""The trainer's data: text, JSON Lines, Parquet and saved 🤗 datasets, tokenized once into a cache,
cut into fixed-length samples and dealt out as deterministic, resumable global batches.

    tokenizer = load_tokenizer(model_dir)                          # the model's own, else UTF-8 bytes
    cache = build_token_cache(paths, tokenizer, "cache/", model_vocab=V)   # launcher: every input error here
    # on each rank, from cache.path:
    train, heldout = PackedSequences(TokenCache.open(path), seq_len=512).split(0.01)
    loader = BatchLoader(train, global_batch=32, dp_rank=d, dp_size=dp, seed=0)
    inputs, targets = next(loader)                                 # this replica's rows; Pipeline(batch="local")

The launcher does everything that reads user files (`load_tokenizer`, `build_token_cache`), so
bad input is one `DataError` line before any rank starts; the ranks only open the cache
read-only.  The public surface:

- `DataError(PipeDSLError)`: a file, tokenizer or data checkpoint that cannot be used; names
  the file (and line or row).
- `load_tokenizer(model_dir) -> TextTokenizer`: `HFTokenizer` (AutoTokenizer, local files only)
  when the folder holds tokenizer files, else `ByteTokenizer` (bytes 0..255, end-of-text 256).
  A `TextTokenizer` has `encode(text)`, `encode_batch(texts)`, `decode(ids)`, `eos_id`, `bos_id`,
  `vocab_size`, `fingerprint` and `save(dir) -> list[str]`.
- `read_documents(paths, text_field="text") -> Iterator[Document]`: `Document(source, text)`.
- `build_token_cache(paths, tokenizer, cache_dir, *, text_field, max_tokens, model_vocab,
  model_where) -> TokenCache`; `TokenCache.open(path)`; `check_vocab(cache, vocab_size, where)`.
- `PackedSequences(cache, seq_len, mode="pack" | "pad", doc_mask=False)`: `len`, `sample(i)`,
  `batch(indices)`, `split(eval_fraction) -> (train, heldout)`, `fingerprint`.
- `BatchLoader(samples, global_batch, *, dp_rank, dp_size, seed, shuffle)`: `next(loader)`,
  `batch_at(step)`, `global_batch_at(step)`, `state_dict()` / `load_state_dict(d)`, `step`,
  `epoch`, `tokens_per_step`; `eval_batches(heldout, global_batch, dp_rank, dp_size, max_batches)`.

The document boundary: a document's tokens are the tokenizer's BOS if it prepends one (Llama),
the text's tokens, then `eos_id` — always, whatever the tokenizer's own special tokens.  Packing
joins documents into one stream; attention crosses the boundaries unless `doc_mask=True`.
docs/data.md has the formats, the cache and the determinism / resume contract.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import math
import os
import secrets
import tempfile
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from pipedsl.errors import PipeDSLError, one_line
from pipedsl.models.hf import TOKENIZER_FILES

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100  # a target that counts in no loss (models/hf/stages.py, transformers)
CACHE_FORMAT = 1  # bump when the cache's files or their meaning change: old caches are then rebuilt
SNIFF_BYTES = 8192  # how much of a text file is checked for binary content before reading it all
HELDOUT_BLOCK = 16  # consecutive samples a held-out block holds (`PackedSequences.split`)
JSONL_SUFFIXES = (".jsonl", ".json-lines", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
MODES = ("pack", "pad")
# inside a folder, files of these kinds are not text and are passed over (a docs folder has its pictures);
# named on the command line they are still read, and refused as binary
NOT_TEXT_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".svg", ".ico", ".bmp", ".tiff", ".pdf", ".zip", ".gz",
                     ".tar", ".bz2", ".xz", ".zst", ".7z", ".pt", ".pth", ".bin", ".safetensors", ".npy", ".npz",
                     ".pkl", ".so", ".pyc", ".mp3", ".wav", ".flac", ".mp4", ".mov", ".arrow")

Paths = str | os.PathLike | Sequence[str | os.PathLike]


class DataError(PipeDSLError):
    """Training data, a tokenizer or a data loader state that cannot be used; the message names the file."""

    kind = "data error"


# ---------------------------------------------------------------- tokenizers


class TextTokenizer:
    """Text to token ids for the trainer: what every tokenizer gives the cache builder.

    `encode` returns one document's ids *without* the end-of-text token (the cache appends
    `eos_id` to every document) but with `bos_id` first when the tokenizer prepends one.
    `fingerprint` names the tokenizer's behaviour (stable across processes and folders); it is
    part of the cache key.
    """

    eos_id: int
    bos_id: int | None = None
    vocab_size: int
    fingerprint: str

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[Sequence[int]]:
        """`encode` of each text (subclasses batch it for speed)."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def save(self, directory: str) -> list[str]:
        """Write the files that `load_tokenizer(directory)` reads back; returns their paths."""
        raise NotImplementedError


class ByteTokenizer(TextTokenizer):
    """UTF-8 bytes as ids 0..255 and end-of-text 256: any text, no files, for a model with ≥ 257 embeddings."""

    eos_id = 256
    vocab_size = 257
    fingerprint = "utf8-bytes-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[Sequence[int]]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def save(self, directory: str) -> list[str]:
        return []  # no files: a model folder without tokenizer files loads as bytes again


class HFTokenizer(TextTokenizer):
    """A transformers tokenizer, used without its own special tokens except a prepended BOS.

    Whether it prepends BOS is found by encoding a probe with and without special tokens (the
    `add_bos_token` attribute is not kept by every tokenizer class on reload); appended ones
    (EOS, SEP) are left out because the cache puts `eos_id` after every document itself.
    """

    def __init__(self, tokenizer: Any, where: str) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
        if eos is None:
            raise DataError(f"{where}: the tokenizer has no eos_token (nor sep_token) to end documents with; "
                            f"set eos_token in its tokenizer_config.json")
        self.eos_id = int(eos)
        self.vocab_size = len(tokenizer)
        self.bos_id = self._prepended_bos()
        self.fingerprint = self._fingerprint()

    def _prepended_bos(self) -> int | None:
        bos = self.tokenizer.bos_token_id
        if bos is None:
            return None
        with_special = self.tokenizer("a", add_special_tokens=True)["input_ids"]
        plain = self.tokenizer("a", add_special_tokens=False)["input_ids"]
        return int(bos) if with_special[:1] == [bos] and plain[:1] != [bos] else None

    def _fingerprint(self) -> str:
        """A hash of the saved files (JSON canonicalised, the folder's name dropped) and the boundary tokens."""
        h = hashlib.sha256(json.dumps({"eos": self.eos_id, "bos": self.bos_id}).encode())
        with tempfile.TemporaryDirectory() as tmp:
            self.tokenizer.save_pretrained(tmp)
            for name in sorted(n for n in os.listdir(tmp) if os.path.isfile(os.path.join(tmp, n))):
                with open(os.path.join(tmp, name), "rb") as f:
                    content = f.read()
                if name.endswith(".json"):
                    value = json.loads(content)
                    if isinstance(value, dict):
                        value.pop("name_or_path", None)
                    content = json.dumps(value, sort_keys=True).encode()
                h.update(name.encode() + b"\0" + content + b"\0")
        return "hf-" + h.hexdigest()[:24]

    def encode(self, text: str) -> list[int]:
        return list(self.encode_batch([text])[0])

    def encode_batch(self, texts: Sequence[str]) -> list[Sequence[int]]:
        ids = self.tokenizer(list(texts), add_special_tokens=False, verbose=False, return_attention_mask=False,
                             return_token_type_ids=False)["input_ids"]
        return ids if self.bos_id is None else [[self.bos_id, *x] for x in ids]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def save(self, directory: str) -> list[str]:
        return [str(p) for p in self.tokenizer.save_pretrained(directory)]


def load_tokenizer(model_dir: str | os.PathLike | None) -> TextTokenizer:
    """The model folder's own tokenizer when it has tokenizer files, else `ByteTokenizer` (also for None)."""
    if model_dir is None:
        return ByteTokenizer()
    where = os.fspath(model_dir)
    if not os.path.isdir(where):
        raise DataError(f"{where}: no such model folder")
    if not any(os.path.isfile(os.path.join(where, name)) for name in TOKENIZER_FILES):
        return ByteTokenizer()
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True)
    except Exception as err:  # noqa: BLE001 - any failure of a broken tokenizer folder is the user's to fix
        raise DataError(f"{where}: cannot load its tokenizer: {one_line(err)}") from None
    return HFTokenizer(tokenizer, where)


# ---------------------------------------------------------------- reading documents


class Document(NamedTuple):
    """One text and where it came from: "a.txt", "a.jsonl:17" (line), "b.parquet[3]" (row from 0)."""

    source: str
    text: str


class _Input(NamedTuple):
    """One readable unit of the inputs: a file, or a folder saved by `datasets`."""

    path: str
    kind: str  # "text" | "jsonl" | "parquet" | "dataset"
    files: tuple[str, ...]  # what its documents depend on (the cache key stats them)


def read_documents(paths: Paths, text_field: str = "text") -> Iterator[Document]:
    """Every document of `paths` in order: files as given, folders recursively sorted by path.

    Text files are one document each; `.jsonl` / `.json-lines` / `.ndjson` one per line (field
    `text_field`); `.parquet` one per row of column `text_field`; a `datasets` `save_to_disk`
    folder one per row (a DatasetDict: its "train" split).  Hidden files and folders are skipped, and so
    are files of a kind that is never text (`NOT_TEXT_SUFFIXES`: pictures, archives, weights) inside folders.
    """
    for item in _inputs(paths):
        yield from _READERS[item.kind](item, text_field)


def check_data_paths(paths: Paths) -> None:
    """Every data path exists and a folder holds a readable file: a DataError naming the path (what the launcher
    checks before the heavy imports)."""
    _inputs(paths)


def _inputs(paths: Paths) -> list[_Input]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise DataError("no data paths given")
    found: list[_Input] = []
    for given in map(os.fspath, paths):
        if not os.path.exists(given):
            raise DataError(f"{given}: no such file or folder")
        if not os.path.isdir(given):
            found.append(_file_input(given))
            continue
        inside = _folder_inputs(given)
        if not inside:
            raise DataError(f"{given}: a folder with no readable file (hidden files and folders, pictures, archives "
                            f"and weights are skipped)")
        found += inside
    return found


def _file_input(path: str) -> _Input:
    lower = path.lower()
    kind = "jsonl" if lower.endswith(JSONL_SUFFIXES) else "parquet" if lower.endswith(PARQUET_SUFFIXES) else "text"
    return _Input(path, kind, (path,))


def _folder_inputs(folder: str) -> list[_Input]:
    if _is_dataset(folder):
        return [_dataset_input(folder)]
    found = []
    for here, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        if here != folder and _is_dataset(here):
            found.append(_dataset_input(here))
            dirs[:] = []
            continue
        found += [_file_input(os.path.join(here, f)) for f in files
                  if not f.startswith(".") and not f.lower().endswith(NOT_TEXT_SUFFIXES)]
    return sorted(found, key=lambda item: item.path)


def _is_dataset(folder: str) -> bool:
    has = lambda name: os.path.isfile(os.path.join(folder, name))  # noqa: E731
    return has("dataset_dict.json") or (has("state.json") and has("dataset_info.json"))


def _dataset_input(folder: str) -> _Input:
    """A `save_to_disk` folder: its arrow files from state.json (a DatasetDict's "train" split's)."""
    index = os.path.join(folder, "dataset_dict.json")
    head: tuple[str, ...] = ()
    if os.path.isfile(index):
        splits = _json_file(index).get("splits", [])
        if "train" not in splits:
            raise DataError(f"{index}: a DatasetDict without a 'train' split (splits: {', '.join(splits) or 'none'}); "
                            f"pass the split's folder instead")
        folder, head = os.path.join(folder, "train"), (index,)
    state = os.path.join(folder, "state.json")
    names = [entry.get("filename") for entry in _json_file(state).get("_data_files", [])]
    if not names or not all(isinstance(n, str) for n in names):
        raise DataError(f"{state}: lists no data files (_data_files); not a datasets save_to_disk folder?")
    files = tuple(os.path.join(folder, n) for n in names)
    for f in files:
        if not os.path.isfile(f):
            raise DataError(f"{f}: missing (listed in {state})")
    return _Input(folder, "dataset", (*head, state, *files))


def _json_file(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: unreadable: {one_line(err)}") from None
    if not isinstance(value, dict):
        raise DataError(f"{path}: expected a JSON object")
    return value


def _read_text(item: _Input, field: str) -> Iterator[Document]:
    path = item.path
    with open(path, "rb") as f:
        data = f.read()
    _check_not_binary(path, data[:SNIFF_BYTES])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        bad = data[err.start]
        raise DataError(f"{path}: not UTF-8 text (invalid byte 0x{bad:02x} at offset {err.start})") from None
    _check_not_empty(path, len(data), text)
    yield Document(path, text.removeprefix("\ufeff"))


def _read_jsonl(item: _Input, field: str) -> Iterator[Document]:
    path, seen = item.path, False
    with open(path, "rb") as f:
        _check_not_binary(path, f.read(SNIFF_BYTES))
        f.seek(0)
        for number, raw in enumerate(f, 1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{where}: not UTF-8 (invalid byte 0x{raw[err.start]:02x} at column {err.start + 1})"
                                ) from None
            if not line.strip():
                continue  # blank lines (a trailing newline, separators) hold no record
            seen = True
            yield Document(where, _record_text(where, line.removeprefix("\ufeff"), field))
    if not seen:
        _check_not_empty(path, os.path.getsize(path), "")


def _record_text(where: str, line: str, field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: a JSON {_json_type(record)}, not an object with a {field!r} field")
    if field not in record:
        raise DataError(f"{where}: no field {field!r} (fields: {_names(list(record))}); choose the text field")
    text = record[field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {field!r} is a JSON {_json_type(text)}, not a string")
    return text


def _read_parquet(item: _Input, field: str) -> Iterator[Document]:
    import pyarrow.parquet as pq

    path = item.path
    if os.path.getsize(path) == 0:
        raise DataError(f"{path}: empty file (0 bytes)")
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises several kinds for a file that is not Parquet
        raise DataError(f"{path}: not a Parquet file ({one_line(err)})") from None
    _check_column(path, parquet.schema_arrow, field)
    row = 0
    for group in range(parquet.num_row_groups):  # one row group in memory at a time
        column = parquet.read_row_group(group, columns=[field]).column(0)
        yield from _rows(path, column, row, field)
        row += len(column)
    if row == 0:
        raise DataError(f"{path}: no rows")


def _read_dataset(item: _Input, field: str) -> Iterator[Document]:
    import pyarrow as pa

    row = 0
    for path in item.files:
        if not path.endswith(".arrow"):
            continue
        try:
            reader = pa.ipc.open_stream(pa.memory_map(path))
        except Exception as err:  # noqa: BLE001
            raise DataError(f"{path}: not an Arrow stream written by datasets ({one_line(err)})") from None
        _check_column(item.path, reader.schema, field)
        for batch in reader:
            yield from _rows(item.path, batch.column(batch.schema.get_field_index(field)), row, field)
            row += batch.num_rows
    if row == 0:
        raise DataError(f"{item.path}: a dataset with no rows")


def _check_column(where: str, schema: Any, field: str) -> None:
    import pyarrow as pa

    if field not in schema.names:
        raise DataError(f"{where}: no column {field!r} (columns: {_names(schema.names)}); choose the text field")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise DataError(f"{where}: column {field!r} holds {kind}, not strings")


def _rows(where: str, column: Any, first: int, field: str) -> Iterator[Document]:
    for i, text in enumerate(column.to_pylist(), first):
        if text is None:
            raise DataError(f"{where}[{i}]: {field!r} is null")
        yield Document(f"{where}[{i}]", text)


def _check_not_binary(path: str, head: bytes) -> None:
    nul = head.find(b"\0")
    if nul >= 0:
        raise DataError(f"{path}: a binary file (NUL byte at offset {nul}), not UTF-8 text")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a character cut at the end is fine
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: a binary file (invalid UTF-8 byte 0x{head[err.start]:02x} at offset {err.start}), "
                        f"not UTF-8 text") from None


def _check_not_empty(path: str, size: int, text: str) -> None:
    if size == 0:
        raise DataError(f"{path}: empty file (0 bytes)")
    if not text.strip():
        raise DataError(f"{path}: empty file (only whitespace)")


_READERS = {"text": _read_text, "jsonl": _read_jsonl, "parquet": _read_parquet, "dataset": _read_dataset}


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def _names(names: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(map(str, names[:limit]))
    return (shown + f", … ({len(names)} in all)" if len(names) > limit else shown) or "none"


# ---------------------------------------------------------------- the token cache


class TokenCache:
    """A tokenized corpus on disk: every document's tokens then eos, in one flat uint32 array.

    `tokens` [num_tokens] and `doc_offsets` [num_documents + 1] (document i is
    `tokens[doc_offsets[i]:doc_offsets[i + 1]]`) are read-only memory maps.  `fingerprint`
    hashes the tokens and the offsets — what training sees — so it changes when the data or the
    tokenizer changes what the model is fed, and not when the files move, are touched, or a
    library saves the same tokenizer differently: a checkpoint resumes on the same data only.
    """

    def __init__(self, path: str, meta: dict[str, Any], tokens: np.ndarray, doc_offsets: np.ndarray) -> None:
        self.path, self.meta, self.tokens, self.doc_offsets = path, meta, tokens, doc_offsets
        self.fingerprint: str = meta["fingerprint"]
        self.eos_id: int = meta["eos_id"]
        self.bos_id: int | None = meta["bos_id"]
        self.tokenizer_vocab: int = meta["tokenizer_vocab"]
        self.max_token_id: int = meta["max_token_id"]

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_documents(self) -> int:
        return len(self.doc_offsets) - 1

    def document(self, i: int) -> np.ndarray:
        """Document i's tokens, ending with eos."""
        return self.tokens[self.doc_offsets[i]:self.doc_offsets[i + 1]]

    @classmethod
    def open(cls, path: str | os.PathLike) -> TokenCache:
        """Open a complete cache read-only (what each rank does with the launcher's `cache.path`)."""
        path = os.fspath(path)
        meta_path = os.path.join(path, "meta.json")
        if not os.path.isfile(meta_path):
            raise DataError(f"{path}: not a complete token cache (no meta.json); build it with build_token_cache")
        meta = _json_file(meta_path)
        if meta.get("format") != CACHE_FORMAT:
            raise DataError(f"{path}: a token cache of format {meta.get('format')}, this pipedsl reads {CACHE_FORMAT}; "
                            f"build it again")
        try:
            tokens = np.load(os.path.join(path, "tokens.npy"), mmap_mode="r")
            offsets = np.load(os.path.join(path, "doc_offsets.npy"), mmap_mode="r")
        except (OSError, ValueError) as err:
            raise DataError(f"{path}: damaged token cache ({one_line(err)}); delete it to rebuild") from None
        if (tokens.dtype != np.uint32 or len(tokens) != meta["num_tokens"]
                or len(offsets) != meta["num_documents"] + 1 or offsets[-1] != len(tokens)):
            raise DataError(f"{path}: damaged token cache (its arrays do not match meta.json); delete it to rebuild")
        return cls(path, meta, tokens, offsets)


def build_token_cache(paths: Paths, tokenizer: TextTokenizer, cache_dir: str | os.PathLike, *,
                      text_field: str = "text", max_tokens: int | None = None, model_vocab: int | None = None,
                      model_where: str = "the model") -> TokenCache:
    """Tokenize every document of `paths` once into `cache_dir/<key>/`, or reuse the complete cache there.

    The key hashes each input file's absolute path, size and mtime_ns, `text_field`, the
    tokenizer's fingerprint and the cache format, so editing, adding or removing a file
    rebuilds.  More than `max_tokens` tokens in all is a DataError (a guard against tokenizing
    the wrong folder).  With `model_vocab`, `check_vocab` runs too.
    """
    inputs = _inputs(paths)
    key = _cache_key(inputs, text_field, tokenizer)
    target = os.path.join(os.fspath(cache_dir), key)
    cache = _open_if_complete(target)
    if cache is None:
        cache = _write_cache(inputs, tokenizer, target, key, text_field, max_tokens)
    elif max_tokens is not None and cache.num_tokens > max_tokens:
        raise DataError(f"{_names([item.path for item in inputs], 3)}: the data has {cache.num_tokens} tokens, more "
                        f"than max_tokens={max_tokens}")
    specials = 1 + (cache.bos_id is not None)  # eos ends every document, bos may open it
    if cache.num_documents and int(np.diff(cache.doc_offsets).max()) <= specials:
        raise DataError(f"{_names([item.path for item in inputs], 3)}: every one of its {cache.num_documents} "
                        f"documents is empty (no tokens but {'bos and ' if specials > 1 else ''}eos): nothing to "
                        f"train on (is --text-field {text_field!r} the field that holds the text?)")
    if model_vocab is not None:
        check_vocab(cache, model_vocab, model_where)
    return cache


def check_vocab(cache: TokenCache, vocab_size: int, where: str) -> None:
    """Every token id of the data must index the model's embedding (`where` names the model)."""
    if cache.max_token_id >= vocab_size:
        raise DataError(f"{where}: the model's vocabulary has {vocab_size} tokens but the data's tokenizer has "
                        f"{cache.tokenizer_vocab} (token id {cache.max_token_id} occurs); use the model's own "
                        f"tokenizer (its files in the model folder) or a model with a larger vocabulary")


def _cache_key(inputs: list[_Input], text_field: str, tokenizer: TextTokenizer) -> str:
    stats = []
    for item in inputs:
        for f in item.files:
            st = os.stat(f)
            stats.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
    blob = json.dumps({"format": CACHE_FORMAT, "text_field": text_field, "tokenizer": tokenizer.fingerprint,
                       "files": stats})
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _open_if_complete(path: str) -> TokenCache | None:
    try:
        return TokenCache.open(path)
    except DataError:
        return None  # absent, partial (a build that died before meta.json) or stale: build it again


def _write_cache(inputs: list[_Input], tokenizer: TextTokenizer, target: str, key: str, text_field: str,
                 max_tokens: int | None) -> TokenCache:
    try:
        os.makedirs(target, exist_ok=True)
    except OSError as err:  # a file where the cache directory goes, no permission, a full disk
        raise DataError(f"cannot create the token cache {target}: {err.strerror or err}") from None
    unique = f"{os.getpid()}.{secrets.token_hex(4)}"  # builders racing for one key (even on two hosts) never collide
    temps = {name: os.path.join(target, f".{name}.{unique}.tmp")
             for name in ("tokens.npy", "doc_offsets.npy", "meta.json")}
    digest = hashlib.sha256(b"pipedsl-token-cache")
    offsets, total, top = array("q", [0]), 0, -1
    try:
        with open(temps["tokens.npy"], "wb") as out:
            _npy_header(out, 0)
            for chunk in _chunks(_documents(inputs, text_field)):
                parts = []
                for doc, ids in zip(chunk, tokenizer.encode_batch([d.text for d in chunk])):
                    length = len(ids) + 1
                    if max_tokens is not None and total + length > max_tokens:
                        raise DataError(f"{doc.source}: the data has more than max_tokens={max_tokens} tokens "
                                        f"({total} before this document of {length})")
                    parts += [np.asarray(ids, dtype=np.uint32), np.array([tokenizer.eos_id], dtype=np.uint32)]
                    total += length
                    offsets.append(total)
                flat = np.concatenate(parts).astype("<u4", copy=False)
                top = max(top, int(flat.max()))
                digest.update(flat.data)
                out.write(flat.data)
            out.seek(0)
            _npy_header(out, total)
            _sync(out)
        doc_offsets = np.frombuffer(offsets, dtype=np.int64)
        digest.update(doc_offsets.astype("<i8").data)
        with open(temps["doc_offsets.npy"], "wb") as out:
            np.save(out, doc_offsets)
            _sync(out)
        meta = {"format": CACHE_FORMAT, "key": key, "fingerprint": digest.hexdigest()[:24],
                "num_tokens": total, "num_documents": len(doc_offsets) - 1, "eos_id": tokenizer.eos_id,
                "bos_id": tokenizer.bos_id, "tokenizer": tokenizer.fingerprint, "tokenizer_vocab": tokenizer.vocab_size,
                "max_token_id": top, "text_field": text_field, "inputs": [item.path for item in inputs]}
        with open(temps["meta.json"], "w", encoding="utf-8") as out:
            json.dump(meta, out, indent=1)
            _sync(out)
        for name, temp in temps.items():  # meta.json last: its presence marks the cache complete
            os.replace(temp, os.path.join(target, name))
        _sync_dir(target)
    finally:
        for temp in temps.values():
            if os.path.exists(temp):
                os.remove(temp)
    return TokenCache.open(target)


def _documents(inputs: list[_Input], text_field: str) -> Iterator[Document]:
    for item in inputs:
        yield from _READERS[item.kind](item, text_field)


def _chunks(docs: Iterator[Document], max_docs: int = 512, max_chars: int = 1 << 22) -> Iterator[list[Document]]:
    """Documents grouped for `encode_batch`: a few MB of text at a time."""
    chunk, chars = [], 0
    for doc in docs:
        chunk.append(doc)
        chars += len(doc.text)
        if len(chunk) >= max_docs or chars >= max_chars:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _npy_header(out: Any, length: int) -> None:
    """A .npy header for `length` uint32s; numpy pads it to the same size for any length, so it is rewritten last."""
    np.lib.format.write_array_header_1_0(out, {"descr": "<u4", "fortran_order": False, "shape": (length,)})


def _sync(f: Any) -> None:
    f.flush()
    os.fsync(f.fileno())


def _sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- samples


class PackedSequences:
    """Fixed-length training samples of `seq_len` tokens from a `TokenCache`.

    `mode="pack"`: the token stream cut into windows of seq_len + 1 tokens at stride seq_len
    (inputs = w[:-1], targets = w[1:], Megatron's layout), so consecutive windows share one
    token and the stream's tail shorter than a window is dropped.  Attention crosses document
    boundaries (GPT-2, Megatron, torchtitan pretraining); `doc_mask=True` adds `position_ids`
    that count from 0 at the row's start and again after every eos, which `causal_lm_stages(...,
    position_ids=True)` turns into a mask keeping documents apart.

    `mode="pad"`: one document per sample, its first seq_len + 1 tokens (the rest is dropped),
    right-padded: `attention_mask` 1 on tokens, 0 on padding, targets `IGNORE_INDEX` on padding.
    Documents of fewer than 2 tokens have nothing to predict and make no sample.
    """

    def __init__(self, cache: TokenCache, seq_len: int, mode: str = "pack", doc_mask: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        if doc_mask and mode != "pack":
            raise ValueError("doc_mask applies to mode='pack' (a padded sample holds one document)")
        self.cache, self.seq_len, self.mode, self.doc_mask = cache, seq_len, mode, doc_mask
        if mode == "pack":
            self._docs = None
            count = (cache.num_tokens - 1) // seq_len
        else:
            self._docs = np.flatnonzero(np.diff(cache.doc_offsets) >= 2)
            count = len(self._docs)
        self.start, self.stop = 0, count
        self._rows: np.ndarray | None = None  # a split's samples, when not one contiguous range (`split`)

    def __len__(self) -> int:
        return len(self._rows) if self._rows is not None else self.stop - self.start

    @property
    def fingerprint(self) -> str:
        """The cache's fingerprint with the cut: what a checkpointed data order depends on."""
        which = (hashlib.sha256(self._rows.tobytes()).hexdigest() if self._rows is not None
                 else f"{self.start}:{self.stop}")
        cut = f"{self.cache.fingerprint}/{self.mode}/{self.seq_len}/{self.doc_mask}/{which}"
        return hashlib.sha256(cut.encode()).hexdigest()[:24]

    def describe(self) -> str:
        """E.g. "4 samples of 128 tokens (packed from 600 tokens in 3 documents)"."""
        how = "packed from" if self.mode == "pack" else "padded, one per document of"
        return (f"{len(self)} samples of {self.seq_len} tokens ({how} {self.cache.num_tokens} tokens in "
                f"{self.cache.num_documents} documents)")

    def sample(self, i: int) -> dict[str, torch.Tensor]:
        """Sample i: 1-D int64 tensors "input_ids", "targets" [, "position_ids" | "attention_mask"] of seq_len."""
        return {name: t[0] for name, t in self.batch([i]).items()}

    __getitem__ = sample

    def batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, torch.Tensor]:
        """The samples `indices` stacked: the tensors of `sample`, [len(indices), seq_len] each."""
        import torch

        rows = np.asarray(indices, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"sample index out of range 0 .. {len(self) - 1}: {rows.tolist()}")
        rows = self._rows[rows] if self._rows is not None else rows + self.start
        out = self._packed(rows) if self.mode == "pack" else self._padded(rows)
        return {name: torch.from_numpy(a) for name, a in out.items()}

    def _packed(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        T, tokens = self.seq_len, self.cache.tokens
        windows = np.stack([tokens[r * T:r * T + T + 1] for r in rows]) if len(rows) else np.zeros((0, T + 1))
        windows = windows.astype(np.int64)  # [b, T+1]
        out = {"input_ids": np.ascontiguousarray(windows[:, :-1]), "targets": np.ascontiguousarray(windows[:, 1:])}
        if self.doc_mask:
            out["position_ids"] = document_positions(out["input_ids"], self.cache.eos_id)
        return out

    def _padded(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        T, offsets = self.seq_len, self.cache.doc_offsets
        ids = np.full((len(rows), T), self.cache.eos_id, dtype=np.int64)  # padding: any id the model has
        mask = np.zeros((len(rows), T), dtype=np.int64)
        targets = np.full((len(rows), T), IGNORE_INDEX, dtype=np.int64)
        for r, doc in enumerate(self._docs[rows]):
            start = int(offsets[doc])
            w = self.cache.tokens[start:min(int(offsets[doc + 1]), start + T + 1)]
            n = len(w) - 1
            ids[r, :n], mask[r, :n], targets[r, :n] = w[:-1], 1, w[1:]
        return {"input_ids": ids, "targets": targets, "attention_mask": mask}

    def split(self, eval_fraction: float) -> tuple[PackedSequences, PackedSequences]:
        """(train, heldout): ceil(eval_fraction · n) samples held out, in blocks of `HELDOUT_BLOCK` consecutive samples
        spread evenly over the whole stream.

        Not the last samples: a corpus read file by file would hold out its last file alone (one source, one
        topic).  Blocks, not single samples: packed, a document crossing a cut is in both sets, so cuts are
        few (two a block).  Deterministic (no seed): the same data gives the same split on every rank and run.
        """
        n = len(self)
        held = held_out(n, eval_fraction, self)
        if not held:
            return self.subset(0, n), self.subset(n, n)
        blocks = -(-held // HELDOUT_BLOCK)
        starts = np.floor((np.arange(blocks) + 0.5) * n / blocks).astype(np.int64)  # block centres, evenly spaced
        starts = np.minimum(np.maximum(starts - HELDOUT_BLOCK // 2, 0), n - HELDOUT_BLOCK) if n >= HELDOUT_BLOCK \
            else np.zeros(1, dtype=np.int64)
        chosen = np.zeros(n, dtype=bool)
        for first in starts:
            chosen[first:first + HELDOUT_BLOCK] = True
        picked = np.flatnonzero(chosen)[:held]  # blocks may touch (a large fraction): exactly `held` samples
        if len(picked) < held:
            picked = np.sort(np.concatenate([picked, np.flatnonzero(~chosen)[:held - len(picked)]]))
        chosen[:] = False
        chosen[picked] = True
        return self._pick(np.flatnonzero(~chosen)), self._pick(picked)

    def _pick(self, rows: np.ndarray) -> PackedSequences:
        """These samples (indices into this set), sharing the cache."""
        return self._part(_rows=self._rows[rows] if self._rows is not None else rows + self.start)

    def subset(self, start: int, stop: int) -> PackedSequences:
        """Samples [start, stop) of these, sharing the cache."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"subset [{start}, {stop}) of {len(self)} samples")
        if self._rows is not None:
            return self._pick(np.arange(start, stop))
        return self._part(start=self.start + start, stop=self.start + stop)

    def _part(self, **changed: Any) -> PackedSequences:
        """A copy of this set (the cache shared) with `changed` attributes: how subsets and splits are made."""
        part = object.__new__(PackedSequences)
        part.__dict__.update(self.__dict__, **changed)
        return part


def held_out(n: int, eval_fraction: float, samples: Any) -> int:
    """How many of `n` samples `split` holds out: ceil(eval_fraction · n), at least one when asked, never all."""
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    held = math.ceil(eval_fraction * n - 1e-9) if eval_fraction else 0  # 0.7 * 10 is 7.000000000000001
    held = max(held, 1) if eval_fraction and n else held
    if n and held >= n:
        raise DataError(f"{samples.cache.path}: holding out {eval_fraction} of {samples.describe()} leaves none to "
                        f"train on")
    return held


def document_positions(input_ids: np.ndarray, eos_id: int) -> np.ndarray:
    """Position ids [b, T] counting from 0 at each row's start and at the token after every eos."""
    b, T = input_ids.shape
    col = np.arange(T)
    starts = np.zeros((b, T), dtype=bool)
    starts[:, 0] = True
    starts[:, 1:] = input_ids[:, :-1] == eos_id
    return col - np.maximum.accumulate(np.where(starts, col, 0), axis=1)


# ---------------------------------------------------------------- batches


def _step_args(tensors: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor]:
    """(inputs, targets) as `Pipeline.step` takes them with `causal_lm_stages(attention_mask=…, position_ids=…)`,
    or with `seq2seq_stages`: (input_ids, attention_mask, decoder_input_ids)."""
    extra = [tensors[k] for k in ("attention_mask", "position_ids", "decoder_input_ids") if k in tensors]
    inputs = (tensors["input_ids"], *extra) if extra else tensors["input_ids"]
    return inputs, tensors["targets"]


class BatchLoader:
    """Global batches of `samples`, the same on every process for a given seed, resumable at any step.

    Step s is positions [s·B, (s+1)·B) of an endless stream of epochs, each a permutation of the
    samples from `numpy.random.default_rng([seed, epoch])` (`shuffle=False`: in order).  A batch
    may run into the next epoch.  dp rank d gets rows [d·B/dp, (d+1)·B/dp) of it, the rows
    `Pipeline(batch="global")` gives replica d, so `Pipeline(batch="local")` fed `next(loader)`
    trains exactly as one process fed `global_batch_at(step)`; the order does not depend on dp.
    """

    def __init__(self, samples: PackedSequences, global_batch: int, *, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, shuffle: bool = True) -> None:
        _check_batch(global_batch, dp_rank, dp_size)
        if len(samples) < global_batch:
            raise DataError(f"{samples.cache.path}: the dataset has {samples.describe()}, fewer than one global "
                            f"batch of {global_batch}")
        self.samples, self.global_batch, self.dp_rank, self.dp_size = samples, global_batch, dp_rank, dp_size
        self.seed, self.shuffle, self.step = seed, shuffle, 0
        self._orders: dict[int, np.ndarray] = {}

    @property
    def epoch(self) -> int:
        """The epoch the next batch starts in."""
        return self.step * self.global_batch // len(self.samples)

    @property
    def tokens_per_step(self) -> int:
        """Token positions in a global batch (B · seq_len; padding included in mode="pad")."""
        return self.global_batch * self.samples.seq_len

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> tuple[Any, torch.Tensor]:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def indices(self, step: int) -> np.ndarray:
        """The sample indices of global batch `step`, [B]."""
        n, B = len(self.samples), self.global_batch
        positions = np.arange(step * B, (step + 1) * B, dtype=np.int64)
        epochs = positions // n
        return np.concatenate([self._order(int(e))[positions[epochs == e] % n] for e in np.unique(epochs)])

    def batch_at(self, step: int) -> tuple[Any, torch.Tensor]:
        """This dp rank's rows of global batch `step` as (inputs, targets)."""
        share = self.global_batch // self.dp_size
        rows = self.indices(step)[self.dp_rank * share:(self.dp_rank + 1) * share]
        return _step_args(self.samples.batch(rows))

    def global_batch_at(self, step: int) -> tuple[Any, torch.Tensor]:
        """The whole global batch `step` (a one-process reference; tests)."""
        return _step_args(self.samples.batch(self.indices(step)))

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            n = len(self.samples)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}  # a batch spans ≤ 2 epochs
            self._orders[epoch] = order
        return self._orders[epoch]

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint stores: the next step and what the order depends on."""
        return {"step": self.step, "seed": self.seed, "shuffle": self.shuffle, "fingerprint": self.samples.fingerprint,
                "global_batch": self.global_batch, "num_samples": len(self.samples)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the batch after the checkpoint's; the data, batch and order must be unchanged."""
        missing = [k for k in ("step", "seed", "fingerprint", "global_batch", "num_samples") if k not in state]
        if missing:
            raise DataError(f"not a data loader state: it has no {', '.join(missing)}")
        now = self.state_dict()
        if state["global_batch"] != self.global_batch:
            raise DataError(f"the checkpoint's data loader used a global batch of {state['global_batch']}, this run "
                            f"{self.global_batch}: the batch size changed since the checkpoint, resume with the same")
        if state["num_samples"] != now["num_samples"]:
            raise DataError(f"the checkpoint's data had {state['num_samples']} samples, this run's "
                            f"{self.samples.describe()}: the data, seq_len or eval fraction changed since the "
                            f"checkpoint")
        if state["fingerprint"] != now["fingerprint"]:
            raise DataError(f"the data changed since the checkpoint (fingerprint {state['fingerprint']} then, "
                            f"{now['fingerprint']} now): same files, tokenizer, seq_len and mode are needed to resume")
        if state["seed"] != self.seed or state.get("shuffle", self.shuffle) != self.shuffle:
            raise DataError(f"the checkpoint's data order used seed {state['seed']} (shuffle "
                            f"{state.get('shuffle', self.shuffle)}), this run seed {self.seed} (shuffle "
                            f"{self.shuffle}): resume with the same seed")
        self.step = int(state["step"])


def eval_batches(heldout: PackedSequences, global_batch: int, dp_rank: int = 0, dp_size: int = 1,
                 max_batches: int | None = None) -> list[tuple[Any, torch.Tensor]]:
    """The held-out samples in order as this dp rank's share of global batches; the incomplete last one is dropped.
    `max_batches` of them, evenly spaced over the set, when there are more.

    Dropping it keeps every evaluation batch the shape training batches have (the pipeline's
    microbatch split), at the cost of up to B − 1 unused samples.
    """
    _check_batch(global_batch, dp_rank, dp_size)
    if len(heldout) < global_batch:
        raise DataError(f"{heldout.cache.path}: the held-out set has {heldout.describe()}, fewer than one global "
                        f"batch of {global_batch}; hold out more or lower the batch")
    count = len(heldout) // global_batch
    chosen = np.arange(count)
    if max_batches is not None and max_batches < count:  # spread over the held-out set, not its beginning
        chosen = np.floor((np.arange(max_batches) + 0.5) * count / max_batches).astype(np.int64)
    share = global_batch // dp_size
    first = chosen * global_batch + dp_rank * share
    return [_step_args(heldout.batch(np.arange(f, f + share))) for f in first]


def _check_batch(global_batch: int, dp_rank: int, dp_size: int) -> None:
    if global_batch < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"need global_batch ≥ 1, dp_size ≥ 1 and 0 ≤ dp_rank < dp_size; got {global_batch}, "
                         f"{dp_size}, {dp_rank}")
    if global_batch % dp_size:
        raise DataError(f"a global batch of {global_batch} does not split over dp={dp_size} replicas")
