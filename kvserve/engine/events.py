"""The live engine as a stream of events, for the dashboard: step-boundary snapshots and a
bounded buffer per viewer.

`EngineEvents` is an `EngineObserver`. With no viewer connected every hook but `on_token`
returns at its first line, so the engine pays one attribute read per call; `on_token` adds its
count (and a first token's wait) to a bounded recent history (`History`: per second of the last
two minutes, and the newest first-token times), which a viewer's snapshot carries so that its
charts start with the recent past. With viewers, the hooks record integers (request ids,
counts, reasons; never prompt or answer text) and at most `max_rate` times a second the pending
records are coalesced, together with a snapshot of the slots, the pool and the queue, into one
JSON event that every viewer receives. The pool's block tables go whole in a snapshot and by
their changes in an update (kvserve/engine/pool_events.py), so an update's size follows what
changed, not the pool's size.

Everything here runs on the engine loop's thread, the only thread that mutates the Scheduler,
the BlockPool and the AdmissionQueue, so a snapshot never sees a half-made change: it shows the
state after the last applied step (a step in flight on the device thread has not been applied
yet). Snapshots are taken in `on_step`, right after a step is applied, when one is due; a timer
takes them when steps stop (the engine went idle, or the last changes were admissions) and once
a second while viewers are connected, so a quiet engine still shows its queue's waits.

Each viewer has a buffer of at most `buffer_size` events. The engine never waits for a viewer:
an event that finds the buffer full drops that viewer (the rule the engine applies to a client
that reads its tokens too slowly, applied to its own observers).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvserve.engine.engine import EngineObserver
from kvserve.engine.pool_events import PoolTracker

if TYPE_CHECKING:
    from kvserve.core import ChunkPlan, StepPlan
    from kvserve.engine.embedding import EmbeddingJob
    from kvserve.engine.engine import Engine, RequestState

__all__ = ["EngineEvents", "History", "Viewer", "engine_snapshot"]

log = logging.getLogger("kvserve.engine.events")

MAX_EVENTS_PER_SECOND = 10.0
HEARTBEAT_SECONDS = 1.0
DEFAULT_BUFFER_SIZE = 32
MAX_STEPS_PER_EVENT = 64  # step compositions kept between two events (the newest ones)
HISTORY_SECONDS = 120  # the charts' span (the dashboard draws the last two minutes)
MAX_TTFT_HISTORY = 1024  # first-token times kept for the charts (the newest ones)

# Ends that refuse or drop a request, and the HTTP status the client saw (None: the answer had
# started, so the stream ended with an error event instead of a status).
REFUSALS = {
    "queue_full": 429,
    "queue_timeout": 429,
    "cancelled": 499,
    "slow_consumer": None,
}


class Viewer:
    """One connected viewer: a bounded buffer of serialized events and a wake-up."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.dropped = False
        self.closed = False
        self.on_drop: Callable[[], None] | None = None  # called once if the engine drops it
        self._buffer: deque[str] = deque()
        self._ready = asyncio.Event()

    def offer(self, text: str) -> bool:
        """Append without waiting; False (and nothing appended) when the buffer is full."""
        if len(self._buffer) >= self.capacity:
            return False
        self._buffer.append(text)
        self._ready.set()
        return True

    def close(self) -> None:
        """No more events: `next_batch` returns what is left, then None."""
        self.closed = True
        self._ready.set()

    async def next_batch(self) -> list[str] | None:
        """Every buffered event (waiting for at least one); None once closed and drained."""
        while not self._buffer:
            if self.closed:
                return None
            self._ready.clear()
            await self._ready.wait()
        batch = list(self._buffer)
        self._buffer.clear()
        return batch


