"""Scheduling policy over integers: sequences, block pool, KV manager, scheduler, admission
queue, step plans.

Nothing here imports torch, touches tensors, reads a clock or knows about HTTP, so every rule
is tested in milliseconds and the simulator drives the same code the server runs.
"""

from kvserve.core.blocks import BlockPool
from kvserve.core.kv_manager import ComputedBlocks, KVManager, copy_source_owner
from kvserve.core.plan import BlockCopy, ChunkPlan, StepPlan
from kvserve.core.prefix import PrefixCache, block_hashes
from kvserve.core.queue import AdmissionQueue, CapacitySignal, Outcome, Waiter
from kvserve.core.scheduler import Infeasible, Scheduler, admit_or_enqueue, admit_waiting
from kvserve.core.sequence import (
    FINISH_REASONS,
    Prompt,
    Sequence,
    SequenceStatus,
    make_sequences,
    sequence_id,
)

__all__ = [
    "FINISH_REASONS",
    "AdmissionQueue",
    "BlockCopy",
    "BlockPool",
    "CapacitySignal",
    "ChunkPlan",
    "ComputedBlocks",
    "Infeasible",
    "KVManager",
    "Outcome",
    "PrefixCache",
    "Prompt",
    "Scheduler",
    "Sequence",
    "SequenceStatus",
    "StepPlan",
    "Waiter",
    "admit_or_enqueue",
    "admit_waiting",
    "block_hashes",
    "copy_source_owner",
    "make_sequences",
    "sequence_id",
]
