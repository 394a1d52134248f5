"""OpenAI chat: `POST /v1/chat/completions` (`chat.completion` and `chat.completion.chunk`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from kvserve.engine.stream import TokenLogprob
from kvserve.server import schemas
from kvserve.server.core import ServerState, in_thread
from kvserve.server.dialects.openai import (
    ChatCompletionRequest,
    OpenAIBody,
    OpenAIStream,
    chat_logprobs,
    engine_param_names,
    sampling_params,
    usage_dict,
)
from kvserve.server.protocol import APIError
from kvserve.server.render import CallArguments, CallEnd, CallStart, Ending, Rendering, Update
from kvserve.server.sse import event
from kvserve.server.structured import structured
from kvserve.server.tools import ToolPlan, parser_for, plan_tools, tool_prompt
from kvserve.tokenizer import ChatTemplateError

__all__ = ["PATHS", "ChatBody", "ChatStream", "chat_rendering", "register"]

PATHS = ("/v1/chat/completions",)
BODIES = {("post", "/v1/chat/completions"): ChatCompletionRequest}
"""Each route's JSON body, for the API's description."""


def _finish_reason(reason: str, num_calls: int, named: bool) -> str:
    # OpenAI: "tool_calls" once calls were made, but "stop" for a function the request named.
    if reason == "stop" and num_calls and not named:
        return "tool_calls"
    return reason


class ChatStream(OpenAIStream):
    """`chat.completion.chunk` events: the first delta of each answer carries its role; text
    goes out as `delta.content`, a call as `delta.tool_calls` (its first delta with index, id,
    type and name, then its arguments)."""

    chunk_object = "chat.completion.chunk"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._num_calls = [0] * self.n
        self._named = False

    def head(self) -> str:
        return "".join(
            event(
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
            )
            for index in range(self.n)
        )

    def update(self, update: Update) -> str:
        index = update.index
        chunks: list[str] = []
        text: list[str] = []
        for piece in update.pieces:
            if isinstance(piece, str):
                text.append(piece)
                continue
            if text:
                chunks.append(self._content(index, "".join(text), (), None))
                text = []
            if isinstance(piece, CallStart):
                self._named = piece.named
                self._num_calls[index] += 1
                entry = {
                    "index": self._num_calls[index] - 1,
                    "id": piece.id,
                    "type": "function",
                    "function": {"name": piece.name, "arguments": ""},
                }
                chunks.append(self._tool_delta(index, entry))
            elif isinstance(piece, CallArguments):
                entry = {"index": self._num_calls[index] - 1, "function": {"arguments": piece.text}}
                chunks.append(self._tool_delta(index, entry))
        content = "".join(text)
        logprobs = update.logprobs if self.want_logprobs else ()
        finish = update.finish_reason
        if finish is not None:
            finish = _finish_reason(finish, self._num_calls[index], self._named)
        if content or logprobs or finish is not None:
            chunks.append(self._content(index, content, logprobs, finish))
        return "".join(map(event, chunks))

    def _content(
        self, index: int, text: str, logprobs: Sequence[TokenLogprob], finish_reason: str | None
    ) -> str:
        choice = {
            "index": index,
            "delta": {"content": text} if text or finish_reason is None else {},
            "logprobs": {"content": chat_logprobs(logprobs, self.token_bytes)}
            if logprobs
            else None,
            "finish_reason": finish_reason,
        }
        return self._chunk([choice])

    def _tool_delta(self, index: int, entry: dict[str, Any]) -> str:
        choice = {
            "index": index,
            "delta": {"tool_calls": [entry]},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._chunk([choice])


class ChatBody(OpenAIBody):
    """A `chat.completion`: each answer's message (its calls as `message.tool_calls`, and
    `content` null when it made calls and said nothing) and finish reason."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._calls: list[list[dict[str, Any]]] = [[] for _ in range(self.n)]
        self._named = False

    def update(self, update: Update) -> None:
        super().update(update)
        calls = self._calls[update.index]
        for piece in update.pieces:
            if isinstance(piece, CallStart):
                self._named = piece.named
                function = {"name": piece.name, "arguments": ""}
                calls.append({"id": piece.id, "type": "function", "function": function})
            elif isinstance(piece, CallEnd):
                calls[-1]["function"]["arguments"] = piece.arguments

    def body(self, ending: Ending) -> dict[str, Any]:
        choices = []
        for index, text, logprobs, reason in self.answers(ending.finish_reason):
            calls = self._calls[index]
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text if text or not calls else None,
            }
            if calls:
                message["tool_calls"] = calls
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": (
                        {"content": chat_logprobs(logprobs, self.token_bytes)}
                        if self.want_logprobs
                        else None
                    ),
                    "finish_reason": _finish_reason(reason, len(calls), self._named),
                }
            )
        return {
            "id": self.response_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage_dict(ending.usage),
        }


def chat_rendering(
    response_id: str,
    model: str,
    token_bytes: Callable[[int], bytes],
    *,
    logprobs: bool = False,
    include_usage: bool = False,
    n: int = 1,
    plan: ToolPlan | None = None,
) -> Rendering:
    """One chat answer, streamed or whole. With tools offered no log-probabilities are
    streamed (a token may lie inside a call); the whole answer still lists them."""
    args = (response_id, model, int(time.time()), token_bytes)
    offers_tools = plan is not None and plan.offers_tools
    return Rendering(
        plan,
        stream=lambda: ChatStream(
            *args, logprobs=logprobs and not offers_tools, include_usage=include_usage, n=n
        ),
        whole=lambda: ChatBody(*args, logprobs=logprobs, n=n),
    )


def register(app: FastAPI, state: ServerState) -> None:
    """Add the route."""

    @app.post(
        "/v1/chat/completions",
        responses={
            200: schemas.stream_response(schemas.ChatCompletion, schemas.ChatCompletionChunk),
            **schemas.error_responses(400, 401, 404, 413, 429, 503),
        },
    )
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
        tokenizer = engine.tokenizer
        tools = plan_tools(
            body.tools,
            body.tool_choice,
            parallel_tool_calls=body.parallel_tool_calls,
            parser=parser_for(tokenizer.chat_template, state.config.tool_call_parser),
        )
        constraint = structured(body)
        if constraint is not None and tools is not None and tools.constraint is not None:
            raise APIError(
                400,
                "a required or named tool choice already constrains the answer; "
                "drop 'response_format'/'structured_outputs'",
                param="tool_choice",
            )
        # Validate before tokenizing: a bad parameter costs no template rendering.
        params = sampling_params(
            body,
            engine.model_config.vocab_size,
            constraint or (tools.constraint if tools is not None else None),
        )
        messages = [message.model_dump(exclude_none=True) for message in body.messages]
        messages, template_kwargs = tool_prompt(
            tools, messages, tokenizer.chat_template, template_kwargs
        )
        try:
            prompt_ids = await in_thread(lambda: tokenizer.encode_chat(messages, **template_kwargs))
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages") from None
        if tools is not None and tools.offers_tools and params.n != 1:
            raise APIError(400, "'n' above 1 is not supported with 'tools'", param="n")
        rendering = chat_rendering(
            f"chatcmpl-{exchange.request_id}",
            exchange.model_name,
            tokenizer.token_bytes,
            logprobs=bool(body.logprobs),
            include_usage=body.include_usage,
            n=params.n,
            plan=tools,
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
