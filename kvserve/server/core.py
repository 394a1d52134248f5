"""The generation core: one request lifecycle for every dialect of the HTTP API.

A dialect turns its request into prompt ids, SamplingParams and a `Rendering` (its renderers,
`kvserve.server.render`); the core does the rest, the same way for all of them. A request's
status code is decided before its first byte goes out: the engine refuses it at `submit` (400
impossible, 429 queue full) or while it waits for a slot (429 wait expired), and only once
`stream.admitted()` returns does a 200 (and, when streaming, the first event) go out. A client that leaves (while queued, while generating,
while streaming) has its engine request cancelled and is logged and counted as 499, never as a
server error. Errors after a stream began go out as the dialect's error event.

Every engine call happens on the event loop thread, as the engine requires; tokenizing runs in
worker threads so a long prompt does not hold up other requests' streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import Response

from kvserve.config import ServerConfig
from kvserve.engine.engine import Engine, EngineObserver
from kvserve.engine.stream import Delta, Stream
from kvserve.params import SamplingParams
from kvserve.request import EngineError, GenerationRequest, RequestCancelled
from kvserve.server.metrics import ServerMetrics
from kvserve.server.models import KEEP, ModelRegistry, ServedModel
from kvserve.server.protocol import APIError, ModelT, dumps, parse_request, refused_fields
from kvserve.server.render import Rendering, Timing
from kvserve.server.sse import ClientGone, DisconnectWatcher, EventStreamResponse

__all__ = [
    "GOOD_ENDINGS",
    "EngineFactory",
    "ErrorShape",
    "Exchange",
    "ServerState",
    "in_thread",
    "json_response",
]

log = logging.getLogger("kvserve.server")

T = TypeVar("T")

GOOD_ENDINGS = frozenset({"stop", "length"})
"""Finish reasons that end an answer normally; any other is an error for the client."""

EngineFactory = Callable[[EngineObserver], Engine]
"""Builds the engine (loading the model) given the app's metrics observer; runs in a thread."""

ErrorShape = Callable[[APIError], dict[str, Any]]
"""A dialect's error body for an APIError."""

FieldPolicy = Callable[[Mapping[str, Any]], tuple[list[str], APIError | None]]
"""Sorts a request's extra fields: (ignored names, the error for the first refused one)."""


