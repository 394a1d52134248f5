"""Anthropic Messages: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

The request's `system`, `messages` (text, `tool_use` and `tool_result` blocks) and `tools` become
a chat-template conversation (tool calls as the assistant's `tool_calls`, results as `tool`
messages). The answer is a `message` with content blocks, `stop_reason` (`end_turn`,
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

from kvserve.engine.stream import Delta
from kvserve.params import SamplingParams
from kvserve.server import schemas
from kvserve.server.core import ServerState, json_response
from kvserve.server.core import sampling_params as core_sampling_params
from kvserve.server.dialects.function_tools import (
    FunctionTool,
    Piece,
    ToolCall,
    ToolCallParser,
    ToolChoice,
    encode_conversation,
    output_pieces,
    parse_arguments,
    require_schema,
    tool_call_schema,
)
from kvserve.server.protocol import APIError, _Model, dumps

__all__ = [
    "PATHS",
    "CountTokensRequest",
    "MessagesRequest",
    "MessagesRendering",
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
    """`{"type": "error", "error": {"type", "message"}}` as Anthropic sends it."""
    return {
        "type": "error",
        "error": {"type": _ERROR_TYPES.get(error.status, "api_error"), "message": error.message},
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


def tool_setup(body: CountTokensRequest) -> tuple[list[FunctionTool], ToolChoice]:
    """The request's tools and tool choice, checked against each other."""
    tools = [FunctionTool(t.name, t.description, t.input_schema) for t in body.tools or ()]
    raw = body.tool_choice
    if raw is None:
        return tools, ToolChoice("auto")
    kind = raw.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise APIError(
            400, "'tool_choice.type' must be auto, any, tool or none", param="tool_choice"
        )
    if not tools and kind != "none":
        raise APIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
    if kind == "tool":
        name = raw.get("name")
        if name not in {tool.name for tool in tools}:
            raise APIError(
                400, f"'tool_choice.name': no tool is named {name!r}", param="tool_choice"
            )
        return tools, ToolChoice("named", name)
    return tools, ToolChoice({"auto": "auto", "any": "required", "none": "none"}[kind])


async def _prompt_ids(
    engine: Any, body: CountTokensRequest
) -> tuple[list[int], list[FunctionTool], ToolChoice]:
    tools, choice = tool_setup(body)
    messages = conversation(body)
    prompt_ids = await encode_conversation(
        engine.tokenizer, messages, tools, choice, param="messages"
    )
    return prompt_ids, tools, choice


def sampling_params(body: MessagesRequest, vocab_size: int) -> SamplingParams:
    """The request's SamplingParams, validated; errors name the Messages field."""
    return core_sampling_params(
        vocab_size,
        _PARAM_NAMES,
        max_tokens=body.max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        stop=tuple(body.stop_sequences or ()),
        ignore_eos=bool(body.ignore_eos),
    )


# --------------------------------------------------------------------------------------------
# Rendering


def _frame(kind: str, data: Mapping[str, Any]) -> str:
    return f"event: {kind}\ndata: {dumps(data)}\n\n"


def _stop_reason(final: Delta, called: bool) -> str:
    if called:
        return "tool_use"
    if final.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if final.stop_sequence is not None else "end_turn"


