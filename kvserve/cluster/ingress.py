"""The ingress: one HTTP endpoint in front of N kvserve replicas, each serving its own port.

Every route is proxied to a replica, byte for byte: the status, the headers and the body, and a
stream event by event (each chunk read from the replica is sent on as its own body message, so
nothing is buffered in between). The ingress adds `X-KVServe-Replica`. It answers four routes
itself:

    GET /health     the ingress is up
    GET /ready      200 once a replica is ready (503 until then)
    GET /metrics    every replica's `kvserve:*` samples with a `replica` label, and the ingress's
    GET /cluster/replicas   the replicas, their addresses and their load, as JSON

Replicas announce themselves (`register`, about twice a second, with their running and waiting
counts); one that has not been heard from for `stale_after` seconds, or that refuses a
connection, is not routed to. Where a request goes is `PrefixRouter`'s choice; a replica that
answers 429 before streaming is retried on the next one, each replica once, and the client sees
the 429 (with Retry-After) only when every replica refused. A client that leaves closes the
replica's connection, so the replica cancels the request (its 499). A replica that fails
mid-stream ends the stream with the dialect's error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvserve.cluster.prompt import GENERATING_PATHS, PromptHasher
from kvserve.cluster.router import PrefixRouter
from kvserve.server.protocol import APIError
from kvserve.server.sse import DONE, ClientGone, DisconnectWatcher, EventStreamResponse, event

__all__ = ["REPLICA_HEADER", "Ingress", "ReplicaInfo", "merge_metrics"]

log = logging.getLogger("kvserve.cluster")

REPLICA_HEADER = "X-KVServe-Replica"

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the proxy sets itself.
_NOT_FORWARDED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "upgrade",
        "te",
        "trailer",
        "host",
        "content-length",
    }
)


@dataclass
class ReplicaInfo:
    """What a replica says about itself when it registers."""

    replica_id: str
    url: str
    actor_name: str = ""
    model: str = ""
    running: int = 0
    waiting: int = 0
    ready: bool = False
    seen_at: float = field(default_factory=time.monotonic)

    def as_json(self, load: int) -> dict[str, Any]:
        return {
            "replica": self.replica_id,
            "url": self.url,
            "actor_name": self.actor_name,
            "model": self.model,
            "ready": self.ready,
            "running": self.running,
            "waiting": self.waiting,
            "load": load,
        }


# ------------------------------------------------------------------------------------------
# /metrics of several replicas as one exposition

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?( .*)$")


def merge_metrics(texts: dict[str, str], label: str = "replica") -> str:
    """Prometheus text expositions, one per replica, as one: each sample gains
    `label="<replica>"`, and each family's HELP and TYPE appear once, its samples together."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for replica_id, text in texts.items():
        current: tuple[list[str], list[str]] | None = None
        quoted = json.dumps(replica_id)  # a Prometheus label value escapes like a JSON string
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                name = line.split(" ", 3)[2]
                current = families.setdefault(name, ([], []))
                if line not in current[0]:
                    current[0].append(line)
                continue
            match = _SAMPLE.match(line)
            if match is None:
                continue
            if current is None:
                current = families.setdefault(match.group(1), ([], []))
            labels = match.group(2)
            joined = f"{label}={quoted}" + (f",{labels}" if labels else "")
            current[1].append(f"{match.group(1)}{{{joined}}}{match.group(3)}")
    lines: list[str] = []
    for header, samples in families.values():
        lines += header + samples
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------
# Errors in the shape of the route's dialect


