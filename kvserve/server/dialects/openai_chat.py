"""OpenAI chat: `POST /v1/chat/completions` (`chat.completion` and `chat.completion.chunk`)."""

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
    ChatCompletionRequest,
    OpenAIStream,
    _Renderer,
    chat_logprobs,
    engine_param_names,
    sampling_params,
    usage_dict,
)
from kvserve.server.protocol import APIError
from kvserve.server.structured import structured
from kvserve.server.tools import (
    ToolCall,
    ToolPlan,
    parse_required,
    parser_for,
    plan_tools,
    tool_prompt,
)
from kvserve.tokenizer import ChatTemplateError

__all__ = ["PATHS", "ChatRenderer", "ToolChatRenderer", "register"]

PATHS = ("/v1/chat/completions",)
BODIES = {("post", "/v1/chat/completions"): ChatCompletionRequest}
"""Each route's JSON body, for the API's description."""


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


# --------------------------------------------------------------------------------------------
# The answer: message.tool_calls, and streaming deltas like OpenAI's


class ToolChatRenderer(ChatRenderer):
    """Chat responses for a request with tools: calls as `message.tool_calls` and as
    `delta.tool_calls` (the first delta of a call carries index, id, type and name; then its
    arguments), `finish_reason` "tool_calls" when calls were made ("stop" for a named function,
    as OpenAI does)."""

    def __init__(self, *args: Any, plan: ToolPlan, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plan = plan
        self._parser = plan.new_parser() if plan.reads_with_parser else None
        self._num_calls = 0
        self._named: ToolCall | None = None
        self._buffered: list[str] = []

    # -- streaming

    def delta_chunks(
        self,
        text: str,
        logprobs: Sequence[TokenLogprob],
        finish_reason: str | None,
        index: int = 0,
    ) -> list[str]:
        chunks: list[str] = []  # one answer: requests with tools have n = 1
        choice = "auto" if self.plan.reads_with_parser else self.plan.choice
        if choice == "auto":
            items = self._parser.feed(text) if text else []
            if finish_reason is not None:
                items += self._parser.finish()
            for item in items:
                if isinstance(item, ToolCall):
                    chunks += self._call_chunks(item)
                else:
                    chunks.append(self._chunk([self._choice(item, (), None, 0)]))
        elif choice == "named":
            if text:
                if self._named is None:
                    self._named = ToolCall(self.plan.name, "")
                    chunks.append(self._tool_delta(self._header(self._named, 0)))
                chunks.append(self._tool_delta({"index": 0, "function": {"arguments": text}}))
        else:  # required: the calls are known once the array is complete
            self._buffered.append(text)
            if finish_reason is not None:
                full = "".join(self._buffered)
                calls = parse_required(full)
                if calls is None:
                    if full:
                        chunks.append(self._chunk([self._choice(full, (), None, 0)]))
                else:
                    for call in calls:
                        chunks += self._call_chunks(call)
        if finish_reason is not None:
            end = {
                "index": 0,
                "delta": {},
                "logprobs": None,
                "finish_reason": self._finish_reason(finish_reason),
            }
            chunks.append(self._chunk([end]))
        return chunks

    def _call_chunks(self, call: ToolCall) -> list[str]:
        index = self._num_calls
        self._num_calls += 1
        return [
            self._tool_delta(self._header(call, index)),
            self._tool_delta({"index": index, "function": {"arguments": call.arguments}}),
        ]

    @staticmethod
    def _header(call: ToolCall, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        }

    def _tool_delta(self, entry: dict[str, Any]) -> str:
        choice = {
            "index": 0,
            "delta": {"tool_calls": [entry]},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._chunk([choice])

    def _finish_reason(self, finish_reason: str) -> str:
        if finish_reason == "stop" and self.plan.choice != "named" and self._num_calls:
            return "tool_calls"
        return finish_reason

    # -- one response

    def response(self, finish_reason: str, usage: Usage) -> dict[str, Any]:
        body = super().response(finish_reason, usage)
        text = self.text
        choice = "auto" if self.plan.reads_with_parser else self.plan.choice
        content: str | None
        if choice == "auto":
            content, calls = self.plan.new_parser().parse(text)
        elif choice == "named":
            content, calls = None, [ToolCall(self.plan.name, text)]
        else:
            calls = parse_required(text)
            content, calls = (text or None, []) if calls is None else (None, calls)
        self._num_calls = len(calls)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.as_dict() for call in calls]
        result = body["choices"][0]
        result["message"] = message
        result["finish_reason"] = self._finish_reason(finish_reason)
        return body


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
        renderer_args = (
            f"chatcmpl-{exchange.request_id}",
            state.model_name,
            int(time.time()),
            tokenizer.token_bytes,
        )
        if tools is not None and tools.offers_tools:
            if params.n != 1:
                raise APIError(400, "'n' above 1 is not supported with 'tools'", param="n")
            renderer = ToolChatRenderer(*renderer_args, logprobs=bool(body.logprobs), plan=tools)
        else:
            renderer = ChatRenderer(*renderer_args, logprobs=bool(body.logprobs), n=params.n)
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
