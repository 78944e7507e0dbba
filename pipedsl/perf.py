"""Keep Python's cycle collector out of passes that allocate millions of small objects.

Programs are trees of tuples with no reference cycles; generation-2 collections during a
big compile only rescan them again and again (they doubled lowering time at 10⁶
instructions).  Reference counting still frees everything as usual.

What a paused block made is still young when the collector resumes: the next young
collection would walk all of it (0.2 s at 10⁶ instructions) and promote it, and the middle
generation's would walk it again.  It lives as long as its caller keeps it, so `no_gc` moves
it straight to the oldest generation (`gc.freeze` then `gc.unfreeze`, which moves lists, not
objects); a cycle among it is still found by the next full collection.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


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
            if gc.get_freeze_count() == 0:  # unfreeze would thaw objects someone else froze
                gc.freeze()
                gc.unfreeze()
            gc.enable()
