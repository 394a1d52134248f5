"""Function tools as every dialect shares them, on the tool calling of `kvserve.server.tools`:
one validation, one prompt, one parser per template family, one constraint per tool choice, and
one reader of the answer.

Each dialect checks its own `tools` in its own words (`FunctionTool`, `openai_tools`; OpenAI's
and Ollama's tools already have OpenAI's shape), turns its `tool_choice` into OpenAI's, and gets
a `ToolPlan` from `tool_plan`. A forced call (`required` or a named function in OpenAI's words,
Anthropic's `any` or a named tool) comes back with the structured-output constraint its answer
is generated under:

- `required`: a JSON array of ``{"name", "parameters"}`` calls (vLLM's shape);
- a named tool: that tool's arguments, as a JSON object.

`CallReader` reads the answer back as the pieces a renderer draws (`kvserve.server.render`):
text, and each call as a `CallStart`, its arguments in `CallArguments` pieces, and a `CallEnd`.
With `auto` the calls are those the model wrote in its own syntax (Hermes:
`<tool_call>{...}</tool_call>`); a named call streams its arguments as they are generated; a
`required` array is read once it is complete.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.server.protocol import APIError
from kvserve.server.tools import (
    TOOL_NAME,
    ToolCall,
    ToolPlan,
    new_call_id,
    parse_required,
    plan_tools,
    tool_prompt,
)
from kvserve.tokenizer import ChatTemplateError, Tokenizer

__all__ = [
    "CallArguments",
    "CallEnd",
    "CallReader",
    "CallStart",
    "FunctionTool",
    "Piece",
    "encode_conversation",
    "openai_tools",
    "parse_arguments",
    "tool_plan",
]


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """One function the model may call: its name, description and JSON schema of arguments."""

    name: Any
    description: Any
    parameters: Any


def openai_tools(tools: Sequence[FunctionTool], param: str, schema_field: str) -> list[dict]:
    """The tools as OpenAI function tools, or a 400 naming the dialect's own field
    (`{param}[i].name`, `{param}[i].{schema_field}`)."""
    converted: list[dict[str, Any]] = []
    names: set[str] = set()
    for index, tool in enumerate(tools):
        where = f"{param}[{index}]"
        if not isinstance(tool.name, str) or not TOOL_NAME.match(tool.name):
            raise APIError(
                400, f"'{where}.name' must be 1-64 letters, digits, '_' or '-'", param=where
            )
        if tool.name in names:
            raise APIError(400, f"'{where}.name': {tool.name!r} is named twice", param=where)
        names.add(tool.name)
        if not isinstance(tool.parameters, Mapping):
            field = f"{where}.{schema_field}"
            raise APIError(400, f"'{field}' must be a JSON schema object", param=field)
        if tool.description is not None and not isinstance(tool.description, str):
            field = f"{where}.description"
            raise APIError(400, f"'{field}' must be a string", param=field)
        function: dict[str, Any] = {"name": tool.name, "parameters": dict(tool.parameters)}
        if tool.description is not None:
            function["description"] = tool.description
        converted.append({"type": "function", "function": function})
    return converted


def tool_plan(
    tools: list[dict[str, Any]],
    tool_choice: Any,
    *,
    parallel_tool_calls: bool | None,
    parser: str,
    param: str,
) -> ToolPlan | None:
    """The plan of OpenAI-shaped `tools` and `tool_choice` (None: no tools, no choice).

    A forced call's constraint names `param` (the dialect's tools field), so a schema the
    grammar engine refuses is a 400 naming it."""
    plan = plan_tools(
        tools or None,
        tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        parser=parser,
        tools_param=param,
        choice_param="tool_choice",
    )
    if plan is not None and plan.constraint is not None:
        plan = dataclasses.replace(
            plan, constraint=dataclasses.replace(plan.constraint, param=param)
        )
    return plan


async def encode_conversation(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], plan: ToolPlan | None, *, param: str
) -> list[int]:
    """The conversation's prompt ids, the tools shown as the chat dialect shows them (the
    template's `tools` variable, or the fallback prompt); a template error is a 400 naming
    `param`."""
    messages, template_kwargs = tool_prompt(plan, messages, tokenizer.chat_template, {})
    try:
        # Off the event loop: a long conversation takes a while to render and encode.
        return await asyncio.to_thread(lambda: tokenizer.encode_chat(messages, **template_kwargs))
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param=param) from None


def parse_arguments(arguments: str) -> Any:
    """A call's arguments as JSON, or `{}` when they are not valid JSON (cut by the budget)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