def _error_body(path: str, error: APIError) -> dict[str, Any]:
    if path.startswith("/v1/messages"):
        kind = {429: "rate_limit_error", 503: "overloaded_error"}.get(error.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": error.message}}
    return error.body()


def _error_response(path: str, error: APIError, replica_id: str | None = None) -> Response:
    headers = dict(error.headers)
    if replica_id is not None:
        headers[REPLICA_HEADER] = replica_id
    return Response(
        json.dumps(_error_body(path, error)),
        error.status,
        headers=headers,
        media_type="application/json",
    )


def _error_event(path: str, error: APIError) -> bytes:
    """The event a stream ends with when its replica fails: what kvserve sends on a mid-stream
    error in each dialect."""
    if path.startswith("/v1/messages"):
        return f"event: error\ndata: {json.dumps(_error_body(path, error))}\n\n".encode()
    if path == "/v1/responses":
        data = {"type": "error", "code": error.code, "message": error.message, "param": None}
        return f"event: error\ndata: {json.dumps(data)}\n\n".encode()
    return event(json.dumps(error.body())).encode() + DONE


# ------------------------------------------------------------------------------------------
# The app


class Ingress:
    """The ingress app (`self.app`, Starlette) and the replica table it routes over.

    `register` must be called on the app's event loop (the Ray deployment hands it over)."""

    def __init__(
        self,
        hasher: PromptHasher | None,
        *,
        router: PrefixRouter | None = None,
        stale_after: float = 10.0,
        connect_timeout: float = 5.0,
        max_body_bytes: int = 8 * 1024 * 1024,
    ) -> None:
        self.hasher = hasher
        self.max_body_bytes = max_body_bytes
        self.router = router or PrefixRouter()
        self.stale_after = stale_after
        self.replicas: dict[str, ReplicaInfo] = {}
        self._timeout = httpx.Timeout(None, connect=connect_timeout)
        self._client: httpx.AsyncClient | None = None
        self.registry = CollectorRegistry()
        self.routed = Counter(
            "kvserve:cluster_routed_requests",
            "Requests the ingress sent to a replica, by replica and why it was chosen "
            "(prefix: it holds the prompt's first blocks; load: a holder was too busy; "
            "balance: no holder; retry: the choice before it answered 429).",
            ["replica", "reason"],
            registry=self.registry,
        )
        self.refused = Counter(
            "kvserve:cluster_overloaded_requests",
            "Requests answered 429 because every replica refused them.",
            registry=self.registry,
        )
        self.replica_failures = Counter(
            "kvserve:cluster_replica_failures",
            "Requests whose replica could not be reached or failed before answering in full.",
            ["replica"],
            registry=self.registry,
        )
        Gauge(
            "kvserve:cluster_replicas", "Replicas routed to.", registry=self.registry
        ).set_function(lambda: len(self.living()))
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/ready", self.ready, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/cluster/replicas", self.describe, methods=["GET"]),
                Route(
                    "/{path:path}",
                    self.proxy,
                    methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"],
                ),
            ],
            lifespan=self._lifespan,
        )

    # -- the replica table -------------------------------------------------------------------

    def register(self, info: ReplicaInfo) -> None:
        """A replica's announcement: its address, readiness and load, now."""
        info.seen_at = time.monotonic()
        if info.replica_id not in self.replicas:
            log.info("replica %s at %s", info.replica_id, info.url)
        self.replicas[info.replica_id] = info
        self.router.report(info.replica_id, info.running, info.waiting)

    def living(self) -> list[ReplicaInfo]:
        """Ready replicas heard from lately."""
        now = time.monotonic()
        for replica_id in [
            r.replica_id for r in self.replicas.values() if now - r.seen_at > self.stale_after
        ]:
            self.drop(replica_id, "silent")
        return [r for r in self.replicas.values() if r.ready]

    def drop(self, replica_id: str, why: str) -> None:
        """Route nothing more to a replica until it registers again."""
        if self.replicas.pop(replica_id, None) is not None:
            log.warning("replica %s dropped: %s", replica_id, why)
        self.router.forget(replica_id)

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=self._timeout,
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            )
        return self._client

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if self._client is not None:
                await self._client.aclose()

    # -- own routes --------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return Response('{"status":"ok"}', media_type="application/json")

    async def ready(self, request: Request) -> Response:
        living = self.living()
        if not living:
            body = {"status": "loading", "replicas": 0}
            return Response(json.dumps(body), 503, media_type="application/json")
        body = {"status": "ready", "model": living[0].model, "replicas": len(living)}
        return Response(json.dumps(body), media_type="application/json")

    async def describe(self, request: Request) -> Response:
        self.living()
        loads = self.router.loads()
        body = {
            "replicas": [
                info.as_json(loads.get(info.replica_id, 0)) for info in self.replicas.values()
            ],
            "remembered_blocks": self.router.num_remembered,
        }
        return Response(json.dumps(body), media_type="application/json")

    async def metrics(self, request: Request) -> Response:
        replicas = self.living()

        async def scrape(info: ReplicaInfo) -> str:
            try:
                response = await self.client.get(info.url + "/metrics", timeout=10.0)
                return response.text if response.status_code == 200 else ""
            except httpx.HTTPError:
                return ""

        texts = await asyncio.gather(*(scrape(info) for info in replicas))
        merged = merge_metrics(
            {info.replica_id: text for info, text in zip(replicas, texts, strict=True)}
        )
        own = generate_latest(self.registry).decode()
        return Response(merged + own, media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- the proxy ---------------------------------------------------------------------------

    async def proxy(self, request: Request) -> Response:
        path = request.url.path
        # Read at most the limit (the replicas refuse more anyway): a body is held in memory.
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                error = APIError(
                    413,
                    f"the request body is larger than the limit of {self.max_body_bytes} bytes",
                    code="request_too_large",
                    headers={"Connection": "close"},  # the rest is not read
                )
                return _error_response(path, error)
            chunks.append(chunk)
        body = b"".join(chunks)
        hashes: list[bytes] = []
        if request.method == "POST" and path in GENERATING_PATHS and self.hasher is not None:
            hashes = await asyncio.to_thread(self.hasher.hashes, path, body)
        living = self.living()
        if not living:
            return _error_response(path, APIError(503, "no replica is ready yet"))
        by_id = {info.replica_id: info for info in living}
        decision = self.router.choose(hashes, list(by_id))
        headers = [
            (name, value)
            for name, value in request.headers.raw
            if name.decode("latin-1").lower() not in _NOT_FORWARDED
        ]
        target = path + (f"?{request.url.query}" if request.url.query else "")
        watcher = DisconnectWatcher(request.receive)
        refused: tuple[httpx.Response, bytes, str] | None = None
        try:
            for attempt, replica_id in enumerate(decision.order):
                outgoing = self.client.build_request(
                    request.method, by_id[replica_id].url + target, headers=headers, content=body
                )
                # In flight from here until its answer ends, however it ends.
                self.router.started(replica_id)
                relayed = False
                try:
                    upstream = await watcher.race(self.client.send(outgoing, stream=True))
                    if upstream.status_code == 429:
                        refused = (upstream, await watcher.race(upstream.aread()), replica_id)
                        await upstream.aclose()
                        continue
                    reason = decision.reason if attempt == 0 else "retry"
                    self.routed.labels(replica_id, reason).inc()
                    if upstream.status_code < 400:
                        self.router.sent(replica_id, hashes)
                    relayed = True
                    return await self._relay(upstream, replica_id, path, watcher)
                except httpx.ConnectError:
                    # Never reached the replica: safe to send elsewhere.
                    self.replica_failures.labels(replica_id).inc()
                    self.drop(replica_id, "refused a connection")
                    continue
                except httpx.TransportError as exc:
                    self.replica_failures.labels(replica_id).inc()
                    self.drop(replica_id, f"failed before answering: {exc!r}")
                    error = APIError(502, "the replica failed before answering")
                    return _error_response(path, error, replica_id)
                finally:
                    if not relayed:
                        self.router.ended(replica_id)
        except ClientGone:
            watcher.stop()
            return Response(status_code=499)
        watcher.stop()
        if refused is not None:
            upstream, content, replica_id = refused
            self.refused.inc()
            return Response(content, 429, headers=self._answer_headers(upstream, replica_id))
        return _error_response(path, APIError(503, "no replica could be reached"))

    def _answer_headers(self, upstream: httpx.Response, replica_id: str) -> dict[str, str]:
        headers = {
            name: value
            for name, value in upstream.headers.items()
            # The ingress's own server writes date and server.
            if name.lower() not in _NOT_FORWARDED and name.lower() not in ("date", "server")
        }
        headers[REPLICA_HEADER] = replica_id
        return headers

    async def _relay(
        self, upstream: httpx.Response, replica_id: str, path: str, watcher: DisconnectWatcher
    ) -> Response:
        """The replica's answer as the client's; the request stops being in flight at the
        replica (`router.ended`) once it is relayed in full, failed, or the client left."""
        headers = self._answer_headers(upstream, replica_id)
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):

            async def end() -> None:
                # Also when the client left before the first chunk: the generator's own
                # cleanup never ran then, and the replica must see the connection close.
                await upstream.aclose()
                self.router.ended(replica_id)

            return _RelayedStream(
                self._events(upstream, replica_id, path), watcher, headers=headers, on_end=end
            )
        try:
            content = await watcher.race(upstream.aread())
        except httpx.TransportError:
            self.replica_failures.labels(replica_id).inc()
            self.drop(replica_id, "failed while answering")
            error = APIError(502, "the replica failed while answering")
            return _error_response(path, error, replica_id)
        finally:
            watcher.stop()
            await upstream.aclose()
            self.router.ended(replica_id)
        return Response(content, upstream.status_code, headers=headers)

    async def _events(
        self, upstream: httpx.Response, replica_id: str, path: str
    ) -> AsyncIterator[bytes]:
        """The replica's stream, chunk by chunk; its failure becomes the dialect's error event.
        Closing this (the client left) closes the replica's connection: it cancels there."""
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.TransportError:
            self.replica_failures.labels(replica_id).inc()
            self.drop(replica_id, "failed mid-stream")
            yield _error_event(path, APIError(502, "the replica serving this stream failed"))
        finally:
            await upstream.aclose()


class _RelayedStream(EventStreamResponse):
    """An event stream that calls `on_end` once it is over, whether it was sent, failed, or its
    client left before it began."""

    def __init__(self, *args: Any, on_end: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_end = on_end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_end()
