"""The OpenAI wire protocol: request models, field policy, error bodies, response shapes.

Requests are parsed from the raw body with pydantic in strict mode (a string is not a number,
a float is not an integer), every model allowing extra fields. Extras are then sorted:

- fields that would change the answer and are not supported (`tools`, `response_format` other
  than text, `echo`, `suffix`, `best_of > 1`, guided decoding, ...) are refused by name (400);
- every other extra is accepted, has no effect, and is reported back in the
  `X-KVServe-Ignored-Fields` header and counted.

Responses are plain dicts serialised with `json.dumps`: this runs once per streamed token, and a
dict is several times cheaper to build and dump than a pydantic model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from kvserve.engine.stream import TokenLogprob, Usage
from kvserve.request import EngineError, Overloaded
from kvserve.sampling import SamplingParams, SamplingParamsError

__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "StreamOptions",
    "TokenizeRequest",
    "ChatRenderer",
    "CompletionRenderer",
    "chat_logprobs",
    "completion_logprobs",
    "error_body",
    "parse_request",
    "refused_fields",
    "sampling_params",
    "usage_dict",
]

ModelT = TypeVar("ModelT", bound=BaseModel)

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default `max_tokens` for /v1/completions (chat has none: the rest of the context)."""

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


class StreamOptions(_Model):
    include_usage: bool | None = None


class ChatMessage(_Model):
    """One message; extra keys (name, tool_call_id, ...) are passed to the chat template."""

    role: str
    content: str | list[dict[str, Any]] | None = None


class _SamplingFields(_Model):
    """Parameters shared by chat and completions, under their OpenAI/vLLM names."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int | None = None
    cache_salt: str | None = None  # isolates a tenant in the prefix cache (vLLM's name)
    stream: bool | None = None
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions`. `prompt` is text, token ids, or a list holding one of those."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None


class TokenizeRequest(_Model):
    """`POST /tokenize`: either `prompt` (plain text) or `messages` (rendered by the chat
    template), as vLLM accepts them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Model):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: list[int]


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


def _response_format_changes(value: Any) -> bool:
    return value is not None and not (isinstance(value, Mapping) and value.get("type") == "text")


def _tool_choice_changes(value: Any) -> bool:
    return value not in (None, "none", "auto")


# Unsupported fields that would change the answer when given a meaningful value. Given a value
# that means "off" (tools: [], echo: false, best_of: 1), they are accepted and reported.
_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (_present, "tool calling is not supported"),
    "tool_choice": (_tool_choice_changes, "tool calling is not supported"),
    "functions": (_present, "function calling is not supported"),
    "function_call": (_tool_choice_changes, "function calling is not supported"),
    "response_format": (
        _response_format_changes,
        "only response_format {'type': 'text'} is supported",
    ),
    "best_of": (_not_in(None, 1), "only best_of=1 is supported"),
    "echo": (_present, "echo is not supported"),
    "suffix": (lambda value: value not in (None, ""), "suffix is not supported"),
    "audio": (_present, "audio output is not supported"),
    "modalities": (lambda value: value not in (None, ["text"]), "only text output is supported"),
    "prediction": (_present, "predicted outputs are not supported"),
    "guided_json": (_present, "guided decoding is not supported"),
    "guided_regex": (_present, "guided decoding is not supported"),
    "guided_choice": (_present, "guided decoding is not supported"),
    "guided_grammar": (_present, "guided decoding is not supported"),
    "structured_outputs": (_present, "structured outputs are not supported"),
    "grammar": (_present, "grammars are not supported"),
    "json_schema": (_present, "JSON schemas are not supported"),
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
# Sampling parameters


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def sampling_params(
    request: ChatCompletionRequest | CompletionRequest, vocab_size: int
) -> SamplingParams:
    """The request's SamplingParams, validated; APIError(400) names the request's own field."""
    if request.cache_salt is not None and not request.cache_salt:
        raise APIError(400, "'cache_salt' must be a non-empty string", param="cache_salt")
    if isinstance(request, ChatCompletionRequest):
        max_tokens = request.max_completion_tokens
        if max_tokens is None:
            max_tokens = request.max_tokens
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
        logprobs = _or(request.top_logprobs, 0) if request.logprobs else None
    else:
        max_tokens = _or(request.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)
        logprobs = request.logprobs
    if request.stream_options is not None and not request.stream:
        raise APIError(
            400, "'stream_options' is only allowed when 'stream' is true", param="stream_options"
        )
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_or(request.temperature, 1.0),
            top_p=_or(request.top_p, 1.0),
            top_k=_or(request.top_k, 0),
            min_p=_or(request.min_p, 0.0),
            seed=request.seed,
            stop=_or(request.stop, ()),
            stop_token_ids=_or(request.stop_token_ids, ()),
            ignore_eos=_or(request.ignore_eos, False),
            presence_penalty=_or(request.presence_penalty, 0.0),
            frequency_penalty=_or(request.frequency_penalty, 0.0),
            repetition_penalty=_or(request.repetition_penalty, 1.0),
            logit_bias=_or(request.logit_bias, ()),
            logprobs=logprobs,
            n=_or(request.n, 1),
        )
        params.validate(vocab_size)
    except SamplingParamsError as exc:
        param = request_param(request, exc.param)
        raise APIError(400, exc.message, param=param) from None
    return params


