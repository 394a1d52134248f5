"""Python's cyclic garbage collector paused while a start makes its long-lived objects.

Importing torch and FastAPI, and loading a model (a vocabulary of 150k tokens and as many
merges, the records of the prepared tensors), make hundreds of thousands of container objects
that live on or are freed by their reference counts. The collector, set off by their number,
walks the ones alive again and again: on 2 cores, 0.2-0.4 s of the server's 1.5 s of imports
and 0.25 s of the 1.1 s cached load of qwen2.5-coder:1.5b (docs/benchmarks.md, "2026-12-06
18:10"). Nothing is lost by pausing it: what it would have freed is freed at the next
collection after the pause.

What the server's imports make lives as long as the process (modules, classes, functions):
`keep_for_good` moves it out of the collector's sight after them, so that no collection walks
it again.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_pauses = 0
_enabled_before = False


@contextmanager
def collector_paused() -> Iterator[None]:
    """The collector off inside the block, on again after the last of overlapping pauses (from
    any thread) ends, if it was on before the first."""
    global _pauses, _enabled_before
    with _lock:
        if _pauses == 0:
            _enabled_before = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            if _pauses == 0 and _enabled_before:
                gc.enable()


def keep_for_good() -> None:
    """Every object the collector tracks now moved to its permanent generation (`gc.freeze`):
    no collection walks them again. For the objects of a server's imports, before anything else
    of size is made: the first collections after them walked their 320k objects again, 0.1-0.3 s
    of the start on 2 cores. The reference cycles the imports left as garbage stay (7,323
    objects after torch's and FastAPI's imports)."""
    gc.freeze()
