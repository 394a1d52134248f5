"""Anthropic Messages: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

The request's `system`, `messages` (text, `tool_use` and `tool_result` blocks) and `tools` become
a chat-template conversation (tool calls as the assistant's `tool_calls`, results as `tool`
messages); `tool_choice` `any` or a named tool forces a call, generated under structured output.
The answer is a `message` with content blocks, `stop_reason` (`end_turn`,
`max_tokens`, `stop_sequence` with the matched sequence, or `tool_use`) and `usage`; streamed, it
is `message_start`, then per block `content_block_start` / `content_block_delta` /
`content_block_stop`, then `message_delta` (stop reason, usage) and `message_stop`, every frame
with an `event:` line naming its type. Errors are `{"type": "error", "error": {type, message}}`;
429 (the queue is full or the wait expired) is `overloaded_error` with Retry-After; an error
after the stream began is `event: error`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from kvserve.params import SamplingParams
from kvserve.server import schemas
from kvserve.server.core import ServerState, json_response
from kvserve.server.dialects.function_tools import (
    FunctionTool,
    encode_conversation,
    openai_tools,
    parse_arguments,
    tool_plan,
)
from kvserve.server.protocol import APIError, _Model, dumps, validated_sampling_params
from kvserve.server.render import (
    BodyRenderer,
    CallArguments,
    CallEnd,
    CallStart,
    Ending,
    Piece,
    Rendering,
    StreamRenderer,
    Update,
)
from kvserve.server.tools import ToolPlan, parser_for

__all__ = [
    "PATHS",
    "CountTokensRequest",
    "MessagesBody",
    "MessagesRendering",
    "MessagesRequest",
    "MessagesStream",
    "error_body",
    "register",
]

PATHS = ("/v1/messages", "/v1/messages/count_tokens")

# Each engine parameter as a Messages request names it.
_PARAM_NAMES = {"prompt": "messages", "max_tokens": "max_tokens", "stop": "stop_sequences"}

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    # A full queue is an overload, not a quota: Anthropic's overloaded_error, with Retry-After.
    429: "overloaded_error",
}


def error_body(error: APIError) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}` as Anthropic sends it. The shape has
    no `param`, so the message names the field when it does not already."""
    message = error.message
    if error.param and error.param not in message:
        message = f"'{error.param}': {message}"
    return {
        "type": "error",
        "error": {"type": _ERROR_TYPES.get(error.status, "api_error"), "message": message},
    }


# --------------------------------------------------------------------------------------------
# Request models


class AnthropicMessage(_Model):
    """One turn: a string, or content blocks (`text`, `tool_use`, `tool_result`)."""

    role: str
    content: str | list[dict[str, Any]]


class AnthropicTool(_Model):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class CountTokensRequest(_Model):
    """`POST /v1/messages/count_tokens`: the prompt part of a Messages request."""

    model: str | None = None  # required by Anthropic; optional here as on the OpenAI routes
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    stream: bool | None = None
    # vLLM's extension, as on the OpenAI routes: generate all max tokens, past the stop token.
    ignore_eos: bool | None = None


def _refused(extras: Mapping[str, Any]) -> tuple[list[str], APIError | None]:
    """Messages extras that would change the answer are refused; the rest are reported."""
    ignored: list[str] = []
    for name, value in extras.items():
        if name == "thinking" and not (
            isinstance(value, Mapping) and value.get("type") == "disabled"
        ):
            return ignored, APIError(
                400, "'thinking': extended thinking is not supported", param=name
            )
        if name in ("mcp_servers", "container", "output_format", "output_config") and value:
            return ignored, APIError(400, f"'{name}' is not supported", param=name)
        ignored.append(name)
    return ignored, None


# --------------------------------------------------------------------------------------------
# Request to conversation


def _text_of(blocks: str | list[dict[str, Any]] | None, where: str) -> str:
    """The text of a string or of a list of `text` blocks."""
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    texts = []
    for index, block in enumerate(blocks):
        if not isinstance(block, Mapping) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, Mapping) else type(block).__name__
            raise APIError(
                400,
                f"'{where}[{index}]': only text blocks are supported here, got {kind!r}",
                param=where,
            )
        text = block.get("text")
        if not isinstance(text, str):
            raise APIError(400, f"'{where}[{index}].text' must be a string", param=where)
        texts.append(text)
    return "\n".join(texts)