def engine_snapshot(engine: Engine, now: float) -> dict[str, Any]:
    """The engine's slots, pool counts and queue as plain integers and ids (no text).

    Call on the engine loop's thread. Preempted sequences, first in line to resume, are listed
    in `preempted`. The pool's block tables are not here: `PoolTracker` sends them whole in a
    snapshot and by their changes in updates (kvserve/engine/pool_events.py).
    """
    embedder = engine.embedder
    embeddings = {
        "waiting": 0 if embedder is None else embedder.num_waiting,
        "running": 0 if embedder is None else embedder.num_running,
    }
    if not engine.generates:
        # An embedding-only engine has no slots, pool or generation queue to show.
        pool_view = {"num_blocks": 0, "block_size": 0, "num_used": 0, "num_free": 0}
        return {
            "step": 0,
            "num_running": 0,
            "num_waiting": 0,
            "num_preempted": 0,
            "num_preemptions": 0,
            "slots": [],
            "preempted": [],
            "pool": pool_view,
            "queue": [],
            "embeddings": embeddings,
        }
    scheduler = engine.scheduler
    pool = engine.pool
    slots: list[dict[str, Any] | None] = [None] * engine.config.scheduler.max_num_seqs
    running = scheduler.running if scheduler is not None else []
    for seq in running:
        slots[seq.slot] = {
            "request_id": seq.seq_id,
            "phase": (
                "recompute" if seq.is_recomputing else "prefill" if seq.is_prefilling else "decode"
            ),
            "num_prompt_tokens": seq.num_prompt_tokens,
            "num_computed": seq.num_computed,
            "num_output": seq.num_output,
            "max_tokens": seq.max_tokens,
            "num_preemptions": seq.num_preemptions,
        }
    preempted = (
        [
            {
                "request_id": seq.seq_id,
                "num_tokens": seq.num_tokens,
                "num_preemptions": seq.num_preemptions,
            }
            for seq in scheduler.preempted
        ]
        if scheduler is not None
        else []
    )
    queue = [
        {
            "request_id": waiter.request_id,
            "num_prompt_tokens": waiter.num_prompt_tokens,
            "waited_ms": round(1000 * (now - waiter.enqueued_at)),
        }
        for waiter in engine.queue.waiters
    ]
    return {
        "step": engine.num_steps,
        "num_running": len(running),
        "num_waiting": len(queue),
        "num_preempted": len(preempted),
        "num_preemptions": engine.num_preemptions,
        "slots": slots,
        "preempted": preempted,
        "pool": {
            "num_blocks": pool.num_blocks,
            "block_size": pool.block_size,
            "num_used": pool.num_used,
            "num_free": pool.num_free,
        },
        "queue": queue,
        "embeddings": embeddings,
    }


def engine_settings(engine: Engine) -> dict[str, Any]:
    """The configuration a viewer needs to draw the engine (sent once, on connect)."""
    config = engine.config
    if not engine.generates:
        return {
            "max_num_seqs": 0,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "prefill_chunk": 0,
            "admission": config.scheduler.admission,
            "num_blocks": 0,
            "block_size": 0,
            "max_model_len": engine.max_model_len,
            "max_waiters": 0,
            "queue_timeout": config.queue.queue_timeout,
            "prefix_caching": False,
            "model": engine.loaded.name,
            "generates": False,
        }
    return {
        "generates": True,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "prefill_chunk": config.scheduler.prefill_chunk,
        "admission": config.scheduler.admission,
        "reserve_tokens": config.scheduler.reserve_tokens,
        "num_blocks": engine.pool.num_blocks,
        "block_size": engine.pool.block_size,
        "max_model_len": engine.max_model_len,
        "max_waiters": engine.queue.max_waiters,
        "queue_timeout": config.queue.queue_timeout,
        "prefix_caching": getattr(engine.pool, "cache", None) is not None,
        "model": engine.loaded.name,
    }


