"""Ollama's dialect without a model: options and their defaults, format, the conversation, and
the NDJSON stream read back into the same answer the whole response gives."""

from __future__ import annotations

import json

import pytest

from kvserve.engine.stream import Delta, Usage
from kvserve.server.dialects.ollama import (
    OllamaMessage,
    OllamaOptions,
    _format,
    _quantization_level,
    check_keep_alive,
    conversation,
    created_at,
    error_body,
    ollama_rendering,
)
from kvserve.server.protocol import APIError
from kvserve.server.render import Timing
from kvserve.server.tools import plan_tools

VOCAB = 1000


def _params(options, prompt_tokens=10, **kwargs):
    return OllamaOptions(options).sampling_params(VOCAB, prompt_tokens, None, **kwargs)


def test_ollamas_defaults_apply_when_options_say_nothing():
    params = _params(None)
    assert (params.temperature, params.top_k, params.top_p) == (0.8, 40, 0.9)
    assert params.repetition_penalty == 1.1
    assert params.max_tokens is None  # num_predict -1: the rest of the context
    assert params.seed is None
    given = _params({"temperature": 0, "num_predict": 5, "seed": 3, "stop": "\n", "top_k": 1})
    assert (given.temperature, given.max_tokens, given.seed, given.stop) == (0, 5, 3, ("\n",))
    assert _params({"seed": -1}).seed is None  # Ollama's "random"
    assert _params({"num_predict": -2}).max_tokens is None


def test_num_ctx_caps_prompt_and_answer_and_is_refused_above_the_model():
    assert _params({"num_ctx": 50}, prompt_tokens=20).max_tokens == 30
    assert _params({"num_ctx": 50, "num_predict": 5}, prompt_tokens=20).max_tokens == 5
    with pytest.raises(APIError) as caught:
        _params({"num_ctx": 20}, prompt_tokens=20)
    assert caught.value.param == "options.num_ctx"
    options = OllamaOptions({"num_ctx": 4096})
    options.check_context(4096)
    with pytest.raises(APIError, match="above this model's context of 2048"):
        options.check_context(2048)


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"temperature": "hot"}, "options.temperature"),
        ({"temperature": 5.0}, "options.temperature"),
        ({"top_p": 0}, "options.top_p"),
        ({"num_predict": 0}, "options.num_predict"),
        ({"num_predict": 1.5}, "options.num_predict"),
        ({"repeat_penalty": 0}, "options.repeat_penalty"),
        ({"stop": [1]}, "options.stop"),
        ({"mirostat": 2}, "options.mirostat"),
        ({"typical_p": 0.5}, "options.typical_p"),
    ],
)
def test_bad_options_are_400_naming_the_option(options, param):
    with pytest.raises(APIError) as caught:
        _params(options)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert param in error_body(caught.value)["error"]


def test_options_without_effect_are_reported_not_refused():
    options = OllamaOptions({"num_gpu": 99, "repeat_last_n": 64, "mirostat": 0, "typical_p": 1.0})
    assert options.ignored == [
        "options.num_gpu",
        "options.repeat_last_n",
        "options.mirostat",
        "options.typical_p",
    ]
    assert OllamaOptions({"tool_choice": "required"}).tool_choice == "required"


