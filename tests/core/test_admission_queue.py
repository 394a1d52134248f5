"""AdmissionQueue and CapacitySignal: bounded FIFO with K overtakes, four distinct outcomes,
coalesced wake-ups that leave no admissible waiter asleep."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.config import QueueConfig
from kvserve.core import (
    AdmissionQueue,
    CapacitySignal,
    Outcome,
    Scheduler,
    Waiter,
    admit_or_enqueue,
    admit_waiting,
)
from tests.core.helpers import admit, can_admit, make_scheduler, sequences


def scheduler_of(max_num_seqs: int, num_blocks: int, max_model_len: int = 32) -> Scheduler:
    return make_scheduler(
        num_blocks=num_blocks,
        block_size=4,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        admission="reserve",
    )


# -- the signal ----------------------------------------------------------------------------------


def test_capacity_signal_coalesces_to_one_pending() -> None:
    signal = CapacitySignal()
    assert not signal.take()
    assert signal.offer()
    assert not signal.offer()
    assert signal.pending
    assert signal.take()
    assert not signal.pending and not signal.take()
    assert signal.offer()  # a release after the take is not lost
    assert (signal.num_offered, signal.num_taken, signal.num_dropped) == (3, 1, 1)


# -- overtaking ----------------------------------------------------------------------------------


def admit_ids(queue: AdmissionQueue, admissible: set[str]) -> list[str]:
    return [w.request_id for w in queue.drive(lambda w: w.request_id in admissible)]


@pytest.mark.parametrize("max_overtakes", [0, 1, 2, 3])
def test_the_head_is_overtaken_at_most_k_times(max_overtakes: int) -> None:
    queue = AdmissionQueue(max_waiters=10, timeout=30.0, max_overtakes=max_overtakes)
    for request_id in ["head", "w1", "w2", "w3", "w4"]:
        queue.offer(request_id, now=0.0)
    behind = {"w1", "w2", "w3", "w4"}
    assert admit_ids(queue, behind) == ["w1", "w2", "w3", "w4"][:max_overtakes]
    head = queue.get("head")
    assert head is not None and head.num_overtaken == max_overtakes
    # More passes without the head fitting admit nobody.
    assert admit_ids(queue, behind) == []
    # Once the head goes, those behind it follow.
    assert (
        admit_ids(queue, behind | {"head"}) == ["head"] + ["w1", "w2", "w3", "w4"][max_overtakes:]
    )
    assert len(queue) == 0


def test_overtakes_accumulate_across_passes() -> None:
    queue = AdmissionQueue(max_waiters=10, timeout=30.0, max_overtakes=2)
    for request_id in ["head", "w1", "w2", "w3"]:
        queue.offer(request_id, now=0.0)
    assert admit_ids(queue, {"w1"}) == ["w1"]
    assert admit_ids(queue, {"w2", "w3"}) == ["w2"]
    assert [w.request_id for w in queue.waiters] == ["head", "w3"]


def test_a_new_head_starts_with_a_fresh_overtake_count() -> None:
    queue = AdmissionQueue(max_waiters=10, timeout=30.0, max_overtakes=1)
    for request_id in ["head", "second", "third", "fourth"]:
        queue.offer(request_id, now=0.0)
    # head admitted first; "second" becomes the head and is overtaken once by "fourth".
    assert admit_ids(queue, {"head", "fourth"}) == ["head", "fourth"]
    second = queue.get("second")
    assert second is not None and second.num_overtaken == 1


def index_of(waiter: Waiter) -> int:
    return int(waiter.request_id.removeprefix("r"))


@given(
    max_overtakes=st.integers(min_value=0, max_value=4),
    passes=st.lists(st.sets(st.integers(min_value=0, max_value=7)), min_size=1, max_size=8),
)
def test_fifo_with_k_overtakes_property(max_overtakes: int, passes: list[set[int]]) -> None:
    """Each pass admits, in queue order, every admissible waiter up to the first one left
    waiting (the head), and behind the head only as many admissible waiters as the head's
    remaining overtakes allow."""
    queue = AdmissionQueue(max_waiters=8, timeout=30.0, max_overtakes=max_overtakes)
    for index in range(8):
        queue.offer(f"r{index}", now=0.0)
    head: int | None = None
    head_overtaken = 0
    for admissible in passes:
        before = [index_of(w) for w in queue.waiters]
        got = [index_of(w) for w in queue.drive(lambda w, ok=admissible: index_of(w) in ok)]
        after = [index_of(w) for w in queue.waiters]
        assert after == [i for i in before if i not in got]
        if not after:
            assert got == [i for i in before if i in admissible]
            break
        new_head = after[0]
        ahead = [i for i in before if i < new_head]
        behind_admissible = [i for i in before if i > new_head and i in admissible]
        prior = head_overtaken if new_head == head else 0
        allowed = max_overtakes - prior
        assert got == ahead + behind_admissible[:allowed]
        head, head_overtaken = new_head, prior + len(got) - len(ahead)
        assert head_overtaken <= max_overtakes
        head_waiter = queue.get(f"r{new_head}")
        assert head_waiter is not None and head_waiter.num_overtaken == head_overtaken


# -- the four outcomes ---------------------------------------------------------------------------


def test_queue_full_refuses_without_taking_a_place() -> None:
    queue = AdmissionQueue(max_waiters=2, timeout=30.0, max_overtakes=0)
    assert queue.offer("a", now=0.0) is not None
    assert queue.offer("b", now=0.0) is not None
    assert queue.offer("c", now=0.0) is None
    assert len(queue) == 2 and "c" not in queue
    assert queue.cancel("c") is None
    queue.cancel("a")
    assert queue.offer("c", now=1.0) is not None


def test_the_deadline_is_the_queues_own() -> None:
    queue = AdmissionQueue(max_waiters=4, timeout=30.0, max_overtakes=0)
    first = queue.offer("a", now=100.0)
    second = queue.offer("b", now=105.0)
    assert first is not None and second is not None
    assert (first.enqueued_at, first.deadline) == (100.0, 130.0)
    assert queue.next_deadline == 130.0
    assert queue.expire(129.9) == []
    assert queue.expire(130.0) == [first]
    assert queue.next_deadline == 135.0
    assert queue.expire(200.0) == [second]
    assert queue.next_deadline is None


def test_cancel_after_timeout_and_timeout_after_cancel_are_no_ops() -> None:
    queue = AdmissionQueue(max_waiters=4, timeout=10.0, max_overtakes=0)
    queue.offer("timed-out", now=0.0)
    queue.offer("cancelled", now=0.0)
    cancelled = queue.cancel("cancelled")
    assert cancelled is not None and cancelled.request_id == "cancelled"
    assert queue.cancel("cancelled") is None
    assert [w.request_id for w in queue.expire(10.0)] == ["timed-out"]
    assert queue.cancel("timed-out") is None
    assert queue.expire(1e9) == []
    assert queue.drive(lambda w: True) == []


def test_each_request_ends_in_exactly_one_of_four_outcomes() -> None:
    scheduler = scheduler_of(1, 8)
    queue = AdmissionQueue(max_waiters=3, timeout=10.0, max_overtakes=0)
    outcomes: dict[str, Outcome] = {}

    def arrive(request_id: str, now: float) -> None:
        result = admit_or_enqueue(scheduler, queue, sequences(request_id, 4, 4), now)
        if isinstance(result, Outcome):
            outcomes[request_id] = result

    arrive("runs-at-once", 0.0)
    arrive("admitted-later", 0.0)
    arrive("client-gone", 1.0)
    arrive("times-out", 2.0)
    arrive("refused", 3.0)
    assert outcomes == {"runs-at-once": Outcome.ADMITTED, "refused": Outcome.QUEUE_FULL}

    for waiter in queue.expire(5.0):  # nothing is due yet
        outcomes[waiter.request_id] = Outcome.TIMED_OUT
    gone = queue.cancel("client-gone")
    assert gone is not None
    outcomes[gone.request_id] = Outcome.CANCELLED
    scheduler.release("runs-at-once")
    for waiter in admit_waiting(scheduler, queue):
        outcomes[waiter.request_id] = Outcome.ADMITTED
    for waiter in queue.expire(12.0):
        outcomes[waiter.request_id] = Outcome.TIMED_OUT
    assert outcomes == {
        "runs-at-once": Outcome.ADMITTED,
        "admitted-later": Outcome.ADMITTED,
        "client-gone": Outcome.CANCELLED,
        "times-out": Outcome.TIMED_OUT,
        "refused": Outcome.QUEUE_FULL,
    }
    assert len(queue) == 0
    assert len(set(Outcome)) == 4


# -- the door helper -----------------------------------------------------------------------------


def test_admit_or_enqueue_never_overtakes_a_waiter() -> None:
    scheduler = scheduler_of(2, 4)
    queue = AdmissionQueue(max_waiters=4, timeout=10.0, max_overtakes=0)
    assert (
        admit_or_enqueue(scheduler, queue, sequences("big", 4, 8), 0.0) is Outcome.ADMITTED
    )  # 3 blocks
    waiting = admit_or_enqueue(scheduler, queue, sequences("needs-two", 4, 4), 0.0)
    assert isinstance(waiting, Waiter)
    assert can_admit(scheduler, 2, 2)  # one block would fit ...
    small = admit_or_enqueue(scheduler, queue, sequences("small", 2, 2), 0.0)
    assert isinstance(small, Waiter)  # ... but someone is already waiting
    assert [w.request_id for w in queue.waiters] == ["needs-two", "small"]
    assert small.arrival > waiting.arrival > scheduler.running[0].arrival


def test_a_queue_of_zero_still_admits_what_fits_at_once() -> None:
    scheduler = scheduler_of(1, 4)
    queue = AdmissionQueue.from_config(QueueConfig(max_queue_per_slot=0), num_slots=1)
    assert admit_or_enqueue(scheduler, queue, sequences("a", 4, 4), 0.0) is Outcome.ADMITTED
    assert admit_or_enqueue(scheduler, queue, sequences("b", 4, 4), 0.0) is Outcome.QUEUE_FULL


def test_from_config_sizes_the_queue_per_slot_and_defaults_overtakes_to_slots() -> None:
    queue = AdmissionQueue.from_config(QueueConfig(), num_slots=8)
    assert (queue.max_waiters, queue.timeout, queue.max_overtakes) == (64, 30.0, 8)
    strict = AdmissionQueue.from_config(QueueConfig(max_overtakes=0), num_slots=8)
    assert strict.max_overtakes == 0


# -- wake-ups ------------------------------------------------------------------------------------


@given(
    num_running=st.integers(min_value=1, max_value=6),
    waiter_sizes=st.lists(st.integers(min_value=1, max_value=24), min_size=1, max_size=12),
    num_released=st.integers(min_value=1, max_value=6),
    max_overtakes=st.integers(min_value=0, max_value=6),
)
def test_a_burst_of_releases_wakes_the_driver_once_and_leaves_no_admissible_waiter(
    num_running: int, waiter_sizes: list[int], num_released: int, max_overtakes: int
) -> None:
    num_released = min(num_released, num_running)
    scheduler = scheduler_of(6, 6 * 4, max_model_len=64)
    queue = AdmissionQueue(max_waiters=16, timeout=30.0, max_overtakes=max_overtakes)
    for index in range(num_running):
        assert admit(scheduler, f"run{index}", 8, 8, index) is not None  # 4 blocks each
    for index, size in enumerate(waiter_sizes):
        queue.offer(f"wait{index}", 0.0, sequences(f"wait{index}", size, size))
    admit_waiting(scheduler, queue)
    assert not scheduler.capacity.pending

    for index in range(num_released):
        scheduler.release(f"run{index}")
    assert scheduler.capacity.num_offered == num_released
    assert scheduler.capacity.num_dropped == num_released - 1

    num_wakes = 0
    while scheduler.capacity.take():
        num_wakes += 1
        admit_waiting(scheduler, queue)
    assert num_wakes == 1

    # A fixed point: another pass admits nobody.
    assert admit_waiting(scheduler, queue) == []
    # Every waiter left is either refused by capacity, or held back by the overtake rule.
    waiters = queue.waiters
    if waiters:
        head = waiters[0]
        assert not scheduler.can_admit(head.sequences)
        if head.num_overtaken < max_overtakes:
            for waiter in waiters[1:]:
                assert not scheduler.can_admit(waiter.sequences)