class History:
    """The charts' recent past, kept whether or not anyone watches: output tokens and
    inter-token gaps per whole second (of the engine's monotonic clock), for the last `seconds`,
    and the newest `max_ttft` first-token waits. Bounded: at most `seconds` buckets and
    `max_ttft` waits, whatever the load."""

    def __init__(self, seconds: int = HISTORY_SECONDS, max_ttft: int = MAX_TTFT_HISTORY) -> None:
        if seconds < 1 or max_ttft < 1:
            raise ValueError("seconds and max_ttft must be at least 1")
        self.seconds = seconds
        # [second, tokens, gap sum, gap count, gap max], oldest first, only seconds with tokens
        self._buckets: deque[list[Any]] = deque(maxlen=seconds)
        self._ttft: deque[tuple[float, int]] = deque(maxlen=max_ttft)  # (when, milliseconds)

    def add_tokens(self, now: float, num_tokens: int, gap: float | None) -> None:
        """`num_tokens` output tokens at `now`; `gap`: seconds since the request's previous
        token (None for its first)."""
        second = int(now)
        buckets = self._buckets
        if not buckets or buckets[-1][0] != second:
            buckets.append([second, 0, 0.0, 0, 0.0])
        bucket = buckets[-1]
        bucket[1] += num_tokens
        if gap is not None:
            bucket[2] += gap
            bucket[3] += 1
            if gap > bucket[4]:
                bucket[4] = gap

    def add_first_token(self, now: float, ms: int) -> None:
        """A request's first token at `now`, `ms` milliseconds after it arrived."""
        self._ttft.append((now, ms))

    def to_json(self, now: float) -> dict[str, Any]:
        """The whole seconds before `now` within the span, as the charts' points (times on the
        clock of the events' `time`): `tokens` `[[end of second, tokens]]` for every second
        from the oldest one with tokens (zeros where there were none), `itl_ms` `[[end of
        second, mean, max]]` for the seconds with gaps, `ttft_ms` `[[when, ms]]`."""
        current = int(now)
        oldest = current - self.seconds
        buckets = [b for b in self._buckets if oldest <= b[0] < current]
        tokens: list[list[float]] = []
        if buckets:
            counts = {b[0]: b[1] for b in buckets}
            tokens = [
                [second + 1, counts.get(second, 0)] for second in range(buckets[0][0], current)
            ]
        itl = [
            [b[0] + 1, round(1000 * b[2] / b[3], 2), round(1000 * b[4], 2)] for b in buckets if b[3]
        ]
        ttft = [[round(when, 3), ms] for when, ms in self._ttft if when >= now - self.seconds]
        return {"seconds": self.seconds, "tokens": tokens, "itl_ms": itl, "ttft_ms": ttft}


def _step_chunk(chunk: ChunkPlan, kept: dict[str, int]) -> list[Any]:
    """A chunk of a step as the page draws it: `[request_id, rows, is_prefill]`; a speculative
    chunk adds its guesses (the last rows) and how many of them were kept (None when the
    sequence ended in that step before its verification was applied)."""
    entry: list[Any] = [chunk.request_id, chunk.num_tokens, chunk.is_prefill]
    if chunk.is_speculative:
        entry += [len(chunk.draft_token_ids), kept.get(chunk.request_id)]
    return entry


