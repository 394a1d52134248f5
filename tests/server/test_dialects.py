"""The Messages and Responses renderers without a model: tool calls found in the text, and the
streamed events read back by the official clients' own accumulators into the same answer the
non-streaming response gives."""

from __future__ import annotations

import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from openai import omit
from openai._models import construct_type_unchecked
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from kvserve.engine.stream import Delta, Usage
from kvserve.server.dialects.anthropic_messages import MessagesRendering
from kvserve.server.dialects.function_tools import (
    CallArguments,
    CallEnd,
    CallReader,
    CallStart,
)
from kvserve.server.dialects.openai_responses import ResponsesRendering
from kvserve.server.protocol import APIError
from kvserve.server.tools import plan_tools

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def _split(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
AUTO = plan_tools([WEATHER], "auto")
NAMED = plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
REQUIRED = plan_tools([WEATHER], "required")


def _read(reader: CallReader, chunks: list[str]) -> list:
    pieces = []
    for index, chunk in enumerate(chunks):
        pieces += reader.feed(chunk, final=index == len(chunks) - 1)
    return pieces


def _calls(pieces: list) -> list[tuple[str, str, str]]:
    """(id, name, arguments) of each call, checking that its arguments pieces add up."""
    calls, start, parts = [], None, []
    for piece in pieces:
        if isinstance(piece, CallStart):
            assert start is None
            start, parts = piece, []
        elif isinstance(piece, CallArguments):
            parts.append(piece.text)
        elif isinstance(piece, CallEnd):
            assert "".join(parts) == piece.arguments
            calls.append((start.id, start.name, piece.arguments))
            start = None
    assert start is None
    return calls


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_auto_reads_the_models_calls_however_the_text_is_split(size):
    text = "Let me look. " + CALL + "\n" + CALL + " done <tool"
    pieces = _read(CallReader(AUTO, "toolu_"), _split(text, size))
    assert "".join(p for p in pieces if isinstance(p, str)) == "Let me look.done <tool"
    calls = _calls(pieces)
    assert [(name, json.loads(arguments)) for _, name, arguments in calls] == [
        ("get_weather", {"city": "Paris"})
    ] * 2
    assert calls[0][0] != calls[1][0]
    assert all(call_id.startswith("toolu_") for call_id, _, _ in calls)


def test_named_streams_the_arguments_as_they_come():
    reader = CallReader(NAMED, "call_")
    first = reader.feed('{"city": ', final=False)
    assert isinstance(first[0], CallStart) and first[0].name == "get_weather"
    assert first[1:] == [CallArguments('{"city": ')]
    assert reader.feed('"Rome"}', final=True) == [
        CallArguments('"Rome"}'),
        CallEnd('{"city": "Rome"}'),
    ]
    assert reader.called


def test_required_is_read_once_the_array_is_complete():
    reader = CallReader(REQUIRED, "call_")
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    assert reader.feed(text[:20], final=False) == []
    calls = _calls(reader.feed(text[20:], final=True))
    assert [(name, json.loads(arguments)) for _, name, arguments in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    # cut by the budget: what there is stays text
    assert CallReader(REQUIRED, "call_").feed('[{"name": "get_w', final=True) == [
        '[{"name": "get_w'
    ]


def test_without_tools_or_with_none_everything_is_text():
    for plan in (None, plan_tools([WEATHER], "none")):
        reader = CallReader(plan, "call_")
        assert _read(reader, [CALL[:9], CALL[9:]]) == [CALL[:9], CALL[9:]]
        assert not reader.called


def _deltas(text: str, usage: Usage, *, finish: str = "stop", stop: str | None = None):
    chunks = _split(text, 5)
    deltas = [Delta(text=chunk, token_ids=(1,)) for chunk in chunks[:-1]]
    deltas.append(Delta(text=chunks[-1], finish_reason=finish, usage=usage, stop_sequence=stop))
    return deltas


def _sse_data(frames: str) -> list[dict]:
    events = []
    for frame in frames.split("\n\n"):
        if frame:
            kind, data = frame.split("\n")
            value = json.loads(data.removeprefix("data: "))
            assert kind == f"event: {value['type']}"
            events.append(value)
    return events


def _play(rendering_factory, deltas) -> tuple[dict, list[dict]]:
    """The same deltas through one rendering whole and another streamed: (the response, the
    streamed events)."""
    whole = rendering_factory()
    for delta in deltas:
        whole.add(delta)
    streamed = rendering_factory()
    frames = streamed.head() + "".join(streamed.frames(d) for d in deltas[:-1])
    frames += streamed.tail(deltas[-1])
    return whole.response(deltas[-1]), _sse_data(frames)


def _anthropic(rendering_factory, deltas) -> tuple[dict, object]:
    whole, events = _play(rendering_factory, deltas)
    snapshot, buffers = None, {}
    for event in events:
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=buffers)
    return whole, snapshot


def test_messages_tool_use_streamed_and_whole_agree():
    usage = Usage(20, 30)
    deltas = _deltas("I will check. " + CALL, usage)
    whole, streamed = _anthropic(lambda: MessagesRendering("msg_1", "m", 20, plan=AUTO), deltas)
    assert whole["stop_reason"] == "tool_use"
    assert [block["type"] for block in whole["content"]] == ["text", "tool_use"]
    assert whole["content"][1]["input"] == {"city": "Paris"}
    assert whole["content"][1]["id"].startswith("toolu_")
    assert streamed.stop_reason == "tool_use"
    assert streamed.content[0].text == whole["content"][0]["text"] == "I will check."
    assert streamed.content[1].name == "get_weather"
    assert streamed.content[1].input == {"city": "Paris"}
    assert streamed.usage.output_tokens == 30


def test_messages_without_tools_keep_the_text_as_written():
    deltas = _deltas("Use <tool_call> tags. ", Usage(5, 6), stop="END")
    whole, streamed = _anthropic(lambda: MessagesRendering("msg_1", "m", 5), deltas)
    assert whole["content"] == [{"type": "text", "text": "Use <tool_call> tags. "}]
    assert streamed.content[0].text == "Use <tool_call> tags. "
    assert whole["stop_reason"] == streamed.stop_reason == "stop_sequence"
    assert whole["stop_sequence"] == streamed.stop_sequence == "END"


def test_messages_error_after_the_start_is_an_error_event():
    rendering = MessagesRendering("msg_1", "m", 5)
    frame = rendering.error_tail(APIError(429, "too slow", code="slow_consumer"))
    assert _sse_data(frame) == [
        {"type": "error", "error": {"type": "overloaded_error", "message": "too slow"}}
    ]


def _responses(deltas, *, plan=None):
    def factory() -> ResponsesRendering:
        return ResponsesRendering("resp_1", "m", {"tools": []}, plan=plan)

    whole, events = _play(factory, deltas)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in events:
        state.handle_event(construct_type_unchecked(type_=ResponseStreamEvent, value=event))
    return whole, state._completed_response, [e["type"] for e in events]


def test_responses_function_call_streamed_and_whole_agree():
    deltas = _deltas("Checking. " + CALL, Usage(20, 30))
    whole, final, kinds = _responses(deltas, plan=AUTO)
    assert [item["type"] for item in whole["output"]] == ["message", "function_call"]
    call = whole["output"][1]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    assert final.output_text == "Checking."
    assert final.output[1].type == "function_call"
    assert final.output[1].call_id.startswith("call_")
    assert json.loads(final.output[1].arguments) == {"city": "Paris"}
    assert final.usage.output_tokens == 30


def test_responses_incomplete_when_the_budget_ran_out():
    whole, final, kinds = _responses(_deltas("Some words here", Usage(3, 4), finish="length"))
    assert whole["status"] == final.status == "incomplete"
    assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final.output_text == "Some words here"
    assert kinds[-1] == "response.completed"


def test_responses_error_after_the_start_is_response_failed():
    rendering = ResponsesRendering("resp_1", "m", {})
    events = _sse_data(rendering.head() + rendering.error_tail(APIError(500, "boom")))
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "boom"}
    assert events[-1]["sequence_number"] == 2


