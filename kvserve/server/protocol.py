"""What every dialect of the HTTP API shares: the error class, strict parsing, field policy.

Requests are parsed from the raw body with pydantic in strict mode (a string is not a number,
a float is not an integer), every model allowing extra fields. Extras are then sorted:

- fields that would change the answer and are not supported (`functions`, `suffix`,
  `best_of > 1`, the older `guided_*` fields, `echo` on chat, ...) are refused by name (400);
- every other extra is accepted, has no effect, and is reported back in the
  `X-KVServe-Ignored-Fields` header and counted.

Responses are plain dicts serialised with `json.dumps`: this runs once per streamed token, and a
dict is several times cheaper to build and dump than a pydantic model.

The OpenAI request models and renderers live in `kvserve.server.dialects`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from kvserve.params import SamplingParams, SamplingParamsError
from kvserve.request import EngineError, Overloaded

__all__ = [
    "APIError",
    "ModelT",
    "dumps",
    "error_body",
    "parse_request",
    "refused_fields",
    "validation_error",
    "validation_error_from_list",
]

ModelT = TypeVar("ModelT", bound=BaseModel)

# --------------------------------------------------------------------------------------------
# Errors


class APIError(Exception):
    """An HTTP error with an OpenAI error body: `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type or _default_type(status)
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The OpenAI error body."""
        return error_body(self.message, self.error_type, self.param, self.code)

    @classmethod
    def from_engine(cls, error: EngineError, *, param_names: Mapping[str, str] = {}) -> APIError:
        """The one HTTP mapping of an engine error. `param_names` renames engine parameters to
        the fields this request actually used (the engine says "prompt", a chat request sent
        "messages")."""
        param = param_names.get(error.param, error.param) if error.param else None
        headers: dict[str, str] = {}
        code = None
        if isinstance(error, Overloaded):
            # The wait budget, not a guess: a client retrying after it finds a shorter queue.
            headers["Retry-After"] = str(max(1, math.ceil(error.retry_after)))
            code = error.reason
        return cls(
            error.status,
            error.message,
            error_type=error.error_type,
            param=param,
            code=code,
            headers=headers,
        )


def _default_type(status: int) -> str:
    return {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
    }.get(status, "server_error")


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}` as OpenAI sends it."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


# --------------------------------------------------------------------------------------------
# Request models


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


# Pydantic's names for union members inside an error location; they are not request fields.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "null"})


def _param_from_loc(loc: Sequence[int | str]) -> str | None:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            if parts:
                parts[-1] += f"[{item}]"
        elif "[" in item or "-" in item or item in _TYPE_TAGS:
            continue
        else:
            parts.append(item)
    return ".".join(parts) or None


def validation_error(exc: ValidationError) -> APIError:
    """A pydantic (or FastAPI request) validation error as a 400 naming the first bad field."""
    return validation_error_from_list(exc.errors(include_url=False))


def validation_error_from_list(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """As `validation_error`, from `exc.errors()` (FastAPI's RequestValidationError has them)."""
    if not errors:
        return APIError(400, "the request is invalid")
    first = errors[0]
    loc = [item for item in first.get("loc", ()) if item not in ("body",)]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg')}")
    if kind in ("model_type", "model_attributes_type", "dict_type") and not loc:
        return APIError(400, "the request body must be a JSON object")
    param = _param_from_loc(loc)
    if kind == "missing":
        message = f"'{param}' is a required field"
    else:
        message = f"'{param}': {first.get('msg', 'invalid value')}" if param else first["msg"]
    return APIError(400, message, param=param)


def parse_request(model: type[ModelT], body: bytes) -> ModelT:
    """Parse a JSON body into `model`, raising APIError(400) naming the bad field."""
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


# --------------------------------------------------------------------------------------------
# Field policy


def _present(value: Any) -> bool:
    return value is not None and value is not False and value != [] and value != {}


def _not_in(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: value not in allowed


def _tool_choice_changes(value: Any) -> bool:
    return value not in (None, "none", "auto")


# Unsupported fields that would change the answer when given a meaningful value. Given a value
# that means "off" (tools: [], echo: false, best_of: 1), they are accepted and reported.
_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (_present, "'functions' is not supported; use 'tools'"),
    "function_call": (_tool_choice_changes, "'function_call' is not supported; use 'tool_choice'"),
    "best_of": (_not_in(None, 1), "only best_of=1 is supported"),
    "echo": (_present, "echo is not supported"),
    "suffix": (lambda value: value not in (None, ""), "suffix is not supported"),
    "audio": (_present, "audio output is not supported"),
    "modalities": (lambda value: value not in (None, ["text"]), "only text output is supported"),
    "prediction": (_present, "predicted outputs are not supported"),
    "guided_json": (_present, "guided_* fields are gone; use 'structured_outputs'"),
    "guided_regex": (_present, "guided_* fields are gone; use 'structured_outputs'"),
    "guided_choice": (_present, "guided_* fields are gone; use 'structured_outputs'"),
    "guided_grammar": (_present, "guided_* fields are gone; use 'structured_outputs'"),
    "grammar": (_present, "use 'structured_outputs': {'grammar': ...}"),
    "json_schema": (_present, "use 'response_format' or 'structured_outputs'"),
    "use_beam_search": (_present, "beam search is not supported"),
    "length_penalty": (_not_in(None, 1, 1.0), "length_penalty is not supported"),
    "min_tokens": (_not_in(None, 0), "min_tokens is not supported"),
    "prompt_logprobs": (_present, "prompt_logprobs is not supported"),
    "include_stop_str_in_output": (_present, "include_stop_str_in_output is not supported"),
    "skip_special_tokens": (lambda value: value is False, "special tokens are always skipped"),
    "truncate_prompt_tokens": (_present, "prompt truncation is not supported"),
    "continue_final_message": (_present, "continue_final_message is not supported"),
    "add_generation_prompt": (
        lambda value: value is False,
        "the chat template always adds the generation prompt",
    ),
    "documents": (_present, "documents are not supported"),
    "bad_words": (_present, "bad_words is not supported"),
    "allowed_token_ids": (_present, "allowed_token_ids is not supported"),
    "logits_processors": (_present, "logits processors are not supported"),
    "typical_p": (_not_in(None, 1, 1.0), "typical_p is not supported"),
    "mirostat": (_not_in(None, 0), "mirostat is not supported"),
}


def refused_fields(extras: Mapping[str, Any]) -> tuple[list[str], APIError | None]:
    """Sort a request's extra fields: (accepted-and-ignored names, error for the first refused).

    The error is a 400 naming the field; callers raise it before doing any work.
    """
    ignored: list[str] = []
    for name, value in extras.items():
        rule = _REFUSED.get(name)
        if rule is not None and rule[0](value):
            return ignored, APIError(400, f"'{name}': {rule[1]}", param=name)
        ignored.append(name)
    return ignored, None


# --------------------------------------------------------------------------------------------
# Response pieces


def dumps(value: Any) -> str:
    """Compact JSON, non-ASCII kept as is (the body is UTF-8)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def validated_sampling_params(
    vocab_size: int, param_names: Mapping[str, str], **fields: Any
) -> SamplingParams:
    """SamplingParams from `fields`, validated; an error names the field as the request spelled
    it (`param_names` maps the engine's names to the dialect's)."""
    try:
        params = SamplingParams(**fields)
        params.validate(vocab_size)
    except SamplingParamsError as exc:
        param = param_names.get(exc.param, exc.param)
        raise APIError(400, exc.message.replace(exc.param, param, 1), param=param) from None
    return params
