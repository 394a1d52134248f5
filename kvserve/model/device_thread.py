"""The one thread that runs torch work on the CPU.

libgomp gives every thread that opens a parallel region its own pool of worker threads. With
two such threads in a process (say, the one that loaded the model and the one that runs steps)
a 2-core machine has more OpenMP threads than cores, and every parallel op then pays for the
other pool: measured here, a decode step went from 25 ms to 37 ms. So loading, warm-up and
every forward pass run on this single thread, and no other thread calls parallel torch ops.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_thread_ident: int | None = None


def _mark() -> None:
    global _thread_ident
    _thread_ident = threading.get_ident()


def executor() -> ThreadPoolExecutor:
    """The process-wide single-thread executor for torch work (created on first use)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="kvserve-device", initializer=_mark
            )
        return _executor


def on_device_thread() -> bool:
    return _thread_ident is not None and threading.get_ident() == _thread_ident


def call(fn: Callable[..., T], *args, **kwargs) -> T:
    """Run `fn` on the device thread and wait for it (directly when already there)."""
    if on_device_thread():
        return fn(*args, **kwargs)
    return executor().submit(fn, *args, **kwargs).result()
