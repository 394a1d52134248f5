"""OpenAI legacy completions: `POST /v1/completions` (`text_completion`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from kvserve.engine.stream import TokenLogprob, Usage
from kvserve.server import schemas
from kvserve.server.core import ServerState, in_thread
from kvserve.server.dialects.openai import (
    CompletionRequest,
    OpenAIStream,
    _Renderer,
    completion_logprobs,
    engine_param_names,
    sampling_params,
    usage_dict,
)
from kvserve.server.protocol import APIError
from kvserve.server.structured import structured

__all__ = ["PATHS", "CompletionRenderer", "register"]

PATHS = ("/v1/completions",)
BODIES = {("post", "/v1/completions"): CompletionRequest}
"""Each route's JSON body, for the API's description."""


class CompletionRenderer(_Renderer):
    """`text_completion` responses and chunks.

    With `echo`, the prompt (`echo_text`, `echo_ids`) comes first: in the text, and with logprobs
    in the tokens and log-probabilities too, as vLLM answers (the first prompt token has null
    ones). `generate=False` (echo with max_tokens 0) drops the generated token and counts no
    completion tokens.
    """

    chunk_object = "text_completion"

    def __init__(
        self,
        *args: Any,
        echo_text: str | None = None,
        echo_ids: Sequence[int] = (),
        generate: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._text_offsets = [0] * self.n
        self._echo_text = echo_text
        self._echo_ids = list(echo_ids)
        self._echo_entries: list[TokenLogprob | int] | None = None
        # The answers whose first chunk (or response entry) still owes the echoed prompt.
        self._echo_pending = set(range(self.n)) if echo_text is not None else set()
        self._generate = generate

    def prompt_scored(self, entries: Sequence[TokenLogprob | None]) -> None:
        if self._echo_text is not None:
            self._echo_entries = [
                token_id if entry is None else entry
                for token_id, entry in zip(self._echo_ids, entries, strict=True)
            ]

    def _take_echo(self, index: int) -> tuple[str, list[TokenLogprob | int]]:
        """The prompt's text and logprob entries, once per answer (its first chunk or its
        entry in the response)."""
        if index not in self._echo_pending:
            return "", []
        self._echo_pending.discard(index)
        text = self._echo_text or ""
        entries = self._echo_entries or []
        if self.want_logprobs and text and not entries:
            entries = list(self._echo_ids)  # echo without scores: tokens, null logprobs
        return text, entries if self.want_logprobs else []

    def delta_chunk(
        self,
        text: str,
        logprobs: Sequence[TokenLogprob],
        finish_reason: str | None,
        index: int = 0,
    ) -> str | None:
        if not self._generate:
            text, logprobs = "", ()
        if index in self._echo_pending:
            echo_text, echo_entries = self._take_echo(index)
            text = echo_text + text
            logprobs = [*echo_entries, *(logprobs if self.want_logprobs else ())]
        return super().delta_chunk(text, logprobs, finish_reason, index)

    def add(
        self,
        text: str,
        logprobs: Sequence[TokenLogprob],
        index: int = 0,
        finish_reason: str | None = None,
    ) -> None:
        if not self._generate:
            text, logprobs = "", ()
        super().add(text, logprobs, index, finish_reason)

    def _choice(
        self,
        text: str,
        logprobs: Sequence[TokenLogprob | int],
        finish_reason: str | None,
        index: int,
    ) -> dict[str, Any]:
        rendered = None
        if logprobs:
            rendered, self._text_offsets[index] = completion_logprobs(
                logprobs, self.token_bytes, self._text_offsets[index]
            )
        return {"index": index, "text": text, "logprobs": rendered, "finish_reason": finish_reason}

    def _usage(self, usage: Usage) -> Usage:
        return usage if self._generate else Usage(usage.prompt_tokens, 0)

    def usage_chunk(self, usage: Usage) -> str:
        return super().usage_chunk(self._usage(usage))

    def response(self, finish_reason: str, usage: Usage) -> dict[str, Any]:
        choices = []
        for index, text, entries, reason in self.answers(finish_reason):
            echo_text, echo_entries = self._take_echo(index)
            logprobs = None
            if self.want_logprobs:
                logprobs, _ = completion_logprobs([*echo_entries, *entries], self.token_bytes, 0)
            choices.append(
                {
                    "index": index,
                    "text": echo_text + text,
                    "logprobs": logprobs,
                    "finish_reason": reason,
                }
            )
        return {
            "id": self.response_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage_dict(self._usage(usage)),
        }


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
        renderer = CompletionRenderer(
            f"cmpl-{exchange.request_id}",
            state.model_name,
            int(time.time()),
            tokenizer.token_bytes,
            logprobs=body.logprobs is not None,
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
            OpenAIStream(renderer, include_usage=body.include_usage),
            stream=bool(body.stream),
            param_names=engine_param_names(body),
            cache_salt=body.cache_salt,
        )
