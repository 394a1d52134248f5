"""The bounded admission queue in front of the scheduler, and the capacity signal that drives it.

Time is passed in as `now` (seconds on any monotonic clock); nothing here reads a clock.
A waiter leaves the queue in exactly one of four ways (`Outcome`): admitted by `drive`, refused
at `offer` because the queue is full, expired by `expire` when its own wait budget runs out, or
cancelled by `cancel` when its client goes away. The wait budget is the queue's deadline, set at
offer time; client cancellation is a separate call, so a timeout (429) and a disconnect (499)
are never mistaken for one another.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.config import QueueConfig

if TYPE_CHECKING:
    from kvserve.core.sequence import Sequence


class CapacitySignal:
    """A capacity-1 coalescing signal: at most one wake-up is ever pending.

    Every release offers it without blocking; a burst of releases leaves one pending signal, so
    the single driver re-checks the waiters once. A driver that takes the signal and then looks
    at every waiter cannot lose a wake-up: a release after the take offers a fresh signal.
    """

    def __init__(self) -> None:
        self._pending = False
        self.num_offered = 0
        self.num_taken = 0
        self.num_dropped = 0

    @property
    def pending(self) -> bool:
        """Whether a signal waits to be taken."""
        return self._pending

    def offer(self) -> bool:
        """Make a signal pending; False when one already was (this one is dropped)."""
        self.num_offered += 1
        if self._pending:
            self.num_dropped += 1
            return False
        self._pending = True
        return True

    def take(self) -> bool:
        """Consume the pending signal; False when none was pending."""
        if not self._pending:
            return False
        self._pending = False
        self.num_taken += 1
        return True


class Outcome(enum.Enum):
    """How a request's stay at the door ended."""

    ADMITTED = "admitted"
    QUEUE_FULL = "queue_full"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"


@dataclass(slots=True)
class Waiter:
    """A request waiting for its slots and blocks; `sequences` are its answers' records."""

    request_id: str
    arrival: int  # order of arrival at the door; the scheduler keeps sequences in this order
    enqueued_at: float
    deadline: float  # enqueued_at + the queue's timeout
    sequences: tuple[Sequence, ...] = ()
    num_overtaken: int = 0  # admissions of later waiters while this one was the head

    @property
    def num_prompt_tokens(self) -> int:
        return self.sequences[0].num_prompt_tokens if self.sequences else 0


class AdmissionQueue:
    """Bounded FIFO of waiters, where later waiters may overtake the head at most K times.

    `max_waiters` bounds waiters only (running requests do not count); 0 means nothing may
    wait. `timeout` is each waiter's wait budget in seconds. `max_overtakes` is K: once the
    head has been overtaken K times nobody behind it is admitted until it is; 0 = strict FIFO.
    """

    def __init__(self, max_waiters: int, timeout: float, max_overtakes: int) -> None:
        if max_waiters < 0:
            raise ValueError("max_waiters must be >= 0")
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        if max_overtakes < 0:
            raise ValueError("max_overtakes must be >= 0")
        self.max_waiters = max_waiters
        self.timeout = timeout
        self.max_overtakes = max_overtakes
        # Insertion-ordered: iteration is FIFO, removal by id is O(1).
        self._waiters: dict[str, Waiter] = {}
        self._num_arrivals = 0

    @classmethod
    def from_config(cls, config: QueueConfig, num_slots: int) -> AdmissionQueue:
        """The queue the config describes: `max_queue_per_slot * num_slots` waiters, and
        `num_slots` overtakes of the head unless the config names a number."""
        max_overtakes = num_slots if config.max_overtakes is None else config.max_overtakes
        return cls(config.max_queue_per_slot * num_slots, config.queue_timeout, max_overtakes)

    def __len__(self) -> int:
        return len(self._waiters)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._waiters

    @property
    def waiters(self) -> tuple[Waiter, ...]:
        """Waiters in FIFO order; the first is the head."""
        return tuple(self._waiters.values())

    def get(self, request_id: str) -> Waiter | None:
        """The waiter for `request_id`, or None when it is not waiting."""
        return self._waiters.get(request_id)

    def next_arrival(self) -> int:
        """Hand out the next arrival number (also used for requests admitted without waiting)."""
        arrival = self._num_arrivals
        self._num_arrivals += 1
        return arrival

    def offer(self, request_id: str, now: float, sequences: Seq[Sequence] = ()) -> Waiter | None:
        """Append a waiter whose deadline is `now + timeout`; None when the queue is full."""
        if request_id in self._waiters:
            raise ValueError(f"{request_id!r} is already waiting")
        if len(self._waiters) >= self.max_waiters:
            return None
        waiter = Waiter(
            request_id=request_id,
            arrival=self.next_arrival(),
            enqueued_at=now,
            deadline=now + self.timeout,
            sequences=tuple(sequences),
        )
        self._waiters[request_id] = waiter
        return waiter

    def cancel(self, request_id: str) -> Waiter | None:
        """Remove a waiter whose client went away; None when it is not waiting (idempotent)."""
        return self._waiters.pop(request_id, None)

    def expire(self, now: float) -> list[Waiter]:
        """Remove and return the waiters whose deadline is at or before `now`, in FIFO order."""
        expired = [waiter for waiter in self._waiters.values() if waiter.deadline <= now]
        for waiter in expired:
            del self._waiters[waiter.request_id]
        return expired

    @property
    def next_deadline(self) -> float | None:
        """The earliest deadline among the waiters; None when nobody waits."""
        return min((waiter.deadline for waiter in self._waiters.values()), default=None)

    def drive(self, try_admit: Callable[[Waiter], bool]) -> list[Waiter]:
        """One FIFO pass offering every waiter to `try_admit`; returns (and removes) those admitted.

        Once the head has been overtaken `max_overtakes` times, nobody behind it is tried. If
        `try_admit` only ever refuses for lack of capacity, one pass leaves the queue at a fixed
        point: a second pass without a release would admit nobody.
        """
        admitted: list[Waiter] = []
        head: Waiter | None = None
        for waiter in list(self._waiters.values()):
            if head is not None and head.num_overtaken >= self.max_overtakes:
                break
            if try_admit(waiter):
                del self._waiters[waiter.request_id]
                admitted.append(waiter)
                if head is not None:
                    head.num_overtaken += 1
            elif head is None:
                head = waiter
        return admitted
