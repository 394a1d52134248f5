"""The HTTP app (FastAPI on uvicorn) over the Engine's public API: the dialects' routes, the
middleware, and the probes.

    POST /v1/chat/completions   POST /v1/completions   POST /v1/responses   GET /v1/models
    POST /v1/messages   POST /v1/messages/count_tokens
    POST /api/chat   POST /api/generate   GET /api/tags   POST /api/show   GET /api/ps
    GET /api/version   POST /api/pull   GET / (Ollama's)
    POST /v1/embeddings   POST /api/embed   POST /api/embeddings
    GET /v1/models/{id}
    POST /tokenize   POST /detokenize   GET /health   GET /ready   GET /metrics
    GET /v1/engine/events   GET /dashboard

The request lifecycle every generating route shares is `kvserve.server.core`; each dialect
(`kvserve.server.dialects`) adds its routes; `kvserve.server.middleware` guards them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from kvserve import __version__
from kvserve.config import ServerConfig
from kvserve.engine.engine import Engine
from kvserve.server import dashboard, schemas
from kvserve.server.core import EngineFactory, Exchange, ServerState, json_response
from kvserve.server.dialects import (
    anthropic_messages,
    embeddings,
    ollama,
    openai_chat,
    openai_completions,
    openai_responses,
    tokenize,
)
from kvserve.server.middleware import OPEN_PATHS, Gatekeeper
from kvserve.server.models import ModelRegistry, ServedModel
from kvserve.server.protocol import APIError, validation_error_from_list

log = logging.getLogger("kvserve.server")

__all__ = [
    "ENDPOINTS",
    "EngineFactory",
    "Exchange",
    "Server",
    "ServerState",
    "create_app",
]

_DIALECTS = (
    openai_chat,
    openai_completions,
    openai_responses,
    anthropic_messages,
    ollama,
    embeddings,
    tokenize,
)

MODEL_PATH = "/v1/models/{model_id}"
"""One model's card; counted under this label whatever the id."""

ENDPOINTS = frozenset(
    {
        "/v1/models",
        MODEL_PATH,
        *OPEN_PATHS,
        *(path for dialect in _DIALECTS for path in dialect.PATHS),
    }
)
"""Every route; other paths are counted under the endpoint label "other"."""


