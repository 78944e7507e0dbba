"""Keep Python's cycle collector out of passes that allocate millions of small objects.

Programs are trees of tuples with no reference cycles; generation-2 collections during a
big compile only rescan them again and again (they doubled lowering time at 10⁶
instructions).  Reference counting still frees everything as usual.

What a paused block made is still young when the collector resumes: the next young
collection would walk all of it (0.2 s at 10⁶ instructions) and promote it, and the middle
generation's would walk it again.  It lives as long as its caller keeps it, so `no_gc` moves
it straight to the oldest generation (`gc.freeze` then `gc.unfreeze`, which moves lists, not
objects); a cycle among it is still found by the next full collection.

A process that froze what it imported (`freeze_imports`: the pool's workers, launched ranks) skips that aging:
unfreezing would thaw torch's objects back into every full collection, and merely asking how many objects are
frozen (`gc.get_freeze_count`) walks all of them, 0.1 s each time.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

_imports_frozen = False  # set once by `freeze_imports`; read by `no_gc`


def freeze_imports() -> None:
    """Move every object alive now (what the process imported: torch is ~170,000 of them) out of the cycle
    collector's reach for good: they are never garbage, and each full collection walked them all (0.15 s)."""
    global _imports_frozen
    gc.freeze()
    _imports_frozen = True


@contextmanager
def no_gc() -> Iterator[None]:
    """Pause the cycle collector for the duration of the block (re-entrant); on leaving the
    outermost block, age what it made to the oldest generation."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if not _imports_frozen and gc.get_freeze_count() == 0:  # unfreeze would thaw what someone else froze
                gc.freeze()
                gc.unfreeze()
            gc.enable()
