"""vLLM's token endpoints: `POST /tokenize` and `POST /detokenize`."""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.responses import Response

from kvserve.server import schemas
from kvserve.server.core import ServerState, in_thread, json_response
from kvserve.server.dialects.openai import ChatMessage
from kvserve.server.protocol import APIError, _Model
from kvserve.tokenizer import ChatTemplateError

__all__ = ["PATHS", "DetokenizeRequest", "TokenizeRequest", "register"]

PATHS = ("/tokenize", "/detokenize")


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


BODIES = {("post", "/tokenize"): TokenizeRequest, ("post", "/detokenize"): DetokenizeRequest}
"""Each route's JSON body, for the API's description."""


def register(app: FastAPI, state: ServerState) -> None:
    """Add the routes."""

    @app.post(
        "/tokenize",
        responses={
            200: schemas.json_response(schemas.TokenizeResponse),
            **schemas.error_responses(400, 401, 404, 413, 503),
        },
    )
    async def tokenize(request: Request) -> Response:
        exchange, engine, body = await state.accept(request, TokenizeRequest)
        tokenizer = engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
        if body.prompt is not None:
            text, add_bos = body.prompt, tokenizer.add_bos and body.add_special_tokens
            # The ids /v1/completions would use for this prompt: control tokens parsed.
            token_ids = await in_thread(
                lambda: tokenizer.encode(text, add_bos=add_bos, parse_special=True)
            )
        else:
            messages = [message.model_dump(exclude_none=True) for message in body.messages or ()]
            generation_prompt = body.add_generation_prompt
            try:
                token_ids = await in_thread(
                    lambda: tokenizer.encode_chat(messages, add_generation_prompt=generation_prompt)
                )
            except ChatTemplateError as exc:
                raise APIError(400, str(exc), param="messages") from None
        return json_response(
            {"tokens": token_ids, "count": len(token_ids), "max_model_len": engine.max_model_len}
        )

    @app.post(
        "/detokenize",
        responses={
            200: schemas.json_response(schemas.DetokenizeResponse),
            **schemas.error_responses(400, 401, 404, 413, 503),
        },
    )
    async def detokenize(request: Request) -> Response:
        exchange, engine, body = await state.accept(request, DetokenizeRequest)
        tokenizer = engine.tokenizer
        vocab = tokenizer.vocab_size
        for index, token_id in enumerate(body.tokens):
            if not 0 <= token_id < vocab:
                raise APIError(
                    400,
                    f"'tokens[{index}]': {token_id} is not a token id of this model",
                    param="tokens",
                )
        return json_response({"prompt": tokenizer.decode(body.tokens)})
