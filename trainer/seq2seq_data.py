"""Training samples for encoder-decoders: (source, target) pairs, and T5's span corruption of plain text.

Both give what `PackedSequences` gives a causal decoder — `len`, `batch(indices)`, `split`,
`subset`, `fingerprint`, `describe` — so `BatchLoader`, evaluation and resume work unchanged;
a batch holds "input_ids", "attention_mask" [b, seq], "decoder_input_ids" and "targets"
[b, target_seq], which `Pipeline.step((input_ids, attention_mask, decoder_input_ids), targets)`
takes with `seq2seq_stages` and `seq2seq_loss`.

- `Seq2SeqPairs`: record i of the data is one sample, its `--source-field` text the encoder's
  input and its `--target-field` text the target (two token caches of the same records, each
  document ending with eos, as T5 and BART are trained).  Longer texts are cut to `seq` and
  `target_seq` tokens; padding is masked in the input and -100 in the targets.
- `SpanCorruption`: T5's pretraining objective (Raffel et al. 2020, §3.1.4; the mT5 paper trains
  with it): the token stream is cut into windows of `raw_length` tokens, in each a random 15 %
  (`noise_density`) in spans of mean length 3 (`mean_noise_span`) is replaced in the input by one
  sentinel each (`<extra_id_0>`, `<extra_id_1>`, …) and the target lists the sentinels each
  followed by its span, then eos.  `raw_length` is the longest window whose corrupted input fits
  `seq` tokens (T5's `compute_input_and_target_lengths`); the target length follows from it.  The
  noise of sample i is drawn from `numpy.random.default_rng([seed, i])`: the same on every rank,
  every epoch and after a resume.

In both the decoder's input is the targets shifted right behind `decoder_start_token_id`, -100
replaced by the pad id (transformers' `shift_tokens_right`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pipedsl.trainer.data import IGNORE_INDEX, DataError, TokenCache, held_out

if TYPE_CHECKING:
    import torch


class _Samples:
    """What `Seq2SeqPairs` and `SpanCorruption` share: a range [start, stop) of samples and the cut's bookkeeping."""

    cache: TokenCache
    seq_len: int
    target_len: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    def _cut(self) -> str:
        raise NotImplementedError

    @property
    def fingerprint(self) -> str:
        """What a checkpointed data order depends on: the data, the cut, the lengths and the range."""
        cut = f"{self._cut()}/{self.seq_len}/{self.target_len}/{self.start}:{self.stop}"
        return hashlib.sha256(cut.encode()).hexdigest()[:24]

    def batch(self, indices: object) -> dict[str, torch.Tensor]:
        import torch

        rows = np.asarray(indices, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"sample index out of range 0 .. {len(self) - 1}: {rows.tolist()}")
        out = self._rows(rows + self.start)
        out["decoder_input_ids"] = shift_right(out["targets"], self.start_id, self.pad_id)
        return {name: torch.from_numpy(a) for name, a in out.items()}

    def _rows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def split(self, eval_fraction: float) -> tuple[_Samples, _Samples]:
        """(train, heldout): the last ceil(eval_fraction · n) samples are held out."""
        n = len(self)
        held = held_out(n, eval_fraction, self)
        return self.subset(0, n - held), self.subset(n - held, n)

    def subset(self, start: int, stop: int) -> _Samples:
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"subset [{start}, {stop}) of {len(self)} samples")
        part = object.__new__(type(self))
        part.__dict__.update(self.__dict__)
        part.start, part.stop = self.start + start, self.start + stop
        return part

    def describe(self) -> str:
        raise NotImplementedError

    start_id: int
    pad_id: int


def shift_right(targets: np.ndarray, start_id: int, pad_id: int) -> np.ndarray:
    """The decoder's inputs [b, T]: start token, then the targets but the last, -100 as the pad id."""
    out = np.empty_like(targets)
    out[:, 0] = start_id
    out[:, 1:] = targets[:, :-1]
    out[out == IGNORE_INDEX] = pad_id
    return out


def _tokens(cache: TokenCache, start: int, stop: int) -> int:
    """The tokens of documents [start, stop) of `cache`."""
    return int(cache.doc_offsets[stop] - cache.doc_offsets[start])


def _padded(rows: list[np.ndarray], length: int, fill: int) -> np.ndarray:
    out = np.full((len(rows), length), fill, dtype=np.int64)
    for r, ids in enumerate(rows):
        out[r, :len(ids)] = ids[:length]
    return out


