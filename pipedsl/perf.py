"""Keep Python's cycle collector out of passes that allocate millions of small objects.

Programs are trees of tuples with no reference cycles; generation-2 collections during a
big compile only rescan them again and again (they doubled lowering time at 10⁶
instructions).  Reference counting still frees everything as usual.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def no_gc() -> Iterator[None]:
    """Pause the cycle collector for the duration of the block (re-entrant)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
