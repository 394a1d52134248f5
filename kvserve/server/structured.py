"""Request fields that constrain the answer's text, turned into one `StructuredOutput`.

- OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`
  (any JSON object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`
  (the schema is always enforced, whatever `strict` says);
- OpenAI Responses' `text.format`: `{"type": "text"}`, `{"type": "json_object"}`,
  `{"type": "json_schema", "name", "schema", "strict"}` (the same meanings, flattened);
- vLLM's `structured_outputs`: one of `json` (a schema, as an object or as JSON text), `regex`,
  `choice` (a list of strings), `grammar` (Lark, or GBNF with ``::=`` rules), or
  `json_object: true`. vLLM's tuning options (`disable_fallback`, `disable_any_whitespace`,
  `disable_additional_properties`, `whitespace_pattern`, `backend`) are accepted and have no
  effect: whitespace is always bounded here.

Only the shape is checked here (400 naming the field); the grammar engine checks the meaning
when it compiles, and its refusal is a 400 naming the same field. Nothing here imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from kvserve.params import SamplingParamsError, StructuredOutput
from kvserve.server.protocol import APIError

__all__ = [
    "STRUCTURED_KINDS",
    "from_response_format",
    "from_structured_outputs",
    "from_text_format",
    "structured",
]

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
"""The kinds of vLLM's `structured_outputs`, one per request."""

_HARMLESS_OPTIONS = frozenset(
    {
        "disable_fallback",
        "disable_any_whitespace",
        "disable_additional_properties",
        "whitespace_pattern",
        "backend",
        "_backend",
        "_backend_was_auto",
    }
)


def from_response_format(value: Any, param: str = "response_format") -> StructuredOutput | None:
    """OpenAI's `response_format`; None for text."""

    def json_schema(fmt: Mapping[str, Any]) -> StructuredOutput:
        spec = fmt.get("json_schema")
        if not isinstance(spec, Mapping):
            raise APIError(
                400,
                f"'{param}.json_schema' must be an object with 'name' and 'schema'",
                param=f"{param}.json_schema",
            )
        schema = spec.get("schema")
        if schema is None:
            return StructuredOutput.json_object(f"{param}.json_schema")
        return _shaped(lambda: StructuredOutput.json_schema(schema, f"{param}.json_schema.schema"))

    return _json_format(value, param, json_schema, type_param=f"{param}.type")


def from_text_format(value: Any, param: str = "text.format") -> StructuredOutput | None:
    """OpenAI Responses' `text.format` (the schema beside `type`, not under `json_schema`);
    None for text. Every refusal names `param`, the grammar engine's too."""

    def json_schema(fmt: Mapping[str, Any]) -> StructuredOutput:
        schema = fmt.get("schema")
        if not isinstance(schema, Mapping):
            raise APIError(400, f"'{param}.schema' must be a JSON schema object", param=param)
        return _shaped(lambda: StructuredOutput.json_schema(schema, param))

    return _json_format(value, param, json_schema, type_param=param)


def _json_format(
    value: Any,
    param: str,
    json_schema: Callable[[Mapping[str, Any]], StructuredOutput],
    *,
    type_param: str,
) -> StructuredOutput | None:
    """An OpenAI format object: `text` (None), `json_object`, or `json_schema` (read by
    `json_schema`, as each API nests the schema differently)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise APIError(400, f"'{param}' must be an object", param=param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput.json_object(param)
    if kind == "json_schema":
        return json_schema(value)
    raise APIError(
        400,
        f"'{param}.type' must be 'text', 'json_object' or 'json_schema', not {kind!r}",
        param=type_param,
    )


def from_structured_outputs(
    value: Any, param: str = "structured_outputs"
) -> StructuredOutput | None:
    """vLLM's `structured_outputs`: exactly one kind."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise APIError(400, f"'{param}' must be an object", param=param)
    unknown = [key for key in value if key not in STRUCTURED_KINDS and key not in _HARMLESS_OPTIONS]
    if unknown:
        raise APIError(
            400,
            f"'{param}.{unknown[0]}' is not supported; give one of " + ", ".join(STRUCTURED_KINDS),
            param=f"{param}.{unknown[0]}",
        )
    kinds = [
        key
        for key in STRUCTURED_KINDS
        if key in value and value[key] is not None and value[key] is not False
    ]
    if len(kinds) != 1:
        found = ", ".join(kinds) if kinds else "none"
        raise APIError(
            400,
            f"'{param}' takes exactly one of " + ", ".join(STRUCTURED_KINDS) + f" (got {found})",
            param=param,
        )
    kind = kinds[0]
    spec = value[kind]
    field = f"{param}.{kind}"
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise APIError(400, f"'{field}' is not valid JSON: {exc}", param=field) from None
        return _shaped(lambda: StructuredOutput.json_schema(spec, field))
    if kind == "json_object":
        if spec is not True:
            raise APIError(400, f"'{field}' must be true", param=field)
        return StructuredOutput.json_object(field)
    if kind == "regex":
        return _shaped(lambda: StructuredOutput.regex(spec, field))
    if kind == "choice":
        return _shaped(lambda: StructuredOutput.choice(spec, field))
    return _shaped(lambda: StructuredOutput.grammar(spec, field))


def structured(body: Any) -> StructuredOutput | None:
    """The constraint of a chat or completions request (`response_format` or
    `structured_outputs`, not both)."""
    response_format = from_response_format(getattr(body, "response_format", None))
    outputs = from_structured_outputs(getattr(body, "structured_outputs", None))
    if response_format is not None and outputs is not None:
        raise APIError(
            400,
            "give either 'response_format' or 'structured_outputs', not both",
            param="structured_outputs",
        )
    return response_format or outputs


def _shaped(build: Any) -> StructuredOutput:
    try:
        constraint = build()
        constraint.validate()
    except SamplingParamsError as exc:
        raise APIError(400, f"'{exc.param}': {exc.message}", param=exc.param) from None
    return constraint
