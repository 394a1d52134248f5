"""The token ids a request's prompt starts with, as the ingress sees them, for routing.

The engine's prefix cache names blocks by the prompt's token ids, so the ingress tokenizes the
prompt the way the dialects do (the chat template for conversations, plain encoding for
completions) and hashes its first blocks with the engine's chaining and salt. Only routing
depends on it: a request this cannot read (a shape it does not know, a template that refuses
it) routes by load and is validated by the replica as usual.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvserve.tokenizer import Tokenizer

__all__ = ["GENERATING_PATHS", "PromptHasher"]

GENERATING_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"}
)
"""Routes whose prompt is routed by prefix; every other route goes to the least loaded."""


def _text_of(content: Any) -> Any:
    """Anthropic and Responses content parts as chat content: the text parts joined."""
    if isinstance(content, list):
        return "".join(
            part.get("text", "") for part in content if isinstance(part, dict) and "text" in part
        )
    return content


class PromptHasher:
    """`hashes(path, request)`: the block hashes of a request's first `max_blocks` blocks, by
    one model's tokenizer (each model of a cluster has its own hasher)."""

    def __init__(self, tokenizer: Tokenizer, block_size: int, *, max_blocks: int = 64) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.max_blocks = max_blocks

    def hashes(self, path: str, request: dict[str, Any]) -> list[bytes]:
        """Empty when the request (its parsed JSON body) is not one this can read."""
        try:
            from kvserve.core.prefix import block_hashes

            token_ids = self.prompt_ids(path, request)
        except Exception:  # routing is best effort; the replica gives the real answer
            return []
        if not token_ids:
            return []
        salt = request.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        limit = self.block_size * self.max_blocks
        return block_hashes(token_ids[:limit], self.block_size, salt)

    def prompt_ids(self, path: str, request: dict[str, Any]) -> list[int]:
        tokenizer = self.tokenizer
        if path == "/v1/completions":
            prompt = request.get("prompt")
            if isinstance(prompt, list) and prompt:
                prompt = prompt[0] if not isinstance(prompt[0], int) else prompt
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return list(prompt)
            if isinstance(prompt, str):
                return tokenizer.encode(prompt, add_bos=tokenizer.add_bos, parse_special=True)
            return []
        return self._chat_ids(self._messages(path, request))

    def _messages(self, path: str, request: dict[str, Any]) -> list[dict[str, Any]]:
        if path == "/v1/chat/completions":
            return list(request.get("messages") or [])
        messages: list[dict[str, Any]] = []
        if path == "/v1/messages":
            system = _text_of(request.get("system"))
            if system:
                messages.append({"role": "system", "content": system})
            raw: Sequence[Any] = request.get("messages") or []
        else:  # /v1/responses
            if request.get("instructions"):
                messages.append({"role": "system", "content": request["instructions"]})
            raw = request.get("input") or []
            if isinstance(raw, str):
                raw = [{"role": "user", "content": raw}]
        for message in raw:
            if isinstance(message, dict) and "role" in message:
                messages.append(
                    {"role": message["role"], "content": _text_of(message.get("content"))}
                )
        return messages

    def _chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        if not messages:
            return []
        try:
            return self.tokenizer.encode_chat(messages)
        except Exception:
            # A conversation the template refuses still has a stable routing key.
            return self.tokenizer.encode(json.dumps(messages, sort_keys=True))