def conversation(body: CountTokensRequest) -> list[dict[str, Any]]:
    """The request as chat-template messages (the OpenAI shape templates know)."""
    messages: list[dict[str, Any]] = []
    system = _text_of(body.system, "system")
    if system:
        messages.append({"role": "system", "content": system})
    for index, message in enumerate(body.messages):
        where = f"messages[{index}]"
        if message.role not in ("user", "assistant"):
            raise APIError(
                400, f"'{where}.role' must be 'user' or 'assistant'", param=f"{where}.role"
            )
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for number, block in enumerate(message.content):
            messages_param = f"{where}.content[{number}]"
            kind = block.get("type")
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and message.role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise APIError(
                        400,
                        f"'{messages_param}': tool_use needs 'id' and 'name'",
                        param=messages_param,
                    )
                arguments = block.get("input", {})
                if not isinstance(arguments, Mapping):
                    raise APIError(
                        400, f"'{messages_param}.input' must be an object", param=messages_param
                    )
                calls.append(
                    {
                        "id": block["id"],
                        "type": "function",
                        "function": {"name": block["name"], "arguments": dict(arguments)},
                    }
                )
            elif kind == "tool_result" and message.role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise APIError(
                        400,
                        f"'{messages_param}': tool_result needs 'tool_use_id'",
                        param=messages_param,
                    )
                content = _text_of(block.get("content"), f"{messages_param}.content")
                results.append(
                    {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}
                )
            else:
                raise APIError(
                    400,
                    f"'{messages_param}': a {kind!r} block is not supported in a {message.role} turn",
                    param=messages_param,
                )
        messages.extend(results)
        if message.role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                turn["tool_calls"] = calls
            messages.append(turn)
        elif texts or not results:
            messages.append({"role": "user", "content": "\n".join(texts)})
    return messages


def tool_setup(body: CountTokensRequest, parser: str) -> ToolPlan | None:
    """The request's tools and tool choice as a plan (None: neither is given); `any` and a
    named tool come with the constraint of their forced call."""
    tools = openai_tools(
        [FunctionTool(t.name, t.description, t.input_schema) for t in body.tools or ()],
        "tools",
        "input_schema",
    )
    raw = body.tool_choice
    choice: Any = None
    parallel: bool | None = None
    if raw is not None:
        kind = raw.get("type")
        if kind not in ("auto", "any", "tool", "none"):
            raise APIError(
                400, "'tool_choice.type' must be auto, any, tool or none", param="tool_choice"
            )
        if not tools and kind != "none":
            raise APIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        if kind == "tool":
            name = raw.get("name")
            if name not in {tool["function"]["name"] for tool in tools}:
                raise APIError(
                    400, f"'tool_choice.name': no tool is named {name!r}", param="tool_choice"
                )
            choice = {"type": "function", "function": {"name": name}}
        else:
            choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
        if raw.get("disable_parallel_tool_use") is True:
            parallel = False
    return tool_plan(tools, choice, parallel_tool_calls=parallel, parser=parser, param="tools")


def _plan(state: ServerState, engine: Any, body: CountTokensRequest) -> ToolPlan | None:
    parser = parser_for(engine.tokenizer.chat_template, state.config.tool_call_parser)
    return tool_setup(body, parser)


async def _prompt_ids(engine: Any, body: CountTokensRequest, plan: ToolPlan | None) -> list[int]:
    messages = conversation(body)
    return await encode_conversation(engine.tokenizer, messages, plan, param="messages")


def sampling_params(
    body: MessagesRequest, vocab_size: int, plan: ToolPlan | None = None
) -> SamplingParams:
    """The request's SamplingParams, validated; errors name the Messages field. A forced tool
    call constrains the answer."""
    return validated_sampling_params(
        vocab_size,
        _PARAM_NAMES,
        max_tokens=body.max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        stop=tuple(body.stop_sequences or ()),
        ignore_eos=bool(body.ignore_eos),
        structured=plan.constraint if plan is not None else None,
    )


# --------------------------------------------------------------------------------------------
# Rendering


def _frame(kind: str, data: Mapping[str, Any]) -> str:
    return f"event: {kind}\ndata: {dumps(data)}\n\n"


Event = tuple[str, dict[str, Any]]
"""A stream event: its type and its data."""