def create_app(
    server_config: ServerConfig,
    models: EngineFactory | ModelRegistry,
    *,
    on_ready: Callable[[Engine], None] | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """The FastAPI app over one model (`models` an EngineFactory: the model loaded at start
    and kept) or several (a ModelRegistry). Each load runs `factory(observer)` in a background
    thread while /health already answers; /ready says 503 until the models marked for start-up
    are loaded. `on_ready(engine)` is called after each load. The app's state is
    `app.state.kvserve` (a ServerState)."""
    state = ServerState(server_config, models, on_ready=on_ready, on_load_error=on_load_error)
    events = state.models.default.events

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(state.load(), name="kvserve-load")
        try:
            yield
        finally:
            if not loader.done():
                loader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loader
            await state.stop()

    app = FastAPI(
        title="kvserve",
        description="LLM serving in OpenAI's, Anthropic's and Ollama's APIs (and vLLM's "
        "/tokenize and /detokenize).",
        version=__version__,
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.state.kvserve = state
    app.state.engine_events = events
    state.metrics.embedding_endpoints = frozenset(embeddings.PATHS)

    def error_response(request: Request, error: APIError) -> Response:
        body = state.error_body(request.url.path, error)
        return json_response(body, error.status, error.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        # OpenAI clients expect 400 with the field named, never FastAPI's 422.
        return error_response(request, validation_error_from_list(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(request, APIError(exc.status_code, str(exc.detail)))

    app.add_middleware(Gatekeeper, state=state, endpoints=ENDPOINTS)
    if server_config.allowed_origins:
        # Outside the Gatekeeper: a preflight is answered here (no key needed, not logged nor
        # counted), and the Gatekeeper's own answers (401, 413, 503) carry the CORS headers.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(server_config.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS", "HEAD"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id", "Retry-After", "X-KVServe-Ignored-Fields"],
        )

    errors = schemas.error_responses

    @app.get("/health", responses={200: schemas.json_response(schemas.Status), **errors(503)})
    async def health() -> Response:
        # Liveness: the process answers; an engine that died while loaded is not alive.
        for model in state.models.models:
            if model.loaded and not model.engine.running:
                return json_response({"status": "engine stopped", "model": model.name}, 503)
        return json_response({"status": "ok"})

    @app.get("/ready", responses={200: schemas.json_response(schemas.Status), **errors(503)})
    async def ready() -> Response:
        if state.draining:
            return json_response({"status": "draining"}, 503)
        if state.ready:
            body: dict = {"status": "ready", "model": state.model_name}
            if len(state.models.models) > 1:
                body["models"] = {m.name: m.status for m in state.models.models}
            engine = state.engine
            return json_response(body | (engine.loaded.kernels_status() if engine else {}))
        if state.load_error is not None:
            return json_response({"status": "failed", "error": str(state.load_error)}, 503)
        return json_response({"status": "loading"}, 503)

    @app.get("/metrics", responses={200: schemas.text_response("text/plain", "Prometheus metrics")})
    async def metrics() -> Response:
        content, content_type = state.metrics.render()
        return Response(content, media_type=content_type)

    @app.get(
        "/v1/models",
        responses={200: schemas.json_response(schemas.ModelList), **errors(401, 503)},
    )
    async def models() -> Response:
        served = state.models.models
        if served[0].name is None:  # a lone model, named once it has loaded
            state.require_engine()
        return json_response({"object": "list", "data": [model_card(m) for m in served]})

    @app.get(
        MODEL_PATH.replace("}", ":path}"),
        responses={200: schemas.json_response(schemas.ModelCard), **errors(401, 404, 503)},
    )
    async def model(model_id: str) -> Response:
        served = state.models.find(model_id)
        if served is None or served.name is None:
            if served is not None:
                state.require_engine()
            raise state.models.not_found(model_id)
        return json_response(model_card(served))

    def model_card(served: ServedModel) -> dict:
        """OpenAI's model object, with whether it is loaded and until when."""
        engine = served.engine
        card = {
            "id": served.name,
            "object": "model",
            "created": state.created,
            "owned_by": "kvserve",
            "root": engine.loaded.name if engine is not None else served.name,
        }
        if engine is not None:
            card["max_model_len"] = engine.max_model_len
        return card | served.card()

    for dialect in _DIALECTS:
        dialect.register(app, state)
    dashboard.register(app, state)

    schemas.describe(app, {key: body for d in _DIALECTS for key, body in d.BODIES.items()})
    return app


# --------------------------------------------------------------------------------------------
# Running it


class Server(uvicorn.Server):
    """uvicorn's server, adjusted for serving generation.

    SIGTERM or SIGINT drains: new generation and embedding requests get 503 (and /ready does),
    those waiting for a slot get it at once, and running ones have `shutdown_timeout` seconds
    (ServerConfig's, unless given) to finish while the server still listens. Then the engine is
    stopped: what still runs ends at once (a stream gets an error event and its terminator).
    A second signal ends the drain at once; a third, during the wait for connections, stops
    without waiting. Other stops (`should_exit` set directly) skip the drain. `run`/`serve`
    return normally after a signal (uvicorn would re-raise it). uvicorn's access log is off:
    the app writes its own line per request, 499s included.
    """

    def __init__(
        self,
        app: FastAPI,
        *,
        host: str,
        port: int,
        log_level: str = "info",
        shutdown_grace: float = 5.0,
        shutdown_timeout: float | None = None,
    ) -> None:
        super().__init__(
            uvicorn.Config(
                app,
                host=host,
                port=port,
                http="h11",
                ws="none",
                lifespan="on",
                access_log=False,
                log_config=None,
                log_level=log_level,
                # Once the engine has stopped, only clients that do not read are left
                # holding connections open; they get this long, then are cut.
                timeout_graceful_shutdown=shutdown_grace,
            )
        )
        self.state: ServerState = app.state.kvserve
        self.shutdown_timeout = (
            self.state.config.shutdown_timeout if shutdown_timeout is None else shutdown_timeout
        )
        self._drain_asked = False  # a signal asked for a drain
        self._drain_over = False  # the drain ended (or was skipped): the engine stops next
        self._hurry = False  # a second signal: stop draining

    def handle_exit(self, sig: int, frame: object) -> None:
        # Runs in the signal handler (or another thread, in tests): only flags are set; the
        # serving loop polls them.
        if not self.should_exit:
            self._drain_asked = True
            self.should_exit = True
        elif self._drain_asked and not self._drain_over:
            self._hurry = True
        else:
            self.force_exit = True

    async def main_loop(self) -> None:
        await super().main_loop()
        try:
            if self._drain_asked and not self._hurry:
                await self._drain()
        finally:
            self._drain_over = True

    async def _drain(self) -> None:
        """Refuse new work, then wait for what runs, up to `shutdown_timeout` seconds."""
        state = self.state
        refused = state.begin_drain()
        loop = asyncio.get_running_loop()
        started = loop.time()
        timeout = self.shutdown_timeout
        running = state.num_in_flight - refused
        log.info(
            "draining: %d running, up to %g s%s; new requests get 503, a second signal stops "
            "at once",
            running,
            timeout,
            f" ({refused} waiting for a slot refused with 503)" if refused else "",
        )
        while state.num_in_flight > 0 and not self._hurry and loop.time() - started < timeout:
            await asyncio.sleep(0.05)
        left = state.num_in_flight
        if left == 0:
            log.info("drained in %.1f s", loop.time() - started)
        elif self._hurry:
            log.info("second signal: stopping now; %d still running end with an error", left)
        else:
            log.warning(
                "shutdown timeout (%g s): stopping now; %d still running end with an error",
                timeout,
                left,
            )

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.state.stop()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {
            sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @property
    def bound_port(self) -> int | None:
        """The port actually listened on (useful with port 0), once started."""
        for server in getattr(self, "servers", ()):
            for sock in server.sockets:
                return sock.getsockname()[1]
        return None
