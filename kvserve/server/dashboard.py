"""The live view of the engine: `GET /v1/engine/events` (Server-Sent Events) and `GET /dashboard`.

The event stream is one served model's `kvserve.engine.events.EngineEvents` (`?model=NAME`,
default the first) served over SSE: a snapshot on connect,
then at most ten coalesced updates a second. It is protected by `--api-key` like every `/v1/*`
route. A viewer that stops reading is dropped by the engine side (its buffer is bounded) and its
connection is then cut here.

The dashboard is one self-contained page (no CDN; its only requests are `/v1/models`, for the
model picker, and the event stream) drawn with the components the simulator's page uses
(kvserve/view). It reads the engine and changes nothing in it; pausing it only stops drawing in the browser. The page itself holds no data, so
it is open like /health; it sends the API key it is given to the event stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import cache
from importlib import resources

from fastapi import FastAPI, Request
from starlette.responses import HTMLResponse, Response

from kvserve.engine.events import EngineEvents, Viewer
from kvserve.server.core import ServerState, exchange_of
from kvserve.server.sse import DisconnectWatcher, EventStreamResponse, event
from kvserve.view import inline_components

__all__ = ["EVENTS_PATH", "PAGE_PATH", "PATHS", "register"]

EVENTS_PATH = "/v1/engine/events"
PAGE_PATH = "/dashboard"
PATHS = (EVENTS_PATH, PAGE_PATH)


@cache
def dashboard_html() -> str:
    """The dashboard page with the shared components inlined."""
    template = resources.files("kvserve.server").joinpath("dashboard.html").read_text("utf-8")
    return inline_components(template)


def register(app: FastAPI, state: ServerState) -> None:
    """Add the event stream and the page to `app`."""

    # Out of the API's description: a stream that never ends is nothing to fuzz, and the page
    # is not an API. Their HTTP counters are labelled "other".
    @app.get(EVENTS_PATH, include_in_schema=False)
    async def engine_events(request: Request, model: str | None = None) -> Response:
        # `?model=NAME` picks a served model (default: the first). Watching does not load a
        # model nor keep it loaded; when it unloads, its viewers' streams end.
        served = state.model_for(model)
        engine = state.loaded_engine(served)
        events = served.events
        events.bind(engine)
        exchange = exchange_of(request)
        viewer = events.connect()
        watcher = DisconnectWatcher(request.receive)
        # A viewer dropped while its writer waits on a full socket is cut at once.
        viewer.on_drop = watcher.gone.set

        def gone() -> None:
            exchange.status = 499
            if viewer.dropped:
                exchange.finish_reason = "slow_consumer"

        return EventStreamResponse(_frames(events, viewer), watcher, on_client_gone=gone)

    @app.get(PAGE_PATH, include_in_schema=False)
    async def dashboard() -> Response:
        return HTMLResponse(dashboard_html())


async def _frames(events: EngineEvents, viewer: Viewer) -> AsyncIterator[bytes]:
    """The viewer's events as SSE frames, every buffered one in one write."""
    try:
        while True:
            batch = await viewer.next_batch()
            if batch is None:
                return
            yield "".join(event(text) for text in batch).encode()
    finally:
        events.disconnect(viewer)
