"""The OpenAI request models, sampling parameters and renderer base shared by chat and
completions (`openai_chat`, `openai_completions`), and how the generation core streams them:
`data: {json}` frames ending in `data: [DONE]`, errors as `{"error": {...}}`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from kvserve.engine.stream import Delta, TokenLogprob, Usage
from kvserve.sampling import SamplingParams, SamplingParamsError
from kvserve.server.protocol import APIError, _Model, dumps
from kvserve.server.sse import DONE, event

__all__ = [
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "OpenAIStream",
    "StreamOptions",
    "chat_logprobs",
    "completion_logprobs",
    "request_param",
    "sampling_params",
    "usage_dict",
]

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default `max_tokens` for /v1/completions (chat has none: the rest of the context)."""

# --------------------------------------------------------------------------------------------
# Request models


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
    """`POST /v1/completions`. `prompt` is text, token ids, or a list holding one of those.

    Text is a raw prompt: the client templated it, so control-token spellings in it are control
    tokens. `echo` puts the prompt (its tokens and, with `logprobs`, their log-probabilities)
    before the answer; with `max_tokens: 0` it scores the prompt without generating.
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None

    @property
    def scores_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt is scored, nothing is generated."""
        return bool(self.echo) and self.max_tokens == 0


# --------------------------------------------------------------------------------------------
# Sampling parameters


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def sampling_params(
    request: ChatCompletionRequest | CompletionRequest, vocab_size: int
) -> SamplingParams:
    """The request's SamplingParams, validated; APIError(400) names the request's own field."""
    if _or(request.n, 1) != 1:
        raise APIError(400, "'n': only n=1 is supported", param="n")
    prompt_logprobs = None
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
        if request.scores_only:
            # The engine samples after the prompt whatever happens; that one token is dropped.
            max_tokens = 1
        if request.echo and logprobs is not None:
            prompt_logprobs = logprobs
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
            prompt_logprobs=prompt_logprobs,
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
    elif param in ("top_logprobs", "prompt_logprobs"):
        return "logprobs"
    return param


# --------------------------------------------------------------------------------------------
# Response pieces


def usage_dict(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
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
    entries: Sequence[TokenLogprob | int], token_bytes: Callable[[int], bytes], text_offset: int
) -> tuple[dict[str, Any], int]:
    """Legacy completions logprobs (tokens, token_logprobs, top_logprobs, text_offset) for
    these tokens, and the text offset after them. A bare token id (an echoed prompt's first
    token, which nothing precedes) has null for its logprob and alternatives, as in vLLM."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        token_id = entry if isinstance(entry, int) else entry.token_id
        text = token_bytes(token_id).decode("utf-8", "replace")
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if isinstance(entry, int):
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(_finite(entry.logprob))
        alternatives: dict[str, float] = {}
        for alt_id, logprob in entry.top:
            alternatives.setdefault(
                token_bytes(alt_id).decode("utf-8", "replace"), _finite(logprob)
            )
        top.append(alternatives)
    return (
        {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        },
        text_offset,
    )


# --------------------------------------------------------------------------------------------
# Per-request renderers: the same deltas, as chat or as legacy completions


class _Renderer:
    """Turns one request's deltas into stream chunks (JSON text) or one response body."""

    chunk_object = ""

    def __init__(
        self,
        response_id: str,
        model: str,
        created: int,
        token_bytes: Callable[[int], bytes],
        *,
        logprobs: bool,
    ) -> None:
        self.response_id = response_id
        self.model = model
        self.created = created
        self.token_bytes = token_bytes
        self.want_logprobs = logprobs
        # Every chunk starts the same way; built once, not per token.
        self._head = (
            f'{{"id":{dumps(response_id)},"object":"{self.chunk_object}",'
            f'"created":{created},"model":{dumps(model)},"choices":'
        )
        self._texts: list[str] = []
        self._logprobs: list[TokenLogprob] = []

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
        self, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str | None
    ) -> str | None:
        """The chunk for one delta; None when it carries nothing a client could see."""
        wanted = logprobs if self.want_logprobs else ()
        if not text and not wanted and finish_reason is None:
            return None
        return self._chunk([self._choice(text, wanted, finish_reason)])

    def _choice(
        self, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str | None
    ) -> dict[str, Any]:
        """The one choice of a delta chunk (`logprobs` empty when none are to be sent)."""
        raise NotImplementedError

    def prompt_scored(self, entries: Sequence[TokenLogprob | None]) -> None:
        """The prompt's log-probabilities arrived (one entry per prompt token, None first)."""

    def add(self, text: str, logprobs: Sequence[TokenLogprob]) -> None:
        """Accumulate a delta for the non-streaming response."""
        if text:
            self._texts.append(text)
        if self.want_logprobs and logprobs:
            self._logprobs.extend(logprobs)

    @property
    def text(self) -> str:
        return "".join(self._texts)


class OpenAIStream:
    """An OpenAI renderer as the generation core drives it (`kvserve.server.core.Rendering`):
    one `data:` frame per chunk, the finish reason on the last content chunk, the usage chunk
    when asked for, then `[DONE]`; an error after the 200 is an error frame and `[DONE]`."""

    def __init__(self, renderer: _Renderer, *, include_usage: bool) -> None:
        self.renderer = renderer
        self.include_usage = include_usage

    def head(self) -> str:
        return "".join(event(chunk) for chunk in self.renderer.start_chunks())

    def _scored(self, delta: Delta) -> None:
        if delta.prompt_logprobs is not None:
            self.renderer.prompt_scored(delta.prompt_logprobs)

    def frames(self, delta: Delta) -> str:
        self._scored(delta)
        chunk = self.renderer.delta_chunk(delta.text, delta.logprobs, None)
        return "" if chunk is None else event(chunk)

    def tail(self, final: Delta) -> str:
        self._scored(final)
        chunk = self.renderer.delta_chunk(final.text, final.logprobs, final.finish_reason)
        parts = [event(chunk)] if chunk is not None else []
        if self.include_usage and final.usage is not None:
            parts.append(event(self.renderer.usage_chunk(final.usage)))
        return "".join(parts) + DONE.decode()

    def error_tail(self, error: APIError) -> str:
        return event(dumps(error.body())) + DONE.decode()

    def add(self, delta: Delta) -> None:
        self._scored(delta)
        self.renderer.add(delta.text, delta.logprobs)

    def response(self, final: Delta) -> dict[str, Any]:
        assert final.finish_reason is not None and final.usage is not None
        return self.renderer.response(final.finish_reason, final.usage)  # type: ignore[attr-defined]


def engine_param_names(request: ChatCompletionRequest | CompletionRequest) -> dict[str, str]:
    """The engine's parameter names as this request spelled them, for the errors naming them."""
    return {
        "prompt": request_param(request, "prompt"),
        "max_tokens": request_param(request, "max_tokens"),
    }
