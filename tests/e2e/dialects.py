"""The API's dialects as the seed-rule tests see them: one request shape, how its answer ends
(stop reason and usage on the final event or NDJSON object), and its 429 body.

The overload, disconnect and slow-consumer tests are parametrized over `DIALECTS`, so every rule
is checked once per dialect from one test body.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvserve.model.paths import DEFAULT_MODEL_NAME

LENGTH_ENDINGS = {
    "chat": "length",
    "anthropic": "max_tokens",
    "responses": "incomplete",
    "ollama": "length",
}


@dataclass(frozen=True)
class Dialect:
    name: str
    path: str

    def __str__(self) -> str:
        return self.name

    def request(
        self, text: str, max_tokens: int, *, stream: bool = False, ignore_eos: bool = True
    ) -> dict:
        """A generation request in this dialect; streaming ones ask for usage where needed."""
        messages = [{"role": "user", "content": text}]
        if self.name == "chat":
            payload = {"messages": messages, "max_tokens": max_tokens}
            if stream:
                payload["stream_options"] = {"include_usage": True}
        elif self.name == "anthropic":
            payload = {"messages": messages, "max_tokens": max_tokens}
        elif self.name == "ollama":
            # The servers under test serve the default model under its own name.
            options = {"num_predict": max_tokens}
            payload = {"model": DEFAULT_MODEL_NAME, "messages": messages, "options": options}
        else:
            payload = {"input": messages, "max_output_tokens": max_tokens}
        payload.update(stream=stream, ignore_eos=ignore_eos)
        return payload

    def events(self, body: bytes) -> list[dict | str]:
        """The SSE data of a streamed body, JSON-decoded (`[DONE]` kept as the string); every
        frame of the Anthropic and Responses dialects must name its type in an `event:` line.
        Ollama's body is NDJSON: one object per line."""
        if self.name == "ollama":
            return [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        frames = [frame for frame in body.decode().split("\n\n") if frame.strip()]
        out: list[dict | str] = []
        for frame in frames:
            lines = frame.split("\n")
            data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
            assert len(data) == 1, frame
            if data[0] == "[DONE]":
                out.append("[DONE]")
                continue
            value = json.loads(data[0])
            if self.name != "chat":
                assert lines[0] == f"event: {value['type']}", frame
            out.append(value)
        return out

    def ending(self, body: bytes, stream: bool) -> tuple[str, int]:
        """(stop reason, completion tokens) from a whole answer or from the final stream event,
        checking that the stream ends as the dialect ends it."""
        if not stream:
            answer = json.loads(body)
            if self.name == "chat":
                return answer["choices"][0]["finish_reason"], answer["usage"]["completion_tokens"]
            if self.name == "anthropic":
                return answer["stop_reason"], answer["usage"]["output_tokens"]
            if self.name == "ollama":
                assert answer["done"] is True
                return answer["done_reason"], answer["eval_count"]
            return answer["status"], answer["usage"]["output_tokens"]
        events = self.events(body)
        if self.name == "ollama":
            assert [event["done"] for event in events] == [False] * (len(events) - 1) + [True]
            return events[-1]["done_reason"], events[-1]["eval_count"]
        if self.name == "chat":
            assert events[-1] == "[DONE]"
            # The last content chunk carries the finish reason; the usage chunk follows it.
            # (Counting content chunks would undercount: a token that ends inside a UTF-8
            # character, or text held back for a possible stop string, sends no chunk.)
            assert events[-2]["choices"] == []
            return events[-3]["choices"][0]["finish_reason"], events[-2]["usage"][
                "completion_tokens"
            ]
        assert "[DONE]" not in events
        if self.name == "anthropic":
            assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
            return events[-2]["delta"]["stop_reason"], events[-2]["usage"]["output_tokens"]
        assert events[-1]["type"] == "response.completed"
        numbers = [event["sequence_number"] for event in events]
        assert numbers == list(range(len(events)))
        response = events[-1]["response"]
        return response["status"], response["usage"]["output_tokens"]

    def rate_limited(self, body: bytes, code: str) -> None:
        """Check a 429 body: the dialect's error shape, saying what overflowed."""
        error = json.loads(body)
        if self.name == "ollama":
            assert set(error) == {"error"} and isinstance(error["error"], str)
            assert error["error"]
            return
        if self.name == "anthropic":
            assert error["type"] == "error"
            assert error["error"]["type"] == "overloaded_error"
            assert error["error"]["message"]
            return
        assert error["error"]["type"] == "rate_limit_error"
        assert error["error"]["code"] == code

    def stream_error(self, body: bytes) -> dict:
        """The error event that ended a stream after its 200: (type, message)."""
        events = self.events(body)
        if self.name == "ollama":
            assert set(events[-1]) == {"error"}
            return {"message": events[-1]["error"]}
        if self.name == "chat":
            assert events[-1] == "[DONE]"
            return events[-2]["error"]
        if self.name == "anthropic":
            assert events[-1]["type"] == "error"
            return events[-1]["error"]
        assert events[-1]["type"] == "response.failed"
        return events[-1]["response"]["error"]


CHAT = Dialect("chat", "/v1/chat/completions")
ANTHROPIC = Dialect("anthropic", "/v1/messages")
RESPONSES = Dialect("responses", "/v1/responses")
OLLAMA = Dialect("ollama", "/api/chat")
DIALECTS = [CHAT, ANTHROPIC, RESPONSES, OLLAMA]
