"""Tool calls in the Llama 3 and Mistral formats through the official openai client.

The default model's own template is ChatML with the Hermes syntax; here the server is given
Llama 3.1's and Mistral 7B v0.3's templates (`chat_template`, the `--chat-template` flag), so
it picks the family's parser, writes `required` and named calls under a grammar in that
family's format, and reads them back. Under `auto` the model is held (with a regex) to the
family's own call syntax, marker included, to show the parser reading what such a model
writes. A 135M model does not know these formats: the grammar is what makes its answers
parse, so a failure here is the family's constraint or parser.
"""

from __future__ import annotations

import dataclasses
import json
import re

import openai
import pytest

from kvserve.config import ServerConfig
from tests.chat_templates import LLAMA_3_1, MISTRAL_V0_3
from tests.e2e.conftest import small_engine_config
from tests.e2e.tool_schemas import ARGS, DESCRIPTIONS

pytestmark = pytest.mark.slow

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": DESCRIPTIONS[name],
            "parameters": model.model_json_schema(),
        },
    }
    for name, model in ARGS.items()
]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
MAX_TOKENS = 120

FAMILIES = {
    "llama3": (
        LLAMA_3_1,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}',
    ),
    "mistral": (
        MISTRAL_V0_3,
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]',
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, server_factory):
    template, own_syntax = FAMILIES[request.param]
    config = dataclasses.replace(small_engine_config(max_num_seqs=4), chat_template=template)
    server = server_factory(config, ServerConfig())
    with openai.OpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600
    ) as client:
        yield client, client.models.list().data[0].id, own_syntax
    server.stop()


def check_calls(calls, names=tuple(ARGS)):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        ARGS[call.function.name].model_validate_json(call.function.arguments)


def test_a_required_call_in_the_familys_format(family):
    client, model, _ = family
    completion = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls)


def test_a_named_call_streams_into_the_client_helper(family):
    client, model, _ = family
    with client.chat.completions.stream(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=MAX_TOKENS,
        temperature=0,
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI ends a named call
    assert len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls, ("get_time",))


def test_auto_reads_the_familys_own_syntax_streamed(family):
    client, model, own_syntax = family
    with client.chat.completions.stream(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=MAX_TOKENS,
        temperature=0,
        # The model is held to what a model of the family writes, marker and all.
        extra_body={"structured_outputs": {"regex": re.escape(own_syntax)}},
    ) as stream:
        for _ in stream:
            pass
        choice = stream.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Oslo", "unit": "celsius"})]


def test_auto_text_that_is_no_call_stays_content(family):
    client, model, _ = family
    completion = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=16,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "It is sunny in Oslo\\."}},
    )
    choice = completion.choices[0]
    assert choice.message.content == "It is sunny in Oslo."
    assert not choice.message.tool_calls
    assert choice.finish_reason == "stop"


def test_a_tool_result_round_trips_through_the_familys_template(family):
    client, model, _ = family
    first = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    call = first.choices[0].message.tool_calls[0]
    check_calls([call], ("get_weather",))
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    # Mistral's template refuses call ids that are not nine letters and digits, and Llama 3's
    # wants the arguments as an object: both are rewritten for the template, so it renders
    # (a template error would be a 400), the call and its result in the prompt.
    final, alone = (
        client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4
        )
        for messages in (history, ASK)
    )
    choice = final.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert not choice.message.tool_calls
    assert final.usage.prompt_tokens > alone.usage.prompt_tokens + 20