# --------------------------------------------------------------------------------------------
# The answer, read back as text and calls


@dataclass(frozen=True, slots=True)
class CallStart:
    """A call begins: its id and the function's name. `named`: the tool choice named this
    function, so the whole answer is this call's arguments."""

    id: str
    name: str
    named: bool = False


@dataclass(frozen=True, slots=True)
class CallArguments:
    """More of the open call's arguments (JSON text)."""

    text: str


@dataclass(frozen=True, slots=True)
class CallEnd:
    """The open call is complete; `arguments` is all of its JSON text."""

    arguments: str


Piece = str | CallStart | CallArguments | CallEnd
"""A piece of the answer as a renderer draws it."""


class CallReader:
    """Reads one answer, a delta at a time, as text and calls under a request's tool plan:
    the one place where the tool choice decides what the answer's text is.

    - no plan, or `none`: all of it is text;
    - `auto`: the calls are those the model wrote in its own syntax (the plan's parser), the
      rest is text;
    - a named function: the whole answer is that call's arguments, streamed as generated;
    - `required`: the answer is a JSON array of calls, read once it is complete (cut short by
      the budget, what there is stays text).

    With tools offered, whitespace-only text that opens the answer or follows a call is layout,
    not content, and is dropped. Call ids begin with `id_prefix`.
    """

    def __init__(self, plan: ToolPlan | None, id_prefix: str) -> None:
        self._choice = plan.choice if plan is not None and plan.offers_tools else "none"
        self._name = plan.name if plan is not None else None
        self._id_prefix = id_prefix
        self._parser = (
            plan.new_parser(id_prefix)
            if plan is not None and self._choice != "none" and plan.reads_with_parser
            else None
        )
        self._text: list[str] = []  # a named call's arguments, or the required array
        self._in_text = False  # text was said since the start or the last call
        self.called = False

    @property
    def offers_tools(self) -> bool:
        """Whether calls may appear in the answer."""
        return self._choice != "none"

    def feed(self, text: str, *, final: bool) -> list[Piece]:
        """The pieces `text` completes; `final` on the answer's last delta."""
        if self._choice == "none":
            return [text] if text else []
        if self._parser is not None:  # auto, or a forced call in the family's own syntax
            items = self._parser.feed(text) if text else []
            if final:
                items += self._parser.finish()
            pieces: list[Piece] = []
            for item in items:
                pieces += self._call(item) if isinstance(item, ToolCall) else self._said(item)
            return pieces
        if self._choice == "named":
            return self._named(text, final)
        self._text.append(text)  # required: the calls are known once the array is complete
        if not final:
            return []
        whole = "".join(self._text)
        calls = parse_required(whole, self._id_prefix)
        if calls is None:  # cut by the budget: what there is stays text
            return self._said(whole)
        return [piece for call in calls for piece in self._call(call)]

    def _said(self, text: str) -> list[Piece]:
        if not self._in_text and not text.strip():
            return []  # layout around calls
        self._in_text = True
        return [text]

    def _named(self, text: str, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        if text:
            if not self.called:
                self.called = True
                call_id = new_call_id(self._id_prefix)
                pieces.append(CallStart(call_id, self._name or "", named=True))
            self._text.append(text)
            pieces.append(CallArguments(text))
        if final and self.called:
            pieces.append(CallEnd("".join(self._text)))
        return pieces

    def _call(self, call: ToolCall) -> list[Piece]:
        self.called = True
        self._in_text = False
        return [
            CallStart(call.id, call.name),
            CallArguments(call.arguments),
            CallEnd(call.arguments),
        ]
