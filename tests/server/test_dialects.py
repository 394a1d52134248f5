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
from kvserve.server.dialects.function_tools import ToolCall, ToolCallParser
from kvserve.server.dialects.openai_responses import ResponsesRendering
from kvserve.server.protocol import APIError

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def _split(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_parser_finds_calls_however_the_text_is_split(size):
    parser = ToolCallParser()
    pieces = []
    for chunk in _split("Let me look. " + CALL + "\n" + CALL + " done <tool", size):
        pieces += parser.feed(chunk)
    pieces += parser.flush()
    texts = [p for p in pieces if isinstance(p, str)]
    calls = [p for p in pieces if isinstance(p, ToolCall)]
    assert "".join(texts) == "Let me look. \n done <tool"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ] * 2
    assert calls[0].call_id != calls[1].call_id


def test_parser_never_shows_half_a_tag():
    parser = ToolCallParser()
    assert parser.feed("Hi <tool_c") == ["Hi "]
    assert parser.feed("all>") == []
    assert parser.feed('{"name": "f"}</tool_call>')[0].name == "f"


def test_parser_keeps_what_is_not_a_call_as_text():
    parser = ToolCallParser()
    assert parser.feed("<tool_call>not json</tool_call>") == ["<tool_call>not json</tool_call>"]
    # A call the model ended on its stop token, without the closing tag, still counts.
    assert parser.feed('<tool_call>{"name": "f", "arguments": {}}') == []
    assert [p.name for p in parser.flush()] == ["f"]


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
    whole, streamed = _anthropic(lambda: MessagesRendering("msg_1", "m", 20, tools=True), deltas)
    assert whole["stop_reason"] == "tool_use"
    assert [block["type"] for block in whole["content"]] == ["text", "tool_use"]
    assert whole["content"][1]["input"] == {"city": "Paris"}
    assert whole["content"][1]["id"].startswith("toolu_")
    assert streamed.stop_reason == "tool_use"
    assert streamed.content[0].text == whole["content"][0]["text"] == "I will check. "
    assert streamed.content[1].name == "get_weather"
    assert streamed.content[1].input == {"city": "Paris"}
    assert streamed.usage.output_tokens == 30


def test_messages_without_tools_keep_the_text_as_written():
    deltas = _deltas("Use <tool_call> tags. ", Usage(5, 6), stop="END")
    whole, streamed = _anthropic(lambda: MessagesRendering("msg_1", "m", 5, tools=False), deltas)
    assert whole["content"] == [{"type": "text", "text": "Use <tool_call> tags. "}]
    assert streamed.content[0].text == "Use <tool_call> tags. "
    assert whole["stop_reason"] == streamed.stop_reason == "stop_sequence"
    assert whole["stop_sequence"] == streamed.stop_sequence == "END"


def test_messages_error_after_the_start_is_an_error_event():
    rendering = MessagesRendering("msg_1", "m", 5, tools=False)
    frame = rendering.error_tail(APIError(429, "too slow", code="slow_consumer"))
    assert _sse_data(frame) == [
        {"type": "error", "error": {"type": "overloaded_error", "message": "too slow"}}
    ]


def _responses(deltas, *, tools: bool):
    def factory() -> ResponsesRendering:
        return ResponsesRendering("resp_1", "m", {"tools": []}, tools=tools)

    whole, events = _play(factory, deltas)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in events:
        state.handle_event(construct_type_unchecked(type_=ResponseStreamEvent, value=event))
    return whole, state._completed_response, [e["type"] for e in events]


def test_responses_function_call_streamed_and_whole_agree():
    deltas = _deltas("Checking. " + CALL, Usage(20, 30))
    whole, final, kinds = _responses(deltas, tools=True)
    assert [item["type"] for item in whole["output"]] == ["message", "function_call"]
    call = whole["output"][1]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    assert final.output_text == "Checking. "
    assert final.output[1].type == "function_call"
    assert final.output[1].call_id.startswith("call_")
    assert json.loads(final.output[1].arguments) == {"city": "Paris"}
    assert final.usage.output_tokens == 30


def test_responses_incomplete_when_the_budget_ran_out():
    whole, final, kinds = _responses(
        _deltas("Some words here", Usage(3, 4), finish="length"), tools=False
    )
    assert whole["status"] == final.status == "incomplete"
    assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final.output_text == "Some words here"
    assert kinds[-1] == "response.completed"


def test_responses_error_after_the_start_is_response_failed():
    rendering = ResponsesRendering("resp_1", "m", {}, tools=False)
    events = _sse_data(rendering.head() + rendering.error_tail(APIError(500, "boom")))
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "boom"}
    assert events[-1]["sequence_number"] == 2
