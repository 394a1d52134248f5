"""The official `openai` client's Responses API against a live server on loopback."""

from __future__ import annotations

import json
from typing import Annotated, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.dialects import RESPONSES
from tests.e2e.tool_schemas import ARGS, DESCRIPTIONS

pytestmark = pytest.mark.slow

INPUT = "Name three colours."


@pytest.fixture(scope="module")
def server(server_factory):
    server = server_factory()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def model(server):
    return server.state.model_name


def test_create_matches_chat_and_reports_usage(client, model):
    response = client.responses.create(
        model=model, input=INPUT, max_output_tokens=24, temperature=0
    )
    assert response.object == "response"
    assert response.id.startswith("resp_")
    assert [item.type for item in response.output] == ["message"]
    assert response.output[0].content[0].type == "output_text"
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": INPUT}], max_tokens=24, temperature=0
    )
    # The same conversation, the same greedy answer, counted the same way.
    assert response.output_text == reply.choices[0].message.content
    assert response.usage.input_tokens == reply.usage.prompt_tokens
    assert response.usage.output_tokens == reply.usage.completion_tokens
    assert response.usage.total_tokens == reply.usage.total_tokens
    if reply.choices[0].finish_reason == "length":
        assert response.status == "incomplete"
    else:
        assert response.status == "completed" and response.incomplete_details is None


def test_a_repeated_prefix_is_reported_as_cached_input(client, model):
    instructions = " ".join(f"Rule {i}: answer briefly and in plain words." for i in range(12))

    def ask():
        return client.responses.create(
            model=model, instructions=instructions, input=INPUT, max_output_tokens=2
        )

    first, second = ask(), ask()
    assert first.usage.input_tokens == second.usage.input_tokens > 64
    # The second prompt was computed for the first: its whole blocks by reference and the rest
    # copied from the first's published tail, all but its last token (computed for its logits).
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached == second.usage.input_tokens - 1
    assert first.usage.input_tokens_details.cached_tokens <= cached


def test_budget_running_out_is_incomplete(client, model):
    response = client.responses.create(
        model=model, input=INPUT, max_output_tokens=4, extra_body={"ignore_eos": True}
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 4


def test_instructions_and_message_items_are_the_conversation(client, server, model):
    response = client.responses.create(
        model=model,
        instructions="Answer in one word.",
        input=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
            {"role": "user", "content": [{"type": "input_text", "text": INPUT}]},
        ],
        max_output_tokens=1,
    )
    tokenizer = server.state.engine.tokenizer
    expected = tokenizer.encode_chat(
        [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": INPUT},
        ]
    )
    assert response.usage.input_tokens == len(expected)


def test_function_call_items_render_as_the_chat_dialect_renders_them(client, model):
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny."},
    ]
    response = client.responses.create(model=model, tools=tools, input=history, max_output_tokens=1)
    # The same conversation in OpenAI chat's terms, with the same tools.
    reply = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."},
        ],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": tools[0]["description"],
                    "parameters": tools[0]["parameters"],
                },
            }
        ],
        max_tokens=1,
    )
    assert response.usage.input_tokens == reply.usage.prompt_tokens
    bare = client.responses.create(model=model, input=history, max_output_tokens=1)
    assert bare.usage.input_tokens < response.usage.input_tokens  # the tools reach the model


def test_stream_and_final_response_match_create(client, model):
    whole = client.responses.create(model=model, input=INPUT, max_output_tokens=16, temperature=0)
    with client.responses.stream(
        model=model, input=INPUT, max_output_tokens=16, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events)))
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1, "the text should arrive in several deltas"
    assert "".join(deltas) == whole.output_text == final.output_text
    assert final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_every_frame_names_its_event(server):
    payload = {"input": INPUT, "max_output_tokens": 3, "stream": True}
    response = httpx.post(server.url + "/v1/responses", json=payload, timeout=60)
    assert response.status_code == 200
    events = RESPONSES.events(response.content)  # checks each frame's event: line
    assert (
        RESPONSES.ending(response.content, True)[1]
        == events[-1]["response"]["usage"]["output_tokens"]
    )


def test_previous_response_id_is_refused_by_name(client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input=INPUT, previous_response_id="resp_earlier")
    assert caught.value.body["param"] == "previous_response_id"


# --------------------------------------------------------------------------------------------
# text.format and forced function calls, under structured output


class Colours(BaseModel):
    colours: Annotated[
        list[Literal["red", "green", "blue", "yellow"]], Field(min_length=3, max_length=3)
    ]
    favourite: Annotated[str, Field(max_length=16)]
    count: Annotated[int, Field(ge=0, le=10)]


COLOURS_FORMAT = {
    "type": "json_schema",
    "name": "colours",
    "schema": Colours.model_json_schema(),
    "strict": True,
}
MAX_TOKENS = 200


def test_json_schema_format_validates(client, model):
    for temperature in (0, 1.0):
        response = client.responses.create(
            model=model,
            input=INPUT,
            text={"format": COLOURS_FORMAT},
            max_output_tokens=MAX_TOKENS,
            temperature=temperature,
        )
        assert response.status == "completed"
        assert [item.type for item in response.output] == ["message"]
        Colours.model_validate(json.loads(response.output_text))
        assert response.text.format.type == "json_schema"


