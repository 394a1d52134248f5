"""Function tools for the Anthropic Messages and OpenAI Responses dialects: the tools a request
offers, the model's calls found in its text, and the point where an answer must be constrained
to a schema. (The OpenAI chat dialect's tools, constrained by structured output, are in
kvserve.server.tools; the two share the Hermes call syntax and should become one.)

The Anthropic and Responses dialects parse their own `tools` / `tool_choice` into `FunctionTool`
and `ToolChoice`; the chat template receives the tools in the OpenAI shape every template knows
(`{"type": "function", "function": {name, description, parameters}}`).

The model's calls are found in its text in the Hermes/Qwen form,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, by `ToolCallParser`, which holds back
text that could still open a call so that streamed text never shows half a tag.

`require_schema` is where constrained decoding applies: a forced tool call (`any`, a named tool,
`required`) or a JSON-schema answer. No grammar engine is wired in yet, so it refuses the request
by name (400) rather than answer without the guarantee the client asked for.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvserve.params import SamplingParams
from kvserve.server.core import in_thread
from kvserve.server.protocol import APIError
from kvserve.tokenizer import ChatTemplateError, Tokenizer

__all__ = [
    "FunctionTool",
    "ToolCall",
    "ToolCallParser",
    "ToolChoice",
    "encode_conversation",
    "new_call_id",
    "output_pieces",
    "require_schema",
    "tool_call_schema",
]

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """One function the model may call: its name, description and JSON schema of arguments."""

    name: str
    description: str | None
    parameters: Mapping[str, Any]

    def template_dict(self) -> dict[str, Any]:
        """The tool as chat templates expect it in their `tools` variable."""
        function: dict[str, Any] = {"name": self.name, "parameters": dict(self.parameters)}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """Whether the model may call a tool (`auto`), must not (`none`), must call one
    (`required`) or must call `name` (`named`)."""

    mode: Literal["auto", "none", "required", "named"] = "auto"
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call found in the model's text; `arguments` is JSON text."""

    call_id: str
    name: str
    arguments: str


def new_call_id(prefix: str = "call_") -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def tool_call_schema(tools: Sequence[FunctionTool], choice: ToolChoice) -> dict[str, Any]:
    """The JSON schema a forced call must satisfy: the named tool's arguments, or any one
    tool's `{name, arguments}` (as vLLM enforces `required`)."""
    if choice.mode == "named":
        tool = next(t for t in tools if t.name == choice.name)
        return dict(tool.parameters)
    return {
        "type": "object",
        "anyOf": [
            {
                "properties": {
                    "name": {"enum": [tool.name]},
                    "arguments": dict(tool.parameters),
                },
                "required": ["name", "arguments"],
            }
            for tool in tools
        ],
    }


def require_schema(
    params: SamplingParams, schema: Mapping[str, Any], *, param: str
) -> SamplingParams:
    """`params` constrained to answers matching `schema`, or a 400 naming `param`.

    This is the one place constrained decoding plugs in: until the engine can apply a grammar,
    no answer could be guaranteed to match, so the request is refused."""
    raise APIError(
        400,
        f"'{param}': answers constrained to a JSON schema are not supported yet "
        "(structured output is not available on this server)",
        param=param,
    )


Piece = str | ToolCall
"""A piece of the model's output: text, or a tool call."""


class ToolCallParser:
    """Finds `<tool_call>{json}</tool_call>` in text fed a delta at a time.

    `feed` returns the pieces that are certain now: text (never part of a tag) and complete
    calls; `flush` returns the rest at the end. A call whose body is not a JSON object with a
    string `name` stays text, as the model wrote it.
    """

    def __init__(self, call_id_prefix: str = "call_") -> None:
        self._buffer = ""
        self._inside = False
        self._prefix = call_id_prefix

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE_TAG)
                if end < 0:
                    return pieces
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE_TAG) :]
                self._inside = False
                _append(pieces, self._call(body) or OPEN_TAG + body + CLOSE_TAG)
                continue
            start = self._buffer.find(OPEN_TAG)
            if start >= 0:
                _append(pieces, self._buffer[:start])
                self._buffer = self._buffer[start + len(OPEN_TAG) :]
                self._inside = True
                continue
            keep = _partial_tag_length(self._buffer)
            _append(pieces, self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return pieces

    def flush(self) -> list[Piece]:
        """The pieces still held: an unclosed call (the model may end on its stop token
        instead of the closing tag) or held-back text."""
        rest, self._buffer = self._buffer, ""
        pieces: list[Piece] = []
        if self._inside:
            self._inside = False
            _append(pieces, self._call(rest) or OPEN_TAG + rest)
        else:
            _append(pieces, rest)
        return pieces

    def _call(self, body: str) -> ToolCall | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            text = arguments
        else:
            text = json.dumps(arguments, ensure_ascii=False)
        return ToolCall(new_call_id(self._prefix), value["name"], text)


def _append(pieces: list[Piece], piece: Piece) -> None:
    if isinstance(piece, str):
        if not piece:
            return
        if pieces and isinstance(pieces[-1], str):
            pieces[-1] += piece
            return
    pieces.append(piece)


def _partial_tag_length(text: str) -> int:
    """The length of the longest end of `text` that could begin the opening tag."""
    for length in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if OPEN_TAG.startswith(text[-length:]):
            return length
    return 0


def parse_arguments(arguments: str) -> Any:
    """A call's arguments as JSON, or `{}` when they are not valid JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


def output_pieces(parser: ToolCallParser | None, text: str, *, final: bool) -> list[Piece]:
    """A delta's text as pieces: as it is without tools, else through the parser (flushed on
    the final delta)."""
    if parser is None:
        return [text] if text else []
    pieces = parser.feed(text)
    if final:
        pieces += parser.flush()
    return pieces


async def encode_conversation(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: Sequence[FunctionTool],
    choice: ToolChoice,
    *,
    param: str,
) -> list[int]:
    """The conversation's prompt ids, the tools in the template's `tools` variable unless the
    choice is `none`; a template error is a 400 naming `param`."""
    template_kwargs: dict[str, Any] = {}
    if tools and choice.mode != "none":
        template_kwargs["tools"] = [tool.template_dict() for tool in tools]
    try:
        return await in_thread(lambda: tokenizer.encode_chat(messages, **template_kwargs))
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param=param) from None