class EngineEvents(EngineObserver):
    """The engine observer behind `GET /v1/engine/events`: records while viewers are
    connected, coalesces to at most `max_rate` events a second, drops viewers that fall
    `buffer_size` events behind."""

    def __init__(
        self,
        *,
        max_rate: float = MAX_EVENTS_PER_SECOND,
        buffer_size: int = DEFAULT_BUFFER_SIZE,
        heartbeat: float = HEARTBEAT_SECONDS,
    ) -> None:
        if max_rate <= 0 or buffer_size < 1 or heartbeat <= 0:
            raise ValueError("max_rate and heartbeat must be positive, buffer_size at least 1")
        self.min_interval = 1.0 / max_rate
        self.buffer_size = buffer_size
        self.heartbeat = heartbeat
        self.engine: Engine | None = None
        self.num_events = 0
        self.num_dropped = 0
        self._viewers: list[Viewer] = []
        self._last_sent = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._heartbeat: asyncio.TimerHandle | None = None
        self.history = History()
        self._pool = PoolTracker()
        self._reset()

    def _reset(self) -> None:
        self._steps: deque[list[Any]] = deque(maxlen=MAX_STEPS_PER_EVENT)
        self._kept: dict[str, int] = {}  # this step's verified sequences: guesses kept
        self._admitted: list[dict[str, Any]] = []
        self._finished: list[dict[str, Any]] = []
        self._refused: list[dict[str, Any]] = []
        self._preemptions: list[dict[str, Any]] = []
        self._num_tokens = 0
        self._ttft: list[int] = []  # milliseconds, one per first token
        self._itl_sum = 0.0
        self._itl_count = 0
        self._itl_max = 0.0
        self._embedded: list[dict[str, Any]] = []
        self._embedding_batches = 0
        self._embedding_inputs = 0

    def bind(self, engine: Engine) -> None:
        """Snapshot this engine from now on."""
        self.engine = engine

    @property
    def num_viewers(self) -> int:
        return len(self._viewers)

    # -- viewers -------------------------------------------------------------------------------

    def connect(self) -> Viewer:
        """A new viewer, whose buffer already holds the snapshot event. On the loop thread."""
        if self.engine is None:
            raise RuntimeError("no engine is bound yet")
        viewer = Viewer(self.buffer_size)
        now = time.monotonic()
        if not self._viewers:
            self._reset()  # nothing recorded while nobody watched is pending
            self._pool.reset()
            self._schedule_heartbeat()
        state = engine_snapshot(self.engine, now)
        state["pool"].update(self._pool_fields(snapshot=True))
        event = {
            "type": "snapshot",
            "seq": self.num_events,
            "time": now,
            "wall": time.time(),
            "config": engine_settings(self.engine),
            **state,
            "history": self.history.to_json(now),
        }
        viewer.offer(json.dumps(event, separators=(",", ":")))
        self._viewers.append(viewer)
        return viewer

    def disconnect(self, viewer: Viewer) -> None:
        """The viewer left (idempotent)."""
        viewer.close()
        if viewer in self._viewers:
            self._viewers.remove(viewer)
        if not self._viewers:
            self._cancel_timers()
            self._pool.reset()  # keep nothing of the pool for nobody

    def _pool_fields(self, *, snapshot: bool) -> dict[str, Any]:
        """The pool's tables, shared and cached-free blocks: all of them, or the changes."""
        engine = self.engine
        assert engine is not None
        if not engine.generates:
            fields: dict[str, Any] = {"tables": {}, "reserved": {}, "shared": {}, "cached_free": []}
            if not snapshot:
                fields.update(released=[], cached_free_removed=[])
            return fields
        if snapshot:
            return self._pool.snapshot(engine.pool, engine.kv)
        return self._pool.update(engine.pool, engine.kv)

    def close_all(self) -> None:
        """Close every viewer (the server is stopping)."""
        for viewer in list(self._viewers):
            self.disconnect(viewer)

    def _cancel_timers(self) -> None:
        for handle in (self._timer, self._heartbeat):
            if handle is not None:
                handle.cancel()
        self._timer = self._heartbeat = None

    # -- engine hooks (loop thread) ------------------------------------------------------------

    def on_admitted(self, state: RequestState) -> None:
        if not self._viewers:
            return
        queued = (state.admitted_at or state.request.arrival_time) - state.request.arrival_time
        self._admitted.append(
            {
                "request_id": state.request_id,
                "num_prompt_tokens": state.num_prompt_tokens,
                "queued_ms": round(1000 * queued),
            }
        )
        self._soon()

    def on_token(self, state: RequestState, now: float, num_tokens: int = 1) -> None:
        # Recorded with or without viewers: the history a viewer's charts start from.
        last = state.last_token_at
        gap = None if last is None else now - last
        self.history.add_tokens(now, num_tokens, gap)
        if gap is None:
            ttft = round(1000 * (now - state.request.arrival_time))
            self.history.add_first_token(now, ttft)
        if not self._viewers:
            return
        self._num_tokens += num_tokens
        if gap is None:
            self._ttft.append(ttft)
        else:
            self._itl_sum += gap
            self._itl_count += 1
            self._itl_max = max(self._itl_max, gap)

    def on_finished(self, state: RequestState) -> None:
        if not self._viewers:
            return
        reason = state.finish_reason or "unknown"
        self._finished.append(
            {
                "request_id": state.request_id,
                "reason": reason,
                "num_prompt_tokens": state.num_prompt_tokens,
                "num_output_tokens": state.num_output_tokens,
            }
        )
        if reason in REFUSALS and reason != "queue_full":
            self._refused.append(
                {"request_id": state.request_id, "reason": reason, "status": REFUSALS[reason]}
            )
        self._soon()

    def on_rejected(self, reason: str) -> None:
        # Only a full queue refuses before a request is registered; the other reasons end a
        # registered request and are reported with its id by on_finished.
        if not self._viewers or reason != "queue_full":
            return
        self._refused.append({"request_id": None, "reason": reason, "status": 429})
        self._soon()

    def on_preempted(self, state: RequestState, num_sequences: int) -> None:
        if not self._viewers:
            return
        self._preemptions.append({"request_id": state.request_id, "num_sequences": num_sequences})

    def on_embedding_finished(self, job: EmbeddingJob) -> None:
        if not self._viewers:
            return
        end = job.finished_at or time.monotonic()
        self._embedded.append(
            {
                "request_id": job.request_id,
                "outcome": job.outcome,
                "num_inputs": len(job.inputs),
                "num_tokens": job.num_tokens,
                "ms": round(1000 * (end - job.arrival_time)),
            }
        )
        if job.outcome == "queue_timeout":
            self._refused.append(
                {"request_id": job.request_id, "reason": "embedding_queue_timeout", "status": 429}
            )
        self._soon()

    def on_embedding_rejected(self, reason: str) -> None:
        if not self._viewers:
            return
        self._refused.append({"request_id": None, "reason": f"embedding_{reason}", "status": 429})
        self._soon()

    def on_embedding_batch(self, num_inputs: int, num_tokens: int, seconds: float) -> None:
        if not self._viewers:
            return
        self._embedding_batches += 1
        self._embedding_inputs += num_inputs
        self._soon()

    def on_speculated(
        self, state: RequestState, num_drafted: int, num_accepted: int, seq_id: str
    ) -> None:
        if self._viewers:
            self._kept[seq_id] = num_accepted

    def on_step(self, plan: StepPlan, seconds: float) -> None:
        if not self._viewers:
            return
        kept, self._kept = self._kept, {}
        self._steps.append(
            [
                plan.step,
                round(1000 * seconds, 2),
                [_step_chunk(c, kept) for c in plan.chunks],
            ]
        )
        if time.monotonic() - self._last_sent >= self.min_interval:
            self._flush()  # the step boundary: the usual place for a snapshot
        else:
            self._soon()

    # -- coalescing ----------------------------------------------------------------------------

    def _soon(self) -> None:
        """Make sure an event goes out within the rate limit even if no step follows."""
        if self._timer is not None:
            return
        delay = max(0.0, self._last_sent + self.min_interval - time.monotonic())
        self._timer = asyncio.get_running_loop().call_later(delay, self._flush)

    def _schedule_heartbeat(self) -> None:
        loop = asyncio.get_running_loop()
        self._heartbeat = loop.call_later(self.heartbeat, self._beat)

    def _beat(self) -> None:
        self._heartbeat = None
        if not self._viewers:
            return
        if self.engine is not None and not self.engine.running:
            self.close_all()  # the engine stopped: end the streams so the server can stop
            return
        if time.monotonic() - self._last_sent >= self.heartbeat * 0.5:
            self._flush()
        self._schedule_heartbeat()

    def flush(self) -> None:
        """Send an update now (normally the steps and the timers decide when)."""
        self._flush()

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._viewers or self.engine is None:
            return
        now = time.monotonic()
        self.num_events += 1
        state = engine_snapshot(self.engine, now)
        state["pool"].update(self._pool_fields(snapshot=False))
        event = {
            "type": "update",
            "seq": self.num_events,
            "time": now,
            "wall": time.time(),
            "interval": round(now - self._last_sent, 4) if self._last_sent else None,
            **state,
            "steps": list(self._steps),
            "admitted": self._admitted,
            "finished": self._finished,
            "refused": self._refused,
            "preemptions": self._preemptions,
            "embedded": self._embedded,
            "embedding_batches": self._embedding_batches,
            "embedding_inputs": self._embedding_inputs,
            "num_tokens": self._num_tokens,
            "ttft_ms": self._ttft,
            "itl_ms": {
                "count": self._itl_count,
                "mean": round(1000 * self._itl_sum / self._itl_count, 2)
                if self._itl_count
                else None,
                "max": round(1000 * self._itl_max, 2),
            },
        }
        self._last_sent = now
        self._reset()
        text = json.dumps(event, separators=(",", ":"))
        for viewer in list(self._viewers):
            if not viewer.offer(text):
                log.info("an engine viewer fell %d events behind; dropping it", viewer.capacity)
                viewer.dropped = True
                self.num_dropped += 1
                self.disconnect(viewer)
                if viewer.on_drop is not None:
                    viewer.on_drop()
