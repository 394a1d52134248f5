"""The ingress: one HTTP endpoint in front of the replicas of one or more models, each replica
serving one model on its own port.

Every route is proxied to a replica, byte for byte: the status, the headers and the body, and a
stream event by event (each chunk read from the replica is sent on as its own body message, so
nothing is buffered in between). The ingress adds `X-KVServe-Replica`. It answers these routes
itself:

    GET /health     the ingress is up
    GET /ready      200 once every model has a ready replica (503 until then)
    GET /metrics    every replica's `kvserve:*` samples with `replica` and `model` labels, and
                    the ingress's
    GET /cluster/replicas   the replicas, their models, addresses and load, as JSON
    GET /v1/models, /api/tags, /api/ps   one ready replica of each model lists it; the lists
                    joined, each model once, in the cluster's order

A request goes to the replicas of the model its JSON body names in `model` (a served name, or
Ollama's `<name>:latest`); a body that names none goes to the first model, as a single server
treats it. A model the cluster does not serve is a 404 in the route's dialect naming the served
models, answered here. Within a model's replicas, where it goes is that model's `PrefixRouter`'s
choice: each model has its own router, hashes and tokenizer, so a prefix remembered for one model
never sends another model's request anywhere.

Replicas announce themselves (`register`, about twice a second, with their model and their
running and waiting counts); one that has not been heard from for `stale_after` seconds, or that
refuses a connection, is not routed to. A replica that answers 429 before streaming is retried on
the next one of its model, each once, and the client sees the 429 (with Retry-After) only when
every replica of the model refused. A client that leaves closes the replica's connection, so the
replica cancels the request (its 499). A replica that fails mid-stream ends the stream with the
dialect's error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
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

__all__ = ["REPLICA_HEADER", "Ingress", "ReplicaInfo", "ServedModel", "Target", "merge_metrics"]

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


@dataclass
class ServedModel:
    """One model of the cluster: the name clients send, how its prompts are hashed (by its own
    tokenizer; None: routed by load alone) and its own router over its own replicas.

    A router per model keeps each model's block hashes apart: two models that tokenize a prompt
    alike still hold different KV, and a prefix remembered for one never routes the other."""

    name: str
    hasher: PromptHasher | None = None
    router: PrefixRouter = field(default_factory=PrefixRouter)


@dataclass(frozen=True)
class Target:
    """Where a request goes: the model it names (None: one the cluster does not serve), the
    name it sent (None: it named none), its prompt's block hashes for that model."""

    model: ServedModel | None
    name: str | None = None
    hashes: tuple[bytes, ...] = ()


# ------------------------------------------------------------------------------------------
# /metrics of several replicas as one exposition

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?( .*)$")


_MODEL_LABEL = re.compile(r'(?:^|,)\s*model\s*=\s*"')


