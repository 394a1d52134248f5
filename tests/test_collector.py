"""The cyclic collector is paused inside `collector_paused` and comes back after the last of
overlapping pauses, as it was before the first."""

from __future__ import annotations

import gc
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
