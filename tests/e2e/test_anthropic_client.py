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
from tests.e2e.tool_schemas import ARGS, DESCRIPTIONS

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


def test_tool_history_renders_as_the_chat_dialect_renders_it(client, server, model):
    counted = client.messages.count_tokens(model=model, messages=TOOL_HISTORY, tools=TOOLS)
    # The same conversation in OpenAI chat's terms: tool calls on the assistant turn, the
    # result as a tool message, the same tools. Both dialects show it to the model alike.
    chat_messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21 C."},
        {"role": "user", "content": "So, should I take an umbrella?"},
    ]
    tools = [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t["description"],
                "parameters": t["input_schema"],
            },
        }
        for t in TOOLS
    ]
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0) as chat:
        reply = chat.chat.completions.create(
            model=model, messages=chat_messages, tools=tools, max_tokens=1
        )
    assert counted.input_tokens == reply.usage.prompt_tokens
    # the tools reach the model: without them the prompt is shorter
    bare = client.messages.count_tokens(model=model, messages=TOOL_HISTORY)
    assert bare.input_tokens < counted.input_tokens
    answer = client.messages.create(
        model=model, max_tokens=8, messages=TOOL_HISTORY, tools=TOOLS, extra_body=GREEDY
    )
    assert answer.usage.input_tokens == counted.input_tokens
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


# --------------------------------------------------------------------------------------------
# Forced tool calls, under structured output


FORCED_TOOLS = [
    {"name": name, "description": DESCRIPTIONS[name], "input_schema": args.model_json_schema()}
    for name, args in ARGS.items()
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED_MAX_TOKENS = 200


def named_call(client, model, name):
    """A greedy call forced to the tool `name`; its one tool_use block, checked."""
    message = client.messages.create(
        model=model,
        max_tokens=FORCED_MAX_TOKENS,
        messages=ASK,
        tools=FORCED_TOOLS,
        tool_choice={"type": "tool", "name": name},
        extra_body=GREEDY,
    )
    (call,) = check_tool_use(message, (name,))
    return message, call


def check_tool_use(message, names=("get_weather", "get_time")):
    """The message is one or more tool calls whose inputs validate; returns the blocks."""
    assert message.stop_reason == "tool_use"
    blocks = [block for block in message.content if block.type == "tool_use"]
    assert blocks and len(blocks) == len(message.content)
    for block in blocks:
        assert block.id.startswith("toolu_")
        assert block.name in names
        assert isinstance(block.input, dict)
        ARGS[block.name].model_validate(block.input)
    return blocks


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "any"}, {"type": "tool", "name": "get_time"}],
    ids=["any", "named"],
)
def test_forced_tool_use_validates(client, model, tool_choice):
    names = ("get_time",) if tool_choice["type"] == "tool" else ("get_weather", "get_time")
    for _ in range(2):  # sampled: every answer must validate, whatever was drawn
        message = client.messages.create(
            model=model,
            max_tokens=FORCED_MAX_TOKENS,
            messages=ASK,
            tools=FORCED_TOOLS,
            tool_choice={**tool_choice, "disable_parallel_tool_use": True},
            extra_body={"temperature": 1.0},
        )
        assert len(check_tool_use(message, names)) == 1


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "any"}, {"type": "tool", "name": "get_weather"}],
    ids=["any", "named"],
)
def test_streamed_tool_use_matches_create(client, model, tool_choice):
    request = {
        "model": model,
        "max_tokens": FORCED_MAX_TOKENS,
        "messages": ASK,
        "tools": FORCED_TOOLS,
        "tool_choice": tool_choice,
        "extra_body": GREEDY,
    }
    whole = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_message()
    check_tool_use(final)
    assert [(b.name, b.input) for b in final.content] == [(b.name, b.input) for b in whole.content]
    assert final.usage.output_tokens == whole.usage.output_tokens
    starts = [e for e in events if e.type == "content_block_start"]
    assert [e.content_block.type for e in starts] == ["tool_use"] * len(final.content)
    json_deltas = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert json_deltas
    if tool_choice["type"] == "tool":
        # a named call's input arrives as it is generated
        assert len(json_deltas) > 1
        assert json.loads("".join(json_deltas)) == final.content[0].input


def test_a_full_tool_round_trip(client, model):
    first, call = named_call(client, model, "get_weather")
    history = [
        *ASK,
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C."}],
        },
    ]
    final = client.messages.create(
        model=model,
        max_tokens=40,
        messages=history,
        tools=FORCED_TOOLS,
        tool_choice={"type": "none"},
        extra_body=GREEDY,
    )
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in final.content] == ["text"]
    assert final.content[0].text.strip()


# An earlier call in the history shows the small model the tool-call syntax, so that with
# tool_choice auto it writes a <tool_call> of its own.
LEAD_TO_A_CALL = [
    *ASK,
    {
        "role": "assistant",
        "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
        ],
    },
    {"role": "user", "content": "What is the weather in Rome?"},
]


def test_auto_reads_the_models_own_tool_call(client, model):
    request = {
        "model": model,
        "max_tokens": 60,
        "messages": LEAD_TO_A_CALL,
        "tools": TOOLS,
        "extra_body": GREEDY,
    }
    message = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        final = stream.get_final_message()
    for answer in (message, final):
        assert answer.stop_reason == "tool_use"
        calls = [block for block in answer.content if block.type == "tool_use"]
        assert [(c.name, c.input) for c in calls] == [("get_weather", {"city": "Rome"})]
        assert all("<tool_call>" not in b.text for b in answer.content if b.type == "text")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_schema_the_grammar_engine_refuses_is_400(client, server, model, stream):
    bad = [
        {"name": "f", "input_schema": {"type": "object", "properties": {"x": {"type": "strin"}}}}
    ]
    response = httpx.post(
        server.url + "/v1/messages",
        json={
            "model": model,
            "max_tokens": 8,
            "messages": ASK,
            "tools": bad,
            "tool_choice": {"type": "any"},
            "stream": stream,
        },
        headers={"x-api-key": API_KEY},
        timeout=120,
    )
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "tools" in body["error"]["message"]
    # and the next forced call is served
    named_call(client, model, "get_time")


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
