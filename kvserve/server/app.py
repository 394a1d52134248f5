"""The OpenAI-compatible HTTP app (FastAPI on uvicorn) over the Engine's public API.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models
    POST /tokenize   POST /detokenize   GET /health   GET /ready   GET /metrics

A request's status code is decided before its first byte goes out: the engine refuses it at
`submit` (400 impossible, 429 queue full) or while it waits for a slot (429 wait expired), and
only once `stream.admitted()` returns does a 200 (and, when streaming, the first SSE event) go
out. A client that leaves (while queued, while generating, while streaming) has its engine
request cancelled and is logged and counted as 499, never as a server error. Errors after a
stream began are sent as an error event followed by `[DONE]`.

Every engine call happens on the event loop thread, as the engine requires; tokenizing runs in
worker threads so a long prompt does not hold up other requests' streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from kvserve.config import ServerConfig
from kvserve.engine.engine import Engine, EngineObserver
from kvserve.engine.stream import Delta, Stream
from kvserve.request import EngineError, GenerationRequest, RequestCancelled
from kvserve.sampling import SamplingParams
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatRenderer,
    CompletionRenderer,
    CompletionRequest,
    DetokenizeRequest,
    ModelT,
    TokenizeRequest,
    dumps,
    parse_request,
    refused_fields,
    request_param,
    sampling_params,
    validation_error_from_list,
)
from kvserve.server.sse import DONE, ClientGone, DisconnectWatcher, EventStreamResponse, event
from kvserve.tokenizer import ChatTemplateError

__all__ = [
    "ENDPOINTS",
    "BackgroundServer",
    "EngineFactory",
    "Exchange",
    "Server",
    "ServerState",
    "create_app",
]

log = logging.getLogger("kvserve.server")
access_log = logging.getLogger("kvserve.access")

T = TypeVar("T")

ENDPOINTS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/ready",
        "/metrics",
    }
)
"""Every route; other paths are counted under the endpoint label "other"."""

# Probes and scrapes stay open when --api-key is set.
_OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_GOOD_ENDINGS = frozenset({"stop", "length"})

EngineFactory = Callable[[EngineObserver], Engine]
"""Builds the engine (loading the model) given the app's metrics observer; runs in a thread."""