def request_param(request: ChatCompletionRequest | CompletionRequest, param: str) -> str:
    """The name of `param` (an engine/sampling name) as this request spelled it."""
    if isinstance(request, ChatCompletionRequest):
        if param == "max_tokens" and request.max_completion_tokens is not None:
            return "max_completion_tokens"
        if param == "prompt":
            return "messages"
    elif param == "top_logprobs":
        return "logprobs"
    return param


# --------------------------------------------------------------------------------------------
# Response pieces


def usage_dict(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _bytes_list(data: bytes) -> list[int]:
    return list(data)


def _finite(value: float) -> float:
    # JSON has no -Infinity; OpenAI reports impossible tokens as -9999.0.
    return value if math.isfinite(value) else -9999.0


def chat_logprobs(
    entries: Sequence[TokenLogprob], token_bytes: Callable[[int], bytes]
) -> list[dict[str, Any]]:
    """`choices[0].logprobs.content` entries for these tokens."""
    content = []
    for entry in entries:
        data = token_bytes(entry.token_id)
        content.append(
            {
                "token": data.decode("utf-8", "replace"),
                "logprob": _finite(entry.logprob),
                "bytes": _bytes_list(data),
                "top_logprobs": [
                    {
                        "token": (alt := token_bytes(token_id)).decode("utf-8", "replace"),
                        "logprob": _finite(logprob),
                        "bytes": _bytes_list(alt),
                    }
                    for token_id, logprob in entry.top
                ],
            }
        )
    return content


def completion_logprobs(
    entries: Sequence[TokenLogprob], token_bytes: Callable[[int], bytes], text_offset: int
) -> tuple[dict[str, Any], int]:
    """Legacy completions logprobs (tokens, token_logprobs, top_logprobs, text_offset) for
    these tokens, and the text offset after them."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        text = token_bytes(entry.token_id).decode("utf-8", "replace")
        tokens.append(text)
        token_logprobs.append(_finite(entry.logprob))
        alternatives: dict[str, float] = {}
        for token_id, logprob in entry.top:
            alternatives.setdefault(
                token_bytes(token_id).decode("utf-8", "replace"), _finite(logprob)
            )
        top.append(alternatives)
        offsets.append(text_offset)
        text_offset += len(text)
    return (
        {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        },
        text_offset,
    )


def dumps(value: Any) -> str:
    """Compact JSON, non-ASCII kept as is (the body is UTF-8)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# --------------------------------------------------------------------------------------------
# Per-request renderers: the same deltas, as chat or as legacy completions


class _Renderer:
    """Turns one request's deltas into stream chunks (JSON text) or one response body.

    With n > 1, every delta names its answer (`index`); chunks carry that index and the
    response lists the n choices in order.
    """

    chunk_object = ""

    def __init__(
        self,
        response_id: str,
        model: str,
        created: int,
        token_bytes: Callable[[int], bytes],
        *,
        logprobs: bool,
        n: int = 1,
    ) -> None:
        self.response_id = response_id
        self.model = model
        self.created = created
        self.token_bytes = token_bytes
        self.want_logprobs = logprobs
        self.n = n
        # Every chunk starts the same way; built once, not per token.
        self._head = (
            f'{{"id":{dumps(response_id)},"object":"{self.chunk_object}",'
            f'"created":{created},"model":{dumps(model)},"choices":'
        )
        self._texts: list[list[str]] = [[] for _ in range(n)]
        self._logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
        self._finish_reasons: list[str | None] = [None] * n

    def _chunk(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> str:
        if usage is None:
            return f"{self._head}{dumps(choices)}}}"
        return f'{self._head}{dumps(choices)},"usage":{dumps(usage_dict(usage))}}}'

    def start_chunks(self) -> list[str]:
        """Chunks sent once the request is admitted, before any token."""
        return []

    def usage_chunk(self, usage: Usage) -> str:
        """The extra chunk of `stream_options.include_usage`: no choices, the usage."""
        return self._chunk([], usage)

    def delta_chunk(
        self,
        text: str,
        logprobs: Sequence[TokenLogprob],
        finish_reason: str | None,
        index: int = 0,
    ) -> str | None:
        """The chunk for one delta; None when it carries nothing a client could see."""
        wanted = logprobs if self.want_logprobs else ()
        if not text and not wanted and finish_reason is None:
            return None
        return self._chunk([self._choice(text, wanted, finish_reason, index)])

    def _choice(
        self, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str | None, index: int
    ) -> dict[str, Any]:
        """The one choice of a delta chunk (`logprobs` empty when none are to be sent)."""
        raise NotImplementedError

    def add(
        self,
        text: str,
        logprobs: Sequence[TokenLogprob],
        index: int = 0,
        finish_reason: str | None = None,
    ) -> None:
        """Accumulate a delta of answer `index` for the non-streaming response."""
        if text:
            self._texts[index].append(text)
        if self.want_logprobs and logprobs:
            self._logprobs[index].extend(logprobs)
        if finish_reason is not None:
            self._finish_reasons[index] = finish_reason

    @property
    def text(self) -> str:
        """The first answer's text."""
        return "".join(self._texts[0])

    def _answers(self, finish_reason: str) -> list[tuple[int, str, list[TokenLogprob], str]]:
        """(index, text, logprobs, finish reason) of every answer, in index order."""
        return [
            (index, "".join(texts), logprobs, self._finish_reasons[index] or finish_reason)
            for index, (texts, logprobs) in enumerate(zip(self._texts, self._logprobs, strict=True))
        ]


class ChatRenderer(_Renderer):
    """`chat.completion` and `chat.completion.chunk`."""

    chunk_object = "chat.completion.chunk"

    def start_chunks(self) -> list[str]:
        return [
            self._chunk(
                [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for index in range(self.n)
        ]

    def _choice(
        self, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str | None, index: int
    ) -> dict[str, Any]:
        return {
            "index": index,
            "delta": {"content": text} if text or finish_reason is None else {},
            "logprobs": {"content": chat_logprobs(logprobs, self.token_bytes)}
            if logprobs
            else None,
            "finish_reason": finish_reason,
        }

    def response(self, finish_reason: str, usage: Usage) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": index,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": (
                        {"content": chat_logprobs(logprobs, self.token_bytes)}
                        if self.want_logprobs
                        else None
                    ),
                    "finish_reason": reason,
                }
                for index, text, logprobs, reason in self._answers(finish_reason)
            ],
            "usage": usage_dict(usage),
        }


class CompletionRenderer(_Renderer):
    """`text_completion` responses and chunks."""

    chunk_object = "text_completion"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._text_offsets = [0] * self.n

    def _choice(
        self, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str | None, index: int
    ) -> dict[str, Any]:
        rendered = None
        if logprobs:
            rendered, self._text_offsets[index] = completion_logprobs(
                logprobs, self.token_bytes, self._text_offsets[index]
            )
        return {"index": index, "text": text, "logprobs": rendered, "finish_reason": finish_reason}

    def response(self, finish_reason: str, usage: Usage) -> dict[str, Any]:
        choices = []
        for index, text, entries, reason in self._answers(finish_reason):
            logprobs = None
            if self.want_logprobs:
                logprobs, _ = completion_logprobs(entries, self.token_bytes, 0)
            choices.append(
                {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
            )
        return {
            "id": self.response_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage_dict(usage),
        }
