"""Tool calling: request validation, the prompt, the constraint, and the parsers per template
family.

The entry point every dialect uses is `plan_tools(tools, tool_choice)`: it validates OpenAI
function tools and a tool choice and returns a `ToolPlan`, whose `constraint` (a
`StructuredOutput`, or None) rides on the engine request's `SamplingParams.structured`:

- `none`: no tools reach the model; the answer is text;
- `auto`: the tools reach the model, which answers in its own tool-call syntax; the text is
  parsed afterwards (a parser per chat-template family, `--tool-call-parser`), and text that is
  not a call stays content;
- `required`: the answer is constrained to a JSON array of one or more calls,
  ``[{"name": <enum of the tools>, "parameters": <that tool's schema>}, ...]`` (vLLM's shape);
- a named function: the answer is constrained to that function's `parameters` schema, and is
  the call's arguments.

Enforced parameter schemas are closed (`additionalProperties: false` where unsaid), as OpenAI's
strict function calling does.

Tools reach the model through the chat template's `tools` variable. A template that never
reads it gets `FALLBACK_TOOL_PROMPT` as (the start of) the system message instead, and its
conversation history is rewritten in the same Hermes syntax: an assistant message's
`tool_calls` become `<tool_call>` blocks in its content, a `role: "tool"` message becomes a user
message holding `<tool_response>` (docs/structured-output.md).
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.params import SamplingParamsError, StructuredOutput
from kvserve.server.protocol import APIError

__all__ = [
    "FALLBACK_TOOL_PROMPT",
    "TOOL_CALL_PARSERS",
    "TOOL_NAME",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ToolCall",
    "ToolCallParser",
    "ToolPlan",
    "parse_tool_choice",
    "parser_for",
    "plan_tools",
    "template_family",
    "tool_prompt",
]

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""A function tool's name, as OpenAI and Anthropic allow it."""

FALLBACK_TOOL_PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
"""The system prompt that teaches a model whose template has no `tools` variable the Hermes
tool-call syntax (as Qwen2.5's and Hermes' templates write it)."""


def new_call_id(prefix: str = "call_") -> str:
    """A fresh call id (`call_...` as OpenAI writes them; Anthropic's are `toolu_...`)."""
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def as_dict(self) -> dict[str, Any]:
        """The OpenAI `tool_calls[]` entry."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's tools and tool choice mean for generation and for the answer.

    `choice` is "none", "auto", "required" or "named" (then `name` is the function);
    `constraint` is what the sampler must enforce (None for none/auto); `tools` are the
    validated OpenAI tool objects.
    """

    tools: tuple[Mapping[str, Any], ...]
    choice: str
    name: str | None = None
    constraint: StructuredOutput | None = None
    parser: str = "hermes"

    @property
    def offers_tools(self) -> bool:
        """Whether the model is shown the tools."""
        return self.choice != "none" and bool(self.tools)

    @property
    def schemas(self) -> dict[str, Mapping[str, Any]]:
        return {tool["function"]["name"]: _parameters(tool) for tool in self.tools}

    @property
    def reads_with_parser(self) -> bool:
        """Whether the answer is read by the family's parser: under `auto`, and under a forced
        choice when the family writes forced calls in its own syntax (Llama 3, Mistral)."""
        if self.choice == "auto":
            return True
        return self.choice != "none" and TOOL_CALL_PARSERS[self.parser].forced_in_syntax

    def new_parser(self, id_prefix: str = "call_") -> ToolCallParser:
        """A fresh parser for one answer under this plan."""
        return TOOL_CALL_PARSERS[self.parser](id_prefix, forced=self.choice != "auto")


