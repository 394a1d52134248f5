"""The API's description: response models and the OpenAPI document at /openapi.json (and /docs).

The routes parse their bodies themselves (strict pydantic, a 400 naming the field) and answer
with plain dicts, which is cheaper per streamed token than pydantic objects. So FastAPI cannot
see their shapes; this module states them. Request bodies are the protocol's own request models;
the response models below describe the dicts the renderers build, and `tests/e2e` checks the
answers against them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "Completion",
    "CompletionChunk",
    "DetokenizeResponse",
    "ErrorResponse",
    "ModelList",
    "Status",
    "TokenizeResponse",
    "describe",
    "error_responses",
    "json_response",
    "stream_response",
    "text_response",
]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobInfo(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobInfo]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str


class ChatCompletion(BaseModel):
    """`POST /v1/chat/completions` without streaming. With `"stream": true` the answer is a
    stream of `chat.completion.chunk` events ending with `data: [DONE]`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    """One streamed event's data; the `include_usage` chunk has no choices and the usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(BaseModel):
    """Legacy logprobs; with `echo` the prompt's tokens come first, the very first with nulls."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str


class Completion(BaseModel):
    """`POST /v1/completions` without streaming (with it: `text_completion` chunk events)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionChunk(BaseModel):
    """One streamed event's data (`text_completion`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int | None = None  # while loaded
    status: Literal["unloaded", "loading", "loaded", "unloading", "failed"]
    loads: int  # how many times it was loaded since the server started
    expires_at: int | None = None  # while loaded: when it unloads (Unix time); None: never
    memory_bytes: int | None = None  # while loaded: its weights and KV pool
    error: str | None = None  # why its last load failed


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class Status(BaseModel):
    """/health and /ready."""

    status: str
    model: str | None = None
    error: str | None = None
    # /ready: the CPU kernels built here (families, failures, instruction sets, paths) and how
    # the model's layers and attention run
    kernels: dict[str, Any] | None = None
    layers: str | None = None
    attention: str | None = None


_ERROR_DESCRIPTIONS = {
    400: "Invalid request; `error.param` names the field",
    401: "Missing or wrong API key (when the server has one)",
    404: "Unknown model",
    413: "Body larger than the limit",
    429: "Overloaded (queue full, or waited too long); see Retry-After",
    502: "The package index failed the pull (a part missing, a checksum that does not match)",
    503: "The model is still loading, failed to load, or the server is stopping",
}


def error_responses(
    *statuses: int, model: type[BaseModel] | None = None
) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for these error statuses, each with the error body (OpenAI's
    unless `model` names the dialect's own)."""
    return {
        status: {"model": model or ErrorResponse, "description": _ERROR_DESCRIPTIONS[status]}
        for status in statuses
    }


class _Open(BaseModel):
    """A body with these fields at least (the dialects' objects carry more)."""

    model_config = ConfigDict(extra="allow")


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error body."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class AnthropicMessage(_Open):
    """An Anthropic `message`."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[dict[str, Any]]
    model: str
    stop_reason: str | None
    usage: dict[str, Any]


class AnthropicEvent(_Open):
    """One Messages stream event (its `event:` line repeats the type)."""

    type: str


class AnthropicTokenCount(BaseModel):
    input_tokens: int


class ResponseObject(_Open):
    """An OpenAI Responses `response`."""

    id: str
    object: Literal["response"]
    status: str
    output: list[dict[str, Any]]


class ResponseEvent(_Open):
    """One Responses stream event."""

    type: str
    sequence_number: int


class OllamaError(BaseModel):
    """Ollama's error body."""

    error: str


class OllamaVersion(_Open):
    version: str


class OllamaChat(_Open):
    """`POST /api/chat` with `"stream": false`; streamed, NDJSON objects of this shape."""

    model: str
    created_at: str
    message: dict[str, Any]
    done: bool


class OllamaGenerate(_Open):
    """`POST /api/generate` with `"stream": false`; streamed, NDJSON objects of this shape."""

    model: str
    created_at: str
    response: str
    done: bool


class OllamaModels(BaseModel):
    """`GET /api/tags` and `GET /api/ps`."""

    models: list[dict[str, Any]]


class OllamaShow(_Open):
    """`POST /api/show`."""

    template: str
    details: dict[str, Any]
    model_info: dict[str, Any]
    capabilities: list[str]


class Embedding(BaseModel):
    object: Literal["embedding"]
    embedding: list[float] | str  # a base64 string with encoding_format "base64"
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    """`POST /v1/embeddings`."""

    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class OllamaEmbed(_Open):
    """`POST /api/embed`."""

    model: str
    embeddings: list[list[float]]


class OllamaEmbedding(BaseModel):
    """`POST /api/embeddings`."""

    embedding: list[float]


class OllamaStatus(_Open):
    """A status object (`POST /api/pull` streams them)."""

    status: str


def json_response(model: type[BaseModel], description: str = "OK") -> dict[str, Any]:
    return {"model": model, "description": description}


def stream_response(
    model: type[BaseModel], chunk: type[BaseModel], error: type[BaseModel] | None = None
) -> dict[str, Any]:
    """A 200 that is `model` as JSON, or, when the request said `stream`, server-sent events
    whose data is a `chunk` as JSON, then `[DONE]` (or an error body, if it failed midway)."""
    data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {
            "anyOf": [
                {"$ref": f"#/components/schemas/{chunk.__name__}"},
                {"$ref": f"#/components/schemas/{(error or ErrorResponse).__name__}"},
            ]
        },
        "description": f"a {chunk.__name__} as JSON, an ErrorResponse, or the final [DONE]",
    }
    return {
        "model": model,
        "description": "The answer; with `stream: true`, server-sent events ending in [DONE]",
        "content": {
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "data": {"anyOf": [data, {"const": "[DONE]"}]},
                        "event": {"type": "string"},
                    },
                    "required": ["data"],
                }
            }
        },
    }


def text_response(media_type: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {media_type: {"schema": {"type": "string"}}}}


def describe(app: FastAPI, bodies: Mapping[tuple[str, str], type[BaseModel]]) -> None:
    """Serve an OpenAPI document for `app` in which each (method, path) of `bodies` takes that
    model as its JSON body (the routes read their bodies themselves)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title,
            version=app.version,
            description=app.description,
            routes=app.routes,
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for chunk in (
            ChatCompletionChunk,
            CompletionChunk,
            AnthropicEvent,
            AnthropicError,
            ResponseEvent,
        ):
            # Named only inside event-stream descriptions, which FastAPI does not read.
            chunk_schema = chunk.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(chunk_schema.pop("$defs", {}))
            components[chunk.__name__] = chunk_schema
        for (method, path), model in bodies.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            schema["paths"][path][method]["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}
                    }
                },
            }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
