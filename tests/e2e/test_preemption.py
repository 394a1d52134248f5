"""Partial reservation through the server: 64 concurrent chat streams without max_tokens on a
pool that holds 4 full contexts. Reserving whole answers would run 4 of them at once; reserving
the prompt and the first answer positions runs them nearly all, preempting by recompute as the
answers grow, and every stream still ends with 200 and its finish reason; the pool is whole
afterwards."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from kvserve.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    QueueConfig,
    SchedulerConfig,
)
from tests.e2e.conftest import scrape

pytestmark = pytest.mark.slow

NUM_STREAMS = 64
MAX_MODEL_LEN = 1024
BLOCK_SIZE = 16
CONTEXTS = 4
TOPICS = ("the sea", "mountains", "a city at night", "rivers", "the moon", "forests", "rain")


def chat(index: int) -> dict:
    topic = TOPICS[index % len(TOPICS)]
    return {
        "messages": [{"role": "user", "content": f"Describe {topic} in five sentences. ({index})"}],
        "stream": True,
        "temperature": 0,
    }


async def stream_one(client: httpx.AsyncClient, index: int) -> dict:
    text, finish = "", None
    async with client.stream("POST", "/v1/chat/completions", json=chat(index)) as response:
        status = response.status_code
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            for choice in event.get("choices", []):
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
    return {"status": status, "text": text, "finish": finish}


def test_sixty_four_chats_without_max_tokens_all_run_and_finish(server_factory, until) -> None:
    config = EngineConfig(
        device=DeviceConfig(device="cpu"),
        cache=CacheConfig(
            block_size=BLOCK_SIZE, num_kv_blocks=CONTEXTS * MAX_MODEL_LEN // BLOCK_SIZE
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=NUM_STREAMS,
            max_model_len=MAX_MODEL_LEN,
            admission="partial",
            reserve_tokens=16,
        ),
        queue=QueueConfig(queue_timeout=600.0),
    )
    server = server_factory(config)
    engine = server.state.engine
    peak = {"running": 0}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            samples = scrape(server)
            peak["running"] = max(peak["running"], int(samples["kvserve:num_requests_running"]))
            done.wait(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:

        async def all_of_them() -> list[dict]:
            limits = httpx.Limits(max_connections=NUM_STREAMS)
            async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as client:
                return await asyncio.gather(
                    *(stream_one(client, index) for index in range(NUM_STREAMS))
                )

        results = asyncio.run(all_of_them())
    finally:
        done.set()
        watcher.join()
    assert [result["status"] for result in results] == [200] * NUM_STREAMS
    assert all(result["finish"] in ("stop", "length") for result in results)
    assert all(result["text"] for result in results)
    until(lambda: server.call(engine.is_idle))
    samples = scrape(server)
    assert peak["running"] >= 48
    assert samples["kvserve:num_preemptions_total"] > 0
    ended = sum(
        samples.get(f'kvserve:request_success_total{{finished_reason="{reason}"}}', 0)
        for reason in ("stop", "length")
    )
    assert ended == NUM_STREAMS
    # The pool is whole: every block free or cached-free, every reference accounted for.
    assert server.call(engine.pool.check_whole) and server.call(engine.kv.check_whole)
    assert int(samples["kvserve:num_free_kv_blocks"]) == engine.pool.num_blocks
    server.stop()