def _parameters(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    parameters = tool["function"].get("parameters")
    return parameters if parameters is not None else {"type": "object", "properties": {}}


def closed_schema(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object that lists its properties
    and says nothing about others. Enforced arguments then hold only the declared parameters:
    left open, a small model invents keys until max_tokens."""
    if isinstance(schema, list):
        return [closed_schema(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    closed = {key: closed_schema(value) for key, value in schema.items()}
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def _validate_tools(tools: Any, param: str) -> tuple[Mapping[str, Any], ...]:
    if not isinstance(tools, list) or not tools:
        raise APIError(400, f"'{param}' must be a non-empty list of function tools", param=param)
    names: set[str] = set()
    for index, tool in enumerate(tools):
        where = f"{param}[{index}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise APIError(
                400, f"'{where}' must be {{'type': 'function', 'function': {{...}}}}", param=where
            )
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise APIError(400, f"'{where}.function' must be an object", param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise APIError(
                400,
                f"'{where}.function.name' must be 1-64 letters, digits, '_' or '-'",
                param=f"{where}.function.name",
            )
        if name in names:
            raise APIError(
                400, f"'{where}.function.name': {name!r} is named twice", param=f"{where}.function"
            )
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise APIError(
                400,
                f"'{where}.function.parameters' must be a JSON schema object",
                param=f"{where}.function.parameters",
            )
    return tuple(tools)


def parse_tool_choice(
    tool_choice: Any, names: Sequence[str], param: str = "tool_choice"
) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", function name or None)."""
    if tool_choice is None:
        return ("auto" if names else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice in ("none", "auto", "required"):
            if tool_choice != "none" and not names:
                raise APIError(400, f"'{param}' {tool_choice!r} needs 'tools'", param=param)
            return tool_choice, None
        raise APIError(
            400,
            f"'{param}' must be 'none', 'auto', 'required' or a function, not {tool_choice!r}",
            param=param,
        )
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str):
            raise APIError(400, f"'{param}.function.name' must be a string", param=param)
        if name not in names:
            known = ", ".join(names) if names else "no tools were given"
            raise APIError(
                400,
                f"'{param}' names {name!r}, which is not among the tools ({known})",
                param=param,
            )
        return "named", name
    raise APIError(
        400,
        f"'{param}' must be 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}",
        param=param,
    )


def plan_tools(
    tools: Any,
    tool_choice: Any,
    *,
    parallel_tool_calls: bool | None = None,
    parser: str = "hermes",
    tools_param: str = "tools",
    choice_param: str = "tool_choice",
) -> ToolPlan | None:
    """Validate `tools` and `tool_choice` (OpenAI shapes); None when neither is given.

    Raises APIError(400) naming the field. The plan's `constraint` goes into
    `SamplingParams.structured`; with `parallel_tool_calls` false, `required` allows one call.
    """
    if tools is None and tool_choice is None:
        return None
    validated = _validate_tools(tools, tools_param) if tools is not None else ()
    names = [tool["function"]["name"] for tool in validated]
    choice, name = parse_tool_choice(tool_choice, names, choice_param)
    plan = ToolPlan(validated, choice, name, parser=parser)
    family = (
        TOOL_CALL_PARSERS[parser].forced_schema(plan.schemas, name, parallel_tool_calls)
        if choice in ("named", "required")
        else None
    )
    try:
        if family is not None:
            where = f"{tools_param}.function.parameters" if choice == "named" else tools_param
            constraint = StructuredOutput.json_schema(family, where)
        elif choice == "named":
            schema = closed_schema(plan.schemas[name])
            constraint = StructuredOutput.json_schema(schema, f"{tools_param}.function.parameters")
        elif choice == "required":
            items = {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "name": {"const": tool_name},
                            "parameters": closed_schema(schema),
                        },
                        "required": ["name", "parameters"],
                        "additionalProperties": False,
                    }
                    for tool_name, schema in plan.schemas.items()
                ]
            }
            array: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
            if parallel_tool_calls is False:
                array["maxItems"] = 1
            constraint = StructuredOutput.json_schema(array, tools_param)
        else:
            constraint = None
    except SamplingParamsError as exc:
        raise APIError(400, f"'{exc.param}': {exc.message}", param=exc.param) from None
    return ToolPlan(validated, choice, name, constraint, parser)


# --------------------------------------------------------------------------------------------
# The prompt


