"""The cyclic collector is paused inside `collector_paused` and comes back after the last of
overlapping pauses, as it was before the first."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading

from kvserve.collector import collector_paused


def test_overlapping_pauses_end_with_the_last() -> None:
    assert gc.isenabled()
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with collector_paused():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    with collector_paused():
        assert not gc.isenabled()
        thread.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread's pause still holds it
    leave.set()
    thread.join(10)
    assert gc.isenabled()


def test_a_collector_off_before_stays_off() -> None:
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_collector_comes_back_after_an_error() -> None:
    try:
        with collector_paused():
            raise KeyError("in the block")
    except KeyError:
        pass
    assert gc.isenabled()


def test_the_servers_imports_are_kept_out_of_later_collections() -> None:
    """In a fresh interpreter (freezing here would keep this test process's garbage for good):
    after the server's imports every object they made is in the permanent generation, and the
    collector is on again."""
    script = (
        "import gc, sys\n"
        "from kvserve.server.cli import import_app\n"
        "before = gc.get_freeze_count()\n"
        "Server, create_app = import_app()\n"
        "assert 'torch' in sys.modules and 'fastapi' in sys.modules\n"
        "assert gc.isenabled()\n"
        "frozen = gc.get_freeze_count()\n"
        "print(before, frozen, len(gc.get_objects()))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    before, frozen, tracked = map(int, result.stdout.split())
    assert before == 0
    # torch and FastAPI make about 300k tracked objects; nearly all of them are frozen.
    assert frozen > 100_000
    assert tracked < frozen // 10