def merge_metrics(
    texts: dict[str, str], label: str = "replica", models: Mapping[str, str] | None = None
) -> str:
    """Prometheus text expositions, one per replica, as one: each sample gains
    `label="<replica>"` (and `model="<its model>"` from `models`, unless the sample has a
    model label of its own), and each family's HELP and TYPE appear once, its samples
    together."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for replica_id, text in texts.items():
        current: tuple[list[str], list[str]] | None = None
        quoted = json.dumps(replica_id)  # a Prometheus label value escapes like a JSON string
        model = (models or {}).get(replica_id)
        model_label = f"model={json.dumps(model)}" if model else None
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
            joined = f"{label}={quoted}"
            if model_label is not None and not (labels and _MODEL_LABEL.search(labels)):
                joined += f",{model_label}"
            joined += f",{labels}" if labels else ""
            current[1].append(f"{match.group(1)}{{{joined}}}{match.group(3)}")
    lines: list[str] = []
    for header, samples in families.values():
        lines += header + samples
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------
# Errors in the shape of the route's dialect


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def _error_body(path: str, error: APIError) -> dict[str, Any]:
    """The body of an error the ingress answers itself, shaped as the route's dialect shapes
    it: Anthropic's for /v1/messages, Ollama's `{"error": ...}` for /api/, OpenAI's elsewhere."""
    message = error.message
    if error.param and error.param not in message:
        # Neither shape but OpenAI's has a `param`: the message names the field.
        message = f"'{error.param}': {message}"
    if path.startswith("/v1/messages"):
        kind = _ANTHROPIC_TYPES.get(error.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    if path.startswith("/api/"):
        return {"error": message}
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


_LISTINGS = {"/v1/models": "data", "/api/tags": "models", "/api/ps": "models"}
"""Routes whose answer lists the served models, and the field that holds the list: every
model's replicas are asked, and the lists joined."""


def _served_names(models: Sequence[ServedModel]) -> str:
    return ", ".join(f"'{model.name}'" for model in models)


class Ingress:
    """The ingress app (`self.app`, Starlette) and the replica table it routes over.

    `models` are the cluster's models in its order (the first takes requests that name none).
    `api_key`, when the replicas require one, is checked before the ingress answers a 404 for
    an unknown model itself: a request without it goes on to a replica, whose 401 it gets.
    `register` must be called on the app's event loop (the Ray deployment hands it over)."""

    def __init__(
        self,
        models: Sequence[ServedModel],
        *,
        stale_after: float = 10.0,
        connect_timeout: float = 5.0,
        max_body_bytes: int = 8 * 1024 * 1024,
        api_key: str | None = None,
    ) -> None:
        if not models:
            raise ValueError("the ingress needs at least one model")
        names = [model.name for model in models]
        doubled = sorted({name for name in names if names.count(name) > 1})
        if doubled:
            raise ValueError(f"two models would be served as {', '.join(map(repr, doubled))}")
        self.models = list(models)
        self._by_name = {model.name: model for model in self.models}
        self.max_body_bytes = max_body_bytes
        self.stale_after = stale_after
        self._api_key = api_key.encode() if api_key else None
        self.replicas: dict[str, ReplicaInfo] = {}
        self._timeout = httpx.Timeout(None, connect=connect_timeout)
        self._client: httpx.AsyncClient | None = None
        self.registry = CollectorRegistry()
        self.routed = Counter(
            "kvserve:cluster_routed_requests",
            "Requests the ingress sent to a replica, by model, replica and why it was chosen "
            "(prefix: it holds the prompt's first blocks; load: a holder was too busy; "
            "balance: no holder; retry: the choice before it answered 429).",
            ["model", "replica", "reason"],
            registry=self.registry,
        )
        self.refused = Counter(
            "kvserve:cluster_overloaded_requests",
            "Requests answered 429 because every replica of their model refused them.",
            ["model"],
            registry=self.registry,
        )
        self.unknown_models = Counter(
            "kvserve:cluster_unknown_model_requests",
            "Requests answered 404 by the ingress: they named a model the cluster does not serve.",
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

    # -- the models --------------------------------------------------------------------------

    def model_named(self, name: str) -> ServedModel | None:
        """The served model `name` asks for: its served name, or that name as Ollama tags
        names (`<name>:latest`), as a single server accepts them."""
        model = self._by_name.get(name)
        if model is None and name.endswith(":latest"):
            model = self._by_name.get(name.removesuffix(":latest"))
        return model

    def target(self, method: str, path: str, body: bytes) -> Target:
        """The model a request names in its JSON body's `model` (`/api/show` also takes Ollama's
        older `name`; `/api/pull` names a model to download, not one to route to), and its
        prompt's block hashes for that model. Blocking (JSON, tokenizing): run in a thread.

        A request that names no model (no body, not JSON, no `model`, or one that is not a
        string) goes to the first model, whose replica gives the real answer."""
        first = self.models[0]
        if method != "POST" or not body:
            return Target(first)
        try:
            request = json.loads(body)
        except Exception:  # not JSON: the replica answers 400
            return Target(first)
        if not isinstance(request, dict):
            return Target(first)
        name = None if path == "/api/pull" else request.get("model")
        if name is None and path == "/api/show":
            name = request.get("name")
        if not isinstance(name, str):
            model, name = first, None
        else:
            model = self.model_named(name)
            if model is None:
                return Target(None, name)
        hashes: list[bytes] = []
        if path in GENERATING_PATHS and model.hasher is not None:
            hashes = model.hasher.hashes(path, request)
        return Target(model, name, tuple(hashes))

    def _model_of(self, info: ReplicaInfo) -> ServedModel | None:
        return self._by_name.get(info.model)

    def _authorized(self, request: Request) -> bool:
        """The API key the replicas require, as they check it (bearer or x-api-key)."""
        if self._api_key is None:
            return True
        bearer = request.headers.get("authorization", "").encode("latin-1")
        api_key = request.headers.get("x-api-key", "").encode("latin-1")
        return hmac.compare_digest(bearer, b"Bearer " + self._api_key) or hmac.compare_digest(
            api_key, self._api_key
        )

    # -- the replica table -------------------------------------------------------------------

    def register(self, info: ReplicaInfo) -> None:
        """A replica's announcement: its model, address, readiness and load, now."""
        info.seen_at = time.monotonic()
        model = self._model_of(info)
        if info.replica_id not in self.replicas:
            log.info("replica %s of '%s' at %s", info.replica_id, info.model, info.url)
            if model is None and info.model:
                log.warning(
                    "replica %s serves '%s', not a model of this cluster (%s): not routed to",
                    info.replica_id,
                    info.model,
                    _served_names(self.models),
                )
        self.replicas[info.replica_id] = info
        if model is not None:
            model.router.report(info.replica_id, info.running, info.waiting)

    def living(self, model: ServedModel | None = None) -> list[ReplicaInfo]:
        """Ready replicas of a cluster's model (of `model`, when given) heard from lately."""
        now = time.monotonic()
        for replica_id in [
            r.replica_id for r in self.replicas.values() if now - r.seen_at > self.stale_after
        ]:
            self.drop(replica_id, "silent")
        known = [r for r in self.replicas.values() if r.ready and self._model_of(r) is not None]
        return known if model is None else [r for r in known if self._model_of(r) is model]

    def drop(self, replica_id: str, why: str) -> None:
        """Route nothing more to a replica until it registers again."""
        if self.replicas.pop(replica_id, None) is not None:
            log.warning("replica %s dropped: %s", replica_id, why)
        for model in self.models:
            model.router.forget(replica_id)

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
        counts = {model.name: len(self.living(model)) for model in self.models}
        body: dict[str, Any] = {"model": self.models[0].name, "models": counts}
        body["replicas"] = sum(counts.values())
        if not all(counts.values()):
            return Response(
                json.dumps({"status": "loading", **body}), 503, media_type="application/json"
            )
        return Response(json.dumps({"status": "ready", **body}), media_type="application/json")

    async def describe(self, request: Request) -> Response:
        self.living()
        loads = {r: load for model in self.models for r, load in model.router.loads().items()}
        body = {
            "replicas": [
                info.as_json(loads.get(info.replica_id, 0)) for info in self.replicas.values()
            ],
            "models": [
                {
                    "model": model.name,
                    "replicas": len(self.living(model)),
                    "remembered_blocks": model.router.num_remembered,
                }
                for model in self.models
            ],
            "remembered_blocks": sum(model.router.num_remembered for model in self.models),
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
            {info.replica_id: text for info, text in zip(replicas, texts, strict=True)},
            models={info.replica_id: info.model for info in replicas},
        )
        own = generate_latest(self.registry).decode()
        return Response(merged + own, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _listing(
        self, path: str, target: str, headers: list[tuple[bytes, bytes]]
    ) -> Response:
        """`/v1/models`, `/api/tags`, `/api/ps`: one ready replica of each model lists its model;
        the lists joined in the cluster's order, each model once. A model with no ready replica
        is not listed yet (a single server answers 503 until its model is loaded). A replica's
        refusal (401 without the key) is the answer."""

        async def ask(model: ServedModel) -> tuple[str, httpx.Response] | None:
            loads = model.router.loads()
            for info in sorted(self.living(model), key=lambda r: loads.get(r.replica_id, 0)):
                try:
                    answer = await self.client.get(info.url + target, headers=headers, timeout=30)
                    return info.replica_id, answer
                except httpx.HTTPError as exc:
                    self.replica_failures.labels(info.replica_id).inc()
                    self.drop(info.replica_id, f"failed to list its model: {exc!r}")
            return None

        answers = [a for a in await asyncio.gather(*map(ask, self.models)) if a is not None]
        if not answers:
            return _error_response(path, APIError(503, "no replica is ready yet"))
        key, listed, seen = _LISTINGS[path], [], set()
        body: dict[str, Any] | None = None
        for replica_id, answer in answers:
            try:
                own = answer.json() if answer.status_code == 200 else None
            except ValueError:
                own = None
            if not isinstance(own, dict) or not isinstance(own.get(key), list):
                return Response(
                    answer.content,
                    answer.status_code,
                    headers=self._answer_headers(answer, replica_id),
                )
            body = own if body is None else body
            for entry in own[key]:
                name = (entry.get("id") or entry.get("name")) if isinstance(entry, dict) else None
                if name not in seen:
                    seen.add(name)
                    listed.append(entry)
        assert body is not None
        first_id, first = answers[0]
        response_headers = self._answer_headers(first, first_id)
        response_headers[REPLICA_HEADER] = ", ".join(replica_id for replica_id, _ in answers)
        return Response(json.dumps({**body, key: listed}), 200, headers=response_headers)

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
        if request.method == "POST" and body:
            chosen = await asyncio.to_thread(self.target, request.method, path, body)
        else:
            chosen = Target(self.models[0])
        if chosen.model is None:
            if self._authorized(request):
                self.unknown_models.inc()
                error = APIError(
                    404,
                    f"the model '{chosen.name}' does not exist; this cluster serves "
                    f"{_served_names(self.models)}",
                    param="model",
                    code="model_not_found",
                )
                return _error_response(path, error)
            # Whoever has no key learns nothing here: a replica answers its 401.
            chosen = Target(self.models[0])
        model, hashes = chosen.model, list(chosen.hashes)
        assert model is not None
        headers = [
            (name, value)
            for name, value in request.headers.raw
            if name.decode("latin-1").lower() not in _NOT_FORWARDED
        ]
        target = path + (f"?{request.url.query}" if request.url.query else "")
        if request.method == "GET" and path in _LISTINGS:
            return await self._listing(path, target, headers)
        living = self.living(model)
        if not living:
            what = "no replica is ready yet"
            if len(self.models) > 1:
                what = f"no replica of '{model.name}' is ready yet"
            return _error_response(path, APIError(503, what))
        router = model.router
        by_id = {info.replica_id: info for info in living}
        decision = router.choose(hashes, list(by_id))
        watcher = DisconnectWatcher(request.receive)
        refused: tuple[httpx.Response, bytes, str] | None = None
        try:
            for attempt, replica_id in enumerate(decision.order):
                outgoing = self.client.build_request(
                    request.method, by_id[replica_id].url + target, headers=headers, content=body
                )
                # In flight from here until its answer ends, however it ends.
                router.started(replica_id)
                relayed = False
                try:
                    upstream = await watcher.race(self.client.send(outgoing, stream=True))
                    if upstream.status_code == 429:
                        refused = (upstream, await watcher.race(upstream.aread()), replica_id)
                        await upstream.aclose()
                        continue
                    reason = decision.reason if attempt == 0 else "retry"
                    self.routed.labels(model.name, replica_id, reason).inc()
                    if upstream.status_code < 400:
                        router.sent(replica_id, hashes)
                    relayed = True
                    return await self._relay(upstream, replica_id, path, watcher, router)
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
                        router.ended(replica_id)
        except ClientGone:
            watcher.stop()
            return Response(status_code=499)
        watcher.stop()
        if refused is not None:
            upstream, content, replica_id = refused
            self.refused.labels(model.name).inc()
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
        self,
        upstream: httpx.Response,
        replica_id: str,
        path: str,
        watcher: DisconnectWatcher,
        router: PrefixRouter,
    ) -> Response:
        """The replica's answer as the client's; the request stops being in flight at the
        replica (`router.ended`) once it is relayed in full, failed, or the client left."""
        headers = self._answer_headers(upstream, replica_id)
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):

            async def end() -> None:
                # Also when the client left before the first chunk: the generator's own
                # cleanup never ran then, and the replica must see the connection close.
                await upstream.aclose()
                router.ended(replica_id)

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
            router.ended(replica_id)
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