def template_reads_tools(template: str | None) -> bool:
    """Whether a chat template uses its `tools` variable (else the fallback prompt is used)."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def tool_prompt(
    plan: ToolPlan | None,
    messages: list[dict[str, Any]],
    template: str | None,
    template_kwargs: dict[str, Any],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and template variables that show the tools (and tool history) to the model.

    A template that reads `tools` gets them as its variable and the history with each call's
    arguments as an object (Llama 3's and Mistral's templates write them with `tojson`, as
    vLLM hands them over); Mistral's templates also get call ids of the nine letters and
    digits they require. Any other template gets the fallback system prompt and the history
    rewritten in Hermes syntax.
    """
    native = template_reads_tools(template)
    if native:
        if plan is not None and plan.offers_tools:
            template_kwargs = {**template_kwargs, "tools": [dict(tool) for tool in plan.tools]}
        short_ids = template_family(template) == "mistral"
        return [_native_history(message, short_ids) for message in messages], template_kwargs
    messages = [_hermes_history(message) for message in messages]
    if plan is not None and plan.offers_tools:
        listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in plan.tools)
        prompt = FALLBACK_TOOL_PROMPT.format(tools=listing)
        if messages and messages[0].get("role") == "system":
            first = dict(messages[0])
            first["content"] = f"{_text(first.get('content'))}\n\n{prompt}"
            messages = [first, *messages[1:]]
        else:
            messages = [{"role": "system", "content": prompt}, *messages]
    return messages, template_kwargs


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "") for part in content if isinstance(part, Mapping)
        )  # text parts
    return str(content)


def mistral_call_id(call_id: str) -> str:
    """A call id as Mistral's templates require it: nine letters and digits (the last nine of
    the id's own, as vLLM cuts them, or a digest of a shorter id). The same id always gives
    the same nine, so a call and its result still match."""
    plain = re.sub(r"[^A-Za-z0-9]", "", call_id)
    if len(plain) >= 9:
        return plain[-9:]
    return hashlib.sha256(call_id.encode("utf-8")).hexdigest()[:9]


def _native_history(message: dict[str, Any], short_ids: bool) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if message.get("role") == "assistant" and isinstance(calls, list) and calls:
        rewritten = []
        for call in calls:
            if not isinstance(call, Mapping):
                rewritten.append(call)
                continue
            call = dict(call)
            function = call.get("function")
            if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
                try:
                    arguments = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    arguments = function["arguments"]
                call["function"] = {**function, "arguments": arguments}
            if short_ids and isinstance(call.get("id"), str):
                call["id"] = mistral_call_id(call["id"])
            rewritten.append(call)
        return {**message, "tool_calls": rewritten}
    if short_ids and message.get("role") == "tool" and isinstance(message.get("tool_call_id"), str):
        return {**message, "tool_call_id": mistral_call_id(message["tool_call_id"])}
    return message


def _hermes_history(message: dict[str, Any]) -> dict[str, Any]:
    role = message.get("role")
    if role == "assistant" and message.get("tool_calls"):
        blocks = []
        for call in message["tool_calls"]:
            function = call.get("function", {}) if isinstance(call, Mapping) else {}
            arguments = function.get("arguments", "{}")
            try:
                parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError:
                parsed = arguments
            body = json.dumps({"name": function.get("name"), "arguments": parsed})
            blocks.append(f"<tool_call>\n{body}\n</tool_call>")
        text = _text(message.get("content"))
        content = "\n".join([text, *blocks] if text else blocks)
        return {"role": "assistant", "content": content}
    if role == "tool":
        return {
            "role": "user",
            "content": f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>",
        }
    return message


# --------------------------------------------------------------------------------------------
# Parsers of the model's own tool-call syntax (tool_choice "auto")


