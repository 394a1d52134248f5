"""OpenAI Responses: `POST /v1/responses`, stateless.

`input` (a string, or message / `function_call` / `function_call_output` items) and
`instructions` become a chat-template conversation; function `tools` are shown to the model as
the chat dialect shows them. `text.format` `json_schema` / `json_object`, and a `required` or
named `tool_choice`, constrain the answer through structured output. Nothing is stored (`store`
is treated as false), so `previous_response_id` is refused by name.

The answer is a `response` whose `output` holds a `message` item with `output_text` (and a
`function_call` item per call found), with `usage` and `status` (`completed`, or `incomplete`
with `incomplete_details` when `max_output_tokens` ran out). Streamed, every event carries its
`sequence_number`: `response.created`, `response.in_progress`, then per item
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta`...,
`response.output_text.done`, `response.content_part.done`, `response.output_item.done` (function
calls: `response.function_call_arguments.delta` / `.done`), and last `response.completed` with
the whole response, its status and usage. An error after the stream began is
`response.failed`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from kvserve.engine.stream import Usage
from kvserve.params import SamplingParams, StructuredOutput
from kvserve.server import schemas
from kvserve.server.core import ServerState
from kvserve.server.dialects.function_tools import (
    FunctionTool,
    encode_conversation,
    openai_tools,
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
from kvserve.server.structured import from_text_format
from kvserve.server.tools import ToolPlan, parser_for

__all__ = [
    "PATHS",
    "ResponsesBody",
    "ResponsesRendering",
    "ResponsesRequest",
    "ResponsesStream",
    "register",
]

PATHS = ("/v1/responses",)

_PARAM_NAMES = {"prompt": "input", "max_tokens": "max_output_tokens"}

_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


class ResponsesRequest(_Model):
    """`POST /v1/responses`."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None
    # vLLM's extension, as on the OpenAI routes: generate all max tokens, past the stop token.
    ignore_eos: bool | None = None


def _refused(extras: Mapping[str, Any]) -> tuple[list[str], APIError | None]:
    """Responses extras that would change the answer are refused; the rest are reported."""
    ignored: list[str] = []
    for name, value in extras.items():
        if name in ("conversation", "prompt", "background", "reasoning", "top_logprobs") and value:
            return ignored, APIError(400, f"'{name}' is not supported", param=name)
        ignored.append(name)
    return ignored, None


# --------------------------------------------------------------------------------------------
# Request to conversation


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"'{where}' must be a string or a list of parts", param=where)
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(
                400, f"'{where}[{index}]': only text parts are supported, got {kind!r}", param=where
            )
        texts.append(part["text"])
    return "\n".join(texts)


def conversation(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request as chat-template messages (the OpenAI chat shape templates know)."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return messages
    for index, item in enumerate(body.input):
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"'{where}.role' is not a known role", param=f"{where}.role")
            text = _content_text(item.get("content"), f"{where}.content")
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            arguments = item.get("arguments")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise APIError(
                    400, f"'{where}': a function_call needs call_id, name, arguments", param=where
                )
            call = {"id": call_id, "type": "function", "function": {"name": name}}
            call["function"]["arguments"] = _json_or_text(arguments)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise APIError(
                    400, f"'{where}': a function_call_output needs call_id and output", param=where
                )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise APIError(400, f"'{where}': {kind!r} items are not supported", param=where)
    return messages


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def tool_setup(body: ResponsesRequest, parser: str) -> ToolPlan | None:
    """The request's function tools and tool choice as a plan (None: neither is given);
    `required` and a named function come with the constraint of their forced call."""
    specs = []
    for index, tool in enumerate(body.tools or ()):
        if tool.get("type") != "function":
            where = f"tools[{index}].type"
            raise APIError(400, f"'{where}': only function tools are supported", param=where)
        parameters = tool.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        specs.append(FunctionTool(tool.get("name"), tool.get("description"), parameters))
    tools = openai_tools(specs, "tools", "parameters")
    raw = body.tool_choice
    choice: Any = raw
    if isinstance(raw, Mapping):
        if raw.get("type") != "function" or not isinstance(raw.get("name"), str):
            raise APIError(
                400,
                "'tool_choice' must be none, auto, required or {'type': 'function', 'name'}",
                param="tool_choice",
            )
        choice = {"type": "function", "function": {"name": raw["name"]}}
    return tool_plan(
        tools,
        choice,
        parallel_tool_calls=body.parallel_tool_calls,
        parser=parser,
        param="tools",
    )


