"""Server-Sent Events over ASGI, and the watch on the client's connection.

`EventStreamResponse` hands every batch of events to the server as its own
`http.response.body` message the moment it is produced: ASGI has no write buffer of its own, so
each message is written to the socket as it is sent. Whether that still holds with every
middleware in place is checked by the tests against the app as served, over a real socket.

`DisconnectWatcher` reads the ASGI receive channel until `http.disconnect`, so a handler can
notice a client that left while its request waits for a slot, generates without streaming, or
streams; the response then stops and the engine request is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from starlette.responses import Response

__all__ = ["DONE", "ClientGone", "DisconnectWatcher", "EventStreamResponse", "event"]

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
"""The OpenAI stream terminator."""

Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[Mapping[str, Any]], Awaitable[None]]


def event(data: str) -> str:
    """One SSE frame. `data` is JSON on one line (json.dumps never writes a raw newline)."""
    return f"data: {data}\n\n"


class ClientGone(Exception):
    """The client closed the connection before the answer was complete (logged as 499)."""


class DisconnectWatcher:
    """Reads `receive` until `http.disconnect`; `gone` is set then. Start it once the request
    body has been read (it consumes the channel), stop it when the response is complete."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.gone = asyncio.Event()
        self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.gone.set()
                return

    async def wait(self) -> None:
        """Return once the client is gone."""
        await self.gone.wait()

    async def race(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable` unless the client leaves first: then cancel it, raise ClientGone."""
        if self.gone.is_set():
            if asyncio.iscoroutine(awaitable):
                awaitable.close()
            raise ClientGone
        work = asyncio.ensure_future(awaitable)
        gone = asyncio.ensure_future(self.gone.wait())
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                with contextlib.suppress(BaseException):
                    await work
        if work.cancelled():
            raise ClientGone
        return work.result()

    def stop(self) -> None:
        self._task.cancel()


class EventStreamResponse(Response):
    """An ASGI streamed response fed by an async iterator of ready-made frames: Server-Sent
    Events (`text/event-stream`), or another `media_type` written the same way (NDJSON).

    Each item the iterator yields (one or more whole events) goes out as one body message. If
    the client disconnects, the iterator is closed at once (its `finally` blocks run: that is
    where the engine request is cancelled) and `on_client_gone` is called.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        frames: AsyncIterator[bytes],
        watcher: DisconnectWatcher,
        *,
        headers: Mapping[str, str] | None = None,
        on_client_gone: Callable[[], None] | None = None,
        media_type: str = "text/event-stream",
    ) -> None:
        self.media_type = media_type
        self._frames = frames
        self._watcher = watcher
        self._on_client_gone = on_client_gone
        # Not Response.__init__: it would add "content-length: 0" for the missing body.
        self.status_code = 200
        self.background = None
        self.init_headers(
            {
                "cache-control": "no-cache",
                # Reverse proxies (nginx) buffer responses unless told otherwise.
                "x-accel-buffering": "no",
                **(headers or {}),
            }
        )

    async def __call__(self, scope: Mapping[str, Any], receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            writer = asyncio.ensure_future(self._write(send))
            gone = asyncio.ensure_future(self._watcher.wait())
            try:
                await asyncio.wait((writer, gone), return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not writer.done():
                    writer.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await writer
            completed = not writer.cancelled() and writer.result()
            if not completed and self._on_client_gone is not None:
                self._on_client_gone()
        finally:
            self._watcher.stop()

    async def _write(self, send: Send) -> bool:
        """Send every frame; True once the response is complete, False if the client left."""
        frames = self._frames
        try:
            async for chunk in frames:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if self._watcher.gone.is_set():
                    # The server drops writes to a closed connection without telling us.
                    return False
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return True
        finally:
            aclose = getattr(frames, "aclose", None)
            if aclose is not None:
                await aclose()
