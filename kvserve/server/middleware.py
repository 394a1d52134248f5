"""The ASGI layer in front of the routes: auth, body limit, request ids, access log.

A request's id is generated here, unique in the process: the engine, its log and the dashboard
know the request by it, and the bodies' ids are made of it. A client's own `X-Request-Id` of at
most 128 visible characters of `[A-Za-z0-9._:/+=@-]` names the request in the access log and
is echoed back; any other (too long, spaces, control characters, non-ASCII) is ignored and the
generated id is sent instead.

Pure ASGI (it must not buffer streamed responses). Its errors are written in the dialect of the
path they answer (`ServerState.error_body`).
"""

from __future__ import annotations

import hmac
import logging
import re
import string
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from kvserve.server.core import Exchange, ServerState
from kvserve.server.protocol import APIError, dumps
from kvserve.server.sse import ClientGone

__all__ = ["OPEN_PATHS", "Gatekeeper"]

log = logging.getLogger("kvserve.server")
access_log = logging.getLogger("kvserve.access")

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/openapi.json", "/docs"})
"""Probes, scrapes and the API's description stay open when --api-key is set."""

OPEN_PAGES = frozenset({"/dashboard"})
"""Pages that hold no data (a browser cannot send a key to load them); what they fetch is
protected."""

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})

_CLIENT_ID = re.compile(rb"[A-Za-z0-9._:/+=@-]{1,128}")
"""An X-Request-Id a client may give its request: safe in a log line and a header."""


def client_request_id(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The client's X-Request-Id (its first), when acceptable; else None."""
    for name, value in headers:
        if name == b"x-request-id":
            return value.decode("ascii") if _CLIENT_ID.fullmatch(value) else None
    return None


def _header_safe(name: str) -> str:
    """A client's field name as header text: anything but visible ASCII (control characters,
    which would make the header illegal, and non-ASCII) is percent-encoded, as are `%` and the
    `,` that separates names."""
    return urllib.parse.quote(name, safe=_HEADER_SAFE)


_HEADER_SAFE = "".join(c for c in string.punctuation if c not in ",%")


class Gatekeeper:
    """Checks the API key and the body size before any route runs, tags responses with the
    request id, catches what the routes did not, and writes the access-log line and HTTP
    counters for every request. `endpoints` are the paths counted under their own label."""

    def __init__(
        self,
        app: Callable[..., Awaitable[None]],
        state: ServerState,
        endpoints: frozenset[str],
    ) -> None:
        self.app = app
        self.state = state
        self.endpoints = endpoints
        key = state.config.api_key
        self._expected = f"Bearer {key}".encode() if key else None
        self._expected_key = key.encode() if key else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = Exchange(
            request_id=uuid.uuid4().hex,
            method=scope["method"],
            path=scope["path"],
            started=time.monotonic(),
            client_id=client_request_id(scope.get("headers", ())),
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
                    (b"x-request-id", exchange.log_id.encode()),
                ]
                if exchange.ignored_fields:
                    ignored = ",".join(map(_header_safe, exchange.ignored_fields)).encode()
                    headers.append((b"x-kvserve-ignored-fields", ignored))
                message = {**message, "headers": headers}
            await send(message)

        try:
            error = self._authorize(scope)
            if error is None:
                receive, error = await self._read_body(scope, receive)
            if error is not None:
                await self._send_error(send_tagged, exchange.path, error)
            else:
                await self.app(scope, receive, send_tagged)
        except ClientGone:
            exchange.status = 499
        except Exception:
            log.exception("%s: unhandled error", exchange.log_id)
            exchange.status = 500
            if not started:
                await self._send_error(
                    send_tagged, exchange.path, APIError(500, "internal server error")
                )
        finally:
            self._finish(exchange)

    def _authorize(self, scope: Mapping[str, Any]) -> APIError | None:
        if self._expected is None or scope["path"] in OPEN_PATHS or scope["path"] in OPEN_PAGES:
            return None
        bearer = api_key = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                bearer = value
            elif name == b"x-api-key":  # as Anthropic clients send it
                api_key = value
        assert self._expected_key is not None
        if hmac.compare_digest(bearer, self._expected) or hmac.compare_digest(
            api_key, self._expected_key
        ):
            return None
        return APIError(
            401,
            "a valid API key is required: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
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
        model_name = exchange.model_name or self.state.model_name or ""
        self.state.finished(exchange)
        status = exchange.status if exchange.status is not None else 499
        exchange.status = status
        endpoint = exchange.path if exchange.path in self.endpoints else "other"
        if endpoint == "other" and exchange.path.startswith("/v1/models/"):
            endpoint = "/v1/models/{model_id}"  # one label for every id
        # A client dropped for reading too slowly is counted once, as slow_consumer.
        self.state.metrics.observe_http(
            endpoint,
            status,
            client_gone=exchange.finish_reason != "slow_consumer",
            shutting_down=exchange.shutting_down and status == 503,
            model_name=model_name,
        )
        duration = time.monotonic() - exchange.started
        level = logging.WARNING if status >= 500 and not exchange.shutting_down else logging.INFO
        access_log.log(level, "%s", exchange.log_line(duration))

    async def _send_error(self, send: Any, path: str, error: APIError) -> None:
        headers = [(b"content-type", b"application/json")]
        headers += [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in error.headers.items()
        ]
        body = dumps(self.state.error_body(path, error)).encode()
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
