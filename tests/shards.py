"""Split the selected tests into N parts by file, balanced by the seconds each file took (tests/durations.txt), so
that N pytest processes can run the suite side by side (tests/run_shards.py): a file's tests stay together, so
its module fixtures are built once, in one part."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent
UNKNOWN_PER_TEST = 0.3  # seconds a test of a file the table does not list counts


def file_seconds() -> dict[str, float]:
    """tests/durations.txt: a file's path under tests/ and its seconds, one a line (`#` comments)."""
    table = {}
    for line in (TESTS / "durations.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            path, seconds = line.rsplit(maxsplit=1)
            table[path] = float(seconds)
    return table


def parse_shard(text: str) -> tuple[int, int]:
    """"K/N" -> (K, N), 1 <= K <= N."""
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise ValueError(f"--shard takes K/N with 1 <= K <= N, got {text!r}")
    return int(k), int(n)


def assign(files: dict[str, int], n: int, seconds: dict[str, float]) -> list[list[str]]:
    """Longest first onto the least loaded part (LPT): `files` maps each file to its number of selected tests."""
    weight = {f: seconds.get(f, UNKNOWN_PER_TEST * count) for f, count in files.items()}
    parts: list[list[str]] = [[] for _ in range(n)]
    load = [0.0] * n
    for f in sorted(files, key=lambda f: (-weight[f], f)):
        k = load.index(min(load))
        parts[k].append(f)
        load[k] += weight[f]
    return parts


def keep_shard(items: list, shard: str) -> set:
    """The items of part K of N."""
    k, n = parse_shard(shard)
    by_file: dict[str, list] = defaultdict(list)
    for item in items:
        by_file[str(Path(item.fspath).resolve().relative_to(TESTS))].append(item)
    mine = assign({f: len(v) for f, v in by_file.items()}, n, file_seconds())[k - 1]
    return {item for f in mine for item in by_file[f]}
