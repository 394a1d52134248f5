"""Embeddings: `POST /v1/embeddings` (OpenAI's), `POST /api/embed` and the older
`POST /api/embeddings` (Ollama's).

Every route tokenizes its inputs (off the event loop), checks each against the model's input
length, and hands them to the engine's `Embedder`, which batches the inputs of concurrent
requests into forward passes on the device thread. The admission rules of generation apply: a
full queue or an expired wait is 429 with Retry-After, a client that leaves is logged as 499
and its inputs not yet started never run.

- `/v1/embeddings`: `input` is a string, a list of strings, a list of token ids or a list of
  such lists; `encoding_format` `float` (the default) or `base64` (little-endian float32);
  `dimensions` is accepted only as the model's own size (no model served here shortens its
  vectors); the answer carries `usage`. An input longer than the model's is a 400 unless
  `truncate: true` (kvserve's extension) asks to cut it.
- `/api/embed`: `input` is a string or a list of strings, `truncate` defaults to true (as in
  Ollama); `options.num_ctx` lowers the input length; the answer has `embeddings`, the
  duration and `prompt_eval_count`.
- `/api/embeddings`: one `prompt`, one `embedding` (an empty prompt gets an empty one).

Vectors are those of the model's own head: an encoder's pooling and normalization as its
sentence-transformers config says, a decoder's pooled states (`--pooling`) L2-normalized.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from starlette.responses import Response

from kvserve.request import EngineError, RequestCancelled
from kvserve.server import schemas
from kvserve.server.core import Exchange, ServerState, in_thread, json_response
from kvserve.server.dialects import ollama
from kvserve.server.protocol import APIError, _Model
from kvserve.server.sse import ClientGone, DisconnectWatcher

__all__ = [
    "PATHS",
    "EmbeddingRequest",
    "OllamaEmbedRequest",
    "OllamaEmbeddingsRequest",
    "register",
]

PATHS = ("/v1/embeddings", "/api/embed", "/api/embeddings")


class EmbeddingRequest(_Model):
    """`POST /v1/embeddings`."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str | None = None
    dimensions: int | None = None
    user: str | None = None
    # kvserve's extension: cut inputs longer than the model's instead of refusing them.
    truncate: bool | None = None


class OllamaEmbedRequest(_Model):
    """`POST /api/embed`."""

    model: str
    input: str | list[str]
    truncate: bool | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None
    dimensions: int | None = None


class OllamaEmbeddingsRequest(_Model):
    """`POST /api/embeddings` (Ollama's older route)."""

    model: str
    prompt: str | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None


BODIES = {
    ("post", "/v1/embeddings"): EmbeddingRequest,
    ("post", "/api/embed"): OllamaEmbedRequest,
    ("post", "/api/embeddings"): OllamaEmbeddingsRequest,
}
"""Each route's JSON body, for the API's description."""


def _check_dimensions(dimensions: int | None, model_dimensions: int) -> None:
    if dimensions is not None and dimensions != model_dimensions:
        raise APIError(
            400,
            f"'dimensions': this model's embeddings have {model_dimensions} dimensions and it "
            "cannot shorten them",
            param="dimensions",
        )


async def _embed(
    state: ServerState,
    request: Request,
    exchange: Exchange,
    engine: Any,
    items: Sequence[str | Sequence[int]],
    *,
    truncate: bool,
    param: str,
    limit: int | None = None,
) -> Any:
    """Tokenize and embed `items` (texts or token ids): [len(items), dimensions] float32, or
    the 499 response when the client left. Errors name `param` (`param[i]` for an item of a
    list)."""
    embedder = engine.embedder
    if embedder is None:
        raise APIError(503, "the model is still loading; GET /ready answers 200 once loaded")

    def where(index: int) -> str:
        return param if len(items) == 1 and isinstance(items[0], str) else f"{param}[{index}]"

    def prepare() -> list[list[int]]:
        inputs = []
        for index, item in enumerate(items):
            try:
                if isinstance(item, str):
                    ids = embedder.tokenize(item, truncate=truncate)
                else:
                    ids = embedder.fit(item, truncate=truncate)
                if limit is not None and len(ids) > limit:
                    if not truncate:
                        raise APIError(
                            400,
                            f"an input has {len(ids)} tokens, more than options.num_ctx ({limit})",
                            param=where(index),
                        )
                    ids = ids[:limit]
            except EngineError as exc:
                raise APIError(400, exc.message, param=where(index)) from None
            inputs.append(ids)
        return inputs

    inputs = await in_thread(prepare)
    exchange.prompt_tokens = sum(len(ids) for ids in inputs)
    state.refuse_if_draining(exchange)
    try:
        job = embedder.submit(exchange.request_id, inputs, exchange.started)
    except EngineError as exc:
        raise APIError.from_engine(exc, param_names={"input": param}) from None
    watcher = DisconnectWatcher(request.receive)

    def refuse() -> bool:
        # None of its inputs has started: it ends now, and answers 503 below.
        return job.started_at is None and embedder.cancel(exchange.request_id)

    try:
        with state.queued(exchange.request_id, refuse):
            vectors = await watcher.race(job.result())
    except RequestCancelled:
        if state.draining:  # only a drain cancels a job that waits
            raise state.shutting_down(exchange) from None
        exchange.status = 499
        return Response(status_code=499)
    except ClientGone:
        exchange.status = 499
        return Response(status_code=499)
    except EngineError as exc:
        raise APIError.from_engine(exc) from None
    finally:
        watcher.stop()
        embedder.cancel(exchange.request_id)  # a no-op once it ended; frees it if it did not
    exchange.finish_reason = "stop"
    return vectors


