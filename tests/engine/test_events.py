"""The engine event stream without a model (kvserve/engine/events.py): a viewer that connects
after requests ended gets their history, and the history is bounded."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from kvserve.bench.events_bench import SyntheticEngine
from kvserve.engine.events import EngineEvents, History

NUM_BLOCKS = 2048
NUM_SLOTS = 8


def full_engine() -> SyntheticEngine:
    engine = SyntheticEngine(NUM_BLOCKS, NUM_SLOTS)
    for _ in range(NUM_SLOTS):
        engine.admit(int(0.9 * NUM_BLOCKS / NUM_SLOTS) * 16 - 64)
    return engine


def state(arrival: float, last: float | None) -> SimpleNamespace:
    return SimpleNamespace(last_token_at=last, request=SimpleNamespace(arrival_time=arrival))


def test_a_viewer_that_connects_after_requests_ended_gets_their_history() -> None:
    async def main() -> None:
        engine = full_engine()
        events = EngineEvents()
        events.bind(engine)  # type: ignore[arg-type]
        start = time.monotonic() - 30.0  # the engine's clock
        # Nobody watches: three requests, first tokens after 120, 250 and 400 ms, then 9
        # more tokens each, 50 ms apart, in the seconds that follow.
        for k, wait in enumerate((0.12, 0.25, 0.4)):
            arrival = start + 3 * k
            first = arrival + wait
            events.on_token(state(arrival, None), first)
            for n in range(1, 10):
                events.on_token(state(arrival, first + 0.05 * (n - 1)), first + 0.05 * n)
        viewer = events.connect()
        snapshot = json.loads((await viewer.next_batch())[0])
        history = snapshot["history"]
        assert [ms for _, ms in history["ttft_ms"]] == [120, 250, 400]
        assert all(start <= when <= snapshot["time"] for when, _ in history["ttft_ms"])
        assert sum(n for _, n in history["tokens"]) == 30
        # One point per second from the first with tokens to the last whole one: zeros between.
        seconds = [t for t, _ in history["tokens"]]
        assert seconds == list(range(int(start + 0.12) + 1, int(snapshot["time"]) + 1))
        assert history["itl_ms"]
        assert all(mean == pytest.approx(50, abs=0.01) for _, mean, _ in history["itl_ms"])
        events.close_all()

    asyncio.run(main())


def test_the_history_is_bounded() -> None:
    history = History(seconds=120, max_ttft=100)
    for k in range(100_000):
        now = k * 0.01  # 1,000 s of tokens, one first token each 10 ms
        history.add_tokens(now, 2, None if k % 3 else 0.01)
        history.add_first_token(now, 5)
    assert len(history._buckets) == 120 and len(history._ttft) == 100
    drawn = history.to_json(1000.0)
    assert len(drawn["tokens"]) == 120 and {n for _, n in drawn["tokens"]} == {200}
    assert len(drawn["ttft_ms"]) == 100