@dataclass(slots=True)
class Exchange:
    """What one HTTP request did: the facts of its access-log line and HTTP counters."""

    request_id: str  # unique in this process: the engine's id, and the bodies' ids
    method: str
    path: str
    started: float
    client_id: str | None = None  # the client's X-Request-Id, when it sent an acceptable one
    status: int | None = None  # as sent, or 499 once the client is known to be gone
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_token_at: float | None = None
    finish_reason: str | None = None
    ignored_fields: tuple[str, ...] = ()
    tracked: bool = False  # counted among the requests a drain waits for
    shutting_down: bool = False  # refused with 503 because the server drains
    model: ServedModel | None = None  # the model it holds until its response ends
    engine: Engine | None = None  # that model's engine
    keep_alive: float | None = KEEP  # the keep-alive it asked for (Ollama's), else KEEP

    @property
    def model_name(self) -> str:
        """The name of the model that answers it, as the bodies report it."""
        return (self.model.name if self.model is not None else None) or ""

    @property
    def log_id(self) -> str:
        """The id the client knows the request by: its X-Request-Id, else the generated one;
        the access log's and the response header's."""
        return self.client_id or self.request_id

    def saw_tokens(self, delta: Delta) -> None:
        if delta.token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()

    def log_line(self, duration: float) -> str:
        ttft = "-" if self.first_token_at is None else f"{self.first_token_at - self.started:.3f}s"
        line = (
            f"{self.log_id} {self.method} {self.path} {self.status} "
            f"prompt_tokens={_or_dash(self.prompt_tokens)} "
            f"completion_tokens={_or_dash(self.completion_tokens)} ttft={ttft} "
            f"duration={duration:.3f}s finish={_or_dash(self.finish_reason)}"
        )
        if self.client_id is not None:
            # The id the engine (its log, the dashboard) and the response bodies use.
            line += f" internal_id={self.request_id}"
        return line


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def json_response(
    body: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    """A JSON response (compact, UTF-8)."""
    return Response(dumps(body), status, headers=headers, media_type="application/json")


async def in_thread(function: Callable[[], T]) -> T:
    """Run blocking work (tokenizing, templates) off the event loop."""
    return await asyncio.to_thread(function)


class ServerState:
    """Everything the routes share: config, metrics, the served models (`ModelRegistry`),
    and the one generation lifecycle."""

    def __init__(
        self,
        config: ServerConfig,
        models: ModelRegistry | EngineFactory,
        *,
        on_ready: Callable[[Engine], None] | None = None,
        on_load_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.config = config
        self.metrics = ServerMetrics()
        if not isinstance(models, ModelRegistry):
            # One model, loaded at start and kept: named as configured, else by its engine.
            lone = ServedModel(config.served_model_name, models, keep_alive=None, preload=True)
            models = ModelRegistry([lone])
        self.models = models
        models.observe(self.metrics.for_model, self._loaded)
        for served in models.models:
            self.metrics.for_model(served).export()
        self.load_error: BaseException | None = None
        self.created = int(time.time())
        self.error_shapes: dict[str, ErrorShape] = {}  # by path
        self.error_prefixes: dict[str, ErrorShape] = {}  # by path prefix, where none is exact
        self._on_ready = on_ready
        self._on_load_error = on_load_error
        self.draining = False
        self.num_in_flight = 0  # API requests accepted whose response has not ended
        # Requests waiting for a slot, by request id: each entry refuses its request if it is
        # still waiting (True when it did).
        self._queued: dict[str, Callable[[], bool]] = {}

    @property
    def engine(self) -> Engine | None:
        """The default (first) model's engine, when it is loaded."""
        return self.models.default.engine

    @property
    def model_name(self) -> str | None:
        """The default (first) model's name."""
        return self.models.default.name

    @property
    def ready(self) -> bool:
        """Every model loaded at start runs, and the server takes requests (not draining)."""
        if self.draining or self.load_error is not None:
            return False
        return all(m.loaded and m.engine.running for m in self.models.models if m.preload)

    def _loaded(self, model: ServedModel, engine: Engine) -> None:
        if self._on_ready is not None:
            self._on_ready(engine)

    async def load(self) -> None:
        """Load the models marked for start-up (each in a daemon thread: a load takes
        seconds, and a server stopped meanwhile must not wait for it)."""
        try:
            await self.models.preload()
        except Exception as exc:
            failed = next((m.load_error for m in self.models.models if m.load_error), None)
            if failed is None and self.models.stopping:
                # The server stopped while the engine was built: the load ends with it, which
                # is no failure (the process exits as a stop does).
                log.info("the model's load ended with the server's stop")
                return
            error = failed or exc
            log.error("the model could not be loaded: %s", error)
            self.load_error = error
            if self._on_load_error is not None:
                self._on_load_error(error)

    @property
    def loading(self) -> bool:
        """Whether a model is being loaded right now (in its thread)."""
        return self.models.loading

    async def stop(self) -> None:
        """End every request (finish reason "shutdown") and stop every engine. Idempotent."""
        await self.models.stop()

    # -- draining ------------------------------------------------------------------------------

    def begin_drain(self) -> int:
        """Take no new generation or embedding requests (503), and refuse at once those still
        waiting for a slot; running ones go on. Returns how many waiting ones were refused."""
        self.draining = True
        self.metrics.draining.set(1)
        return sum(1 for refuse in list(self._queued.values()) if refuse())

    def shutting_down(self, exchange: Exchange) -> APIError:
        """The 503 of a request that arrives, or still waits for a slot, while draining."""
        exchange.shutting_down = True
        return APIError(
            503,
            "the server is shutting down and takes no new requests; retry on another server",
            code="shutting_down",
            # Retry at once: a load balancer sends it elsewhere once /ready says 503.
            headers={"Retry-After": "1"},
        )

    def refuse_if_draining(self, exchange: Exchange) -> None:
        if self.draining:
            raise self.shutting_down(exchange)

    @contextlib.contextmanager
    def queued(self, request_id: str, refuse: Callable[[], bool]) -> Iterator[None]:
        """While the request waits for a slot, a drain may refuse it with `refuse()`."""
        self._queued[request_id] = refuse
        try:
            yield
        finally:
            self._queued.pop(request_id, None)

    def finished(self, exchange: Exchange) -> None:
        """The response of `exchange` has ended (called by the middleware for every request):
        its model may start its keep-alive."""
        if exchange.tracked:
            exchange.tracked = False
            self.num_in_flight -= 1
        model, exchange.model = exchange.model, None
        if model is not None:
            self.models.release(model, exchange.keep_alive)

    def require_engine(self) -> Engine:
        """The default model's engine; 503 while it is not loaded."""
        return self.loaded_engine(self.models.default)

    def loaded_engine(self, model: ServedModel) -> Engine:
        if model.engine is None:
            if model.load_error is not None:
                raise APIError(503, f"the model failed to load: {model.load_error}")
            if model.status == "loading":
                raise APIError(
                    503, "the model is still loading; GET /ready answers 200 once loaded"
                )
            raise APIError(
                503, f"the model '{model.name}' is not loaded; a request for it loads it"
            )
        return model.engine

    def model_for(self, name: str | None) -> ServedModel:
        """The served model called `name` (the default for None); 404 for another."""
        return self.models.resolve(name)

    async def use_model(self, exchange: Exchange, name: str | None) -> Engine:
        """Hold the model the request names until its response ends, loading it first when
        it is not loaded (within the wait budget)."""
        model = self.model_for(name)
        if model.engine is None and self.draining:
            raise self.shutting_down(exchange)
        engine = await self.models.acquire(model)
        exchange.model = model
        exchange.engine = engine
        if name and name not in (model.name, f"{model.name}:latest"):
            raise self.models.not_found(name)  # a lone model, loaded under another name
        return engine

    def accept_extras(
        self, body: BaseModel, exchange: Exchange, policy: FieldPolicy = refused_fields
    ) -> None:
        """Refuse extras that would change the answer; report and count the rest."""
        extras = body.model_extra or {}
        if not extras:
            return
        ignored, error = policy(extras)
        if error is not None:
            raise error
        exchange.ignored_fields = tuple(ignored)
        self.metrics.observe_ignored_fields(ignored)

    async def accept(
        self,
        request: Request,
        model: type[ModelT],
        policy: FieldPolicy = refused_fields,
        *,
        generates: bool = True,
    ) -> tuple[Exchange, Engine, ModelT]:
        """The common start of every API handler: a valid body, its harmless unknown fields
        recorded, and the engine of the model it names (loaded first when it is not). A route
        that `generates` refuses (400) a model that only embeds."""
        exchange = exchange_of(request)
        if not exchange.tracked:  # until its response ends, a drain waits for it
            exchange.tracked = True
            self.num_in_flight += 1
        body = parse_request(model, await request.body())
        self.accept_extras(body, exchange, policy)
        # Ollama's older bodies name the model "name".
        name = getattr(body, "model", None) or getattr(body, "name", None)
        engine = await self.use_model(exchange, name)
        if generates and not engine.generates:
            raise APIError(
                400,
                f"'{exchange.model_name}' is an embedding model and generates no text; "
                "send it to /v1/embeddings or /api/embed",
                param="model",
                code="embedding_model",
            )
        return exchange, engine, body

    def error_body(self, path: str, error: APIError) -> dict[str, Any]:
        """The error body in the dialect that serves `path` (OpenAI's elsewhere)."""
        shape = self.error_shapes.get(path)
        if shape is None:
            shape = next(
                (s for prefix, s in self.error_prefixes.items() if path.startswith(prefix)), None
            )
        return shape(error) if shape is not None else error.body()

    # -- generation ----------------------------------------------------------------------------

    async def generate(
        self,
        request: Request,
        exchange: Exchange,
        prompt_ids: list[int],
        params: SamplingParams,
        rendering: Rendering,
        *,
        stream: bool,
        param_names: Mapping[str, str] = {},
        cache_salt: str | None = None,
    ) -> Response:
        """Submit, wait for a slot while watching the client, then answer or stream.

        `param_names` renames the engine's parameters ("prompt", "max_tokens") to the fields
        this request used, for the errors that name them. `cache_salt` isolates the request's
        tenant in the prefix cache."""
        engine = exchange.engine
        self.refuse_if_draining(exchange)
        request_id = exchange.request_id
        exchange.prompt_tokens = len(prompt_ids)
        try:
            submitted = engine.submit(
                GenerationRequest(
                    tuple(prompt_ids),
                    params,
                    request_id=request_id,
                    arrival_time=exchange.started,
                    cache_salt=cache_salt,
                )
            )
        except EngineError as exc:
            raise APIError.from_engine(exc, param_names=param_names) from None
        watcher = DisconnectWatcher(request.receive)
        handed_over = False

        def refuse() -> bool:
            # Still queued (or compiling its grammar): ends now, and answers 503 below.
            state = engine.get(request_id)
            return (
                state is not None
                and not state.is_admitted
                and engine.cancel(request_id, "shutdown")
            )

        try:
            try:
                with self.queued(request_id, refuse):
                    await watcher.race(submitted.admitted())
            except ClientGone:
                return _client_gone(exchange)
            except RequestCancelled:
                if self.draining:  # only a drain cancels a request that waits
                    raise self.shutting_down(exchange) from None
                return _client_gone(exchange)
            except EngineError as exc:
                raise APIError.from_engine(exc, param_names=param_names) from None
            admitted_at = time.monotonic()
            if stream:
                handed_over = True

                def gone() -> None:
                    exchange.status = 499

                return EventStreamResponse(
                    self._frames(engine, submitted, rendering, exchange, admitted_at),
                    watcher,
                    on_client_gone=gone,
                    media_type=rendering.media_type,
                )
            try:
                final = await watcher.race(_collect(submitted, rendering, exchange))
            except ClientGone:
                return _client_gone(exchange)
            if final.finish_reason not in GOOD_ENDINGS:
                raise _ended_early(final, param_names)
            return json_response(rendering.response(final, _timing(exchange, admitted_at, final)))
        finally:
            if not handed_over:
                watcher.stop()
                engine.cancel(request_id)  # a no-op once it ended; frees it if it did not

    async def _frames(
        self,
        engine: Engine,
        stream: Stream,
        rendering: Rendering,
        exchange: Exchange,
        admitted_at: float,
    ) -> AsyncIterator[bytes]:
        """The streamed frames of one request: deltas already waiting go out in one write,
        each still its own event."""
        try:
            head = rendering.head()
            if head:
                yield head.encode()
            while True:
                deltas = [await anext(stream), *stream.drain_ready()]
                parts: list[str] = []
                final: Delta | None = None
                for delta in deltas:
                    exchange.saw_tokens(delta)
                    if delta.finished:
                        final = delta
                        break
                    parts.append(rendering.frames(delta))
                if final is not None:
                    _record_end(exchange, final)
                    if final.finish_reason in GOOD_ENDINGS:
                        timing = _timing(exchange, admitted_at, final)
                        parts.append(rendering.tail(final, timing))
                    else:
                        parts.append(rendering.error_tail(_stream_error(final)))
                    yield "".join(parts).encode()
                    return
                text = "".join(parts)
                if text:
                    yield text.encode()
        except Exception:
            # The 200 is out: the only way left to tell the client is an error event.
            log.exception("%s: streaming failed", exchange.log_id)
            yield rendering.error_tail(APIError(500, "internal error while streaming")).encode()
        finally:
            if exchange.finish_reason is None:
                # A writer stuck on a client that stopped reading never saw the end the
                # engine delivered (slow_consumer); record it for the log.
                for delta in stream.drain_ready():
                    if delta.finished:
                        _record_end(exchange, delta)
            engine.cancel(exchange.request_id)


def exchange_of(request: Request) -> Exchange:
    """The Exchange the middleware opened for this request."""
    return request.scope["state"]["exchange"]


async def _collect(stream: Stream, rendering: Rendering, exchange: Exchange) -> Delta:
    async for delta in stream:
        exchange.saw_tokens(delta)
        rendering.add(delta)
        if delta.finished:
            _record_end(exchange, delta)
            return delta
    raise RuntimeError("the stream ended without a final delta")


def _timing(exchange: Exchange, admitted_at: float, final: Delta) -> Timing:
    return Timing(exchange.started, admitted_at, exchange.first_token_at, final.timestamp)


def _record_end(exchange: Exchange, final: Delta) -> None:
    exchange.finish_reason = final.finish_reason
    if final.usage is not None:
        exchange.completion_tokens = final.usage.completion_tokens


def _client_gone(exchange: Exchange) -> Response:
    # Nobody reads this; it only marks the exchange for the log and the counters.
    exchange.status = 499
    return Response(status_code=499)


def _ended_early(final: Delta, param_names: Mapping[str, str]) -> APIError:
    if final.error is not None:
        return APIError.from_engine(final.error, param_names=param_names)
    return APIError(
        500, f"the request ended early ({final.finish_reason})", code=final.finish_reason
    )


def _stream_error(final: Delta) -> APIError:
    if final.finish_reason == "slow_consumer":
        return APIError(
            429,
            "the client read the stream too slowly and was dropped",
            code="slow_consumer",
        )
    if final.error is not None:
        return APIError.from_engine(final.error)
    return APIError(
        500, f"the request ended early ({final.finish_reason})", code=final.finish_reason
    )