def _base64(vector: np.ndarray) -> str:
    return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")


def register(app: FastAPI, state: ServerState) -> None:
    """Add the routes; the Ollama ones answer errors in Ollama's shape."""
    for path in ("/api/embed", "/api/embeddings"):
        state.error_shapes[path] = ollama.error_body
    openai_errors = schemas.error_responses(400, 401, 404, 413, 429, 503)
    ollama_errors = schemas.error_responses(400, 401, 404, 413, 429, 503, model=schemas.OllamaError)

    @app.post(
        "/v1/embeddings",
        responses={200: schemas.json_response(schemas.EmbeddingList), **openai_errors},
    )
    async def embeddings(request: Request) -> Response:
        exchange, engine, body = await state.accept(request, EmbeddingRequest, generates=False)
        if body.encoding_format not in (None, "float", "base64"):
            raise APIError(
                400, "'encoding_format' must be 'float' or 'base64'", param="encoding_format"
            )
        _check_dimensions(body.dimensions, engine.embedder.dimensions)
        raw = body.input
        items: list[str | list[int]]
        if isinstance(raw, str):
            items = [raw]
        elif raw and isinstance(raw[0], int):
            items = [raw]  # one input of token ids
        else:
            items = list(raw)
        if not items:
            raise APIError(400, "'input' must hold at least one input", param="input")
        vectors = await _embed(
            state, request, exchange, engine, items, truncate=bool(body.truncate), param="input"
        )
        if isinstance(vectors, Response):
            return vectors
        array = vectors.numpy()
        as_base64 = body.encoding_format == "base64"
        data = [
            {
                "object": "embedding",
                "embedding": _base64(row) if as_base64 else row.tolist(),
                "index": index,
            }
            for index, row in enumerate(array)
        ]
        tokens = exchange.prompt_tokens or 0
        return json_response(
            {
                "object": "list",
                "data": data,
                "model": exchange.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    @app.post(
        "/api/embed",
        responses={200: schemas.json_response(schemas.OllamaEmbed), **ollama_errors},
    )
    async def embed(request: Request) -> Response:
        exchange, engine, body = await state.accept(
            request, OllamaEmbedRequest, ollama._refused, generates=False
        )
        ollama.check_keep_alive(body.keep_alive, exchange)
        _check_dimensions(body.dimensions, engine.embedder.dimensions)
        limit = _num_ctx(state, exchange, body.options, engine.max_model_len)
        raw = body.input
        # As Ollama: an empty string is no input at all.
        items = ([raw] if raw else []) if isinstance(raw, str) else list(raw)
        started = time.monotonic()
        vectors: Any = []
        if items:
            vectors = await _embed(
                state,
                request,
                exchange,
                engine,
                items,
                truncate=body.truncate is not False,  # Ollama truncates unless told not to
                param="input",
                limit=limit,
            )
            if isinstance(vectors, Response):
                return vectors
            vectors = vectors.tolist()
        return json_response(
            {
                "model": body.model,
                "embeddings": vectors,
                "total_duration": round((time.monotonic() - exchange.started) * 1e9),
                "load_duration": 0,
                "prompt_eval_count": exchange.prompt_tokens or 0,
                "prompt_eval_duration": round((time.monotonic() - started) * 1e9),
            }
        )

    @app.post(
        "/api/embeddings",
        responses={200: schemas.json_response(schemas.OllamaEmbedding), **ollama_errors},
    )
    async def legacy_embeddings(request: Request) -> Response:
        exchange, engine, body = await state.accept(
            request, OllamaEmbeddingsRequest, ollama._refused, generates=False
        )
        ollama.check_keep_alive(body.keep_alive, exchange)
        limit = _num_ctx(state, exchange, body.options, engine.max_model_len)
        if not body.prompt:
            return json_response({"embedding": []})
        vectors = await _embed(
            state,
            request,
            exchange,
            engine,
            [body.prompt],
            truncate=True,
            param="prompt",
            limit=limit,
        )
        if isinstance(vectors, Response):
            return vectors
        return json_response({"embedding": vectors[0].tolist()})


def _num_ctx(
    state: ServerState, exchange: Exchange, options: Mapping[str, Any] | None, max_len: int
) -> int | None:
    """`options.num_ctx` as the inputs' length limit (refused above the model's); every other
    option is accepted and reported."""
    options = dict(options or {})
    num_ctx = options.pop("num_ctx", None)
    ignored = [f"options.{name}" for name in options]
    if ignored:
        exchange.ignored_fields = (*exchange.ignored_fields, *ignored)
        state.metrics.observe_ignored_fields(ignored)
    if num_ctx is None:
        return None
    if not isinstance(num_ctx, int) or isinstance(num_ctx, bool) or num_ctx < 1:
        raise APIError(400, "'options.num_ctx' must be a positive integer", param="options.num_ctx")
    if num_ctx > max_len:
        raise APIError(
            400,
            f"'options.num_ctx' is {num_ctx}, above this model's input length of {max_len}",
            param="options.num_ctx",
        )
    return num_ctx
