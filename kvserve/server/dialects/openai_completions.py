"""OpenAI legacy completions: `POST /v1/completions` (`text_completion`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from kvserve.engine.stream import TokenLogprob, Usage
from kvserve.server import schemas
from kvserve.server.core import ServerState, in_thread
from kvserve.server.dialects.openai import (
    CompletionRequest,
    OpenAIBody,
    OpenAIStream,
    completion_logprobs,
    engine_param_names,
    sampling_params,
    usage_dict,
)
from kvserve.server.protocol import APIError
from kvserve.server.render import Ending, Rendering, Update, text_of
from kvserve.server.sse import event
from kvserve.server.structured import structured

__all__ = ["PATHS", "CompletionBody", "CompletionStream", "completion_rendering", "register"]

PATHS = ("/v1/completions",)
BODIES = {("post", "/v1/completions"): CompletionRequest}
"""Each route's JSON body, for the API's description."""


class _Echo:
    """The prompt an `echo` request puts before each answer: its text, and with logprobs its
    tokens and their log-probabilities (as vLLM answers: the first prompt token has null ones),
    owed once per answer."""

    def __init__(self, n: int, text: str | None, token_ids: Sequence[int], logprobs: bool) -> None:
        self._text = text
        self._token_ids = list(token_ids)
        self._logprobs = logprobs
        self._entries: list[TokenLogprob | int] | None = None
        self._pending = set(range(n)) if text is not None else set()

    def scored(self, entries: Sequence[TokenLogprob | None] | None) -> None:
        """The prompt's log-probabilities arrived (one entry per prompt token, None first)."""
        if entries is not None and self._text is not None:
            self._entries = [
                token_id if entry is None else entry
                for token_id, entry in zip(self._token_ids, entries, strict=True)
            ]

    def take(self, index: int) -> tuple[str, list[TokenLogprob | int]] | None:
        """The prompt's text and logprob entries for answer `index`, the first time only."""
        if index not in self._pending:
            return None
        self._pending.discard(index)
        text = self._text or ""
        entries = self._entries or []
        if self._logprobs and text and not entries:
            entries = list(self._token_ids)  # echo without scores: tokens, null logprobs
        return text, entries if self._logprobs else []


def _choice(
    text: str,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    index: int,
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


class CompletionStream(OpenAIStream):
    """`text_completion` chunks. With `echo`, an answer's first chunk starts with the prompt;
    `generate=False` (echo with max_tokens 0) drops the generated token and counts no
    completion tokens."""

    chunk_object = "text_completion"

    def __init__(
        self, *args: Any, echo: _Echo | None = None, generate: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._echo = echo or _Echo(self.n, None, (), False)
        self._generate = generate
        self._text_offsets = [0] * self.n

    def update(self, update: Update) -> str:
        self._echo.scored(update.prompt_logprobs)
        index = update.index
        text = text_of(update.pieces) if self._generate else ""
        logprobs: list[TokenLogprob | int] = (
            list(update.logprobs) if self._generate and self.want_logprobs else []
        )
        echoed = self._echo.take(index)
        if echoed is not None:
            text = echoed[0] + text
            logprobs = [*echoed[1], *logprobs]
        if not text and not logprobs and update.finish_reason is None:
            return ""
        rendered = None
        if logprobs:
            rendered, self._text_offsets[index] = completion_logprobs(
                logprobs, self.token_bytes, self._text_offsets[index]
            )
        return event(self._chunk([_choice(text, rendered, update.finish_reason, index)]))

    def _usage(self, usage: Usage) -> Usage:
        return usage if self._generate else Usage(usage.prompt_tokens, 0)


class CompletionBody(OpenAIBody):
    """A `text_completion`: each answer's text (after the echoed prompt) and logprobs."""

    def __init__(
        self, *args: Any, echo: _Echo | None = None, generate: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._echo = echo or _Echo(self.n, None, (), False)
        self._generate = generate

    def update(self, update: Update) -> None:
        self._echo.scored(update.prompt_logprobs)
        if not self._generate:
            update = Update((), update.index, (), update.finish_reason)
        super().update(update)

    def body(self, ending: Ending) -> dict[str, Any]:
        choices = []
        for index, text, entries, reason in self.answers(ending.finish_reason):
            echo_text, echo_entries = self._echo.take(index) or ("", [])
            logprobs = None
            if self.want_logprobs:
                logprobs, _ = completion_logprobs([*echo_entries, *entries], self.token_bytes, 0)
            choices.append(_choice(echo_text + text, logprobs, reason, index))
        usage = ending.usage if self._generate else Usage(ending.usage.prompt_tokens, 0)
        return {
            "id": self.response_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage_dict(usage),
        }


def completion_rendering(
    response_id: str,
    model: str,
    token_bytes: Callable[[int], bytes],
    *,
    logprobs: bool = False,
    include_usage: bool = False,
    n: int = 1,
    echo_text: str | None = None,
    echo_ids: Sequence[int] = (),
    generate: bool = True,
) -> Rendering:
    """One completion, streamed or whole. `echo_text` (with the prompt's ids `echo_ids`) puts
    the prompt before the answer; `generate=False` scores the prompt without an answer."""
    args = (response_id, model, int(time.time()), token_bytes)

    def echo() -> _Echo:
        return _Echo(n, echo_text, echo_ids, logprobs)

    return Rendering(
        None,
        stream=lambda: CompletionStream(
            *args,
            logprobs=logprobs,
            include_usage=include_usage,
            n=n,
            echo=echo(),
            generate=generate,
        ),
        whole=lambda: CompletionBody(*args, logprobs=logprobs, n=n, echo=echo(), generate=generate),
    )


def register(app: FastAPI, state: ServerState) -> None:
    """Add the route."""

    @app.post(
        "/v1/completions",
        responses={
            200: schemas.stream_response(schemas.Completion, schemas.CompletionChunk),
            **schemas.error_responses(400, 401, 404, 413, 429, 503),
        },
    )
    async def completions(request: Request) -> Response:
        exchange, engine, body = await state.accept(request, CompletionRequest)
        params = sampling_params(body, engine.model_config.vocab_size, structured(body))
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(
                    400, "'prompt': only one prompt per request is supported", param="prompt"
                )
            prompt = prompt[0]
        tokenizer = engine.tokenizer
        if isinstance(prompt, str):
            # A raw prompt: the client templated it, so its control tokens are parsed.
            text = prompt
            prompt_ids = await in_thread(
                lambda: tokenizer.encode(text, add_bos=tokenizer.add_bos, parse_special=True)
            )
        else:
            prompt_ids = list(prompt)
        echo_text = None
        if body.echo:
            echo_text = prompt if isinstance(prompt, str) else None
            if echo_text is None or tokenizer.add_bos:
                echo_text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        rendering = completion_rendering(
            f"cmpl-{exchange.request_id}",
            exchange.model_name,
            tokenizer.token_bytes,
            logprobs=body.logprobs is not None,
            include_usage=body.include_usage,
            n=params.n,
            echo_text=echo_text,
            echo_ids=prompt_ids,
            generate=not body.scores_only,
        )
        return await state.generate(
            request,
            exchange,
            prompt_ids,
            params,
            rendering,
            stream=bool(body.stream),
            param_names=engine_param_names(body),
            cache_salt=body.cache_salt,
        )
