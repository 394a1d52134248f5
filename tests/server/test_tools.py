"""Tool calling without a model: validation, the constraint's schema, the prompt, the Hermes
parser on text (streamed in every split), and the response/stream shapes."""

from __future__ import annotations

import json

import pytest

from kvserve.engine.stream import Delta, Usage
from kvserve.server.dialects.openai_chat import chat_rendering
from kvserve.server.protocol import APIError
from kvserve.server.tools import (
    FALLBACK_TOOL_PROMPT,
    HermesToolParser,
    ToolCall,
    parse_required,
    plan_tools,
    tool_prompt,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}

CANNED = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def test_hermes_parser_reads_calls_and_keeps_content():
    content, calls = HermesToolParser().parse(CANNED)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, len(CANNED)])
def test_hermes_parser_gives_the_same_result_in_any_split(size):
    parser = HermesToolParser()
    items = []
    for start in range(0, len(CANNED), size):
        items += parser.feed(CANNED[start : start + size])
    items += parser.finish()
    content = "".join(i for i in items if isinstance(i, str))
    calls = [(i.name, json.loads(i.arguments)) for i in items if isinstance(i, ToolCall)]
    assert content == "Let me check."
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    # nothing that could be the start of a tag is ever sent as content
    assert "<" not in content


@pytest.mark.parametrize(
    "text",
    [
        "Just text, no call.",
        "a < b and <tool> is not a tag",
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
    ],
)
def test_text_that_is_not_a_call_stays_content(text):
    content, calls = HermesToolParser().parse(text)
    assert calls == []
    assert content == text


@pytest.mark.parametrize("size", [1, 2, 5])
def test_text_after_a_call_keeps_its_own_spaces_in_any_split(size):
    text = 'Sure.\n<tool_call>{"name": "get_time"}</tool_call>\n  then more words here.'
    parser = HermesToolParser(id_prefix="toolu_")
    items = []
    for start in range(0, len(text), size):
        items += parser.feed(text[start : start + size])
    items += parser.finish()
    content = "".join(i for i in items if isinstance(i, str))
    assert content == "Sure.then more words here."
    assert [c.id[:6] for c in items if isinstance(c, ToolCall)] == ["toolu_"]


def test_an_unclosed_block_at_the_end_is_still_a_call():
    content, calls = HermesToolParser().parse('<tool_call>{"name": "get_time", "arguments": {}}')
    assert content is None
    assert [c.name for c in calls] == ["get_time"]


def test_plan_builds_the_constraints():
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert named.choice == "named" and named.name == "get_weather"
    assert json.loads(named.constraint.spec) == {
        **WEATHER["function"]["parameters"],
        "additionalProperties": False,
    }
    required = plan_tools([WEATHER, TIME], "required", parallel_tool_calls=False)
    schema = json.loads(required.constraint.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [option["properties"]["name"]["const"] for option in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert plan_tools([WEATHER], None).choice == "auto"
    assert plan_tools([WEATHER], "auto").constraint is None
    assert plan_tools(None, None) is None
    assert not plan_tools([WEATHER], "none").offers_tools


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([], None, "tools"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (None, "required", "tool_choice"),
        ([{"type": "retrieval"}], None, "tools[0]"),
        ([WEATHER, WEATHER], None, "tools[1].function"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "a", "parameters": []}}],
            None,
            "tools[0].function.parameters",
        ),
    ],
)
def test_plan_refuses_bad_tools_naming_the_field(tools, choice, param):
    with pytest.raises(APIError) as caught:
        plan_tools(tools, choice)
    assert caught.value.status == 400
    assert caught.value.param == param


def test_a_template_without_tools_gets_the_fallback_prompt_and_hermes_history():
    plan = plan_tools([WEATHER], "auto")
    history = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    messages, kwargs = tool_prompt(plan, history, "{{ messages }}", {})
    assert kwargs == {}
    assert messages[0]["role"] == "system"
    assert messages[0]["content"].startswith(FALLBACK_TOOL_PROMPT.split("{tools}")[0])
    assert json.dumps(WEATHER) in messages[0]["content"]
    assert messages[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


def test_a_template_with_tools_gets_them_as_its_variable():
    plan = plan_tools([WEATHER], "auto")
    history = [{"role": "user", "content": "Weather?"}]
    messages, kwargs = tool_prompt(plan, history, "{% for t in tools %}{{ t }}{% endfor %}", {})
    assert messages == history
    assert kwargs == {"tools": [WEATHER]}


def renderer(plan):
    return chat_rendering("chatcmpl-1", "m", lambda t: b"", plan=plan)


END = Usage(1, 2)


def chunks_of(frames: str) -> list[str]:
    """The chunks (JSON text) of streamed SSE frames, `[DONE]` left out."""
    data = [frame.removeprefix("data: ") for frame in frames.split("\n\n") if frame]
    assert data[-1] == "[DONE]"
    return data[:-1]


def stream_tool_calls(chunks):
    """Accumulate streamed tool-call deltas the way OpenAI clients do."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        choice = json.loads(chunk)["choices"][0]
        finish = choice["finish_reason"] or finish
        for entry in choice["delta"].get("tool_calls", []):
            call = calls.setdefault(entry["index"], {"arguments": ""})
            if "id" in entry:
                assert "name" in entry["function"] and entry["type"] == "function"
                call["id"], call["name"] = entry["id"], entry["function"]["name"]
            call["arguments"] += entry["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)], finish


def test_auto_stream_and_response():
    render = renderer(plan_tools([WEATHER, TIME], "auto"))
    frames = render.head()
    for piece in [CANNED[:20], CANNED[20:50], CANNED[50:]]:
        frames += render.frames(Delta(text=piece))
    frames += render.tail(Delta(finish_reason="stop", usage=END))
    calls, finish = stream_tool_calls(chunks_of(frames))
    assert finish == "tool_calls"
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}

    whole = renderer(plan_tools([WEATHER, TIME], "auto"))
    final = Delta(text=CANNED, finish_reason="stop", usage=END)
    whole.add(final)
    body = whole.response(final)
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert message["content"] == "Let me check."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]


def test_named_streams_arguments_as_they_come_and_finishes_with_stop():
    render = renderer(
        plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    )
    frames = render.frames(Delta(text='{"city":'))
    frames += render.tail(Delta(text='"Rome"}', finish_reason="stop", usage=END))
    calls, finish = stream_tool_calls(chunks_of(frames))
    assert finish == "stop"
    assert calls == [{"id": calls[0]["id"], "name": "get_weather", "arguments": '{"city":"Rome"}'}]


def test_required_answer_becomes_calls():
    text = '[{"name":"get_weather","parameters":{"city":"Oslo"}}]'
    assert [(c.name, c.arguments) for c in parse_required(text)] == [
        ("get_weather", '{"city": "Oslo"}')
    ]
    assert parse_required('[{"name":"get_weather","param') is None
    render = renderer(plan_tools([WEATHER], "required"))
    frames = render.tail(Delta(text=text, finish_reason="stop", usage=END))
    calls, finish = stream_tool_calls(chunks_of(frames))
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather"