class _Content:
    """The message's content blocks, built piece by piece: text becomes `text` blocks, each
    call a `tool_use` block. Each change is also returned as the events that announce it
    (`content_block_start`, `content_block_delta`, `content_block_stop`)."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.called = False
        self._open = False  # the last block still takes deltas

    def add(self, update: Update) -> list[Event]:
        events: list[Event] = []
        for piece in update.pieces:
            events += self._add(piece)
        if update.finish_reason is not None:
            events += self._close()
        return events

    def _add(self, piece: Piece) -> list[Event]:
        if isinstance(piece, CallStart):
            self.called = True
            block = {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}}
            return self._close() + self._start(block)
        if isinstance(piece, CallArguments):
            return self._delta({"type": "input_json_delta", "partial_json": piece.text})
        if isinstance(piece, CallEnd):
            self.blocks[-1]["input"] = parse_arguments(piece.arguments)
            return self._close()
        events: list[Event] = []
        if not self._open or self.blocks[-1]["type"] != "text":
            events = self._close() + self._start({"type": "text", "text": ""})
        self.blocks[-1]["text"] += piece
        return events + self._delta({"type": "text_delta", "text": piece})

    def _start(self, block: dict[str, Any]) -> list[Event]:
        self.blocks.append(block)
        self._open = True
        index = len(self.blocks) - 1
        # A copy: the block itself grows as deltas arrive, the event shows how it began.
        data = {"type": "content_block_start", "index": index, "content_block": dict(block)}
        return [("content_block_start", data)]

    def _delta(self, delta: dict[str, Any]) -> list[Event]:
        index = len(self.blocks) - 1
        return [
            ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
        ]

    def _close(self) -> list[Event]:
        if not self._open:
            return []
        self._open = False
        index = len(self.blocks) - 1
        return [("content_block_stop", {"type": "content_block_stop", "index": index})]


def _stop_reason(ending: Ending, called: bool) -> str:
    if ending.finish_reason == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if ending.stop_sequence is not None else "end_turn"


def _usage(ending: Ending) -> dict[str, int]:
    return {
        "input_tokens": ending.usage.prompt_tokens,
        "output_tokens": ending.usage.completion_tokens,
    }


class MessagesStream(StreamRenderer):
    """A Messages answer streamed: `message_start`, the content blocks' events, then
    `message_delta` (stop reason, usage) and `message_stop`; every frame names its type in an
    `event:` line. An error after the start is `event: error`."""

    def __init__(self, message_id: str, model: str, prompt_tokens: int) -> None:
        self.message_id = message_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self._content = _Content()

    def head(self) -> str:
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        }
        return _frame("message_start", {"type": "message_start", "message": message})

    def update(self, update: Update) -> str:
        return "".join(_frame(kind, data) for kind, data in self._content.add(update))

    def tail(self, ending: Ending) -> str:
        delta = {
            "type": "message_delta",
            "delta": {
                "stop_reason": _stop_reason(ending, self._content.called),
                "stop_sequence": ending.stop_sequence,
            },
            "usage": _usage(ending),
        }
        return _frame("message_delta", delta) + _frame("message_stop", {"type": "message_stop"})

    def error(self, error: APIError) -> str:
        return _frame("error", error_body(error))


class MessagesBody(BodyRenderer):
    """A Messages answer whole: a `message` with its content blocks, stop reason and usage."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self._content = _Content()

    def update(self, update: Update) -> None:
        self._content.add(update)

    def body(self, ending: Ending) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "content": self._content.blocks,
            "model": self.model,
            "stop_reason": _stop_reason(ending, self._content.called),
            "stop_sequence": ending.stop_sequence,
            "usage": _usage(ending),
        }


class MessagesRendering(Rendering):
    """One Messages answer, streamed or whole. `plan` is the request's tools (None without)."""

    def __init__(
        self, message_id: str, model: str, prompt_tokens: int, *, plan: ToolPlan | None = None
    ) -> None:
        super().__init__(
            plan,
            stream=lambda: MessagesStream(message_id, model, prompt_tokens),
            whole=lambda: MessagesBody(message_id, model),
            id_prefix="toolu_",
        )


# --------------------------------------------------------------------------------------------
# Routes


BODIES = {
    ("post", "/v1/messages"): MessagesRequest,
    ("post", "/v1/messages/count_tokens"): CountTokensRequest,
}
"""Each route's JSON body, for the API's description."""


def register(app: FastAPI, state: ServerState) -> None:
    """Add the routes and the Anthropic error shape for their paths."""
    for path in PATHS:
        state.error_shapes[path] = error_body

    errors = schemas.error_responses(400, 401, 404, 413, 429, 503, model=schemas.AnthropicError)

    @app.post(
        "/v1/messages",
        responses={
            200: schemas.stream_response(
                schemas.AnthropicMessage, schemas.AnthropicEvent, schemas.AnthropicError
            ),
            **errors,
        },
    )
    async def messages(request: Request) -> Response:
        exchange, engine, body = await state.accept(request, MessagesRequest, _refused)
        if not body.messages:
            raise APIError(400, "'messages' must hold at least one message", param="messages")
        plan = _plan(state, engine, body)
        # Validate before tokenizing: a bad parameter costs no template rendering.
        params = sampling_params(body, engine.model_config.vocab_size, plan)
        prompt_ids = await _prompt_ids(engine, body, plan)
        rendering = MessagesRendering(
            f"msg_{exchange.request_id}", exchange.model_name, len(prompt_ids), plan=plan
        )
        return await state.generate(
            request,
            exchange,
            prompt_ids,
            params,
            rendering,
            stream=bool(body.stream),
            param_names=_PARAM_NAMES,
        )

    @app.post(
        "/v1/messages/count_tokens",
        responses={200: schemas.json_response(schemas.AnthropicTokenCount), **errors},
    )
    async def count_tokens(request: Request) -> Response:
        _, engine, body = await state.accept(request, CountTokensRequest, _refused)
        prompt_ids = await _prompt_ids(engine, body, _plan(state, engine, body))
        return json_response({"input_tokens": len(prompt_ids)})
