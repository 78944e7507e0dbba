"""One assertion for every pipelined comparison against one process: each parameter of the model was compared.

A rank reports the names it compared (`checked`); a check that silently skipped a parameter — not on any stage,
renamed, or an expert shard missing — would otherwise pass.  An expert shard is reported as `name[a:b]` (its rows
of the whole tensor): the shards of every name must cover its rows exactly.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

_SHARD = re.compile(r"^(?P<name>.+)\[(?P<a>\d+):(?P<b>\d+)\]$")


def every_parameter_compared(checked: Iterable[str], names: Iterable[str], rows: Mapping[str, int] | None = None) -> None:
    """Assert the union of the ranks' `checked` names is the model's parameter `names`; `rows[name]`: the first
    dimension of a parameter compared in shards, which the shards' ranges must cover with no gap or overlap."""
    whole, shards = set(), {}
    for key in checked:
        m = _SHARD.match(key)
        if m is None:
            whole.add(key)
        else:
            shards.setdefault(m["name"], set()).add((int(m["a"]), int(m["b"])))
    missing = set(names) - whole - set(shards)
    assert not missing, f"parameters compared on no rank: {sorted(missing)[:8]}"
    unknown = (whole | set(shards)) - set(names)
    assert not unknown, f"compared names the model does not have: {sorted(unknown)[:8]}"
    for name, ranges in shards.items():
        assert rows is not None and name in rows, f"{name} was compared in shards; its row count is not given"
        at = 0
        for a, b in sorted(ranges):
            assert a == at and b > a, f"{name}: the shards {sorted(ranges)} do not tile rows [0, {rows[name]})"
            at = b
        assert at == rows[name], f"{name}: the shards {sorted(ranges)} cover rows [0, {at}) of {rows[name]}"