class Seq2SeqPairs(_Samples):
    """Record i of the data as (source, target): see the module docstring."""

    def __init__(self, source: TokenCache, target: TokenCache, seq_len: int, target_len: int, *, pad_id: int,
                 start_id: int) -> None:
        if source.num_documents != target.num_documents:
            raise DataError(f"{source.path}: {source.num_documents} source texts but {target.num_documents} "
                            f"targets: each record needs both fields")
        self.cache, self.target = source, target
        self.seq_len, self.target_len, self.pad_id, self.start_id = seq_len, target_len, pad_id, start_id
        self.start, self.stop = 0, source.num_documents

    def _cut(self) -> str:
        return f"pairs/{self.cache.fingerprint}/{self.target.fingerprint}"

    def describe(self) -> str:
        """These pairs (a held-out split's not counted with the training ones): how many, their lengths and tokens."""
        return (f"{len(self)} pairs of at most {self.seq_len} source and {self.target_len} target tokens "
                f"({_tokens(self.cache, self.start, self.stop)} + {_tokens(self.target, self.start, self.stop)} "
                f"tokens)")

    def _rows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        sources = [np.asarray(self.cache.document(int(i)), dtype=np.int64) for i in rows]
        targets = [np.asarray(self.target.document(int(i)), dtype=np.int64) for i in rows]
        ids = _padded(sources, self.seq_len, self.pad_id)
        mask = _padded([np.ones(len(s), dtype=np.int64) for s in sources], self.seq_len, 0)
        return {"input_ids": ids, "attention_mask": mask, "targets": _padded(targets, self.target_len, IGNORE_INDEX)}


def span_lengths(raw_length: int, noise_density: float, mean_noise_span: float) -> tuple[int, int, int, int]:
    """(noise tokens, spans, input length, target length) of a window of `raw_length` tokens (T5's rule)."""
    noise = min(max(int(round(raw_length * noise_density)), 1), raw_length - 1)
    spans = max(min(int(round(noise / mean_noise_span)), raw_length - noise), 1)
    return noise, spans, raw_length - noise + spans + 1, noise + spans + 1


class SpanCorruption(_Samples):
    """T5's span corruption of a token stream: see the module docstring."""

    def __init__(self, cache: TokenCache, seq_len: int, *, sentinels: list[int], pad_id: int, start_id: int,
                 noise_density: float = 0.15, mean_noise_span: float = 3.0, seed: int = 0) -> None:
        if not 0 < noise_density < 1 or mean_noise_span < 1:
            raise ValueError(f"noise_density {noise_density} must be in (0, 1) and mean_noise_span {mean_noise_span} "
                             f"at least 1")
        raw = 2
        while span_lengths(raw + 1, noise_density, mean_noise_span)[2] <= seq_len:
            raw += 1
        noise, spans, inputs, targets = span_lengths(raw, noise_density, mean_noise_span)
        if inputs > seq_len:
            raise DataError(f"--seq {seq_len} is too short for span corruption (a window of 2 tokens needs {inputs})")
        if spans > len(sentinels):
            raise DataError(f"span corruption of {raw}-token windows makes {spans} spans but the tokenizer has "
                            f"{len(sentinels)} sentinel tokens")
        self.cache, self.seq_len, self.target_len, self.raw_length = cache, seq_len, targets, raw
        self.noise, self.spans, self.sentinels = noise, spans, np.asarray(sentinels[:spans], dtype=np.int64)
        self.noise_density, self.mean_noise_span, self.seed = noise_density, mean_noise_span, seed
        self.pad_id, self.start_id = pad_id, start_id
        self.start, self.stop = 0, cache.num_tokens // raw

    def _cut(self) -> str:
        return (f"spans/{self.cache.fingerprint}/{self.raw_length}/{self.noise_density}/{self.mean_noise_span}/"
                f"{self.seed}")

    def describe(self) -> str:
        return (f"{len(self)} samples of {self.raw_length} tokens, span-corrupted to {self.seq_len} input and "
                f"{self.target_len} target tokens ({self.noise} noise tokens in {self.spans} spans; "
                f"{len(self) * self.raw_length} of the {self.cache.num_tokens} tokens of {self.cache.num_documents} "
                f"documents)")

    def noise_mask(self, index: int) -> np.ndarray:
        """Sample `index`'s noise mask [raw_length]: `spans` noise spans, alternating with kept runs, kept first."""
        rng = np.random.default_rng([self.seed, index])
        noise_runs = _segments(self.noise, self.spans, rng)
        kept_runs = _segments(self.raw_length - self.noise, self.spans, rng)
        lengths = np.stack([kept_runs, noise_runs], axis=1).reshape(-1)  # kept, noise, kept, noise, …
        flags = np.tile([False, True], self.spans)
        return np.repeat(flags, lengths)

    def _rows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        L, eos = self.raw_length, self.cache.eos_id
        inputs, targets = [], []
        for i in rows:
            window = np.asarray(self.cache.tokens[int(i) * L:(int(i) + 1) * L], dtype=np.int64)
            noise = self.noise_mask(int(i))
            first = noise & ~np.concatenate([[False], noise[:-1]])  # each span's first token
            span = np.maximum(np.cumsum(first) - 1, 0)  # the span a noise token is in
            inputs.append(np.concatenate([np.where(first, self.sentinels[span], window)[~noise | first], [eos]]))
            targets.append(np.concatenate([*(np.concatenate([[self.sentinels[k]], window[noise & (span == k)]])
                                             for k in range(self.spans)), [eos]]))
        ids = _padded(inputs, self.seq_len, self.pad_id)
        mask = _padded([np.ones(len(x), dtype=np.int64) for x in inputs], self.seq_len, 0)
        return {"input_ids": ids, "attention_mask": mask, "targets": _padded(targets, self.target_len, IGNORE_INDEX)}