def test_format_is_json_or_a_schema():
    assert _format(None) is None and _format("") is None
    assert _format("json").kind == "json_object"
    schema = _format({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert schema.kind == "json" and schema.param == "format"
    with pytest.raises(APIError) as caught:
        _format("yaml")
    assert caught.value.param == "format"


@pytest.mark.parametrize("value", ["5m", "1h30m", "-1", "0", "10s", 300, 0.5, None])
def test_keep_alive_takes_durations_and_numbers(value):
    check_keep_alive(value)


def test_keep_alive_refuses_what_is_no_duration():
    with pytest.raises(APIError, match="duration"):
        check_keep_alive("soon")


def test_the_conversation_takes_ollamas_tool_history():
    call = {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    messages = conversation(
        [
            OllamaMessage(role="user", content="Weather in Oslo?"),
            OllamaMessage(role="assistant", content="", tool_calls=[call]),
            OllamaMessage(role="tool", content="sunny", tool_name="get_weather"),
        ]
    )
    assert messages[1]["tool_calls"] == [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    ]
    assert messages[2] == {"role": "tool", "content": "sunny", "name": "get_weather"}
    with pytest.raises(APIError, match="vision"):
        conversation([OllamaMessage(role="user", content="look", images=["aGk="])])
    with pytest.raises(APIError) as caught:
        conversation([OllamaMessage(role="robot", content="beep")])
    assert caught.value.param == "messages[0].role"


def _play(rendering_factory, deltas, timing):
    whole = rendering_factory()
    for delta in deltas:
        whole.add(delta)
    streamed = rendering_factory()
    frames = streamed.head() + "".join(streamed.frames(d) for d in deltas[:-1])
    frames += streamed.tail(deltas[-1], timing)
    lines = [json.loads(line) for line in frames.splitlines()]
    assert streamed.media_type == "application/x-ndjson"
    return whole.response(deltas[-1], timing), lines


TIMING = Timing(arrived=10.0, admitted=10.5, first_token=11.0, finished=13.0)


def test_chat_stream_and_whole_agree_with_counts_and_durations_in_ns():
    deltas = [Delta(text="Hel", token_ids=(1,)), Delta(text="lo", token_ids=(2,))]
    deltas.append(Delta(text="!", finish_reason="stop", usage=Usage(7, 3)))
    whole, lines = _play(
        lambda: ollama_rendering("m", chat=True, token_bytes=lambda t: b""), deltas, TIMING
    )
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    assert "".join(line["message"]["content"] for line in lines) == "Hello!"
    assert whole["message"] == {"role": "assistant", "content": "Hello!"}
    for last in (whole, lines[-1]):
        assert last["done_reason"] == "stop"
        assert (last["prompt_eval_count"], last["eval_count"]) == (7, 3)
        assert last["total_duration"] == 3_000_000_000
        assert last["prompt_eval_duration"] == 500_000_000
        assert last["eval_duration"] == 2_000_000_000
        assert last["model"] == "m" and last["created_at"].endswith("Z")


def test_a_call_comes_whole_with_its_arguments_as_an_object():
    plan = plan_tools(
        [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
        {"type": "function", "function": {"name": "get_weather"}},
    )
    deltas = [
        Delta(text='{"city": '),
        Delta(text='"Oslo"}', finish_reason="stop", usage=Usage(5, 4)),
    ]
    whole, lines = _play(
        lambda: ollama_rendering("m", chat=True, token_bytes=lambda t: b"", plan=plan),
        deltas,
        TIMING,
    )
    expected = [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]
    assert whole["message"]["tool_calls"] == expected
    assert [line["message"].get("tool_calls") for line in lines if not line["done"]] == [expected]
    assert all(line["message"]["content"] == "" for line in lines)


def test_generate_answers_in_response_and_errors_are_a_line():
    deltas = [Delta(text="The sea", finish_reason="length", usage=Usage(2, 2))]
    whole, lines = _play(
        lambda: ollama_rendering("m", chat=False, token_bytes=lambda t: b""), deltas, TIMING
    )
    assert whole["response"] == "The sea" and whole["done_reason"] == "length"
    assert "message" not in whole
    rendering = ollama_rendering("m", chat=False, token_bytes=lambda t: b"")
    line = rendering.error_tail(APIError(429, "too slow", code="slow_consumer"))
    assert json.loads(line) == {"error": "too slow"}


def test_details_name_the_quantization_as_ollama_does():
    assert _quantization_level(["F32", "Q4_1", "Q6_K"]) == "Q4_1"
    assert _quantization_level(["torch.bfloat16"]) == "BF16"
    assert _quantization_level(["F32"]) == "F32"


def test_timestamps_are_rfc3339_utc():
    assert created_at(0.0) == "1970-01-01T00:00:00.000000Z"


def test_logprobs_when_asked_for():
    from kvserve.engine.stream import TokenLogprob

    table = {1: b"He", 2: b"llo", 3: b"\xe2\x82"}
    entry = TokenLogprob(1, -0.5, ((1, -0.5), (3, float("-inf"))))
    deltas = [Delta(text="He", logprobs=(entry,)), Delta(finish_reason="stop", usage=Usage(1, 1))]
    whole, lines = _play(
        lambda: ollama_rendering("m", chat=True, token_bytes=table.__getitem__, logprobs=True),
        deltas,
        TIMING,
    )
    expected = [
        {
            "token": "He",
            "logprob": -0.5,
            "top_logprobs": [
                {"token": "He", "logprob": -0.5},
                {"token": "\ufffd", "logprob": -9999.0},  # JSON has no -Infinity
            ],
        }
    ]
    assert whole["logprobs"] == expected and lines[0]["logprobs"] == expected
    plain = ollama_rendering("m", chat=True, token_bytes=table.__getitem__)
    assert "logprobs" not in json.loads(plain.frames(deltas[0]))