def sampling_params(
    body: ResponsesRequest, vocab_size: int, structured: StructuredOutput | None = None
) -> SamplingParams:
    """The request's SamplingParams, validated; errors name the Responses field. `structured`
    is the answer's constraint (`text.format`, or a forced function call)."""
    return validated_sampling_params(
        vocab_size,
        _PARAM_NAMES,
        max_tokens=body.max_output_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        ignore_eos=bool(body.ignore_eos),
        structured=structured,
    )


def constraint(body: ResponsesRequest, plan: ToolPlan | None) -> StructuredOutput | None:
    """The answer's constraint: `text.format`'s JSON, or a forced call's (not both)."""
    text_format = from_text_format((body.text or {}).get("format"))
    forced = plan.constraint if plan is not None else None
    if text_format is not None and forced is not None:
        raise APIError(
            400,
            "a required or named tool choice already constrains the answer; "
            "drop the JSON 'text.format'",
            param="tool_choice",
        )
    return text_format or forced


# --------------------------------------------------------------------------------------------
# Rendering


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


Event = tuple[str, dict[str, Any]]
"""A stream event: its type and its fields (the sequence number is added when it is sent)."""


class _Output:
    """The response's output items, built piece by piece: text becomes a `message` item with
    one `output_text` part, each call a `function_call` item. Each change is also returned as
    the events that announce it."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open_message = False

    def add(self, update: Update) -> list[Event]:
        events: list[Event] = []
        for piece in update.pieces:
            events += self._add(piece)
        return events

    def _add(self, piece: Piece) -> list[Event]:
        if isinstance(piece, CallStart):
            item = {
                "type": "function_call",
                "id": _item_id("fc"),
                "call_id": piece.id,
                "name": piece.name,
                "arguments": "",
                "status": "in_progress",
            }
            events = self._close_message()
            self.items.append(item)
            index = len(self.items) - 1
            return [*events, ("response.output_item.added", {"output_index": index, "item": item})]
        if isinstance(piece, CallArguments | CallEnd):
            item = self.items[-1]
            ids = {"item_id": item["id"], "output_index": len(self.items) - 1}
            if isinstance(piece, CallArguments):
                item["arguments"] += piece.text
                return [("response.function_call_arguments.delta", {**ids, "delta": piece.text})]
            item["arguments"] = piece.arguments
            item["status"] = "completed"
            return [
                (
                    "response.function_call_arguments.done",
                    {**ids, "arguments": piece.arguments},
                ),
                ("response.output_item.done", {"output_index": ids["output_index"], "item": item}),
            ]
        events = [] if self._open_message else self._open()
        part = self.items[-1]["content"][0]
        part["text"] += piece
        delta = {
            "item_id": self.items[-1]["id"],
            "output_index": len(self.items) - 1,
            "content_index": 0,
            "delta": piece,
            "logprobs": [],
        }
        return [*events, ("response.output_text.delta", delta)]

    def _open(self) -> list[Event]:
        self._open_message = True
        item = {
            "type": "message",
            "id": _item_id("msg"),
            "status": "in_progress",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}],
        }
        self.items.append(item)
        index = len(self.items) - 1
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            (
                "response.output_item.added",
                {"output_index": index, "item": {**item, "content": []}},
            ),
            (
                "response.content_part.added",
                {"item_id": item["id"], "output_index": index, "content_index": 0, "part": part},
            ),
        ]

    def _close_message(self) -> list[Event]:
        if not self._open_message:
            return []
        self._open_message = False
        item = self.items[-1]
        item["status"] = "completed"
        index = len(self.items) - 1
        part = item["content"][0]
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            ("response.output_text.done", {**ids, "text": part["text"], "logprobs": []}),
            ("response.content_part.done", {**ids, "part": part}),
            ("response.output_item.done", {"output_index": index, "item": item}),
        ]

    def finish(self) -> list[Event]:
        """The end of the output: an empty answer is still a message; the message closes."""
        events = [] if self.items else self._open()
        return events + self._close_message()


class _ResponseObject:
    """What the streamed and the whole answer share: the `response` object around the output.

    `settings` are the request's own values the response object repeats (instructions,
    max_output_tokens, temperature, tools, ...)."""

    def __init__(self, response_id: str, model: str, settings: Mapping[str, Any]) -> None:
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.settings = dict(settings)
        self.output = _Output()

    def _response(
        self,
        status: str,
        *,
        usage: Usage | None = None,
        error: Any = None,
        incomplete: bool = False,
    ) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "model": self.model,
            "output": self.output.items,
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "store": False,
            **self.settings,
            "usage": None if usage is None else _usage(usage),
        }

    def _finished(self, ending: Ending) -> dict[str, Any]:
        incomplete = ending.finish_reason == "length"
        return self._response(
            "incomplete" if incomplete else "completed", usage=ending.usage, incomplete=incomplete
        )


class ResponsesStream(_ResponseObject, StreamRenderer):
    """A Responses answer streamed: every event carries its `sequence_number`;
    `response.created` and `response.in_progress` first, `response.completed` (the whole
    response) last, `response.failed` for an error after the start."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._sequence = 0

    def _events(self, events: list[Event]) -> str:
        return "".join(self._event(kind, **fields) for kind, fields in events)

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {dumps(data)}\n\n"

    def head(self) -> str:
        response = self._response("in_progress")
        return self._event("response.created", response=response) + self._event(
            "response.in_progress", response=response
        )

    def update(self, update: Update) -> str:
        return self._events(self.output.add(update))

    def tail(self, ending: Ending) -> str:
        out = self._events(self.output.finish())
        return out + self._event("response.completed", response=self._finished(ending))

    def error(self, error: APIError) -> str:
        failed = self._response(
            "failed", error={"code": error.code or error.error_type, "message": error.message}
        )
        return self._event("response.failed", response=failed)