def _segments(items: int, segments: int, rng: np.random.Generator) -> np.ndarray:
    """`items` split into `segments` random positive run lengths (T5's `_random_segmentation`)."""
    marks = np.zeros(items - 1, dtype=bool)
    marks[rng.choice(items - 1, size=segments - 1, replace=False)] = True
    ends = np.concatenate([np.flatnonzero(marks) + 1, [items]])
    return np.diff(np.concatenate([[0], ends]))


def sentinel_ids(tokenizer: object, where: str) -> list[int]:
    """The tokenizer's T5 sentinels `<extra_id_0>`, `<extra_id_1>`, … as ids, or a DataError naming the model."""
    hf = getattr(tokenizer, "tokenizer", None)
    convert = getattr(hf, "convert_tokens_to_ids", None)
    if convert is None:
        raise DataError(f"{where}: span corruption needs the model's own tokenizer with sentinel tokens "
                        f"(<extra_id_0>, …); give --source-field and --target-field to train on pairs instead")
    unk = getattr(hf, "unk_token_id", None)
    out = []
    for k in range(1000):
        i = convert(f"<extra_id_{k}>")
        if i is None or i == unk:
            break
        out.append(int(i))
    if not out:
        raise DataError(f"{where}: its tokenizer has no sentinel tokens (<extra_id_0>, …) for span corruption; give "
                        f"--source-field and --target-field to train on (source, target) pairs instead")
    return out


@dataclass(frozen=True)
class Seq2SeqObjective:
    """What an encoder-decoder trains on, as the launcher chose it (trainer/hf_setup.py) so that no rank looks
    again: (source, target) `pairs` with their target caches, or T5's span corruption (`spans`) of text."""

    kind: str  # "pairs" or "spans"
    pad_id: int
    start_id: int  # the decoder's start token
    target_seq: int = 0  # pairs: the target's length
    target_cache: str | None = None  # pairs: the targets of --data, and of --eval-data
    eval_target_cache: str | None = None
    sentinels: tuple[int, ...] = ()  # spans: <extra_id_k> token ids
    noise_density: float = 0.0
    mean_noise_span: float = 0.0
    seed: int = 0


def samples(objective: Seq2SeqObjective, cache_path: str, seq_len: int, *, held_out: bool = False) -> _Samples:
    """The samples the launcher chose (`objective`, trainer/hf_setup.py) over the token cache at `cache_path`;
    `held_out`: of --eval-data (its own target cache)."""
    cache = TokenCache.open(cache_path)
    o = objective
    if o.kind == "pairs":
        target = TokenCache.open(o.eval_target_cache if held_out else o.target_cache)
        return Seq2SeqPairs(cache, target, seq_len, o.target_seq, pad_id=o.pad_id, start_id=o.start_id)
    return SpanCorruption(cache, seq_len, sentinels=list(o.sentinels), pad_id=o.pad_id, start_id=o.start_id,
                          noise_density=o.noise_density, mean_noise_span=o.mean_noise_span, seed=o.seed)
