"""Policies the simulator shows beside the engine's and nobody serves with: request-level
batching and admission on a free slot alone. Each is the core Scheduler with one of its hooks
changed, so everything else (step composition, blocks, the prefix cache) is the engine's code.

- `RequestLevelScheduler`: a batch forms only while nothing runs and closes at the first step
  it runs; it reopens when its last member is released. The admission round is therefore the
  span between two `schedule()` calls; the driver needs no extra call, `can_admit` answers False
  while the batch is closed.
- `SlotOnlyScheduler`: a free slot is enough; blocks are taken only as rows need them, and a
  sequence that cannot grow waits instead of preempting anyone. When the pool runs dry no
  sequence can grow and nothing finishes (`Scheduler.is_stuck`): the deadlock that reserving
  part of the answer at admission exists to prevent.
"""

from __future__ import annotations

from kvserve.config import SchedulerConfig
from kvserve.core.kv_manager import KVManager
from kvserve.core.queue import CapacitySignal
from kvserve.core.scheduler import Scheduler
from kvserve.core.sequence import Sequence


class RequestLevelScheduler(Scheduler):
    """Request-level batching: a batch runs to completion before the next one forms."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVManager,
        max_model_len: int,
        capacity: CapacitySignal | None = None,
    ) -> None:
        super().__init__(config, kv, max_model_len, capacity)
        self._batch_open = True

    @property
    def batch_open(self) -> bool:
        """Whether the batch still admits (no step has run since it formed)."""
        return self._batch_open

    def _admission_open(self) -> bool:
        return self._batch_open

    def _on_schedule(self) -> None:
        if self.num_running:
            self._batch_open = False

    def _on_release(self) -> None:
        if not self.num_running and not self.num_preempted:
            self._batch_open = True


class SlotOnlyScheduler(Scheduler):
    """Admission on a free slot alone: nothing reserved, nobody preempted."""

    preempts = False

    def reserved_positions(self, seq: Sequence) -> int:
        return 0


POLICIES: dict[str, type[Scheduler]] = {
    "continuous": Scheduler,
    "request": RequestLevelScheduler,
    "slot-only": SlotOnlyScheduler,
}
"""Scheduler class by policy name: the engine's own ("continuous") and the two shown here."""
