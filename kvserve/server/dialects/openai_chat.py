"""OpenAI chat: `POST /v1/chat/completions` (`chat.completion` and `chat.completion.chunk`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from kvserve.engine.stream import TokenLogprob, Usage
from kvserve.server.core import ServerState, in_thread
from kvserve.server.dialects.openai import (
    ChatCompletionRequest,
    OpenAIStream,
    _Renderer,
    chat_logprobs,
    engine_param_names,
    sampling_params,
    usage_dict,
)
from kvserve.server.protocol import APIError
from kvserve.tokenizer import ChatTemplateError

__all__ = ["PATHS", "ChatRenderer", "register"]

PATHS = ("/v1/chat/completions",)


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
                for index, text, logprobs, reason in self.answers(finish_reason)
            ],
            "usage": usage_dict(usage),
        }


def register(app: FastAPI, state: ServerState) -> None:
    """Add the route."""

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        exchange, engine, body = await state.accept(request, ChatCompletionRequest)
        if not body.messages:
            raise APIError(400, "'messages' must hold at least one message", param="messages")
        template_kwargs = dict(body.chat_template_kwargs or {})
        for reserved in ("messages", "add_generation_prompt"):
            if reserved in template_kwargs:
                raise APIError(
                    400,
                    f"'chat_template_kwargs' may not set '{reserved}'",
                    param="chat_template_kwargs",
                )
        # Validate before tokenizing: a bad parameter costs no template rendering.
        params = sampling_params(body, engine.model_config.vocab_size)
        messages = [message.model_dump(exclude_none=True) for message in body.messages]
        tokenizer = engine.tokenizer
        try:
            prompt_ids = await in_thread(lambda: tokenizer.encode_chat(messages, **template_kwargs))
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages") from None
        renderer = ChatRenderer(
            f"chatcmpl-{exchange.request_id}",
            state.model_name,
            int(time.time()),
            tokenizer.token_bytes,
            logprobs=bool(body.logprobs),
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
