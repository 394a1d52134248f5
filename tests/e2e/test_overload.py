"""Overload: the excess of a burst gets 429 + Retry-After before any body byte, everyone
admitted completes, nothing leaks. A client that stops reading is dropped; others stream on.
Every rule is checked in every dialect (chat, Anthropic messages, Responses)."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from tests.e2e.dialects import DIALECTS, LENGTH_ENDINGS, Dialect

pytestmark = pytest.mark.slow

NUM_SLOTS = 2
QUEUE_PER_SLOT = 2
QUEUE_TIMEOUT = 30.0
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def server(server_factory, engine_config):
    server = server_factory(
        engine_config(
            max_num_seqs=NUM_SLOTS, max_queue_per_slot=QUEUE_PER_SLOT, queue_timeout=QUEUE_TIMEOUT
        )
    )
    yield server
    server.stop()


async def _one(client: httpx.AsyncClient, dialect: Dialect, index: int) -> dict:
    """One request of the burst: even ones stream, odd ones do not."""
    stream = index % 2 == 0
    payload = dialect.request(f"Say a number, {index}.", MAX_TOKENS, stream=stream)
    async with client.stream("POST", dialect.path, json=payload) as response:
        body = await response.aread()
    return {
        "status": response.status_code,
        "headers": response.headers,
        "body": body,
        "stream": stream,
    }


@pytest.mark.parametrize("dialect", DIALECTS, ids=str)
def test_burst_gets_429_for_the_excess_and_completes_the_rest(
    server, dialect, gate_factory, metrics, until
):
    engine = server.state.engine
    capacity = NUM_SLOTS * (1 + QUEUE_PER_SLOT)
    num_requests = 4 * capacity
    before = metrics(server)
    # Steps are held while the burst arrives, so exactly `capacity` requests fit.
    gate = gate_factory(server)

    async def burst() -> list[dict]:
        limits = httpx.Limits(max_connections=num_requests)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            tasks = [asyncio.create_task(_one(client, dialect, i)) for i in range(num_requests)]
            while sum(task.done() for task in tasks) < num_requests - capacity:
                await asyncio.sleep(0.01)
            assert server.call(lambda: (engine.num_running, engine.num_waiting)) == (
                NUM_SLOTS,
                NUM_SLOTS * QUEUE_PER_SLOT,
            )
            gate.open()
            return await asyncio.gather(*tasks)

    results = asyncio.run(burst())
    rejected = [r for r in results if r["status"] == 429]
    served = [r for r in results if r["status"] == 200]
    assert len(rejected) == num_requests - capacity
    assert len(served) == capacity
    for result in rejected:
        # Refused before any SSE byte: a JSON error body even for streaming requests.
        assert result["headers"]["content-type"] == "application/json"
        assert result["headers"]["retry-after"] == str(int(QUEUE_TIMEOUT))
        dialect.rate_limited(result["body"], "queue_full")
    for result in served:
        ending = dialect.ending(result["body"], result["stream"])
        assert ending == (LENGTH_ENDINGS[dialect.name], MAX_TOKENS)
    until(lambda: server.call(engine.is_idle), message="the pool is not whole after the burst")
    after = metrics(server)
    queue_full = 'kvserve:request_rejections_total{reason="queue_full"}'
    assert after[queue_full] - before[queue_full] == num_requests - capacity
    assert not any(name.startswith("kvserve:http_server_errors") for name in after)


@pytest.mark.parametrize("dialect", DIALECTS, ids=str)
def test_wait_expired_is_429_with_the_wait_budget(
    server_factory, engine_config, gate_factory, dialect
):
    server = server_factory(engine_config(max_num_seqs=1, max_queue_per_slot=1, queue_timeout=1))
    engine = server.state.engine
    # Slow steps, not held ones: waits expire at step boundaries.
    gate = gate_factory(server, closed=False, delay=0.05)
    try:

        async def both() -> tuple[httpx.Response, httpx.Response]:
            # A generous timeout: on a shared machine one step can take seconds.
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
                long = {"prompt": "One", "max_tokens": 60, "ignore_eos": True}
                first = asyncio.create_task(client.post("/v1/completions", json=long))
                while server.call(lambda: engine.num_running) == 0:
                    await asyncio.sleep(0.01)
                second = await client.post(
                    dialect.path, json=dialect.request("Two", 2, stream=True, ignore_eos=False)
                )
                return await first, second

        first, second = asyncio.run(both())
        assert first.status_code == 200
        assert first.json()["usage"]["completion_tokens"] == 60
        assert second.status_code == 429
        assert second.headers["content-type"] == "application/json"
        assert second.headers["retry-after"] == "1"
        dialect.rate_limited(second.content, "queue_timeout")
        assert server.call(engine.is_idle)
    finally:
        gate.open()
        server.stop()


@pytest.mark.parametrize("dialect", DIALECTS, ids=str)
def test_slow_consumer_is_dropped_while_others_stream(
    dialect, server_factory, engine_config, raw_client, metrics, until
):
    # The smallest socket buffers on both ends, and a small write buffer in the server for the
    # slow connection, so a client that does not read blocks the server's writes after a few
    # dozen events instead of after megabytes.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    server = server_factory(engine_config(max_num_seqs=2, buffer_steps=4), sock=listener)
    engine = server.state.engine
    slow = raw_client(server.port, receive_buffer=1)
    slow_budget, num_tokens = 400, 150
    try:
        slow.post(dialect.path, dialect.request("Tell a long story.", slow_budget, stream=True))
        status, headers = slow.read_head()
        assert status == 200

        def shrink_write_buffers() -> None:
            # asyncio's default is 64 KiB; only the slow connection is open now.
            for connection in server.server.server_state.connections:
                connection.transport.set_write_buffer_limits(high=1024)

        server.call(shrink_write_buffers)
        slow_id = headers["x-request-id"]
        with httpx.stream(
            "POST",
            server.url + "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Count to two hundred."}],
                "max_tokens": num_tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            timeout=120,
        ) as response:
            fast_id = response.headers["x-request-id"]
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        usage = json.loads(events[-2].removeprefix("data: "))["usage"]
        assert usage["completion_tokens"] == num_tokens
        slow_key = 'kvserve:request_rejections_total{reason="slow_consumer"}'
        until(lambda: metrics(server)[slow_key] == 1, message="the slow client was not dropped")
        samples = metrics(server)
        assert samples['kvserve:request_success_total{finished_reason="slow_consumer"}'] == 1
        # The slow one was dropped while the other kept streaming, long before its budget.
        steps = list(engine.step_log)
        slow_steps = [r.step for r in steps if slow_id in r.request_ids]
        fast_steps = [r.step for r in steps if fast_id in r.request_ids]
        assert len(slow_steps) < slow_budget
        assert max(slow_steps) < max(fast_steps)
        until(lambda: server.call(engine.is_idle))
    finally:
        slow.close()
        server.stop()