@dataclass(slots=True)
class Exchange:
    """What one HTTP request did: the facts of its access-log line and HTTP counters."""

    request_id: str
    method: str
    path: str
    started: float
    status: int | None = None  # as sent, or 499 once the client is known to be gone
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_token_at: float | None = None
    finish_reason: str | None = None
    ignored_fields: tuple[str, ...] = ()

    def saw_tokens(self, delta: Delta) -> None:
        if delta.token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()

    def log_line(self, duration: float) -> str:
        ttft = "-" if self.first_token_at is None else f"{self.first_token_at - self.started:.3f}s"
        return (
            f"{self.request_id} {self.method} {self.path} {self.status} "
            f"prompt_tokens={_or_dash(self.prompt_tokens)} "
            f"completion_tokens={_or_dash(self.completion_tokens)} ttft={ttft} "
            f"duration={duration:.3f}s finish={_or_dash(self.finish_reason)}"
        )


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def _json(body: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(dumps(body), status, headers=headers, media_type="application/json")


def _error_response(error: APIError) -> Response:
    return _json(error.body(), error.status, error.headers)


class ServerState:
    """Everything the routes share: config, metrics, and the engine once it is loaded."""

    def __init__(
        self,
        config: ServerConfig,
        engine_factory: EngineFactory,
        *,
        on_ready: Callable[[Engine], None] | None = None,
        on_load_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.config = config
        self.metrics = ServerMetrics()
        self.engine: Engine | None = None
        self.load_error: BaseException | None = None
        self.model_name: str | None = config.served_model_name
        self.created = int(time.time())
        self._engine_factory = engine_factory
        self._on_ready = on_ready
        self._on_load_error = on_load_error

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.running

    async def load(self) -> None:
        """Build the engine in a daemon thread (the model load takes seconds, and a server
        stopped meanwhile must not wait for it), then start it on this loop."""
        loop = asyncio.get_running_loop()
        built: asyncio.Future[Engine] = loop.create_future()

        def settle(result: Engine | None, error: BaseException | None) -> None:
            if built.done():
                return
            if error is not None:
                built.set_exception(error)
            else:
                built.set_result(result)

        def build() -> None:
            try:
                engine, error = self._engine_factory(self.metrics), None
            except BaseException as exc:  # reported on the loop, whatever it was
                engine, error = None, exc
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(settle, engine, error)

        threading.Thread(target=build, name="kvserve-load", daemon=True).start()
        try:
            engine = await built
            await engine.start()
        except Exception as exc:
            log.exception("the model could not be loaded")
            self.load_error = exc
            if self._on_load_error is not None:
                self._on_load_error(exc)
            return
        self.metrics.bind(engine)
        if self.model_name is None:
            self.model_name = engine.loaded.name
        self.engine = engine
        if self._on_ready is not None:
            self._on_ready(engine)

    async def stop(self) -> None:
        """End every request (finish reason "shutdown") and stop the engine. Idempotent."""
        if self.engine is not None:
            await self.engine.stop()

    def require_engine(self) -> Engine:
        if self.engine is None:
            if self.load_error is not None:
                raise APIError(503, f"the model failed to load: {self.load_error}")
            raise APIError(503, "the model is still loading; GET /ready answers 200 once loaded")
        return self.engine

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    def accept_extras(self, body: BaseModel, exchange: Exchange) -> None:
        """Refuse extras that would change the answer; report and count the rest."""
        extras = body.model_extra or {}
        if not extras:
            return
        ignored, error = refused_fields(extras)
        if error is not None:
            raise error
        exchange.ignored_fields = tuple(ignored)
        self.metrics.observe_ignored_fields(ignored)

    # -- generation ----------------------------------------------------------------------------

    async def generate(
        self,
        request: Request,
        exchange: Exchange,
        prompt_ids: list[int],
        body: ChatCompletionRequest | CompletionRequest,
        params: SamplingParams,
        renderer: ChatRenderer | CompletionRenderer,
    ) -> Response:
        """Submit, wait for a slot while watching the client, then answer or stream."""
        engine = self.require_engine()
        request_id = exchange.request_id
        exchange.prompt_tokens = len(prompt_ids)
        try:
            stream = engine.submit(
                GenerationRequest(
                    tuple(prompt_ids),
                    params,
                    request_id=request_id,
                    arrival_time=exchange.started,
                    cache_salt=body.cache_salt,
                )
            )
        except EngineError as exc:
            raise _engine_error(exc, body) from None
        watcher = DisconnectWatcher(request.receive)
        handed_over = False
        try:
            try:
                await watcher.race(stream.admitted())
            except ClientGone:
                return _client_gone(exchange)
            except RequestCancelled:
                return _client_gone(exchange)
            except EngineError as exc:
                raise _engine_error(exc, body) from None
            if body.stream:
                handed_over = True

                def gone() -> None:
                    exchange.status = 499

                return EventStreamResponse(
                    self._frames(engine, stream, renderer, exchange, body.include_usage),
                    watcher,
                    on_client_gone=gone,
                )
            try:
                final = await watcher.race(self._collect(stream, renderer, exchange))
            except ClientGone:
                return _client_gone(exchange)
            if final.finish_reason not in _GOOD_ENDINGS:
                raise _ended_early(final, body)
            return _json(renderer.response(final.finish_reason, final.usage))
        finally:
            if not handed_over:
                watcher.stop()
                engine.cancel(request_id)  # a no-op once it ended; frees it if it did not

    async def _collect(
        self, stream: Stream, renderer: ChatRenderer | CompletionRenderer, exchange: Exchange
    ) -> Delta:
        async for delta in stream:
            exchange.saw_tokens(delta)
            renderer.add(delta.text, delta.logprobs, delta.index, delta.finish_reason)
            if delta.finished:
                _record_end(exchange, delta)
                return delta
        raise RuntimeError("the stream ended without a final delta")

    async def _frames(
        self,
        engine: Engine,
        stream: Stream,
        renderer: ChatRenderer | CompletionRenderer,
        exchange: Exchange,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        """SSE frames for one request: deltas already waiting go out in one write, each still
        its own event."""
        try:
            head = "".join(event(chunk) for chunk in renderer.start_chunks())
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
                    chunk = renderer.delta_chunk(
                        delta.text, delta.logprobs, delta.finish_reason, delta.index
                    )
                    if chunk is not None:
                        parts.append(event(chunk))
                if final is not None:
                    _record_end(exchange, final)
                    if final.finish_reason in _GOOD_ENDINGS:
                        chunk = renderer.delta_chunk(
                            final.text, final.logprobs, final.finish_reason, final.index
                        )
                        parts.append(event(chunk))
                        if include_usage:
                            parts.append(event(renderer.usage_chunk(final.usage)))
                    else:
                        parts.append(event(dumps(_stream_error(final).body())))
                    yield "".join(parts).encode() + DONE
                    return
                if parts:
                    yield "".join(parts).encode()
        except Exception:
            # The 200 is out: the only way left to tell the client is an error event.
            log.exception("%s: streaming failed", exchange.request_id)
            error = APIError(500, "internal error while streaming")
            yield (event(dumps(error.body()))).encode() + DONE
        finally:
            if exchange.finish_reason is None:
                # A writer stuck on a client that stopped reading never saw the end the
                # engine delivered (slow_consumer); record it for the log.
                for delta in stream.drain_ready():
                    if delta.finished:
                        _record_end(exchange, delta)
            engine.cancel(exchange.request_id)


def _record_end(exchange: Exchange, final: Delta) -> None:
    exchange.finish_reason = final.finish_reason
    if final.usage is not None:
        exchange.completion_tokens = final.usage.completion_tokens


def _client_gone(exchange: Exchange) -> Response:
    # Nobody reads this; it only marks the exchange for the log and the counters.
    exchange.status = 499
    return Response(status_code=499)


def _engine_error(error: EngineError, body: ChatCompletionRequest | CompletionRequest) -> APIError:
    names = {
        "prompt": request_param(body, "prompt"),
        "max_tokens": request_param(body, "max_tokens"),
    }
    return APIError.from_engine(error, param_names=names)


def _ended_early(final: Delta, body: ChatCompletionRequest | CompletionRequest) -> APIError:
    if final.error is not None:
        return _engine_error(final.error, body)
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


async def _in_thread(function: Callable[[], T]) -> T:
    return await asyncio.to_thread(function)


# --------------------------------------------------------------------------------------------
# The ASGI layer in front of the routes: auth, body limit, request ids, access log


class _Gatekeeper:
    """Pure ASGI middleware (it must not buffer streamed responses): checks the API key and
    the body size before any route runs, tags responses with the request id, catches what the
    routes did not, and writes the access-log line and HTTP counters for every request."""

    def __init__(self, app: Callable[..., Awaitable[None]], state: ServerState) -> None:
        self.app = app
        self.state = state
        key = state.config.api_key
        self._expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = Exchange(
            request_id=uuid.uuid4().hex,
            method=scope["method"],
            path=scope["path"],
            started=time.monotonic(),
        )
        scope.setdefault("state", {})["exchange"] = exchange
        started = False

        async def send_tagged(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if exchange.status is None:
                    exchange.status = message["status"]
                headers = [
                    *message.get("headers", ()),
                    (b"x-request-id", exchange.request_id.encode()),
                ]
                if exchange.ignored_fields:
                    ignored = ",".join(exchange.ignored_fields).encode("latin-1", "replace")
                    headers.append((b"x-kvserve-ignored-fields", ignored))
                message = {**message, "headers": headers}
            await send(message)

        try:
            error = self._authorize(scope)
            if error is None:
                receive, error = await self._read_body(scope, receive)
            if error is not None:
                await _send_error(send_tagged, error)
            else:
                await self.app(scope, receive, send_tagged)
        except ClientGone:
            exchange.status = 499
        except Exception:
            log.exception("%s: unhandled error", exchange.request_id)
            exchange.status = 500
            if not started:
                await _send_error(send_tagged, APIError(500, "internal server error"))
        finally:
            self._finish(exchange)

    def _authorize(self, scope: Mapping[str, Any]) -> APIError | None:
        if self._expected is None or scope["path"] in _OPEN_PATHS:
            return None
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        if hmac.compare_digest(given, self._expected):
            return None
        return APIError(
            401,
            "a valid API key is required: send 'Authorization: Bearer <key>'",
            error_type="authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )

    async def _read_body(
        self, scope: Mapping[str, Any], receive: Any
    ) -> tuple[Any, APIError | None]:
        """Read the whole body, refusing it (413) past the limit whether it declared its length
        or came chunked; the routes then get it replayed from memory."""
        if scope["method"] not in _BODY_METHODS:
            return receive, None
        limit = self.state.config.max_body_bytes
        too_large = APIError(
            413,
            f"the request body is larger than the limit of {limit} bytes",
            code="request_too_large",
            # The rest of the body is not read, so the connection cannot be reused.
            headers={"Connection": "close"},
        )
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return receive, APIError(400, "the Content-Length header is not a number")
                if declared > limit:
                    return receive, too_large
                break
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return receive, too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Mapping[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay, None

    def _finish(self, exchange: Exchange) -> None:
        status = exchange.status if exchange.status is not None else 499
        exchange.status = status
        endpoint = exchange.path if exchange.path in ENDPOINTS else "other"
        # A client dropped for reading too slowly is counted once, as slow_consumer.
        self.state.metrics.observe_http(
            endpoint, status, client_gone=exchange.finish_reason != "slow_consumer"
        )
        duration = time.monotonic() - exchange.started
        level = logging.WARNING if status >= 500 else logging.INFO
        access_log.log(level, "%s", exchange.log_line(duration))


async def _send_error(send: Any, error: APIError) -> None:
    headers = [(b"content-type", b"application/json")]
    headers += [
        (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in error.headers.items()
    ]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": dumps(error.body()).encode()})


# --------------------------------------------------------------------------------------------
# The app


def create_app(
    server_config: ServerConfig,
    engine_factory: EngineFactory,
    *,
    on_ready: Callable[[Engine], None] | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """The FastAPI app. At start-up `engine_factory(observer)` runs in a background thread
    (load the model there) while /health already answers and /ready says 503; once it returns
    the engine starts on the serving loop and `on_ready(engine)` is called. The app's state is
    `app.state.kvserve` (a ServerState)."""
    state = ServerState(
        server_config, engine_factory, on_ready=on_ready, on_load_error=on_load_error
    )

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
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.kvserve = state

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        # OpenAI clients expect 400 with the field named, never FastAPI's 422.
        return _error_response(validation_error_from_list(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return _error_response(APIError(exc.status_code, str(exc.detail)))

    app.add_middleware(_Gatekeeper, state=state)

    def exchange_of(request: Request) -> Exchange:
        return request.scope["state"]["exchange"]

    async def accept(request: Request, model: type[ModelT]) -> tuple[Exchange, Engine, ModelT]:
        """The common start of every API handler: a loaded engine, a valid body for a served
        model, its harmless unknown fields recorded."""
        exchange = exchange_of(request)
        engine = state.require_engine()
        body = parse_request(model, await request.body())
        state.check_model(body.model)
        state.accept_extras(body, exchange)
        return exchange, engine, body

    @app.get("/health")
    async def health() -> Response:
        # Liveness: the process answers; an engine that died after loading is not alive.
        if state.engine is not None and not state.engine.running:
            return _json({"status": "engine stopped"}, 503)
        return _json({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if state.ready:
            return _json({"status": "ready", "model": state.model_name})
        if state.load_error is not None:
            return _json({"status": "failed", "error": str(state.load_error)}, 503)
        return _json({"status": "loading"}, 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        content, content_type = state.metrics.render()
        return Response(content, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> Response:
        engine = state.require_engine()
        card = {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "kvserve",
            "root": engine.loaded.name,
            "max_model_len": engine.max_model_len,
        }
        return _json({"object": "list", "data": [card]})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        exchange, engine, body = await accept(request, ChatCompletionRequest)
        if not body.messages:
            raise APIError(400, "'messages' must hold at least one message", param="messages")
        template_kwargs = dict(body.chat_template_kwargs or {})
        for reserved in ("messages", "add_generation_prompt"):
            if reserved in template_kwargs:
                raise APIError(
                    400,
                    f"'chat_template_kwargs' may not set '{reserved}'",
                    param="chat_template_kwargs",
                )
        # Validate before tokenizing: a bad parameter costs no template rendering.
        params = sampling_params(body, engine.model_config.vocab_size)
        messages = [message.model_dump(exclude_none=True) for message in body.messages]
        tokenizer = engine.tokenizer
        try:
            prompt_ids = await _in_thread(
                lambda: tokenizer.encode_chat(messages, **template_kwargs)
            )
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages") from None
        renderer = ChatRenderer(
            f"chatcmpl-{exchange.request_id}",
            state.model_name,
            int(time.time()),
            tokenizer.token_bytes,
            logprobs=bool(body.logprobs),
            n=params.n,
        )
        return await state.generate(request, exchange, prompt_ids, body, params, renderer)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        exchange, engine, body = await accept(request, CompletionRequest)
        params = sampling_params(body, engine.model_config.vocab_size)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(
                    400, "'prompt': only one prompt per request is supported", param="prompt"
                )
            prompt = prompt[0]
        tokenizer = engine.tokenizer
        if isinstance(prompt, str):
            text = prompt
            prompt_ids = await _in_thread(lambda: tokenizer.encode(text, add_bos=tokenizer.add_bos))
        else:
            prompt_ids = list(prompt)
        renderer = CompletionRenderer(
            f"cmpl-{exchange.request_id}",
            state.model_name,
            int(time.time()),
            tokenizer.token_bytes,
            logprobs=body.logprobs is not None,
            n=params.n,
        )
        return await state.generate(request, exchange, prompt_ids, body, params, renderer)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        exchange, engine, body = await accept(request, TokenizeRequest)
        tokenizer = engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
        if body.prompt is not None:
            text, add_bos = body.prompt, tokenizer.add_bos and body.add_special_tokens
            token_ids = await _in_thread(lambda: tokenizer.encode(text, add_bos=add_bos))
        else:
            messages = [message.model_dump(exclude_none=True) for message in body.messages or ()]
            generation_prompt = body.add_generation_prompt
            try:
                token_ids = await _in_thread(
                    lambda: tokenizer.encode_chat(messages, add_generation_prompt=generation_prompt)
                )
            except ChatTemplateError as exc:
                raise APIError(400, str(exc), param="messages") from None
        return _json(
            {"tokens": token_ids, "count": len(token_ids), "max_model_len": engine.max_model_len}
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        exchange, engine, body = await accept(request, DetokenizeRequest)
        tokenizer = engine.tokenizer
        vocab = tokenizer.vocab_size
        for index, token_id in enumerate(body.tokens):
            if not 0 <= token_id < vocab:
                raise APIError(
                    400,
                    f"'tokens[{index}]': {token_id} is not a token id of this model",
                    param="tokens",
                )
        return _json({"prompt": tokenizer.decode(body.tokens)})

    return app


# --------------------------------------------------------------------------------------------
# Running it


class Server(uvicorn.Server):
    """uvicorn's server, adjusted for serving generation.

    On shutdown the engine is stopped first, so requests in flight end at once (a stream gets
    an error event and `[DONE]`) instead of holding the shutdown until they finish. SIGINT and
    SIGTERM end the server and `run`/`serve` return normally (uvicorn would re-raise them).
    uvicorn's access log is off: the app writes its own line per request, 499s included.
    """

    def __init__(
        self,
        app: FastAPI,
        *,
        host: str,
        port: int,
        log_level: str = "info",
        shutdown_grace: float = 5.0,
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


class BackgroundServer:
    """An app served on its own event loop in a daemon thread: for tests and notebooks.

        with BackgroundServer(app) as server:
            httpx.get(server.url + "/health")

    `call(fn)` runs `fn` on the serving loop (where engine state may be read) and returns its
    result; `wait_ready()` waits for the model to load.
    """

    def __init__(
        self,
        app: FastAPI,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        sock: socket.socket | None = None,
        log_level: str = "warning",
    ) -> None:
        self.app = app
        self.state: ServerState = app.state.kvserve
        self.server = Server(app, host=host, port=port, log_level=log_level)
        self.host = host
        self._sock = sock
        self._thread: threading.Thread | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None

    @property
    def port(self) -> int:
        port = self.server.bound_port
        if port is None:
            raise RuntimeError("the server is not listening")
        return port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        """Start serving; returns once the socket listens (the model may still be loading)."""

        def main() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            try:
                sockets = [self._sock] if self._sock is not None else None
                self.loop.run_until_complete(self.server.serve(sockets=sockets))
            except BaseException as exc:
                self._error = exc
            finally:
                self.loop.close()

        self._thread = threading.Thread(target=main, name="kvserve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start: {self._error!r}")
            time.sleep(0.01)
        return self

    def wait_ready(self, timeout: float = 120.0) -> Engine:
        """Block until the engine runs; returns it."""
        deadline = time.monotonic() + timeout
        while not self.state.ready:
            if self.state.load_error is not None:
                raise RuntimeError("the model failed to load") from self.state.load_error
            if time.monotonic() > deadline:
                raise TimeoutError("the engine did not become ready")
            time.sleep(0.01)
        assert self.state.engine is not None
        return self.state.engine

    def call(self, function: Callable[[], T], timeout: float = 30.0) -> T:
        """Run `function()` on the serving loop's thread and return its result."""
        if self.loop is None:
            raise RuntimeError("the server is not running")
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(function())
            except BaseException as exc:
                future.set_exception(exc)

        self.loop.call_soon_threadsafe(run)
        return future.result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Shut down (engine first, then connections) and join the thread."""
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self.server.force_exit = True
                self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
