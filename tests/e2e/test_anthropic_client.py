"""The official `anthropic` client against a live server on loopback (`/v1/messages`).

The server requires an API key, which the client sends as `x-api-key`; the OpenAI client beside
it sends the same key as a bearer token, so the two dialects answer the same prompt side by side.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from kvserve.config import ServerConfig
from tests.e2e.dialects import ANTHROPIC

pytestmark = pytest.mark.slow

API_KEY = "anthropic-test-key"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0}
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
# A finished tool round: the assistant called the tool, the user returns its result.
TOOL_HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me look."},
            {
                "type": "tool_use",
                "id": "toolu_1",
                "name": "get_weather",
                "input": {"city": "Paris"},
            },
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C."},
            {"type": "text", "text": "So, should I take an umbrella?"},
        ],
    },
]


@pytest.fixture(scope="module")
def server(server_factory, engine_config):
    # One slot and one queue place, so a 429 takes only two requests to provoke.
    server = server_factory(
        engine_config(max_num_seqs=1, max_queue_per_slot=1), ServerConfig(api_key=API_KEY)
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def model(server):
    return server.state.model_name


def test_create_matches_chat_and_reports_usage(client, server, model):
    message = client.messages.create(
        model=model, max_tokens=24, messages=MESSAGES, extra_body=GREEDY
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert message.model == model
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.stop_sequence is None
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0) as chat:
        reply = chat.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=24, temperature=0
        )
    # The same conversation, the same greedy answer, counted the same way.
    assert message.content[0].text == reply.choices[0].message.content
    assert message.usage.input_tokens == reply.usage.prompt_tokens
    assert message.usage.output_tokens == reply.usage.completion_tokens
    expected = {"length": "max_tokens", "stop": "end_turn"}[reply.choices[0].finish_reason]
    assert message.stop_reason == expected


def test_max_tokens_is_the_stop_reason_when_the_budget_runs_out(client, model):
    message = client.messages.create(
        model=model, max_tokens=5, messages=MESSAGES, extra_body={"ignore_eos": True}
    )
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 5


def test_stop_sequence_is_named(client, model):
    free = client.messages.create(
        model=model, max_tokens=12, messages=MESSAGES, extra_body={**GREEDY, "ignore_eos": True}
    )
    text = free.content[0].text
    # A stop sequence taken from the middle of what the model says anyway.
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"no usable stop sequence in {text!r}"
    stopped = client.messages.create(
        model=model,
        max_tokens=12,
        messages=MESSAGES,
        stop_sequences=["never said", stop],
        extra_body={**GREEDY, "ignore_eos": True},
    )
    assert stopped.stop_reason == "stop_sequence"
    assert stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]
    assert stopped.usage.output_tokens < 12


def test_stream_and_final_message_match_create(client, model):
    whole = client.messages.create(model=model, max_tokens=16, messages=MESSAGES, extra_body=GREEDY)
    with client.messages.stream(
        model=model, max_tokens=16, messages=MESSAGES, extra_body=GREEDY
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1, "the text should arrive in several deltas"
    assert "".join(pieces) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_every_frame_names_its_event_in_order(server, model):
    payload = {"model": model, "max_tokens": 6, "messages": MESSAGES, "stream": True}
    response = httpx.post(
        server.url + "/v1/messages", json=payload, headers={"x-api-key": API_KEY}, timeout=60
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = ANTHROPIC.events(response.content)  # checks each frame's event: line
    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[0]["message"]["content"] == []
    assert events[0]["message"]["usage"]["input_tokens"] > 0
    assert all(e["delta"]["type"] == "text_delta" for e in events[2:-3])
    assert events[-2]["usage"]["output_tokens"] >= 1


def test_count_tokens_is_the_prompt_of_create(client, model):
    counted = client.messages.count_tokens(model=model, messages=MESSAGES, system="Be brief.")
    message = client.messages.create(
        model=model, max_tokens=1, messages=MESSAGES, system="Be brief."
    )
    assert counted.input_tokens == message.usage.input_tokens > 0
    plain = client.messages.count_tokens(model=model, messages=MESSAGES)
    assert plain.input_tokens != counted.input_tokens


def test_tool_history_renders_through_the_chat_template(client, server, model):
    counted = client.messages.count_tokens(model=model, messages=TOOL_HISTORY, tools=TOOLS)
    # The same conversation in the chat template's own terms: tool calls on the assistant
    # turn, the result as a tool message, the tools in the template's `tools` variable.
    chat_messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21 C."},
        {"role": "user", "content": "So, should I take an umbrella?"},
    ]
    tokenizer = server.state.engine.tokenizer
    tools = [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "parameters": t["input_schema"],
                "description": t["description"],
            },
        }
        for t in TOOLS
    ]
    assert counted.input_tokens == len(tokenizer.encode_chat(chat_messages, tools=tools))
    answer = client.messages.create(
        model=model, max_tokens=8, messages=TOOL_HISTORY, tools=TOOLS, extra_body=GREEDY
    )
    assert answer.usage.input_tokens == counted.input_tokens
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_a_forced_tool_call_is_refused_until_structured_output(client, model):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(
            model=model,
            max_tokens=8,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice={"type": "any"},
        )
    assert "tool_choice" in caught.value.body["error"]["message"]


def test_unknown_model_is_not_found(client):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="no-such-model", max_tokens=4, messages=MESSAGES)
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": caught.value.body["error"]["message"]},
    }
    assert "no-such-model" in caught.value.body["error"]["message"]


def test_errors_are_anthropic_shaped(server, model):
    url = server.url + "/v1/messages"
    headers = {"x-api-key": API_KEY}
    missing = httpx.post(url, json={"model": model, "messages": MESSAGES}, headers=headers)
    assert missing.status_code == 400
    body = missing.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    bad_block = httpx.post(
        url,
        json={
            "model": model,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
        },
        headers=headers,
    )
    assert bad_block.status_code == 400
    assert "messages[0].content[0]" in bad_block.json()["error"]["message"]
    unauthorized = httpx.post(url, json={"model": model, "max_tokens": 4, "messages": MESSAGES})
    assert unauthorized.status_code == 401
    assert unauthorized.json()["error"]["type"] == "authentication_error"
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=model, max_tokens=4, messages=MESSAGES)


def test_overload_is_a_rate_limit_error_with_retry_after(
    client, server, model, gate_factory, raw_client, until
):
    engine = server.state.engine
    gate = gate_factory(server)
    short = {"model": model, "max_tokens": 3, "messages": MESSAGES, "ignore_eos": True}
    holders = []
    for _ in range(2):  # one runs (held at the gate), one waits: the queue is full
        holder = raw_client(server.port)
        holder.post("/v1/messages", short, headers={"x-api-key": API_KEY})
        holders.append(holder)
    until(lambda: server.call(lambda: (engine.num_running, engine.num_waiting)) == (1, 1))
    with pytest.raises(anthropic.RateLimitError) as caught:
        client.messages.create(model=model, max_tokens=4, messages=MESSAGES)
    error = caught.value
    assert error.status_code == 429
    assert error.response.headers["retry-after"] == "30"
    assert error.body["type"] == "error"
    assert error.body["error"]["type"] == "overloaded_error"
    gate.open()
    for holder in holders:
        status, _ = holder.read_head()
        assert status == 200
        answer = json.loads(holder.read_until(b"}}"))  # usage is the body's last field
        assert answer["usage"]["output_tokens"] == 3
    until(lambda: server.call(engine.is_idle))
