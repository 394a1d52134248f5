"""What the engine event stream costs at a large KV pool: the bytes and the loop's CPU time per
update of `EngineEvents` over a pool of 10^5 blocks, with no model.

    python -m kvserve.bench.events_bench [--blocks 100000] [--slots 64] [--updates 200]

The engine is synthetic: a real BlockPool (prefix caching on) and AdmissionQueue, and sequences
that decode. Between two updates (one coalescing interval, 100 ms) every sequence decodes a few
tokens and takes a block when it crosses into a new one, and one sequence finishes (its full
blocks published, so they stay cached-free) and a new one is admitted with a prompt of the
average size. The pool stays about 90% used, so after a few hundred updates its free list is
well mixed. Each update is built and serialized by `EngineEvents` as for a connected viewer;
the figures are its size and the thread's CPU time for it (`time.thread_time`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from kvserve.core.blocks import BlockPool
from kvserve.core.queue import AdmissionQueue
from kvserve.engine.events import EngineEvents

__all__ = ["EventsBench", "SyntheticEngine", "format_events_bench", "run_events_bench"]


@dataclass(slots=True)
class SyntheticSeq:
    """The fields of a running sequence the event stream reads."""

    seq_id: str
    slot: int
    num_prompt_tokens: int
    num_computed: int
    max_tokens: int
    num_output: int = 0
    num_preemptions: int = 0
    is_prefilling: bool = False
    is_recomputing: bool = False


class _Reservations:
    """The KV manager's answers the stream asks for: what each sequence took at admission."""

    def __init__(self) -> None:
        self.reserved: dict[str, int] = {}

    def holds(self, seq_id: str) -> bool:
        return seq_id in self.reserved

    def num_reserved(self, seq_id: str) -> int:
        return self.reserved.get(seq_id, 0)


