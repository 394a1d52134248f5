"""OpenAI legacy completions: `POST /v1/completions` (`text_completion`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from kvserve.engine.stream import TokenLogprob, Usage
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

__all__ = ["PATHS", "CompletionRenderer", "register"]

PATHS = ("/v1/completions",)


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
        for index, text, entries, reason in self.answers(finish_reason):
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


def register(app: FastAPI, state: ServerState) -> None:
    """Add the route."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        exchange, engine, body = await state.accept(request, CompletionRequest)
        params = sampling_params(body, engine.model_config.vocab_size)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(
                    400, "'prompt': only one prompt per request is supported", param="prompt"
                )
            prompt = prompt[0]
        tokenizer = engine.tokenizer
        if isinstance(prompt, str):
            text = prompt
            prompt_ids = await in_thread(lambda: tokenizer.encode(text, add_bos=tokenizer.add_bos))
        else:
            prompt_ids = list(prompt)
        renderer = CompletionRenderer(
            f"cmpl-{exchange.request_id}",
            state.model_name,
            int(time.time()),
            tokenizer.token_bytes,
            logprobs=body.logprobs is not None,
            n=params.n,
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