def test_messages_forced_call_streams_input_json_deltas():
    arguments = '{"city": "Rome"}'
    deltas = _deltas(arguments, Usage(20, 8))
    whole, streamed = _anthropic(lambda: MessagesRendering("msg_1", "m", 20, plan=NAMED), deltas)
    assert whole["stop_reason"] == streamed.stop_reason == "tool_use"
    assert [block["type"] for block in whole["content"]] == ["tool_use"]
    assert whole["content"][0]["input"] == streamed.content[0].input == {"city": "Rome"}
    assert streamed.content[0].name == "get_weather"
    _, events = _play(lambda: MessagesRendering("msg_1", "m", 20, plan=NAMED), deltas)
    json_deltas = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert len(json_deltas) == len(deltas) and "".join(json_deltas) == arguments


def test_messages_forced_call_cut_by_the_budget_is_max_tokens():
    deltas = _deltas('{"city": "Ro', Usage(20, 8), finish="length")
    whole, streamed = _anthropic(lambda: MessagesRendering("msg_1", "m", 20, plan=NAMED), deltas)
    assert whole["stop_reason"] == streamed.stop_reason == "max_tokens"
    assert whole["content"][0]["type"] == "tool_use"


def test_responses_required_calls_become_function_call_items():
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    whole, final, kinds = _responses(_deltas(text, Usage(20, 30)), plan=REQUIRED)
    assert [item["type"] for item in whole["output"]] == ["function_call"]
    assert json.loads(whole["output"][0]["arguments"]) == {"city": "Oslo"}
    assert [item.type for item in final.output] == ["function_call"]
    assert json.loads(final.output[0].arguments) == {"city": "Oslo"}
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
