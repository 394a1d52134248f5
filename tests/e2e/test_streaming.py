"""Streaming through the app as served: events reach the client while generation runs, each
delta its own event, whole characters only, errors after the 200 as an error event + [DONE]."""

from __future__ import annotations

import json
import time

import httpx
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(server_factory):
    server = server_factory()
    yield server
    server.stop()


def _stream(server, payload: dict) -> tuple[httpx.Headers, list[tuple[float, str]]]:
    """POST a streaming request; every SSE data line with the monotonic time it arrived."""
    events = []
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json={**payload, "stream": True}, timeout=60
    ) as response:
        assert response.status_code == 200
        headers = response.headers
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append((time.monotonic(), line.removeprefix("data: ")))
    return headers, events


def test_events_arrive_while_generation_runs(server, gate_factory):
    # Each step takes at least 50 ms, so a server that held output back until the end would
    # deliver every event after the request's last step began.
    gate_factory(server, closed=False, delay=0.05)
    engine = server.state.engine
    num_tokens = 10
    headers, events = _stream(
        server,
        {
            "messages": [{"role": "user", "content": "Count to twenty."}],
            "max_tokens": num_tokens,
            "ignore_eos": True,
        },
    )
    request_id = headers["x-request-id"]
    steps = [record for record in engine.step_log if request_id in record.request_ids]
    assert len(steps) == num_tokens  # one prefill step, then one decode step per token
    token_events = [
        (arrived, data)
        for arrived, data in events
        if data != "[DONE]" and json.loads(data)["choices"][0]["delta"].get("content")
    ]
    assert token_events, "no content events"
    last_step_started = steps[-1].started
    assert token_events[0][0] < last_step_started
    # Spread over the generation, not one burst: all but the final token or two arrive
    # before the last step starts.
    early = [arrived for arrived, _ in token_events if arrived < last_step_started]
    assert len(early) >= len(token_events) - 2


def test_every_delta_is_its_own_event_and_text_is_whole_characters(server):
    payload = {
        "messages": [
            {"role": "user", "content": "Write the word 'hello' in Japanese and Chinese."}
        ],
        "max_tokens": 24,
        "temperature": 0,
    }
    _, events = _stream(server, payload)
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    texts = [c["choices"][0]["delta"].get("content", "") for c in chunks[1:]]
    # Characters split across tokens are held back until whole. Only the last chunk may end in
    # U+FFFD: max_tokens can cut the answer inside a character, as `decode` would show it.
    assert all("\ufffd" not in text for text in texts[:-1])
    whole = httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=60).json()
    assert "".join(texts) == whole["choices"][0]["message"]["content"]
    # One event per token at most: never more content events than generated tokens.
    assert len([t for t in texts if t]) <= whole["usage"]["completion_tokens"]


def test_error_after_streaming_began_is_an_error_event_then_done(
    server, gate_factory, until, metrics
):
    gate = gate_factory(server, closed=False)
    gate.fail_after = 4  # the fifth step fails
    _, events = _stream(
        server,
        {
            "messages": [{"role": "user", "content": "Tell a story."}],
            "max_tokens": 50,
            "ignore_eos": True,
        },
    )
    data = [d for _, d in events]
    assert data[-1] == "[DONE]"
    error = json.loads(data[-2])["error"]
    assert error["type"] == "server_error"
    assert "injected step failure" in error["message"]
    content = [json.loads(d)["choices"][0]["delta"].get("content") for d in data[1:-2]]
    assert any(content), "the failure should come after some tokens were streamed"
    gate.fail_after = None
    engine = server.state.engine
    until(lambda: server.call(engine.is_idle), message="the failed request leaked")
    # The server keeps serving.
    reply = httpx.post(
        server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60
    )
    assert reply.status_code == 200


def test_engine_failure_without_streaming_is_500_with_a_body(server, gate_factory, metrics):
    gate = gate_factory(server, closed=False)
    gate.fail_after = 0  # the first step fails
    before = metrics(server)
    response = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5},
        timeout=60,
    )
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error"
    assert "injected step failure" in error["message"]
    after = metrics(server)
    key = 'kvserve:http_server_errors_total{endpoint="/v1/chat/completions"}'
    assert after[key] - before.get(key, 0) == 1
    gate.fail_after = None
    assert server.call(server.state.engine.is_idle)


def test_unexpected_exception_is_500_with_a_body(server, monkeypatch):
    tokenizer = server.state.engine.tokenizer

    def broken(*args, **kwargs):
        raise RuntimeError("template engine exploded")

    monkeypatch.setattr(tokenizer, "encode_chat", broken)
    response = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5},
        timeout=60,
    )
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    assert response.headers["x-request-id"]
    monkeypatch.undo()
    again = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert again.status_code == 200
