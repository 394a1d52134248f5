"""The official `openai` client's Responses API against a live server on loopback."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.dialects import RESPONSES

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


def test_function_call_items_render_through_the_chat_template(client, server, model):
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    response = client.responses.create(
        model=model,
        tools=tools,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny."},
        ],
        max_output_tokens=1,
    )
    tokenizer = server.state.engine.tokenizer
    expected = tokenizer.encode_chat(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
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
                    "parameters": tools[0]["parameters"],
                    "description": tools[0]["description"],
                },
            }
        ],
    )
    assert response.usage.input_tokens == len(expected)


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


def test_json_schema_format_is_refused_until_structured_output(client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model=model,
            input=INPUT,
            text={
                "format": {
                    "type": "json_schema",
                    "name": "colours",
                    "schema": {"type": "object", "properties": {"c": {"type": "string"}}},
                }
            },
        )
    assert caught.value.body["param"] == "text.format"


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
