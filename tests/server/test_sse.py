"""EventStreamResponse and DisconnectWatcher against a scripted ASGI channel.

Whether events reach a real client while generation runs is tested against the app as served
(tests/e2e/test_streaming.py); here: each item is its own body message, and a disconnect
closes the producer (running its cleanup) whatever it is waiting on.
"""

from __future__ import annotations

import asyncio

import pytest

from kvserve.server.sse import ClientGone, DisconnectWatcher, EventStreamResponse, event


class Channel:
    """An ASGI receive/send pair; `leave()` makes receive report http.disconnect."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self._gone = asyncio.Event()

    async def receive(self) -> dict:
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    def leave(self) -> None:
        self._gone.set()

    @property
    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


def test_event_frame():
    assert event('{"a":1}') == 'data: {"a":1}\n\n'


def test_each_item_is_sent_as_its_own_body_message():
    async def run() -> Channel:
        channel = Channel()

        async def frames():
            for index in range(3):
                yield f"data: {index}\n\n".encode()

        response = EventStreamResponse(frames(), DisconnectWatcher(channel.receive))
        await response({"type": "http"}, channel.receive, channel.send)
        return channel

    channel = asyncio.run(run())
    start = channel.sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert b"content-length" not in headers
    assert channel.bodies == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert [m.get("more_body") for m in channel.sent[1:]] == [True, True, True, False]


def test_disconnect_closes_the_producer_while_it_waits():
    async def run() -> tuple[Channel, list[str], bool]:
        channel = Channel()
        cleanup: list[str] = []
        never = asyncio.Event()

        async def frames():
            try:
                yield b"data: first\n\n"
                await never.wait()  # a generation that has nothing new yet
                yield b"data: never\n\n"
            finally:
                cleanup.append("cancelled the engine request")

        gone = []
        response = EventStreamResponse(
            frames(), DisconnectWatcher(channel.receive), on_client_gone=lambda: gone.append(1)
        )
        task = asyncio.ensure_future(response({"type": "http"}, channel.receive, channel.send))
        while not channel.bodies:
            await asyncio.sleep(0)
        channel.leave()
        await asyncio.wait_for(task, 5)
        return channel, cleanup, bool(gone)

    channel, cleanup, gone = asyncio.run(run())
    assert channel.bodies == [b"data: first\n\n"]
    assert cleanup == ["cancelled the engine request"]
    assert gone


def test_a_complete_stream_is_not_a_client_gone():
    async def run() -> bool:
        channel = Channel()

        async def frames():
            yield b"data: [DONE]\n\n"

        gone = []
        response = EventStreamResponse(
            frames(), DisconnectWatcher(channel.receive), on_client_gone=lambda: gone.append(1)
        )
        await response({"type": "http"}, channel.receive, channel.send)
        return bool(gone)

    assert not asyncio.run(run())


def test_race_returns_the_result_or_raises_client_gone():
    async def run() -> None:
        channel = Channel()
        watcher = DisconnectWatcher(channel.receive)

        async def quick() -> int:
            return 7

        assert await watcher.race(quick()) == 7
        cancelled = []

        async def slow() -> None:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        task = asyncio.ensure_future(watcher.race(slow()))
        await asyncio.sleep(0.01)
        channel.leave()
        with pytest.raises(ClientGone):
            await asyncio.wait_for(task, 5)
        assert cancelled == [True]
        with pytest.raises(ClientGone):
            await watcher.race(quick())
        watcher.stop()

    asyncio.run(run())
