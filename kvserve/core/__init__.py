"""Scheduling policy over integers: block pool, scheduler, admission queue, step plans.

Nothing here imports torch, touches tensors, reads a clock or knows about HTTP, so every rule
is tested in milliseconds and the simulator drives the same code the server runs.
"""

from kvserve.core.blocks import BlockPool
from kvserve.core.plan import ChunkPlan, StepPlan
from kvserve.core.prefix import PrefixCache, block_hashes
from kvserve.core.queue import AdmissionQueue, CapacitySignal, Outcome, Waiter
from kvserve.core.scheduler import (
    Infeasible,
    Prompt,
    Scheduler,
    SeqState,
    admit_or_enqueue,
    admit_waiting,
    choice_id,
)

__all__ = [
    "AdmissionQueue",
    "BlockPool",
    "CapacitySignal",
    "ChunkPlan",
    "Infeasible",
    "Outcome",
    "PrefixCache",
    "Prompt",
    "Scheduler",
    "SeqState",
    "StepPlan",
    "Waiter",
    "admit_or_enqueue",
    "block_hashes",
    "choice_id",
    "admit_waiting",
]
