"""A real model calls a tool on its own: qwen2.5-coder:0.5b (Q4_K_M, as `--quantization auto`
loads it), asked for the weather in Oslo with a `get_weather(city)` tool under `auto`, answers
with a parsed `tool_calls` entry through the official openai client (nothing constrains it: the
model writes the call as a JSON object, which the Hermes parser reads as Ollama's does), then
gets the tool's result back through its template in the next turn."""

from __future__ import annotations

import json

import openai
import pytest

from tests.e2e.conftest import small_engine_config

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def client(server_factory, qwen05_gguf):
    server = server_factory(small_engine_config(max_model_len=2048), loaded=qwen05_gguf)
    with openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600
    ) as client:
        yield client, client.models.list().data[0].id
    server.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_real_model_calls_the_tool_and_uses_its_result(client, stream):
    client, model = client
    if stream:
        with client.chat.completions.stream(
            model=model, messages=ASK, tools=[WEATHER], max_tokens=64, temperature=0
        ) as events:
            message = events.get_final_completion().choices[0]
    else:
        message = client.chat.completions.create(
            model=model, messages=ASK, tools=[WEATHER], max_tokens=64, temperature=0
        ).choices[0]
    assert message.finish_reason == "tool_calls", message
    (call,) = message.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}

    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.function.arguments},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"temperature_celsius": 17, "sky": "light rain"}),
        },
    ]
    # The result goes back in the model's own template (a <tool_response> turn) and is read:
    # the prompt grows by it, and the model answers from there. (Greedy, this 0.5B model
    # mostly repeats its call rather than wording an answer from the result.)
    final, alone = (
        client.chat.completions.create(
            model=model,
            messages=messages,
            tools=[WEATHER],
            tool_choice="none",
            max_tokens=16,
            temperature=0,
        )
        for messages in (history, ASK)
    )
    result_tokens = len(history[-1]["content"]) // 8  # well under one token per 8 characters
    assert final.usage.prompt_tokens > alone.usage.prompt_tokens + result_tokens
    assert not final.choices[0].message.tool_calls
    assert final.choices[0].message.content