class HermesToolParser:
    """Hermes/Qwen syntax: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

    Fed text as it is generated, it returns what can be said so far: content that cannot be the
    start of a call, and each call once its block closes. A block whose body is not a call
    (not JSON, no name) stays content, tags included. Whitespace next to a call is layout, not
    content; elsewhere trailing whitespace is held until more text shows which it is.

    Models of the family also open an answer with the call bare, or in a Markdown JSON fence
    (``{"name": ..., "arguments": {...}}``; Qwen2.5-Coder writes it so): an answer that opens
    with such an object (both keys) reads it as a call, as Ollama does. The opening is held
    only while it can still be one: ``{"name"`` decides, anything else is content at once.
    """

    start = "<tool_call>"
    end = "</tool_call>"
    forced_in_syntax = False
    """Forced answers (required, named) are not in this syntax: `parse_required` reads a
    required one, a named one is the arguments themselves."""
    reads_bare_calls = True

    def __init__(self, id_prefix: str = "call_", *, forced: bool = False) -> None:
        self._id_prefix = id_prefix
        self._buffer = ""
        self._in_call = False
        self._pending_space = ""
        self._after_call = False
        self.calls: list[ToolCall] = []
        self._opening: str | None = "" if self.reads_bare_calls else None  # held opening text

    def _bare_opening(self, out: list[str | ToolCall], *, final: bool) -> str | None:
        """Read the held opening of the answer: None while it may still be a bare call (hold
        on), else the text left to read in the tagged syntax (a call found is in `out`)."""
        raw = self._opening or ""
        text = raw.lstrip()
        fenced = text.startswith("```")
        if not fenced and "```".startswith(text) and text:
            return None if not final else raw  # "`" or "``" so far
        rest = text
        if fenced:
            rest = text[3:]
            if not rest or ("json".startswith(rest) and rest != "json"):
                return None if not final else raw
            if rest.startswith("json"):
                rest = rest[4:]
            rest = rest.lstrip()
        if not rest:
            return None if not final else raw
        if rest[0] != "{":
            return raw
        head = rest[1:].lstrip()
        if len(head) < len('"name"'):
            return raw if final or not '"name"'.startswith(head) else None
        if not head.startswith('"name"'):
            return raw
        end = _json_end(rest)
        if end is None:
            return raw if final else None
        try:
            value = json.loads(rest[:end])
        except json.JSONDecodeError:
            return raw
        keys = {"arguments", "parameters"}
        call = _call_of(value, self._id_prefix, "arguments") if keys & set(value) else None
        if call is None:
            return raw
        after = rest[end:]
        if fenced:
            closing = after.lstrip()
            if "```".startswith(closing) and len(closing) < 3 and not final:
                return None  # the closing fence may follow
            if closing.startswith("```"):
                after = closing[3:]
        self.calls.append(call)
        out.append(call)
        self._after_call = True
        return after

    @staticmethod
    def forced_schema(
        schemas: Mapping[str, Mapping[str, Any]], name: str | None, parallel: bool | None
    ) -> dict[str, Any] | None:
        """None: forced answers take `plan_tools`' shapes (vLLM's array, or the arguments)."""
        return None

    def feed(self, text: str) -> list[str | ToolCall]:
        """New content strings and completed calls, in order."""
        out: list[str | ToolCall] = []
        if self._opening is not None:
            self._opening += text
            left = self._bare_opening(out, final=False)
            if left is None:
                return out
            self._opening = None
            text = left
        self._buffer += text
        while True:
            if not self._in_call:
                index = self._buffer.find(self.start)
                if index >= 0:
                    self._content(out, self._buffer[:index])
                    self._buffer = self._buffer[index + len(self.start) :]
                    self._in_call = True
                    continue
                keep = _partial_suffix(self._buffer, self.start)
                self._content(out, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return out
            index = self._buffer.find(self.end)
            if index < 0:
                return out
            self._block(out, self._buffer[:index], closed=True)
            self._buffer = self._buffer[index + len(self.end) :]
            self._in_call = False

    def finish(self) -> list[str | ToolCall]:
        """Whatever is left once the answer has ended (an unclosed block may still be a call)."""
        out: list[str | ToolCall] = []
        if self._opening is not None:
            left = self._bare_opening(out, final=True) or ""
            self._opening = None
            out += self.feed(left)
        if self._in_call:
            self._block(out, self._buffer, closed=False)
        else:
            self._content(out, self._buffer)
        if self._pending_space and not self._after_call:
            out.append(self._pending_space)
        self._pending_space = ""
        self._buffer = ""
        self._in_call = False
        return out

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole answer: (content or None, calls)."""
        items = self.feed(text) + self.finish()
        content = "".join(item for item in items if isinstance(item, str))
        calls = [item for item in items if isinstance(item, ToolCall)]
        return (content or None), calls

    def _content(self, out: list[str | ToolCall], text: str) -> None:
        # Trailing whitespace waits: before a call it is layout and dropped, before more text
        # it is content. Leading whitespace right after a call is layout too.
        body = text.rstrip()
        if body:
            # Whitespace held since a call (or since earlier text) is settled by this text.
            piece = body.lstrip() if self._after_call else self._pending_space + body
            self._pending_space = ""
            self._after_call = False
            if piece:
                out.append(piece)
        self._pending_space += text[len(body) :]

    def _block(self, out: list[str | ToolCall], body: str, *, closed: bool) -> None:
        call = parse_call_json(body, self._id_prefix)
        if call is None:
            tail = self.end if closed else ""
            self._content(out, f"{self.start}{body}{tail}")
            return
        self._pending_space = ""
        self._after_call = True
        self.calls.append(call)
        out.append(call)


def parse_call_json(body: str, id_prefix: str = "call_") -> ToolCall | None:
    """``{"name": ..., "arguments": {...}}`` (or "parameters") as a call; None otherwise."""
    try:
        value = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(value, Mapping) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(value["name"], text, new_call_id(id_prefix))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def _json_end(text: str, start: int = 0) -> int | None:
    """The end of the JSON object or array that opens at `text[start]`, or None when it does not
    close within `text` (brackets counted outside strings; the JSON itself is checked later)."""
    depth = 0
    in_string = escaped = False
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return index + 1
    return None


def _call_of(value: Any, id_prefix: str, arguments_key: str) -> ToolCall | None:
    """`{"name": ..., <arguments_key>: {...}}` (either key accepted) as a call; None otherwise."""
    if not isinstance(value, Mapping) or not isinstance(value.get("name"), str):
        return None
    other = "parameters" if arguments_key == "arguments" else "arguments"
    arguments = value.get(arguments_key, value.get(other, {}))
    if isinstance(arguments, str):
        text = arguments
    elif isinstance(arguments, Mapping):
        text = json.dumps(arguments, ensure_ascii=False)
    else:
        return None
    return ToolCall(value["name"], text, new_call_id(id_prefix))


def _closed_call_schema(name: str, schema: Mapping[str, Any], arguments_key: str) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, arguments_key: closed_schema(schema)},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


class Llama3JsonToolParser:
    """Llama 3.1-3.3 syntax: the answer is a call, ``{"name": ..., "parameters": {...}}``, bare
    or after ``<|python_tag|>`` (several are taken when joined by ``;``).

    As Llama 3's templates teach it and vLLM's `llama3_json` reads it, a call opens the answer
    (after any whitespace); an answer that opens otherwise is content, and so is one whose
    JSON is not a call (tag and all). Calls come out whole, each once its object closes.
    """

    tag = "<|python_tag|>"
    forced_in_syntax = True
    """A forced answer (required, named) is written in this syntax and read back by `parse`."""

    def __init__(self, id_prefix: str = "call_", *, forced: bool = False) -> None:
        self._id_prefix = id_prefix
        self._buffer = ""
        self._raw = ""  # all text so far while no call has come out (content if none does)
        self._state = "start"  # start | calls | content
        self.calls: list[ToolCall] = []

    @staticmethod
    def forced_schema(
        schemas: Mapping[str, Mapping[str, Any]], name: str | None, parallel: bool | None
    ) -> dict[str, Any]:
        """The JSON an answer under `required` (name None) or a named choice is held to: one
        call object, as Llama 3's templates take one call per assistant turn. The tag is
        left out: in Llama 3's vocabulary it is a control token, which a grammar over text
        cannot write; `parse` reads the call with or without it."""
        if name is not None:
            return _closed_call_schema(name, schemas[name], "parameters")
        return {"anyOf": [_closed_call_schema(n, s, "parameters") for n, s in schemas.items()]}

    def feed(self, text: str) -> list[str | ToolCall]:
        """New content strings and completed calls, in order."""
        self._buffer += text
        if self._state == "calls" and not self.calls:
            self._raw += text
        out: list[str | ToolCall] = []
        if self._state == "start":
            opening = self._buffer.lstrip()
            if not opening or (self.tag.startswith(opening) and opening != self.tag):
                return out  # whitespace, or the tag so far: wait
            if opening.startswith(self.tag) or opening.startswith("{"):
                self._state = "calls"
                self._raw = self._buffer
                self._buffer = opening.removeprefix(self.tag)
            else:
                self._state = "content"
        if self._state == "calls":
            self._read_calls(out, final=False)
        if self._state == "content" and self._buffer:
            out.append(self._buffer)
            self._buffer = ""
        return out

    def finish(self) -> list[str | ToolCall]:
        """Whatever is left once the answer has ended."""
        out: list[str | ToolCall] = []
        if self._state == "calls":
            self._read_calls(out, final=True)
        if self._buffer and (self._state != "start" or self._buffer.strip()):
            out.append(self._buffer)
        self._buffer = ""
        self._state = "content"
        return out

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole answer: (content or None, calls)."""
        items = self.feed(text) + self.finish()
        content = "".join(item for item in items if isinstance(item, str))
        return (content or None), [item for item in items if isinstance(item, ToolCall)]

    def _read_calls(self, out: list[str | ToolCall], *, final: bool) -> None:
        while True:
            rest = self._buffer.lstrip()
            if self.calls:
                rest = rest.lstrip(";").lstrip()
            if not rest:
                self._buffer = ""
                return
            end = _json_end(rest) if rest[0] == "{" else -1
            if end is None and not final:
                self._buffer = rest
                return
            call = None
            if end is not None and end > 0:
                try:
                    call = _call_of(json.loads(rest[:end]), self._id_prefix, "parameters")
                except json.JSONDecodeError:
                    call = None
            if call is None:
                # Not a call: without an earlier call the whole answer is content, as written.
                self._buffer = rest if self.calls else self._raw
                self._state = "content"
                return
            self.calls.append(call)
            out.append(call)
            self._buffer = rest[end:]


class MistralToolParser(HermesToolParser):
    """Mistral syntax: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (Mistral 7B
    v0.3's tokenizer) or, from later tokenizers, ``[TOOL_CALLS]name[ARGS]{...}`` for each call
    (an optional ``[CALL_ID]id`` before ``[ARGS]``).

    Text before the marker is content, as with Hermes; calls come out once their JSON closes;
    what follows a marker but is not a call stays content, marker included. With `forced`
    (the answer was generated under a required or named choice) the array may also open the
    answer without the marker.
    """

    start = "[TOOL_CALLS]"
    args = "[ARGS]"
    call_id_tag = "[CALL_ID]"
    forced_in_syntax = True
    reads_bare_calls = False

    def __init__(self, id_prefix: str = "call_", *, forced: bool = False) -> None:
        super().__init__(id_prefix)
        self._forced = forced
        self._marker = ""  # the marker text that opened the current call block

    @staticmethod
    def forced_schema(
        schemas: Mapping[str, Mapping[str, Any]], name: str | None, parallel: bool | None
    ) -> dict[str, Any]:
        """The JSON a forced answer is held to: v0.3's array of calls (one for a named choice
        or with parallel_tool_calls false). `[TOOL_CALLS]` is left out: in Mistral's
        vocabularies it is a control token, which a grammar over text cannot write; the
        parser reads the array with or without it."""
        if name is not None:
            items: dict[str, Any] = _closed_call_schema(name, schemas[name], "arguments")
        else:
            items = {"anyOf": [_closed_call_schema(n, s, "arguments") for n, s in schemas.items()]}
        array: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
        if name is not None or parallel is False:
            array["maxItems"] = 1
        return array

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> list[str | ToolCall]:
        out = self._run(final=True)
        if self._in_call:
            self._content(out, self._marker + self._buffer)
        else:
            self._content(out, self._buffer)
        if self._pending_space and not self._after_call:
            out.append(self._pending_space)
        self._pending_space = ""
        self._buffer = ""
        self._in_call = False
        return out

    def _run(self, *, final: bool) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        while True:
            if not self._in_call:
                opening = self._buffer.lstrip()
                if self._forced and not self.calls and opening.startswith("["):
                    if self.start.startswith(opening) and opening != self.start and not final:
                        return out
                    if not opening.startswith(self.start):
                        self._in_call, self._marker, self._buffer = True, "", opening
                        continue
                index = self._buffer.find(self.start)
                if index < 0:
                    keep = 0 if final else _partial_suffix(self._buffer, self.start)
                    self._content(out, self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
                self._content(out, self._buffer[:index])
                self._buffer = self._buffer[index + len(self.start) :]
                self._in_call, self._marker = True, self.start
                continue
            consumed = self._read_block(out, final=final)
            if consumed is None:
                return out
            self._buffer = self._buffer[consumed:]
            self._in_call = False

    def _read_block(self, out: list[str | ToolCall], *, final: bool) -> int | None:
        """Reads the calls after a marker: the characters used, or None to wait for more."""
        body = self._buffer
        start = len(body) - len(body.lstrip())
        if start == len(body):
            return None if not final else self._not_a_call(out, len(body))
        if body[start] == "[":
            end = _json_end(body, start)
            if end is None:
                return None if not final else self._not_a_call(out, len(body))
            try:
                value = json.loads(body[start:end])
            except json.JSONDecodeError:
                value = None
            calls = [_call_of(item, self._id_prefix, "arguments") for item in value or []]
            if not isinstance(value, list) or not calls or None in calls:
                return self._not_a_call(out, end)
            for call in calls:
                self._emit_call(out, call)  # type: ignore[arg-type]
            return end
        # name[ARGS]{...}, perhaps name[CALL_ID]id[ARGS]{...}
        args = body.find(self.args, start)
        if args < 0:
            head = body[start:]
            name = head.split("[", 1)[0]
            tail = head[len(name) :]
            waiting = (TOOL_NAME.match(name) is not None or name == "") and (
                tail == ""
                or self.args.startswith(tail)
                or self.call_id_tag.startswith(tail)
                or tail.startswith(self.call_id_tag)
            )
            if waiting and not final and len(head) < 200:
                return None
            return self._not_a_call(out, len(body))
        name = body[start:args].split(self.call_id_tag, 1)[0]
        opening = args + len(self.args)
        opening += len(body[opening:]) - len(body[opening:].lstrip())
        if opening == len(body) and not final:
            return None
        end = _json_end(body, opening) if body[opening : opening + 1] == "{" else -1
        if end is None:
            return None if not final else self._not_a_call(out, len(body))
        call = None
        if end > 0 and TOOL_NAME.match(name):
            try:
                arguments = json.loads(body[opening:end])
            except json.JSONDecodeError:
                arguments = None
            call = _call_of({"name": name, "arguments": arguments}, self._id_prefix, "arguments")
        if call is None:
            return self._not_a_call(out, max(end, opening))
        self._emit_call(out, call)
        return end

    def _not_a_call(self, out: list[str | ToolCall], end: int) -> int:
        self._content(out, self._marker + self._buffer[:end])
        return end

    def _emit_call(self, out: list[str | ToolCall], call: ToolCall) -> None:
        self._pending_space = ""
        self._after_call = True
        self.calls.append(call)
        out.append(call)


ToolCallParser = HermesToolParser | Llama3JsonToolParser | MistralToolParser
"""A parser of one answer: `feed(text)` and `finish()` give content strings and `ToolCall`s in
order, `parse(text)` a whole answer's (content, calls)."""

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}
"""`--tool-call-parser` values (vLLM's names), besides `auto`. Hermes is also what the fallback
prompt teaches."""


def template_family(template: str | None) -> str:
    """The tool-call syntax a chat template teaches: "mistral" (it writes `[TOOL_CALLS]`),
    "llama3_json" (Llama 3's headers with the `ipython` role, or `<|python_tag|>`), else
    "hermes" (Qwen's and Hermes' `<tool_call>`, and the fallback prompt a template that never
    reads `tools` gets)."""
    if not template or not template_reads_tools(template):
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or (
        "<|start_header_id|>" in template and "ipython" in template
    ):
        return "llama3_json"
    return "hermes"


def parser_for(template: str | None, configured: str | None) -> str:
    """The parser for a chat template: the configured one, else (None or "auto") the one of the
    template's family."""
    if configured and configured != "auto":
        return configured
    return template_family(template)


def parse_required(text: str, id_prefix: str = "call_") -> list[ToolCall] | None:
    """The calls of a `required` answer (a JSON array of {name, parameters}); None when the
    text is not one (cut by max_tokens)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, list):
        return None
    calls = []
    for item in value:
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
            return None
        arguments = json.dumps(item.get("parameters", {}), ensure_ascii=False)
        calls.append(ToolCall(item["name"], arguments, new_call_id(id_prefix)))
    return calls