class SyntheticEngine:
    """An engine without a model: the pool, the queue and the running sequences the event stream
    snapshots, moved by hand (`admit`, `decode`, `finish`). Loop-thread only, like the real one."""

    generates = True
    embedder = None
    running = True

    def __init__(self, num_blocks: int, num_slots: int, block_size: int = 16) -> None:
        self.pool = BlockPool(num_blocks, block_size, prefix_caching=True)
        self.kv = _Reservations()
        self.queue = AdmissionQueue(num_slots, 30.0, num_slots)
        self.config = SimpleNamespace(
            scheduler=SimpleNamespace(
                max_num_seqs=num_slots,
                max_num_batched_tokens=2048,
                prefill_chunk=512,
                admission="partial",
                reserve_tokens=256,
            ),
            queue=SimpleNamespace(queue_timeout=30.0),
        )
        self.loaded = SimpleNamespace(name="synthetic")
        self.max_model_len = 1 << 20
        self.scheduler = SimpleNamespace(running=[], preempted=[])
        self.num_steps = 0
        self.num_preemptions = 0
        self._next_id = 0
        self._next_hash = 0

    @property
    def sequences(self) -> list[SyntheticSeq]:
        return self.scheduler.running

    def admit(self, num_prompt_tokens: int, max_tokens: int = 256) -> SyntheticSeq | None:
        """A new sequence in the first free slot with its prompt computed; None when no slot or
        not enough blocks are free."""
        taken = {seq.slot for seq in self.sequences}
        free_slots = [s for s in range(self.config.scheduler.max_num_seqs) if s not in taken]
        num_blocks = self.pool.blocks_for(num_prompt_tokens)
        if not free_slots or num_blocks > self.pool.num_free:
            return None
        seq_id = f"req-{self._next_id:06d}"
        self._next_id += 1
        self.pool.allocate(seq_id, num_blocks)
        self.kv.reserved[seq_id] = num_blocks
        seq = SyntheticSeq(seq_id, free_slots[0], num_prompt_tokens, num_prompt_tokens, max_tokens)
        self.sequences.append(seq)
        return seq

    def decode(self, num_tokens: int) -> None:
        """Every sequence samples `num_tokens` tokens, taking a block when it needs one."""
        for seq in self.sequences:
            for _ in range(num_tokens):
                seq.num_computed += 1
                seq.num_output += 1
                pool, seq_id = self.pool, seq.seq_id
                entries = pool.num_holes(seq_id) + pool.num_held(seq_id)
                if pool.blocks_for(seq.num_computed) > entries and not pool.allocate(seq_id, 1):
                    break
        self.num_steps += num_tokens

    def finish(self, seq: SyntheticSeq) -> None:
        """The sequence ends: its full blocks are published (they stay cached-free), then it
        gives everything back."""
        table = self.pool.table(seq.seq_id)
        for block_id in table[: seq.num_computed // self.pool.block_size]:
            self._next_hash += 1
            self.pool.publish(block_id, self._next_hash.to_bytes(8, "little"))
        self.pool.release(seq.seq_id)
        self.kv.reserved.pop(seq.seq_id, None)
        self.sequences.remove(seq)


@dataclass(slots=True)
class EventsBench:
    """Sizes (bytes) and CPU times (seconds) of the snapshot and of each update."""

    num_blocks: int
    num_slots: int
    snapshot_bytes: int
    snapshot_seconds: float
    update_bytes: list[int] = field(default_factory=list)
    update_seconds: list[float] = field(default_factory=list)
    num_used: list[int] = field(default_factory=list)
    num_cached_free: list[int] = field(default_factory=list)


async def _measure(num_blocks: int, num_slots: int, num_updates: int, block_size: int) -> Any:
    engine = SyntheticEngine(num_blocks, num_slots, block_size)
    prompt_tokens = int(0.9 * num_blocks / num_slots) * block_size - 64
    for _ in range(num_slots):
        engine.admit(prompt_tokens)
    # A large minimum interval: no update goes out unless asked for (`flush`).
    events = EngineEvents(max_rate=1e-3, heartbeat=1e6)
    events.bind(engine)  # type: ignore[arg-type]
    started = time.thread_time()
    viewer = events.connect()
    snapshot_seconds = time.thread_time() - started
    (snapshot,) = await viewer.next_batch() or [""]
    result = EventsBench(num_blocks, num_slots, len(snapshot), snapshot_seconds)
    for index in range(num_updates):
        engine.decode(3)
        # One sequence ends and one arrives per interval, the oldest first.
        engine.finish(engine.sequences[0])
        engine.admit(max(block_size, prompt_tokens - block_size * (index % 8)))
        started = time.thread_time()
        events.flush()
        result.update_seconds.append(time.thread_time() - started)
        (text,) = await viewer.next_batch() or [""]
        result.update_bytes.append(len(text))
        result.num_used.append(engine.pool.num_used)
        result.num_cached_free.append(engine.pool.num_cached_free)
        json.loads(text)  # a whole event
    events.close_all()
    return result


def run_events_bench(
    num_blocks: int = 100_000, num_slots: int = 64, num_updates: int = 200, block_size: int = 16
) -> EventsBench:
    """Build and serialize `num_updates` updates over a synthetic engine (see the module)."""
    return asyncio.run(_measure(num_blocks, num_slots, num_updates, block_size))


def format_events_bench(result: EventsBench) -> str:
    """One Markdown table: the snapshot, then the updates (the later half: a mixed free list)."""
    later = slice(len(result.update_bytes) // 2, None)
    sizes = result.update_bytes[later]
    times = result.update_seconds[later]

    def ms(seconds: float) -> str:
        return f"{1000 * seconds:.2f}"

    rows = [
        f"{result.num_blocks} blocks, {result.num_slots} sequences decoding "
        f"({min(result.num_used)}-{max(result.num_used)} blocks used, "
        f"{min(result.num_cached_free)}-{max(result.num_cached_free)} cached-free); "
        f"updates {len(result.update_bytes) // 2 + 1}-{len(result.update_bytes)}:",
        "",
        "| event | bytes (mean) | bytes (max) | CPU ms (median) | CPU ms (max) |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| snapshot | {result.snapshot_bytes} | {result.snapshot_bytes} | "
        f"{ms(result.snapshot_seconds)} | {ms(result.snapshot_seconds)} |",
        f"| update | {statistics.fmean(sizes):.0f} | {max(sizes)} | "
        f"{ms(statistics.median(times))} | {ms(max(times))} |",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--updates", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    print(
        format_events_bench(
            run_events_bench(args.blocks, args.slots, args.updates, args.block_size)
        )
    )


if __name__ == "__main__":
    main()