def test_json_schema_format_streams_and_parses(client, model):
    whole = client.responses.create(
        model=model,
        input=INPUT,
        text={"format": COLOURS_FORMAT},
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    with client.responses.stream(
        model=model,
        input=INPUT,
        text={"format": COLOURS_FORMAT},
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert len(deltas) > 1
    assert "".join(deltas) == final.output_text == whole.output_text
    Colours.model_validate_json(final.output_text)
    # the client's own parse helper reads the same answer into the model
    parsed = client.responses.parse(
        model=model, input=INPUT, text_format=Colours, max_output_tokens=MAX_TOKENS, temperature=0
    )
    assert isinstance(parsed.output_parsed, Colours)


def test_json_object_format_is_a_json_object(client, model):
    response = client.responses.create(
        model=model,
        input="Describe a cat as JSON.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)
    else:  # cut by the budget: still the start of one
        assert response.output_text.lstrip().startswith("{")


TOOLS = [
    {
        "type": "function",
        "name": name,
        "description": DESCRIPTIONS[name],
        "parameters": args.model_json_schema(),
    }
    for name, args in ARGS.items()
]
ASK = "What is the weather in Paris?"


def check_calls(output, names=("get_weather", "get_time")):
    """The output is function calls whose arguments validate; returns them."""
    calls = [item for item in output if item.type == "function_call"]
    assert calls and len(calls) == len(output)
    for call in calls:
        assert call.call_id.startswith("call_")
        assert call.name in names
        assert call.status == "completed"
        ARGS[call.name].model_validate(json.loads(call.arguments))
    return calls


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "name": "get_time"}],
    ids=["required", "named"],
)
def test_forced_function_call_validates(client, model, tool_choice):
    names = ("get_time",) if isinstance(tool_choice, dict) else ("get_weather", "get_time")
    for _ in range(2):  # sampled: every answer must validate, whatever was drawn
        response = client.responses.create(
            model=model,
            input=ASK,
            tools=TOOLS,
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            max_output_tokens=MAX_TOKENS,
            temperature=1.0,
        )
        assert response.status == "completed"
        assert len(check_calls(response.output, names)) == 1


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "name": "get_weather"}],
    ids=["required", "named"],
)
def test_streamed_function_call_matches_create(client, model, tool_choice):
    request = {
        "model": model,
        "input": ASK,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    whole = client.responses.create(**request)
    with client.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    calls = check_calls(final.output)
    assert [(c.name, c.arguments) for c in calls] == [
        (c.name, c.arguments) for c in check_calls(whole.output)
    ]
    kinds = [event.type for event in events]
    assert kinds.count("response.output_item.added") == len(calls)
    assert kinds.count("response.function_call_arguments.done") == len(calls)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == "".join(c.arguments for c in calls)
    if isinstance(tool_choice, dict):
        assert len(deltas) > 1  # a named call's arguments arrive as they are generated
    assert kinds[-1] == "response.completed"


def test_a_full_function_call_round_trip(client, model):
    first = client.responses.create(
        model=model,
        input=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    (call,) = check_calls(first.output, ("get_weather",))
    history = [
        {"role": "user", "content": ASK},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."},
    ]
    final = client.responses.create(
        model=model,
        input=history,
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=40,
        temperature=0,
    )
    assert [item.type for item in final.output] == ["message"]
    assert final.output_text.strip()


def test_auto_reads_the_models_own_function_call(client, model):
    # An earlier call in the history shows the small model the tool-call syntax, so that with
    # tool_choice auto it writes a <tool_call> of its own.
    history = [
        {"role": "user", "content": ASK},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"role": "user", "content": "What is the weather in Rome?"},
    ]
    tools = [
        {**TOOLS[0], "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    ]
    request = {
        "model": model,
        "input": history,
        "tools": tools,
        "max_output_tokens": 60,
        "temperature": 0,
    }
    response = client.responses.create(**request)
    with client.responses.stream(**request) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    for answer in (response, final):
        calls = [item for item in answer.output if item.type == "function_call"]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Rome"})
        ]
        assert "<tool_call>" not in answer.output_text


BAD_FORMATS = [
    ({"text": {"format": {**COLOURS_FORMAT, "schema": {"type": "strin"}}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    (
        {
            "tools": [
                {
                    **TOOLS[0],
                    "parameters": {"type": "object", "properties": {"x": {"type": "strin"}}},
                }
            ],
            "tool_choice": "required",
        },
        "tools",
    ),
    (
        {"tools": TOOLS, "tool_choice": "required", "text": {"format": COLOURS_FORMAT}},
        "tool_choice",
    ),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0]"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_FORMATS)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_bad_format_or_tools_is_400_naming_the_field(server, fields, param, stream):
    body = {"input": INPUT, "max_output_tokens": 5, "stream": stream, **fields}
    response = httpx.post(server.url + "/v1/responses", json=body, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_bad_input_names_the_field(client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model=model, input=[{"role": "user", "content": [{"type": "input_image"}]}]
        )
    assert caught.value.body["param"] == "input[0].content"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input=INPUT, max_output_tokens=0)
    assert caught.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input=INPUT)