class ResponsesBody(_ResponseObject, BodyRenderer):
    """A Responses answer whole: the `response` with its output items, status and usage
    (`incomplete` with `incomplete_details` when max_output_tokens ran out)."""

    def update(self, update: Update) -> None:
        self.output.add(update)

    def body(self, ending: Ending) -> dict[str, Any]:
        self.output.finish()
        return self._finished(ending)


class ResponsesRendering(Rendering):
    """One Responses answer, streamed or whole. `plan` is the request's tools (None without):
    each call found is a `function_call` item."""

    def __init__(
        self,
        response_id: str,
        model: str,
        settings: Mapping[str, Any],
        *,
        plan: ToolPlan | None = None,
    ) -> None:
        super().__init__(
            plan,
            stream=lambda: ResponsesStream(response_id, model, settings),
            whole=lambda: ResponsesBody(response_id, model, settings),
            id_prefix="call_",
        )


# --------------------------------------------------------------------------------------------
# Routes


BODIES = {("post", "/v1/responses"): ResponsesRequest}
"""The route's JSON body, for the API's description."""


def register(app: FastAPI, state: ServerState) -> None:
    """Add the route."""

    @app.post(
        "/v1/responses",
        responses={
            200: schemas.stream_response(schemas.ResponseObject, schemas.ResponseEvent),
            **schemas.error_responses(400, 401, 404, 413, 429, 503),
        },
    )
    async def responses(request: Request) -> Response:
        exchange, engine, body = await state.accept(request, ResponsesRequest, _refused)
        if body.previous_response_id is not None:
            raise APIError(
                400,
                "'previous_response_id': this server stores no responses; send the whole "
                "conversation in 'input'",
                param="previous_response_id",
            )
        tokenizer = engine.tokenizer
        plan = tool_setup(body, parser_for(tokenizer.chat_template, state.config.tool_call_parser))
        params = sampling_params(body, engine.model_config.vocab_size, constraint(body, plan))
        messages = conversation(body)
        if not messages:
            raise APIError(400, "'input' must hold at least one item", param="input")
        prompt_ids = await encode_conversation(tokenizer, messages, plan, param="input")
        settings = {
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "temperature": params.temperature,
            "top_p": params.top_p,
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
        }
        rendering = ResponsesRendering(
            f"resp_{exchange.request_id}", exchange.model_name, settings, plan=plan
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