class MessagesRendering:
    """One Messages answer, streamed (`kvserve.server.core.Rendering`) or whole."""

    def __init__(self, message_id: str, model: str, prompt_tokens: int, *, tools: bool) -> None:
        self.message_id = message_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self._parser = ToolCallParser("toolu_") if tools else None
        self._blocks: list[dict[str, Any]] = []
        self._open_text = False  # the last block is a text block still taking deltas
        self._called = False

    # -- streaming -----------------------------------------------------------------------------

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

    def frames(self, delta: Delta) -> str:
        return "".join(
            self._piece_frames(piece)
            for piece in output_pieces(self._parser, delta.text, final=False)
        )

    def _piece_frames(self, piece: Piece) -> str:
        out = []
        if isinstance(piece, ToolCall):
            out.append(self._close_text())
            index = len(self._blocks)
            self._add_piece(piece)
            start = {"type": "tool_use", "id": piece.call_id, "name": piece.name, "input": {}}
            out.append(
                _frame(
                    "content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": start},
                )
            )
            delta = {"type": "input_json_delta", "partial_json": piece.arguments}
            out.append(
                _frame(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": index, "delta": delta},
                )
            )
            out.append(_frame("content_block_stop", {"type": "content_block_stop", "index": index}))
            return "".join(out)
        if not self._open_text:
            if self._parser is not None and not piece.strip():
                return ""  # no block for whitespace between calls
            start = {"type": "text", "text": ""}
            out.append(
                _frame(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": len(self._blocks),
                        "content_block": start,
                    },
                )
            )
        self._add_piece(piece)
        delta = {"type": "text_delta", "text": piece}
        out.append(
            _frame(
                "content_block_delta",
                {"type": "content_block_delta", "index": len(self._blocks) - 1, "delta": delta},
            )
        )
        return "".join(out)

    def _close_text(self) -> str:
        if not self._open_text:
            return ""
        self._open_text = False
        index = len(self._blocks) - 1
        return _frame("content_block_stop", {"type": "content_block_stop", "index": index})

    def tail(self, final: Delta) -> str:
        parts = [
            self._piece_frames(piece)
            for piece in output_pieces(self._parser, final.text, final=True)
        ]
        parts.append(self._close_text())
        assert final.usage is not None
        delta = {
            "type": "message_delta",
            "delta": {
                "stop_reason": _stop_reason(final, self._called),
                "stop_sequence": final.stop_sequence,
            },
            "usage": {
                "input_tokens": final.usage.prompt_tokens,
                "output_tokens": final.usage.completion_tokens,
            },
        }
        parts.append(_frame("message_delta", delta))
        parts.append(_frame("message_stop", {"type": "message_stop"}))
        return "".join(parts)

    def error_tail(self, error: APIError) -> str:
        return _frame("error", error_body(error))

    # -- whole ---------------------------------------------------------------------------------

    def _add_piece(self, piece: Piece) -> None:
        if isinstance(piece, ToolCall):
            self._called = True
            self._open_text = False
            self._blocks.append(
                {
                    "type": "tool_use",
                    "id": piece.call_id,
                    "name": piece.name,
                    "input": parse_arguments(piece.arguments),
                }
            )
        elif self._open_text:
            self._blocks[-1]["text"] += piece
        elif piece.strip() or self._parser is None:
            self._open_text = True
            self._blocks.append({"type": "text", "text": piece})

    def add(self, delta: Delta) -> None:
        for piece in output_pieces(self._parser, delta.text, final=delta.finished):
            self._add_piece(piece)

    def response(self, final: Delta) -> dict[str, Any]:
        assert final.usage is not None
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "content": self._blocks,
            "model": self.model,
            "stop_reason": _stop_reason(final, self._called),
            "stop_sequence": final.stop_sequence,
            "usage": {
                "input_tokens": final.usage.prompt_tokens,
                "output_tokens": final.usage.completion_tokens,
            },
        }


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
        # Validate before tokenizing: a bad parameter costs no template rendering.
        params = sampling_params(body, engine.model_config.vocab_size)
        prompt_ids, tools, choice = await _prompt_ids(engine, body)
        if choice.forced:
            params = require_schema(params, tool_call_schema(tools, choice), param="tool_choice")
        rendering = MessagesRendering(
            f"msg_{exchange.request_id}",
            state.model_name or "",
            len(prompt_ids),
            tools=bool(tools) and choice.mode != "none",
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
        prompt_ids, _, _ = await _prompt_ids(engine, body)
        return json_response({"input_tokens": len(prompt_ids)})
